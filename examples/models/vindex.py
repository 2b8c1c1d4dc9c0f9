"""Embedding a corpus once, and a faiss IVF index over the embeddings.

Two pieces other pipelines can reuse:

- :func:`embed_texts`: encode many texts with a :class:`~models.minilm.TextEncoder`
  (or anything with ``encode(list[str]) -> (n, d) float32``) into a cached
  ``.npy``, in length-sorted chunks, with a progress line, resumable after an
  interruption (finished chunks are kept in ``<out>.partial.npy``), and
  reused as long as the texts and the model are the same (a fingerprint is
  kept beside it in ``<out>.json``).
- :class:`VectorIndex`: a faiss ``IndexIVFFlat`` with inner product over unit
  vectors (= cosine), carrying its own ids (``add_with_ids``), with ``nlist``
  ~ 4 sqrt(n) and ``nprobe`` tuned against exact search, saved as
  ``index.faiss`` + ``index.json``.

And the RAG corpus built on them (Debian package descriptions, see
``models.corpus``): :func:`prepare` does corpus -> embeddings -> index, for
the full corpus (``<data>/rag/index/``) or for a small slice
(``<data>/rag/slice-<n>/``, ``n`` passages: the right answers of the first
``n/2`` benchmark queries plus random others, so it can be evaluated too).
A slice takes its rows from the full embeddings when those exist, else
embeds just its own passages.

Call :func:`configure_faiss` in a serving process: one faiss thread (a
replica is one core) and ``distance_compute_blas_threshold = 1`` (small
query batches use BLAS: about 10x faster than faiss' default loop there).

Public API::

    configure_faiss(threads=1)
    embed_texts(texts, out, encoder, chunk=256, key="...") -> np.ndarray
    VectorIndex.build(vectors, ids=None, nlist=None) -> VectorIndex
    VectorIndex.load(dir) / .save(dir) / .search(q, k) -> (scores, ids)
    VectorIndex.tune_nprobe(q, k=10, target=0.98) -> int
    retrieval_metrics(ranked_ids, truth_ids, k=10) -> {"recall@k", "mrr@k"}
    prepare(small=None, threads=2) -> Path        # the RAG index directory
    rag_index_dir(small=None) -> Path
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import build_lock, data_dir

INDEX_FILE = "index.faiss"
META_FILE = "index.json"
IDS_FILE = "ids.npy"  # the passage ids in the index (RAG indexes), sorted
NPROBES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def configure_faiss(threads: int = 1) -> None:
    """Faiss settings for serving: ``threads`` OpenMP threads, and BLAS for
    every query batch size."""
    import faiss

    faiss.omp_set_num_threads(int(threads))
    faiss.cvar.distance_compute_blas_threshold = 1


# ----------------------------------------------------------------- embedding

class Progress:
    """A progress line on stderr: done/total, rate, ETA (from ``weight``,
    e.g. characters, when items differ in cost)."""

    def __init__(self, label: str, total: int, total_weight: float | None = None, every_s: float | None = None):
        self.label, self.total = label, total
        self.total_weight = total_weight if total_weight is not None else float(total)
        self.tty = sys.stderr.isatty()
        self.every_s = every_s if every_s is not None else (1.0 if self.tty else 30.0)  # a log file: fewer lines
        self.t0 = time.monotonic()
        self.last = self.t0

    def update(self, done: int, done_weight: float | None = None, since: int = 0, since_weight: float = 0.0,
               final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.every_s:
            return
        self.last = now
        w = done_weight if done_weight is not None else float(done)
        dt = max(now - self.t0, 1e-9)
        rate = (done - since) / dt
        wrate = (w - since_weight) / dt
        eta = (self.total_weight - w) / wrate if wrate > 0 else float("inf")
        eta_s = f"{eta / 60:.1f} min" if math.isfinite(eta) else "?"
        line = (f"{self.label}: {done}/{self.total} ({100 * done / max(self.total, 1):.1f}%) "
                f"{rate:.1f}/s, elapsed {dt / 60:.1f} min, eta {eta_s}")
        print(("\r" + line + " " * 4) if self.tty and not final else line, end="" if self.tty and not final else "\n",
              file=sys.stderr, flush=True)


def _fingerprint(texts: Sequence[str], key: str) -> str:
    h = hashlib.sha1(key.encode())
    for t in texts:
        h.update(t.encode("utf-8", "replace"))
        h.update(b"\0")
    return h.hexdigest()


def embed_texts(texts: Sequence[str], out: Path, encoder: Any, chunk: int = 256, key: str = "",
                label: str = "embed", progress: bool = True) -> np.ndarray:
    """``encoder.encode`` all ``texts`` into ``out`` (.npy, float32 (n, d)),
    once. ``key`` names the model (it goes into the fingerprint with the
    texts). Work goes in chunks of ``chunk`` texts, shortest first; after each
    chunk the rows so far are on disk, so a killed run resumes where it
    stopped. Returns the array (memory-mapped)."""
    out = Path(out)
    meta_path = out.with_suffix(".json")
    fp = _fingerprint(texts, key)
    if out.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") == fp:
            return np.load(out, mmap_mode="r")
    n = len(texts)
    partial = out.with_name(out.stem + ".partial.npy")
    state_path = out.with_name(out.stem + ".partial.json")
    order = np.argsort(np.array([len(t) for t in texts]), kind="stable")
    weights = np.array([len(t) + 40 for t in texts], dtype=np.float64)  # chars, plus a per-text overhead
    chunks = [order[s:s + chunk] for s in range(0, n, chunk)]
    done = 0
    if partial.is_file() and state_path.is_file():
        state = json.loads(state_path.read_text())
        if state.get("fingerprint") == fp and state.get("chunk") == chunk:
            done = int(state["done_chunks"])
    dim = int(getattr(encoder, "dim", 0)) or encoder.encode(texts[:1]).shape[1]
    if done:
        arr = np.lib.format.open_memmap(partial, mode="r+")
        if arr.shape != (n, dim):
            done = 0
    if not done:
        arr = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(n, dim))
    done_rows = sum(len(c) for c in chunks[:done])
    done_w = float(sum(weights[c].sum() for c in chunks[:done]))
    bar = Progress(label, n, float(weights.sum()))
    if progress and done:
        print(f"{label}: resuming at {done_rows}/{n}", file=sys.stderr, flush=True)
    start_rows, start_w = done_rows, done_w
    for i in range(done, len(chunks)):
        idx = chunks[i]
        arr[idx] = encoder.encode([texts[j] for j in idx])
        arr.flush()
        state_path.write_text(json.dumps({"fingerprint": fp, "chunk": chunk, "done_chunks": i + 1}))
        done_rows += len(idx)
        done_w += float(weights[idx].sum())
        if progress and i + 1 < len(chunks):
            bar.update(done_rows, done_w, start_rows, start_w)
    if progress:
        bar.update(done_rows, done_w, start_rows, start_w, final=True)
    del arr
    os.replace(partial, out)
    meta_path.write_text(json.dumps({"fingerprint": fp, "n": n, "dim": dim, "key": key}))
    state_path.unlink(missing_ok=True)
    return np.load(out, mmap_mode="r")


# --------------------------------------------------------------------- index

def default_nlist(n: int) -> int:
    """~4 sqrt(n) inverted lists, but at least 39 training points per list."""
    return max(1, min(int(round(4 * math.sqrt(n))), n // 39))


class VectorIndex:
    """Faiss IVF (flat, inner product) over unit vectors, with ids.

    ``search`` returns ``(scores, ids)``: float32 and int64 arrays of shape
    (n, k), best first; ids are -1 (score -inf) where fewer than k vectors
    were found in the probed lists.
    """

    def __init__(self, index: Any, meta: dict[str, Any]):
        self.index = index
        self.meta = meta
        self._built: tuple[np.ndarray, np.ndarray] | None = None
        self.nprobe = int(meta.get("nprobe", 1))

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def nprobe(self) -> int:
        return int(self.index.nprobe)

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self.index.nprobe = int(value)
        self.meta["nprobe"] = int(value)

    @classmethod
    def build(cls, vectors: np.ndarray, ids: np.ndarray | None = None, nlist: int | None = None,
              seed: int = 1234) -> VectorIndex:
        import faiss

        x = np.ascontiguousarray(vectors, dtype=np.float32)
        n, d = x.shape
        ids = np.arange(n, dtype=np.int64) if ids is None else np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids) != n:
            raise ValueError(f"{len(ids)} ids for {n} vectors")
        nlist = nlist or default_nlist(n)
        t0 = time.monotonic()
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed = seed
        index.train(x)
        index.add_with_ids(x, ids)
        meta = {"n": n, "dim": d, "nlist": nlist, "nprobe": 1, "build_s": round(time.monotonic() - t0, 2)}
        built = cls(index, meta)
        built._built = (x, ids)
        return built

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.float32)
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise ValueError(f"queries must be (n, {self.dim}), got {q.shape}")
        scores, ids = self.index.search(q, int(k))
        return scores.astype(np.float32, copy=False), ids.astype(np.int64, copy=False)

    def tune_nprobe(self, queries: np.ndarray, k: int = 10, target: float = 0.98,
                    vectors: np.ndarray | None = None, ids: np.ndarray | None = None) -> int:
        """Set the smallest ``nprobe`` whose top-``k`` agrees with exact
        search on at least ``target`` of the results; returns it. Exact
        search runs over ``vectors``/``ids`` (by default those the index was
        built from in this process)."""
        import faiss

        if vectors is None:
            if self._built is None:
                raise ValueError("tune_nprobe needs the indexed vectors (and ids) for a loaded index")
            vectors, ids = self._built
        q = np.ascontiguousarray(queries, dtype=np.float32)
        flat = faiss.IndexIDMap(faiss.IndexFlatIP(self.dim))
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        flat.add_with_ids(x, np.arange(len(x), dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64))
        _, truth = flat.search(q, k)
        chosen, tried = None, {}
        for p in NPROBES:
            if p > self.index.nlist:
                break
            self.index.nprobe = p
            _, got = self.index.search(q, k)
            overlap = np.mean([len(set(a[a >= 0]) & set(b[b >= 0])) / max(1, (b >= 0).sum()) for a, b in zip(got, truth, strict=True)])
            tried[p] = round(float(overlap), 4)
            if overlap >= target:
                chosen = p
                break
        self.nprobe = chosen or min(self.index.nlist, NPROBES[-1])
        self.meta["nprobe_recall_vs_exact"] = tried
        return self.nprobe

    def save(self, directory: Path) -> None:
        import faiss

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{INDEX_FILE}.{os.getpid()}.tmp"
        faiss.write_index(self.index, str(tmp))
        os.replace(tmp, directory / INDEX_FILE)
        (directory / META_FILE).write_text(json.dumps(self.meta, indent=1))

    @classmethod
    def load(cls, directory: Path) -> VectorIndex:
        import faiss

        directory = Path(directory)
        if not (directory / INDEX_FILE).is_file() or not (directory / META_FILE).is_file():
            raise FileNotFoundError(f"no index in {directory} (expected {INDEX_FILE} and {META_FILE})")
        meta = json.loads((directory / META_FILE).read_text())
        return cls(faiss.read_index(str(directory / INDEX_FILE)), meta)

    def __repr__(self) -> str:
        return f"VectorIndex(n={self.ntotal}, dim={self.dim}, nlist={self.index.nlist}, nprobe={self.nprobe})"


def retrieval_metrics(ranked_ids: np.ndarray, truth_ids: Sequence[int], k: int = 10) -> dict[str, float]:
    """recall@k (the right passage is among the first k) and MRR@k (mean of
    1/rank of the right passage, 0 past k) over queries with one right
    passage each."""
    ranked = np.asarray(ranked_ids)[:, :k]
    truth = np.asarray(truth_ids).reshape(-1, 1)
    hit = ranked == truth
    found = hit.any(axis=1)
    rank = hit.argmax(axis=1) + 1
    return {f"recall@{k}": float(found.mean()), f"mrr@{k}": float(np.where(found, 1.0 / rank, 0.0).mean()),
            "queries": int(len(truth))}


# ----------------------------------------------------------- the RAG corpus

def rag_index_dir(small: int | None = None) -> Path:
    """Where the RAG index lives: ``<data>/rag/index`` or ``<data>/rag/slice-<n>``."""
    return data_dir("rag", create=False) / ("index" if not small else f"slice-{int(small)}")


def is_built(directory: Path) -> bool:
    """Whether ``directory`` holds a built RAG index (its metadata and ids)."""
    return (Path(directory) / META_FILE).is_file() and (Path(directory) / IDS_FILE).is_file()


def served_index_dir(mode: str, small: int, setting: str) -> Path:
    """The index an app serves: the full one when ``mode`` is ``full``, or
    ``auto`` and it is built; else the slice of ``small`` passages.
    FileNotFoundError (naming ``setting``, the app's variable) when
    ``full`` is required and not built."""
    full = rag_index_dir(None)
    built = is_built(full)
    if mode == "full" or (mode == "auto" and built):
        if not built:
            raise FileNotFoundError(f"{setting}=full but {full} holds no index: run "
                                    "`nice -n 15 .venv/bin/python scripts/prepare_rag.py` first")
        return full
    return rag_index_dir(small)


def indexed_ids(directory: Path) -> np.ndarray:
    """The sorted passage ids a RAG index directory holds."""
    return np.load(Path(directory) / IDS_FILE)


def held_queries(directory: Path) -> list[dict]:
    """The benchmark queries whose right passage the index in ``directory`` holds."""
    from . import corpus

    held = set(indexed_ids(directory).tolist())
    return [q for q in corpus.load_queries() if q["passage_id"] in held]


def slice_ids(n: int, n_passages: int, queries: Sequence[dict], seed: int = 1234) -> np.ndarray:
    """Passage ids of a slice of ``n`` passages: the right answers of the
    first ``n // 2`` queries, then random other passages; sorted."""
    if n > n_passages:
        raise ValueError(f"a slice of {n} passages from a corpus of {n_passages}")
    chosen = list(dict.fromkeys(int(q["passage_id"]) for q in queries[: n // 2]))
    rng = np.random.default_rng(seed)
    taken = set(chosen)
    for i in rng.permutation(n_passages):
        if len(chosen) >= n:
            break
        if int(i) not in taken:
            chosen.append(int(i))
            taken.add(int(i))
    return np.array(sorted(chosen), dtype=np.int64)


def prepare(small: int | None = None, threads: int = 2, batch_size: int = 8, force: bool = False,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> Path:
    """corpus -> ONNX -> embeddings -> index, each step skipped when its
    output is already there (``force`` rebuilds the index). ``small`` builds
    a slice of that many passages instead of the full corpus. Returns the
    index directory. One process at a time (``build_lock``): builds share
    the corpus, apt's lists and the query embeddings' partial files."""
    from . import corpus, minilm

    with build_lock("rag"):
        t0 = time.monotonic()
        corpus.build()
        passages = corpus.load_passages()
        queries = corpus.load_queries()
        out_dir = rag_index_dir(small)
        if is_built(out_dir) and not force:
            meta = json.loads((out_dir / META_FILE).read_text())
            if meta.get("corpus") == corpus_key(passages):
                log(f"rag: index ready in {out_dir} ({meta['n']} passages, nprobe {meta['nprobe']})")
                return out_dir
        log(f"rag: corpus {len(passages)} passages, {len(queries)} queries ({time.monotonic() - t0:.1f}s)")
        minilm.build_onnx()
        encoder = minilm.TextEncoder(threads=threads, batch_size=batch_size)
        key = f"{minilm.ONNX_NAME}/max_length={encoder.max_length}"
        rag = data_dir("rag")
        full = rag / "embeddings.npy"
        if small:
            ids = slice_ids(int(small), len(passages), queries)
            if full.is_file() and (rag / "embeddings.json").is_file() and \
                    json.loads((rag / "embeddings.json").read_text()).get("fingerprint") == \
                    _fingerprint([p.text for p in passages], key):
                vectors = np.asarray(np.load(full, mmap_mode="r")[ids])
                log(f"rag: slice of {len(ids)} rows taken from the full embeddings")
            else:
                out_dir.mkdir(parents=True, exist_ok=True)
                vectors = np.asarray(embed_texts([passages[i].text for i in ids], out_dir / "embeddings.npy",
                                                 encoder, key=key, label="embed slice"))
            n_tune = min(len(queries), max(50, int(small) // 2))
        else:
            ids = np.arange(len(passages), dtype=np.int64)
            vectors = np.asarray(embed_texts([p.text for p in passages], full, encoder, key=key,
                                             label="embed corpus"))
            n_tune = len(queries)
        qv = np.asarray(embed_texts([q["query"] for q in queries[:n_tune]], rag / f"queries-{n_tune}.npy",
                                    encoder, key=key, label="embed queries", progress=False))
        if small:  # tune on the queries whose right answer is in the slice
            inside = np.isin([q["passage_id"] for q in queries[:n_tune]], ids)
            qv = qv[inside]
        configure_faiss(threads)
        index = VectorIndex.build(vectors, ids)
        nprobe = index.tune_nprobe(qv, k=10)
        index.meta.update({"corpus": corpus_key(passages), "model": key, "small": int(small or 0),
                           "n_corpus": len(passages)})
        index.save(out_dir)
        np.save(out_dir / IDS_FILE, ids)
        log(f"rag: index {index} built in {index.meta['build_s']}s, nprobe {nprobe} "
            f"(top-10 overlap with exact search: {index.meta['nprobe_recall_vs_exact']}) -> {out_dir}")
        return out_dir


def corpus_key(passages: Sequence[Any]) -> str:
    """A fingerprint of the passages' texts (an index records the corpus it was built from)."""
    return _fingerprint([p.text for p in passages], "corpus")
