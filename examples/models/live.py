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

Ids: base passages keep their corpus ids; live rows get ``LIVE_BASE + n``
in arrival order, so that callers can tell them apart.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

LIVE_BASE = 1 << 40


class LiveIndex:
    def __init__(self, base: Any, dim: int, fold_at: int = 2000):
        self.base = base  # a vindex.VectorIndex (its .index is a faiss IndexIVF)
        self.dim = dim
        self.fold_at = int(fold_at)
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
        self.base.index.add_with_ids(self._vecs[:n].copy(), self._ids[:n].copy())
        for lid in self._ids[:n].tolist():
            self.where[int(lid)] = "ivf"
        self._n = 0
        self.folds += 1

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
