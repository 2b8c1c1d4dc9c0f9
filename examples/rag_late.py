"""Late-interaction retrieval (ESPN) served: text query -> MiniLM (sentence
embedding and per-token embeddings, one forward pass) -> IVF candidates
re-ranked by ColBERT MaxSim over the passages' token embeddings, which
stay on SSD and are read with O_DIRECT while the IVF probes run (ESPN:
Shrestha et al., "ESPN: Memory-Efficient Multi-Vector Information
Retrieval", ISMM 2024; see docs/design/late-interaction.md).

    .venv/bin/slipstream serve examples/rag_late.py
    curl -d '{"inputs": {"query": ["podcast client and feed aggregator"]}}' \\
        localhost:8000/v1/pipelines/rag_late/infer

The corpus and the IVF index are the RAG example's (examples/rag.py,
examples/models/vindex.py); the token embeddings of the indexed passages
(fp16, one 4 KiB-aligned block run per passage in ``<index>/tokens.bin``)
are built when the app is loaded if they are missing, with progress lines
(about a minute for the 2,000-passage slice on two cores; ~30 min for the
full corpus, resumable; copied out of the full corpus' file for a slice
when that one is built).

Stages:
- ``Embed``: ``query`` (string, one per row) -> ``embedding`` float32
  (rows, 384), unit rows; ``qtokens`` float16 (rows, 32, 384), the query's
  token vectors (unit rows; zeros past ``qlen``; queries are cut at 32
  tokens); ``qlen`` int64 (rows,).
- ``Search``: -> ``ids`` int64 (rows, k) (passage ids, -1 if none);
  ``maxsim`` float32 (rows, k), the MaxSim score of the first
  ``min(reranked, k)`` answers (0 after them: those are in single-vector
  order); ``cosine`` float32 (rows, k), the single-vector score of every
  answer; ``reranked`` int64 (rows,), how many of the query's candidates
  (best single-vector ones first) were re-ranked by MaxSim; ``target``
  int64 (rows,), how many it meant to (fewer than the re-rank depth when
  the budget's share of the disk's measured bandwidth could not bring
  them: ESPN-Lite's partial re-rank); ``prefetch_hits`` int64 (rows,), how
  many of those the prefetch had already started reading when the probes
  ended; and for people ``package``, ``title``, ``passage`` (rows, k).
  Every ``RAG_LATE_LOG_S`` seconds a replica prints a summary of its
  searches (re-ranked share, searches cut by the budget, prefetch hit
  rate) to the node's log.

The budget: each batch of the Search stage has until its most urgent
request's deadline (``batch.time_left()``, less a tenth of the SLO for
the answer's way back), and at most ``RAG_LATE_BUDGET_MS`` (default a quarter
of the SLO): when it nears, the batch is answered with what has been
re-ranked (re-ranked passages first by MaxSim, the rest in single-vector
order) and ``reranked`` says how many were. A request that waited long in
the queues thus gets a shorter re-rank instead of a late answer. Search
says so (``elastic_ms``, the tenth of the SLO it keeps): the node and the
planner count it at that, not at the budget it spends when unhurried.

Environment variables (read when the app is loaded, by the server and each
worker alike):
- ``SLIPSTREAM_DATA``, ``RAG_INDEX``, ``RAG_SLICE``, ``RAG_TOPK``,
  ``RAG_SNIPPET``, ``RAG_THREADS``: as in examples/rag.py.
- ``RAG_SLO_MS``: the pipeline's p99 objective in ms (default 200).
- ``RAG_LATE_STORAGE``: where the token embeddings are read from: ``ssd``
  (default; ``O_DIRECT`` with the prefetcher), ``mmap`` (the file mapped:
  the page cache) or ``ram`` (read into memory at start).
- ``RAG_LATE_BUDGET_MS``: the most the Search stage spends on a batch
  (default ``RAG_SLO_MS / 4``; less when its requests' deadlines are nearer).
- ``RAG_LATE_CANDIDATES``: single-vector candidates per query (default 100).
- ``RAG_LATE_RERANK_K``: re-rank at most the top k of them (default: all).
- ``RAG_LATE_PREFETCH_AT``: the prefetch step, a fraction of the IVF probes
  (0 turns the prefetch off; default: chosen per search from the measured
  probe time, read bandwidth and precision, `models.prefetch`).
- ``RAG_LATE_BITS``: 1, 2 or 4: the token embeddings stored as residuals of
  that many bits a dimension (`models.residual`; built from the fp16 file
  on first start); 0 (default): fp16.
- ``RAG_LATE_IO_THREADS``: ``O_DIRECT`` reader threads per replica (default 8).
- ``RAG_LATE_READ_DELAY_MS``: hold back each ``O_DIRECT`` read this long
  (default 0): a slow disk, for tests.
- ``RAG_LATE_LOG_S``: seconds between a replica's summaries (default 30; 0: none).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import slipstream as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import corpus, late, vindex  # noqa: E402
from models.minilm import DIM, ModelNotInstalled, TokenEncoder, build_onnx  # noqa: E402

QUERY_TOKENS = 32  # query token rows per query (the benchmark queries have at most 32 with [CLS] and [SEP])


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ss.ConfigError(f"{name} must be a number, not {raw!r}") from None


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ss.ConfigError(f"{name} must be an integer, not {raw!r}") from None


MODE = os.environ.get("RAG_INDEX", "auto").strip().lower()
SLICE = _env_int("RAG_SLICE", 2000) or 2000
TOPK = _env_int("RAG_TOPK", 10) or 10
SNIPPET = _env_int("RAG_SNIPPET", 300) or 0
THREADS = _env_int("RAG_THREADS", None)  # None: planned by `slipstream serve`
SLO_MS = _env_float("RAG_SLO_MS", 200.0)
STORAGE = os.environ.get("RAG_LATE_STORAGE", "ssd").strip().lower() or "ssd"
BUDGET_MS = _env_float("RAG_LATE_BUDGET_MS", SLO_MS / 4)
#: Of a request's time left, what the Search stage leaves for the answer's
#: way back to the client (the node, the HTTP reply) and for the re-rank's
#: own overshoot: a tenth of the SLO.
RESERVE_MS = SLO_MS / 10
CANDIDATES = _env_int("RAG_LATE_CANDIDATES", 100) or 100
RERANK_K = _env_int("RAG_LATE_RERANK_K", None)
#: The candidates a query re-ranks when no budget cuts it short.
RERANK_FULL = CANDIDATES if RERANK_K is None else min(RERANK_K, CANDIDATES)
#: The prefetch step (a fraction of the probes; 0: none); unset or ``auto``:
#: chosen from measured probe time, bandwidth and precision (models.prefetch).
_PREFETCH = os.environ.get("RAG_LATE_PREFETCH_AT", "").strip().lower()
PREFETCH_AT = None if _PREFETCH in ("", "auto") else _env_float("RAG_LATE_PREFETCH_AT", 0.0)
#: Token embeddings as residuals of this many bits a dimension (1, 2 or 4;
#: models.residual), or 0: fp16 as encoded.
BITS = _env_int("RAG_LATE_BITS", 0) or 0
IO_THREADS = _env_int("RAG_LATE_IO_THREADS", 8) or 8
LOG_S = _env_float("RAG_LATE_LOG_S", 30.0)

if MODE not in ("auto", "full", "small"):
    raise ss.ConfigError(f"RAG_INDEX must be auto, full or small, not {MODE!r}")
if STORAGE not in late.MODES:
    raise ss.ConfigError(f"RAG_LATE_STORAGE must be one of {', '.join(late.MODES)}, not {STORAGE!r}")
if BITS not in (0, 1, 2, 4):
    raise ss.ConfigError(f"RAG_LATE_BITS must be 0 (fp16), 1, 2 or 4, not {BITS}")
if not BUDGET_MS > 0:
    raise ss.ConfigError(f"RAG_LATE_BUDGET_MS must be > 0, not {BUDGET_MS}")
CONFIG = late.LateConfig(k=TOPK, candidates=CANDIDATES, rerank_k=RERANK_K, prefetch_at=PREFETCH_AT)
try:
    CONFIG.check()
except ValueError as e:
    raise ss.ConfigError(f"rag_late: {e} (RAG_TOPK, RAG_LATE_CANDIDATES, RAG_LATE_RERANK_K, "
                         "RAG_LATE_PREFETCH_AT)") from None


def index_dir() -> Path:
    """The index served, per ``RAG_INDEX``: the full one if built (or
    required), else the slice of ``RAG_SLICE`` passages."""
    try:
        return vindex.served_index_dir(MODE, SLICE, "RAG_INDEX")
    except FileNotFoundError as e:
        raise ss.ConfigError(str(e)) from None


def ensure_data() -> Path:
    """The index directory with its token file, building what is missing
    (the slice's index, the token graph, the token embeddings)."""
    d = index_dir()
    try:
        if not vindex.is_built(d):
            vindex.prepare(small=SLICE, threads=max(THREADS or 1, 2))
        build_onnx(tokens=True)
        late.ensure_tokens(d, threads=max(THREADS or 1, 2))
        if BITS:
            late.ensure_compressed(d, nbits=BITS, threads=max(THREADS or 1, 2))
    except (corpus.CorpusError, ModelNotInstalled, late.TokenFileError) as e:
        raise ss.ConfigError(f"cannot build the late-interaction data: {e}") from e
    return d


@ss.component(max_batch_size=32, threads=THREADS, inputs={"query": ss.Tensor("string", (-1,))},
              outputs={"embedding": ss.Tensor("float32", (-1, DIM)),
                       "qtokens": ss.Tensor("float16", (-1, QUERY_TOKENS, DIM)),
                       "qlen": ss.Tensor("int64", (-1,))},
              length_of="query")
class Embed:
    """Query text -> its MiniLM sentence embedding and token embeddings (the
    encoder pads a batch to its longest query: ``length_of``)."""

    def __init__(self) -> None:
        self.encoder = TokenEncoder(threads=ss.worker_threads())
        self.encoder.encode_tokens(["warm up"], max_tokens=QUERY_TOKENS)

    def __call__(self, batch: ss.Batch) -> dict:
        emb, toks, lens = self.encoder.encode_tokens(batch["query"], max_tokens=QUERY_TOKENS)
        return {"embedding": emb, "qtokens": toks.astype(np.float16), "qlen": lens}


def budget_s(batch: ss.Batch) -> float:
    """Seconds the Search stage may spend on `batch`: until its most urgent
    request's deadline less the reserve, at most ``RAG_LATE_BUDGET_MS``, at
    least 1 ms (the IVF probes and what is already read still answer)."""
    left_ms = float(np.min(batch.time_left(), initial=np.inf)) * 1e3 - RESERVE_MS
    return max(1.0, min(BUDGET_MS, left_ms)) / 1e3


@ss.component(max_batch_size=16, elastic_ms=RESERVE_MS, inputs={"embedding": ss.Tensor("float32", (-1, DIM)),
                                         "qtokens": ss.Tensor("float16", (-1, QUERY_TOKENS, DIM)),
                                         "qlen": ss.Tensor("int64", (-1,))},
              outputs={"ids": ss.Tensor("int64", (-1, TOPK)), "maxsim": ss.Tensor("float32", (-1, TOPK)),
                       "cosine": ss.Tensor("float32", (-1, TOPK)), "reranked": ss.Tensor("int64", (-1,)),
                       "target": ss.Tensor("int64", (-1,)), "prefetch_hits": ss.Tensor("int64", (-1,)),
                       "package": ss.Tensor("string", (-1, TOPK)), "title": ss.Tensor("string", (-1, TOPK)),
                       "passage": ss.Tensor("string", (-1, TOPK))})
class Search:
    """IVF candidates re-ranked by MaxSim over token embeddings read from
    ``RAG_LATE_STORAGE``, within ``RAG_LATE_BUDGET_MS`` per batch."""

    def __init__(self) -> None:
        d = index_dir()
        self.searcher = late.open_index(d, STORAGE, CONFIG, io_threads=IO_THREADS, nbits=BITS)
        passages = corpus.load_passages()
        n = len(passages)
        # Lookup tables over all passage ids, plus an empty entry at the end for id -1.
        self.package = np.full(n + 1, "", dtype=object)
        self.title = np.full(n + 1, "", dtype=object)
        self.passage = np.full(n + 1, "", dtype=object)
        for i, p in enumerate(passages):
            self.package[i], self.title[i], self.passage[i] = p.package, p.title, snippet(p.text)
        self.stats = {"searches": 0, "reranked": 0, "target": 0, "hits": 0, "cut": 0}
        self.lock = threading.Lock()
        self.last_log = time.monotonic()
        probe = self.searcher.probe
        print(f"rag_late Search: {STORAGE} storage, {self.searcher.tf}, IVF nlist {probe.nlist} nprobe "
              f"{probe.nprobe}, budget {BUDGET_MS:g} ms, {CANDIDATES} candidates", file=sys.stderr, flush=True)
        warm = np.zeros((1, QUERY_TOKENS, DIM), np.float32)
        warm[0, 0] = 1.0
        self.searcher.search(np.eye(1, DIM, dtype=np.float32), warm, [1])

    def __call__(self, batch: ss.Batch) -> dict:
        r = self.searcher.search(batch["embedding"], batch["qtokens"], batch["qlen"], budget_s=budget_s(batch))
        base = np.where(r.ids >= 0, r.ids, len(self.package) - 1)
        shown = np.arange(TOPK)[None, :] < np.minimum(r.reranked, TOPK)[:, None]
        self._account(r)
        return {"ids": r.ids, "maxsim": np.where(shown, r.maxsim, 0.0).astype(np.float32),
                "cosine": np.where(r.ids >= 0, r.cosine, 0.0).astype(np.float32), "reranked": r.reranked,
                "target": r.target, "prefetch_hits": r.hits, "package": self.package[base],
                "title": self.title[base], "passage": self.passage[base]}

    def _account(self, r: late.SearchResult) -> None:
        with self.lock:
            s = self.stats
            s["searches"] += len(r.ids)
            s["reranked"] += int(np.minimum(r.reranked, r.target).sum())
            s["target"] += int(r.target.sum())
            s["hits"] += int(r.hits.sum())
            s["cut"] += int(r.cut.sum())
            now = time.monotonic()
            if LOG_S > 0 and now - self.last_log >= LOG_S and s["searches"]:
                t = max(1, s["target"])
                full = max(1, s["searches"] * RERANK_FULL)
                print(f"rag_late Search: {s['searches']} searches: re-ranked {s['reranked'] / full:.0%} of their "
                      f"{RERANK_FULL} candidates ({s['reranked'] / t:.0%} of their targets, which partial "
                      f"re-ranking trims to the time left), {s['cut'] / s['searches']:.1%} cut by the "
                      f"{BUDGET_MS:g} ms budget, prefetch hit "
                      f"rate {s['hits'] / t:.0%}; prefetch {self.searcher.prefetch_plan().why}", file=sys.stderr,
                      flush=True)
                self.last_log = now


def snippet(text: str) -> str:
    return text if SNIPPET <= 0 or len(text) <= SNIPPET else text[:SNIPPET].rstrip() + "..."


if __name__.startswith("slipstream_app_") and os.environ.get("SLIPSTREAM_WORKER") != "1":
    # `slipstream serve` is loading the app: build what is missing now (with
    # progress on the terminal) rather than inside a worker.
    ensure_data()

rag_late = ss.Pipeline("rag_late", Embed >> Search,  # type: ignore[operator]  # components, once decorated
                       slo=ss.SLO(p99_ms=SLO_MS),
                       example={"query": ["how do I configure a reverse proxy with TLS termination"]})
