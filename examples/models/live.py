"""A vector index that takes additions and deletions while it serves.

The RAG app's base index is an IVF index built offline over the Debian
corpus (see ``vindex``). Documents put into the object store later arrive
here as rows: a name, a unit embedding and the text to show. New rows go to
a flat *delta* searched exactly beside the IVF index (cheap while it is
small: one matrix product); when the delta reaches ``fold_at`` rows it is
folded into the IVF index (``add_with_ids``: assigned to the trained
centroids, no retraining), so a query's cost stays bounded however many
documents are added. Deleting or replacing a row removes it from wherever
it lives. One lock guards both structures; searches and changes take it
briefly.

Folding assigns new rows to centroids trained without them; once the rows
added since the last training reach ``rebuild_at`` of the rows it was
trained on (default half), the lists drift out of balance and recall
drops, so a rebuild pays: a background thread copies every vector out of
the index, trains a new IVF index over them (same nprobe), and swaps it in
under the lock; changes that arrived meanwhile are replayed onto it.

Ids: base passages keep their corpus ids; live rows get ``LIVE_BASE + n``
in arrival order, so that callers can tell them apart.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

LIVE_BASE = 1 << 40


class LiveIndex:
    def __init__(self, base: Any, dim: int, fold_at: int = 2000, rebuild_at: float = 0.5):
        self.base = base  # a vindex.VectorIndex (its .index is a faiss IndexIVF)
        self.dim = dim
        self.fold_at = int(fold_at)
        self.rebuild_at = float(rebuild_at)
        self.trained_on = int(base.index.ntotal)
        self.added = 0  # rows folded in since the last training
        self.rebuilds = 0
        self._rebuilding: threading.Thread | None = None
        # Changes to the IVF index while a rebuild trains on a snapshot of it:
        # ("add", (vectors, ids)) for a fold, ("remove", id) for a deletion.
        self._replay: list[tuple[str, Any]] | None = None
        self.lock = threading.Lock()
        self._vecs = np.zeros((64, dim), dtype=np.float32)
        self._ids = np.zeros(64, dtype=np.int64)
        self._n = 0  # rows used in the delta
        self.by_name: dict[str, int] = {}  # name -> live id
        self.where: dict[int, str] = {}  # live id -> "delta" | "ivf"
        self.text: dict[int, tuple[str, str]] = {}  # live id -> (name, text)
        self._next = LIVE_BASE
        self.folds = 0

    @property
    def size(self) -> int:
        return len(self.by_name)

    def upsert(self, name: str, vec: np.ndarray, text: str) -> int:
        v = np.ascontiguousarray(vec, dtype=np.float32).reshape(self.dim)
        with self.lock:
            self._remove(name)
            lid = self._next
            self._next += 1
            if self._n == len(self._ids):
                self._vecs = np.concatenate([self._vecs, np.zeros_like(self._vecs)])
                self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
            self._vecs[self._n] = v
            self._ids[self._n] = lid
            self._n += 1
            self.by_name[name] = lid
            self.where[lid] = "delta"
            self.text[lid] = (name, text)
            if self._n >= self.fold_at:
                self._fold()
            return lid

    def delete(self, name: str) -> bool:
        with self.lock:
            lid = self.by_name.get(name)
            if lid is not None and self._replay is not None and self.where.get(lid) == "ivf":
                self._replay.append(("remove", lid))
            return self._remove(name)

    def _remove(self, name: str) -> bool:
        lid = self.by_name.pop(name, None)
        if lid is None:
            return False
        place = self.where.pop(lid)
        self.text.pop(lid, None)
        if place == "ivf":
            self.base.index.remove_ids(np.array([lid], dtype=np.int64))
        else:
            row = int(np.flatnonzero(self._ids[:self._n] == lid)[0])
            last = self._n - 1
            self._vecs[row], self._ids[row] = self._vecs[last], self._ids[last]
            self._n = last
        return True

    def _fold(self) -> None:
        """Move the delta into the IVF index (caller holds the lock)."""
        n = self._n
        vecs, ids = self._vecs[:n].copy(), self._ids[:n].copy()
        self.base.index.add_with_ids(vecs, ids)
        for lid in ids.tolist():
            self.where[int(lid)] = "ivf"
        if self._replay is not None:  # a rebuild is training on a snapshot without these
            self._replay.append(("add", (vecs, ids)))
        self._n = 0
        self.folds += 1
        self.added += n
        if self.added >= self.rebuild_at * max(self.trained_on, 1) and self._rebuilding is None:
            self._rebuilding = threading.Thread(target=self._rebuild, name="ivf-rebuild", daemon=True)
            self._rebuilding.start()

    def _rebuild(self) -> None:
        """Retrain the IVF index over all its vectors; swap it in."""
        with self.lock:
            # The snapshot and the start of the replay log are one moment:
            # what changes after it is replayed onto the new index.
            vecs, ids = ivf_contents(self.base.index)
            nprobe = int(self.base.index.nprobe)
            self._replay = []
        try:
            from models import vindex

            fresh = vindex.VectorIndex.build(vecs, ids).index
            fresh.nprobe = nprobe
        except Exception:
            with self.lock:
                self._replay, self._rebuilding = None, None
            raise
        with self.lock:
            replay, self._replay = self._replay or [], None
            # What changed the old index since the snapshot, in order.
            for op, arg in replay:
                if op == "add":
                    fresh.add_with_ids(*arg)
                else:
                    fresh.remove_ids(np.array([arg], dtype=np.int64))
            self.base.index = fresh
            self.trained_on = int(fresh.ntotal)
            self.added = 0
            self.rebuilds += 1
            self._rebuilding = None

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores, ids) over the base index and the live rows."""
        q = np.ascontiguousarray(q, dtype=np.float32)
        with self.lock:
            scores, ids = self.base.search(q, k)
            if self._n == 0:
                return scores, ids
            d = q @ self._vecs[:self._n].T
            dids = np.broadcast_to(self._ids[:self._n], d.shape)
        s = np.concatenate([scores, d], axis=1)
        i = np.concatenate([ids, dids], axis=1)
        s = np.where(i < 0, -np.inf, s)
        top = np.argsort(-s, axis=1, kind="stable")[:, :k]
        out_s = np.take_along_axis(s, top, axis=1).astype(np.float32)
        out_i = np.take_along_axis(i, top, axis=1)
        out_i = np.where(np.isfinite(out_s), out_i, -1)
        return np.where(np.isfinite(out_s), out_s, 0).astype(np.float32), out_i

    def describe(self, lid: int) -> tuple[str, str] | None:
        return self.text.get(int(lid))


def ivf_contents(index: Any) -> tuple[np.ndarray, np.ndarray]:
    """Every (vector, id) an IndexIVFFlat holds, read from its inverted lists."""
    import faiss

    inv = index.invlists
    vecs, ids = [], []
    for lst in range(index.nlist):
        n = inv.list_size(lst)
        if n == 0:
            continue
        ids.append(faiss.rev_swig_ptr(inv.get_ids(lst), n).copy())
        codes = faiss.rev_swig_ptr(inv.get_codes(lst), n * index.code_size).copy()
        vecs.append(codes.view(np.float32).reshape(n, index.d))
    if not ids:
        return np.zeros((0, index.d), dtype=np.float32), np.zeros(0, dtype=np.int64)
    return np.concatenate(vecs), np.concatenate(ids)
