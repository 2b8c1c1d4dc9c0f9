"""Residual compression of token embeddings (ColBERTv2, Santhanam et al.,
"ColBERTv2: Effective and Efficient Retrieval via Lightweight Late
Interaction", NAACL 2022; PLAID reads the same codes).

A token vector ``v`` (unit length) is stored as the id of its nearest
centroid ``c`` (k-means over a sample of the corpus' token vectors) and
its residual ``v - c`` quantized to ``nbits`` bits per dimension, plus the
inverse length of the decoded vector (fp16): 4 + d * nbits / 8 bytes a
token instead of 2 * d in fp16 (d = 384, 2 bits: 100 bytes against 768,
7.7x fewer). Decoding is ``c + w[code]`` renormalised; the stored inverse
length lets the re-rank scale the (n, t) scores instead of normalising the
(n, d) vectors.

Where this differs from ColBERTv2: its bucket cut-offs and values are one
set for all dimensions; here each dimension has its own (the residuals'
spread differs several-fold between dimensions of MiniLM's states, and
per-dimension quantiles cost 2 x d x 2^nbits floats). The centroids are
trained on token vectors, not taken from the passage-level IVF index the
search probes: a passage centroid is a poor predictor of its tokens.

Decoding is a table lookup per byte of codes: for each byte position the
table holds the 8 / nbits values that byte's codes stand for, so a row
decodes with one gather per byte (no per-code bit arithmetic), then adds
the centroid rows and normalises. This module is numpy and faiss only; the
token file (``late.py``) stores the codes and calls :meth:`ResidualCodec.decode`
in the re-rank.
"""

from __future__ import annotations

import math
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: Bits per dimension the codec supports (a byte holds a whole number of codes).
NBITS = (1, 2, 4, 8)
_HEAD = struct.Struct("<8sIIII")  # magic, version, dim, centroids, nbits
MAGIC = b"SLRESID1"
VERSION = 1


class CodecError(ValueError):
    """A codec's bytes that do not parse, or arguments it cannot honour."""


def default_centroids(tokens: int) -> int:
    """ColBERTv2's rule for the number of centroids, ``2^floor(log2(16
    sqrt(tokens)))``, capped to [64, 4096]: the full corpus' 3.2 M tokens
    would ask for 16,384, and k-means over them plus assigning every token
    is most of the compression's time on two cores (4,096 centroids over
    2^17 samples: a few minutes)."""
    if tokens < 1:
        raise CodecError("no tokens to train centroids on")
    k = 2 ** int(math.floor(math.log2(16 * math.sqrt(tokens))))
    return int(min(4096, max(64, k)))


def _byte_values(nbits: int) -> np.ndarray:
    """(256, 8 / nbits) uint8: the codes a byte holds, lowest bits first."""
    per = 8 // nbits
    b = np.arange(256, dtype=np.uint16)[:, None]
    shifts = (np.arange(per, dtype=np.uint16) * nbits)[None, :]
    return ((b >> shifts) & ((1 << nbits) - 1)).astype(np.uint8)


