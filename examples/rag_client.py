"""Query the served RAG pipeline (examples/rag.py) with the benchmark
queries and measure retrieval quality through it: recall@10 (the package's
own description is among the 10 passages returned) and MRR@10, plus
latency, and print a few real answers.

    .venv/bin/slipstream serve examples/rag.py &
    .venv/bin/python examples/rag_client.py --url http://127.0.0.1:8000 -n 1000 --concurrency 4

The queries are the one-line summaries of Debian packages sampled by
``models.corpus`` (``<data>/rag/queries.jsonl``); each one's right answer is
its package's long description. Only queries whose right answer is in the
served index count: the client finds the index the way the server does
(same ``SLIPSTREAM_DATA``, ``RAG_INDEX``, ``RAG_SLICE``), or use ``--index-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import corpus, vindex  # noqa: E402


def default_index_dir() -> Path:
    import rag  # the server's choice of index, from the same environment

    return rag.index_dir()


def infer(url: str, pipeline: str, query: str, timeout: float) -> tuple[dict, float]:
    body = json.dumps({"inputs": {"query": [query]}}).encode()
    req = urllib.request.Request(f"{url}/v1/pipelines/{pipeline}/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())["outputs"]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--pipeline", default="rag")
    ap.add_argument("-n", type=int, default=200, help="queries to send (of the 1,000; default 200)")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    ap.add_argument("--show", type=int, default=3, help="answers to print (default 3)")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--index-dir", type=Path, help="the served index (default: as the server chooses it)")
    ap.add_argument("--json", action="store_true", help="print the metrics as JSON")
    args = ap.parse_args(argv)

    try:
        index_dir = args.index_dir or default_index_dir()
        held = set(vindex.indexed_ids(index_dir).tolist())
        queries = [q for q in corpus.load_queries() if q["passage_id"] in held][: args.n]
    except (FileNotFoundError, corpus.CorpusError, ValueError) as e:  # ValueError: ss.ConfigError from rag.py
        print(f"rag_client: {e}", file=sys.stderr)
        return 1
    if not queries:
        print(f"rag_client: no benchmark query has its answer in {index_dir}", file=sys.stderr)
        return 1
    print(f"{len(queries)} queries against {args.url} (index {index_dir}, {len(held)} passages), "
          f"concurrency {args.concurrency}", file=sys.stderr)

    def ask(q: dict) -> tuple[dict | None, float, str | None]:
        try:
            out, dt = infer(args.url, args.pipeline, q["query"], args.timeout)
            return out, dt, None
        except (OSError, RuntimeError) as e:
            return None, 0.0, str(e)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
        answers = list(pool.map(ask, queries))
    wall = time.perf_counter() - t0
    errors = [err for _, _, err in answers if err is not None]
    if errors:
        print(f"rag_client: {len(errors)} of {len(queries)} requests failed, e.g. {errors[0]}", file=sys.stderr)
    ok = [(q, out, dt) for q, (out, dt, err) in zip(queries, answers, strict=True) if err is None]
    if not ok:
        return 1
    queries = [q for q, _, _ in ok]
    results = [(out, dt) for _, out, dt in ok]

    ranked = np.array([[*out["ids"][0][: args.k], *([-1] * (args.k - len(out["ids"][0])))] for out, _ in results])
    truth = [q["passage_id"] for q in queries]
    m = vindex.retrieval_metrics(ranked, truth, args.k)
    lat = np.array([dt for _, dt in results]) * 1000
    m.update({"failed": len(errors),
              "latency_ms_p50": round(float(np.percentile(lat, 50)), 2),
              "latency_ms_p99": round(float(np.percentile(lat, 99)), 2),
              "requests_per_s": round(len(answers) / wall, 1)})

    for q, (out, dt) in list(zip(queries, results, strict=True))[: args.show]:
        ids = out["ids"][0]
        rank = ids.index(q["passage_id"]) + 1 if q["passage_id"] in ids else None
        print(f"\nquery: {q['query']!r}  (right answer: {q['package']}, "
              f"{'rank ' + str(rank) if rank else 'not in top ' + str(args.k)}; {dt * 1000:.0f} ms)")
        for j in range(min(3, len(ids))):
            mark = "*" if ids[j] == q["passage_id"] else " "
            print(f" {mark}{j + 1}. {out['scores'][0][j]:.3f} {out['package'][0][j]}: {out['title'][0][j]}")
            print(textwrap.indent(textwrap.fill(out["passage"][0][j][:200], 96), "      "))
    print()
    if args.json:
        print(json.dumps(m))
    else:
        print(f"recall@{args.k} {m[f'recall@{args.k}']:.3f}  MRR@{args.k} {m[f'mrr@{args.k}']:.3f}  "
              f"over {m['queries']} answered queries ({m['failed']} failed); latency p50 {m['latency_ms_p50']} ms, p99 {m['latency_ms_p99']} ms, "
              f"{m['requests_per_s']} req/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