class ResidualCodec:
    """Centroids (k, d) float32, per-dimension bucket cut-offs (d, 2^nbits -
    1) and values (d, 2^nbits) float32. :meth:`train` makes one from a
    sample; :meth:`to_bytes` / :meth:`from_bytes` store it (in the token
    file after its table)."""

    def __init__(self, centroids: np.ndarray, cutoffs: np.ndarray, values: np.ndarray, nbits: int):
        if nbits not in NBITS:
            raise CodecError(f"nbits must be one of {NBITS}, got {nbits}")
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        if c.ndim != 2 or c.shape[0] < 1 or c.shape[0] > 65536:
            raise CodecError(f"centroids must be (1..65536, d), got {c.shape}")
        d, nb = c.shape[1], 1 << nbits
        if d * nbits % 8:
            raise CodecError(f"dimension {d} x {nbits} bits is not a whole number of bytes")
        if cutoffs.shape != (d, nb - 1) or values.shape != (d, nb):
            raise CodecError(f"cut-offs {cutoffs.shape} / values {values.shape} do not fit d={d}, nbits={nbits}")
        self.centroids, self.nbits, self.dim = c, int(nbits), int(d)
        self.cutoffs = np.ascontiguousarray(cutoffs, dtype=np.float32)
        self.values = np.ascontiguousarray(values, dtype=np.float32)
        self.code_bytes = d * nbits // 8
        #: bytes a token's record takes: its centroid id (u16, little-endian), the inverse length of its
        #: decoded vector (fp16) and its packed codes
        self.token_bytes = 4 + self.code_bytes
        per = 8 // nbits
        # table[p, byte] = the `per` values of dims p*per .. p*per+per-1 that `byte` stands for
        codes = _byte_values(nbits)  # (256, per)
        dims = np.arange(d).reshape(self.code_bytes, per)  # (P, per)
        self._table = np.ascontiguousarray(
            self.values[dims[:, None, :], codes[None, :, :]], dtype=np.float32).reshape(self.code_bytes * 256, per)
        self._base = (np.arange(self.code_bytes, dtype=np.intp) * 256)[None, :]
        self._index: Any = None  # faiss index over the centroids, built on first encode

    @property
    def k(self) -> int:
        return int(self.centroids.shape[0])

    # ------------------------------------------------------------ training

    @classmethod
    def train(cls, sample: np.ndarray, nbits: int = 2, k: int | None = None, niter: int = 20, seed: int = 0,
              threads: int = 2, log: Callable[[str], None] | None = None) -> ResidualCodec:
        """k-means (faiss) over ``sample`` (n, d) token vectors, then the
        residuals' per-dimension quantiles: cut-offs at i / 2^nbits, values
        at the buckets' midpoints (i + 0.5) / 2^nbits."""
        import faiss

        x = np.ascontiguousarray(sample, dtype=np.float32)
        if x.ndim != 2 or len(x) < 2:
            raise CodecError(f"a training sample must be (n >= 2, d), got {x.shape}")
        if nbits not in NBITS:
            raise CodecError(f"nbits must be one of {NBITS}, got {nbits}")
        k = default_centroids(len(x)) if k is None else int(k)
        k = min(k, len(x))
        if k < 1 or k > 65536:
            raise CodecError(f"centroids must be 1..65536, got {k}")
        faiss.omp_set_num_threads(int(threads))
        t0 = time.monotonic()
        km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, verbose=False,
                          max_points_per_centroid=max(256, -(-len(x) // k)))
        km.train(x)
        centroids = np.asarray(km.centroids, dtype=np.float32)
        if log:
            log(f"residual: {k} centroids over {len(x):,} tokens in {time.monotonic() - t0:.0f} s")
        _, assign = km.index.search(x, 1)
        res = x - centroids[assign[:, 0]]
        nb = 1 << nbits
        cutoffs = np.quantile(res, np.arange(1, nb) / nb, axis=0).T
        values = np.quantile(res, (np.arange(nb) + 0.5) / nb, axis=0).T
        return cls(centroids, cutoffs, values, nbits)

    # ------------------------------------------------------------ coding

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Records of the rows of ``x`` (n, d): (n, ``token_bytes``) uint8,
        the centroid id (u16 little-endian), the inverse length of the
        decoded vector (fp16 little-endian), then the packed codes (the
        lowest bits of a byte hold the lowest dimension)."""
        import faiss

        v = np.ascontiguousarray(x, dtype=np.float32)
        if v.ndim != 2 or v.shape[1] != self.dim:
            raise CodecError(f"vectors must be (n, {self.dim}), got {v.shape}")
        if self._index is None:
            index = faiss.IndexFlatL2(self.dim)
            index.add(self.centroids)
            self._index = index
        _, assign = self._index.search(v, 1)
        cid = assign[:, 0]
        res = v - self.centroids[cid]
        codes = np.zeros(res.shape, dtype=np.uint8)
        for j in range(self.cutoffs.shape[1]):  # 2^nbits - 1 comparisons a value
            codes += res > self.cutoffs[:, j][None, :]
        per = 8 // self.nbits
        shifts = (np.arange(per, dtype=np.uint8) * self.nbits)[None, None, :]
        packed = np.bitwise_or.reduce(codes.reshape(len(v), self.code_bytes, per) << shifts, axis=2)
        out = np.empty((len(v), self.token_bytes), dtype=np.uint8)
        out[:, 0] = cid & 0xFF
        out[:, 1] = cid >> 8
        out[:, 4:] = packed
        out[:, 2:4] = 0
        raw = self._unnormalised(out)
        inv = 1.0 / np.maximum(np.sqrt(np.einsum("ij,ij->i", raw, raw)), 1e-6)
        out[:, 2:4] = inv.astype("<f2").view(np.uint8).reshape(len(v), 2)
        return out

    def is_records(self, a: np.ndarray) -> bool:
        return a.dtype == np.uint8 and a.ndim == 2 and a.shape[1] == self.token_bytes

    def _unnormalised(self, r: np.ndarray) -> np.ndarray:
        """``c + w[code]`` (n, d) float32 of checked records."""
        n = len(r)
        cid = r[:, 0].astype(np.intp) | (r[:, 1].astype(np.intp) << 8)
        if n and int(cid.max()) >= self.k:
            raise CodecError(f"a record names centroid {int(cid.max())} of {self.k}")
        # np.take along axis 0 gathers whole rows, several times faster than fancy indexing
        vals = np.take(self._table, np.add(r[:, 4:], self._base, dtype=np.intp), axis=0)  # (n, P, per)
        out = vals.reshape(n, self.dim)
        out += np.take(self.centroids, cid, axis=0)
        return out

    def _checked(self, records: np.ndarray) -> np.ndarray:
        r = np.asarray(records)
        if not self.is_records(r):
            raise CodecError(f"records must be (n, {self.token_bytes}) uint8, got {r.shape} {r.dtype}")
        return r

    def _inverse_lengths(self, r: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(r[:, 2:4]).view("<f2")[:, 0].astype(np.float32)

    def decode(self, records: np.ndarray) -> np.ndarray:
        """(n, d) float32 unit vectors from records (n, ``token_bytes``) uint8."""
        r = self._checked(records)
        out = self._unnormalised(r)
        out *= self._inverse_lengths(r)[:, None]
        return out

    def scores(self, records: np.ndarray, qt: np.ndarray) -> np.ndarray:
        """``decode(records) @ qt`` (n, t), scaling the scores by the stored
        inverse lengths rather than the vectors (t is a query's tokens, far
        fewer than d)."""
        r = self._checked(records)
        sims = self._unnormalised(r) @ qt
        sims *= self._inverse_lengths(r)[:, None]
        return sims

    # ------------------------------------------------------------ storage

    def to_bytes(self) -> bytes:
        return b"".join([_HEAD.pack(MAGIC, VERSION, self.dim, self.k, self.nbits), self.centroids.tobytes(),
                         self.cutoffs.tobytes(), self.values.tobytes()])

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview) -> ResidualCodec:
        if len(buf) < _HEAD.size:
            raise CodecError(f"a residual codec takes at least {_HEAD.size} bytes, got {len(buf)}")
        magic, version, d, k, nbits = _HEAD.unpack_from(buf)
        if magic != MAGIC or version != VERSION:
            raise CodecError(f"not a residual codec of version {VERSION} (magic {magic!r}, version {version})")
        if nbits not in NBITS or not 1 <= k <= 65536 or not 1 <= d <= 1 << 16:
            raise CodecError(f"damaged residual codec header (d={d}, k={k}, nbits={nbits})")
        nb = 1 << nbits
        sizes = (k * d, d * (nb - 1), d * nb)
        need = _HEAD.size + 4 * sum(sizes)
        if len(buf) < need:
            raise CodecError(f"a residual codec of d={d}, k={k}, nbits={nbits} takes {need} bytes, got {len(buf)}")
        at, parts = _HEAD.size, []
        for s in sizes:
            parts.append(np.frombuffer(buf, dtype="<f4", count=s, offset=at).copy())
            at += 4 * s
        return cls(parts[0].reshape(k, d), parts[1].reshape(d, nb - 1), parts[2].reshape(d, nb), nbits)

    def nbytes(self) -> int:
        """Memory the codec holds (centroids, quantiles and the decode table)."""
        return int(self.centroids.nbytes + self.cutoffs.nbytes + self.values.nbytes + self._table.nbytes)

    def __repr__(self) -> str:
        return f"ResidualCodec(d={self.dim}, k={self.k}, nbits={self.nbits}, {self.token_bytes} bytes a token)"


def log_stderr(s: str) -> None:
    print(s, file=sys.stderr, flush=True)
