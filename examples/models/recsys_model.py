"""A DLRM-style ranking model and a candidate generator, in numpy.

The shape of the model in Ray Serve's published DLRM recommendation
benchmark (and of DLRM itself, Naumov et al. 2019), with random weights:

- **Sparse features** are looked up in embedding tables of dimension
  ``dim`` = 64: the user (``n_users`` = 100k rows, 25.6 MB), the candidate
  item (``n_items`` = 200k rows, 51.2 MB), the item's category (1k rows),
  and the user's recent history as an *embedding bag* (the mean of the
  history items' rows, padding ``-1`` ignored). 200k x 64 keeps the item
  table realistic without the memory churn of a 1M-row table on a small
  machine. Ids beyond a table wrap around (the hashing trick).
- **Dense features** (``n_dense`` = 13, as in Criteo) go through the bottom
  MLP 13 -> 128 -> 64 (ReLU).
- **Interactions**: the pairwise dot products of the five 64-d vectors
  (bottom-MLP output, user, item, category, history): 10 numbers.
- **Top MLP** on [bottom output, interactions] (74) -> 128 -> 64 -> 1, sigmoid.

About 29k multiply-adds per candidate, 0.9M per request of 32 candidates
(the MLPs are small, as in DLRM's Criteo-Kaggle configuration; the tables
hold 19.26M of the 19.29M parameters). Every matrix product runs on all
candidates of the requests of a batch at once, in chunks of 8 requests
(256 rows) so that activations stay in cache: per-call overhead is paid
once per chunk, not once per request.

:class:`Catalog` is the deterministic item side that both pipeline stages
share (popularity, categories, static item features), generated from a seed
so that each worker process builds the same one without a file.
:class:`CandidateGenerator` turns a user id and history into 32 candidate
ids with dense features. Everything is a function of (seed, inputs).

    python examples/models/recsys_model.py   # time score() per batch size
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

N_CANDIDATES = 32
HISTORY = 8  # history items per request, padded with -1


@dataclass(frozen=True)
class RecsysConfig:
    n_users: int = 100_000
    n_items: int = 200_000
    n_categories: int = 1_000
    dim: int = 64
    n_dense: int = 13
    bottom: tuple[int, ...] = (128,)
    top: tuple[int, ...] = (128, 64)
    n_candidates: int = N_CANDIDATES
    seed: int = 0


class Catalog:
    """The item side both stages need: popularity, category and 8 static
    features per item (price, age, ...), drawn from ``config.seed``."""

    N_ITEM_FEATURES = 8

    def __init__(self, config: RecsysConfig = RecsysConfig()):
        self.config = config
        rng = np.random.default_rng([config.seed, 1])
        n = config.n_items
        # Zipf-like popularity over a random permutation of the items.
        order = rng.permutation(n)
        self.popularity = np.empty(n, dtype=np.float32)
        self.popularity[order] = (1.0 / np.arange(1, n + 1, dtype=np.float64) ** 0.8).astype(np.float32)
        self.popular = order[:256].astype(np.int64)  # the most popular items, best first
        self.category = rng.integers(0, config.n_categories, size=n, dtype=np.int64)
        self.features = rng.standard_normal((n, self.N_ITEM_FEATURES), dtype=np.float32)
        self.features[:, 0] = np.log(self.popularity * n)  # log popularity as a feature


class CandidateGenerator:
    """Candidates for a user, in priority order, deduplicated and without
    the user's history items:

    1. up to 16 items co-visited with the history (4 per history item, most
       recent first; "co-visited" is a fixed multiplicative hash of the item),
    2. the most popular items, up to 24 candidates in all,
    3. per-user exploration items (a hash of the user id) up to 32,
    4. less popular items, should exploration collide.

    ``generate`` returns candidate ids (n, 32) int64 and dense features
    (n, 32, 13) float32: the item's 8 static features, the user's activity
    (history length / 8) and a per-user bias, and a one-hot of the source
    (co-visit / popular / explore). Vectorised over the batch.
    """

    SOURCES = 3
    CO_VISIT = 4  # neighbours per history item
    CAPS = (16, 24)  # at most 16 co-visit candidates, 24 co-visit + popular
    POPULAR = 64
    EXPLORE = 64

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        cfg = catalog.config
        if Catalog.N_ITEM_FEATURES + 2 + self.SOURCES != cfg.n_dense:
            raise ValueError(f"n_dense must be {Catalog.N_ITEM_FEATURES + 2 + self.SOURCES}, got {cfg.n_dense}")
        self.k = cfg.n_candidates
        self.n_items = cfg.n_items
        self._j_co = np.arange(1, self.CO_VISIT + 1, dtype=np.int64) * 97 * 40503
        self._j_ex = np.arange(1, self.EXPLORE + 1, dtype=np.int64) * 3266489917

    def _pool(self, users: np.ndarray, history: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """All possible candidates per row in priority order, whether each
        is a real item (not padding), and the segment lengths."""
        n = len(users)
        recent = history[:, ::-1]  # most recent first (padding, -1, comes first here and is masked)
        valid_h = recent >= 0
        co = (np.where(valid_h, recent, 0)[:, :, None] % self.n_items * 2654435761 + self._j_co) % self.n_items
        co_valid = np.repeat(valid_h, self.CO_VISIT, axis=1)
        pop = self.catalog.popular
        u = (users % 2147483647 + 1)[:, None]
        ex = (u * 2246822519 + self._j_ex) % self.n_items
        segs = [co.reshape(n, -1), np.broadcast_to(pop[: self.POPULAR], (n, self.POPULAR)), ex,
                np.broadcast_to(pop[self.POPULAR :], (n, len(pop) - self.POPULAR))]
        pool = np.concatenate(segs, axis=1)
        valid = np.ones(pool.shape, dtype=bool)
        valid[:, : co_valid.shape[1]] = co_valid
        return pool, valid, [s.shape[1] for s in segs]

    def generate(self, users: np.ndarray, history: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        users = np.asarray(users, dtype=np.int64).reshape(-1)
        n = len(users)
        history = np.asarray(history, dtype=np.int64).reshape(n, -1)
        pool, ok, seg = self._pool(users, history)
        # Drop the history's own items and repeats (the first occurrence wins).
        seen = np.where(history >= 0, history % self.n_items, -1)
        ok &= ~(pool[:, :, None] == seen[:, None, :]).any(axis=2)
        key = np.where(ok, pool, -1 - np.arange(pool.shape[1]))  # invalid entries never match
        order = np.argsort(key, axis=1, kind="stable")
        srt = np.take_along_axis(key, order, axis=1)
        dup = np.zeros(pool.shape, dtype=bool)
        dup[:, 1:] = srt[:, 1:] == srt[:, :-1]
        first = np.empty(pool.shape, dtype=bool)
        np.put_along_axis(first, order, ~dup, axis=1)
        ok &= first
        # Take segment by segment under the caps, in priority order.
        take = np.zeros(pool.shape, dtype=bool)
        src = np.zeros(pool.shape, dtype=np.int64)
        caps = [*self.CAPS, self.k, self.k]
        count = np.zeros((n, 1), dtype=np.int64)
        at = 0
        for i, (width, cap) in enumerate(zip(seg, caps, strict=True)):
            part = ok[:, at : at + width]
            t = part & (np.cumsum(part, axis=1) <= cap - count)
            take[:, at : at + width] = t
            src[:, at : at + width] = (0, 1, 2, 1)[i]
            count += t.sum(axis=1, keepdims=True)
            at += width
        if (count != self.k).any():
            raise RuntimeError("candidate generation found fewer than 32 distinct items")
        ids = pool[take].reshape(n, self.k)
        source = src[take].reshape(n, self.k)
        nf = Catalog.N_ITEM_FEATURES
        dense = np.zeros((n, self.k, nf + 2 + self.SOURCES), dtype=np.float32)
        dense[:, :, :nf] = self.catalog.features[ids]
        dense[:, :, nf] = ((history >= 0).sum(axis=1) / history.shape[1])[:, None]
        dense[:, :, nf + 1] = ((users % 2147483647 * 2654435761 % 1000) / 500.0 - 1.0)[:, None]
        dense[:, :, nf + 2 :] = np.eye(self.SOURCES, dtype=np.float32)[source]
        return ids, dense


def _linear(rng: np.random.Generator, fan_in: int, fan_out: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.standard_normal((fan_in, fan_out), dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
    b = rng.standard_normal(fan_out, dtype=np.float32) * np.float32(0.01)
    return w, b


class DLRM:
    """The ranking model. ``score(users, items, dense, history)`` -> (n, C)
    click probabilities for n users with C candidates each."""

    CHUNK = 8  # requests per inner step of a large batch

    def __init__(self, config: RecsysConfig = RecsysConfig(), catalog: Catalog | None = None):
        self.config = c = config
        self.catalog = catalog or Catalog(config)
        rng = np.random.default_rng([c.seed, 2])
        scale = np.float32(1.0 / np.sqrt(c.dim))
        self.user_table = rng.standard_normal((c.n_users, c.dim), dtype=np.float32) * scale
        self.item_table = rng.standard_normal((c.n_items, c.dim), dtype=np.float32) * scale
        self.cat_table = rng.standard_normal((c.n_categories, c.dim), dtype=np.float32) * scale
        dims = [c.n_dense, *c.bottom, c.dim]
        self.bottom = [_linear(rng, a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)]
        top_in = c.dim + 10  # 10 = pairwise dots of 5 vectors
        dims = [top_in, *c.top, 1]
        self.top = [_linear(rng, a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)]

    @property
    def nbytes(self) -> int:
        layers = [w.nbytes + b.nbytes for w, b in self.bottom + self.top]
        return self.user_table.nbytes + self.item_table.nbytes + self.cat_table.nbytes + sum(layers)

    @staticmethod
    def _mlp(x: np.ndarray, layers: list[tuple[np.ndarray, np.ndarray]], last_relu: bool) -> np.ndarray:
        for i, (w, b) in enumerate(layers):
            x = x @ w
            x += b
            if last_relu or i < len(layers) - 1:
                np.maximum(x, 0, out=x)
        return x

    def score(self, users: np.ndarray, items: np.ndarray, dense: np.ndarray, history: np.ndarray) -> np.ndarray:
        n = len(items)
        if n <= self.CHUNK:
            return self._score(users, items, dense, history)
        # Large batches in chunks of CHUNK requests, so that the activations
        # (CHUNK * 32 rows x 128 floats) stay in cache between layers.
        users = np.asarray(users).reshape(-1)
        out = np.empty(items.shape, dtype=np.float32)
        for s in range(0, n, self.CHUNK):
            e = s + self.CHUNK
            out[s:e] = self._score(users[s:e], items[s:e], dense[s:e], history[s:e])
        return out

    def _score(self, users: np.ndarray, items: np.ndarray, dense: np.ndarray, history: np.ndarray) -> np.ndarray:
        c = self.config
        users = np.asarray(users, dtype=np.int64).reshape(-1)
        n, k = items.shape
        if dense.shape != (n, k, c.n_dense):
            raise ValueError(f"dense features must have shape {(n, k, c.n_dense)}, got {dense.shape}")
        history = np.asarray(history, dtype=np.int64).reshape(n, -1)
        items = items % c.n_items
        # Sparse side: one vector per user (user, history bag), one per candidate (item, category).
        u = self.user_table[users % c.n_users]  # (n, d)
        valid = history >= 0
        hist = self.item_table[np.where(valid, history % c.n_items, 0)] * valid[:, :, None]
        bag = hist.sum(axis=1) / np.maximum(valid.sum(axis=1, keepdims=True), 1)  # (n, d)
        it = self.item_table[items]  # (n, k, d)
        cat = self.cat_table[self.catalog.category[items]]  # (n, k, d)
        # Dense side: the bottom MLP over all n*k candidates at once.
        x = self._mlp(dense.reshape(n * k, c.n_dense), self.bottom, last_relu=True)
        # Interactions: pairwise dots of (x, item, category) per candidate,
        # of those with (user, bag) per request, and user . bag.
        v = np.empty((n, k, 3, c.dim), dtype=np.float32)
        v[:, :, 0] = x.reshape(n, k, c.dim)
        v[:, :, 1] = it
        v[:, :, 2] = cat
        gram = np.matmul(v, v.transpose(0, 1, 3, 2))  # (n, k, 3, 3)
        ub = np.stack([u, bag], axis=2)  # (n, d, 2)
        cross = np.matmul(v.reshape(n, k * 3, c.dim), ub).reshape(n, k, 6)
        z = np.empty((n, k, c.dim + 10), dtype=np.float32)
        z[:, :, : c.dim] = v[:, :, 0]
        z[:, :, c.dim : c.dim + 3] = gram[:, :, [0, 0, 1], [1, 2, 2]]
        z[:, :, c.dim + 3 : c.dim + 9] = cross
        z[:, :, c.dim + 9] = np.einsum("nd,nd->n", u, bag)[:, None]
        z = z.reshape(n * k, -1)
        logit = self._mlp(z, self.top, last_relu=False).reshape(n, k)
        return (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)


def top_k(items: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best (items, scores) per row, best first (ties: lower item id first)."""
    order = np.lexsort((items, -scores), axis=-1)[:, :k]
    return np.take_along_axis(items, order, axis=1), np.take_along_axis(scores, order, axis=1)


def time_batches(sizes: tuple[int, ...] = (1, 8, 32, 128, 256), requests: int = 2048) -> dict[int, float]:
    """Median ms of one ``score`` call per batch size. Every call scores new
    requests (32 candidates each), so table rows are not warm in cache from
    the previous call, as in serving."""
    catalog = Catalog()
    model = DLRM(catalog=catalog)
    gen = CandidateGenerator(catalog)
    rng = np.random.default_rng(7)
    users = rng.integers(0, 10**6, size=requests)
    history = rng.integers(-1, catalog.config.n_items, size=(requests, HISTORY))
    ids, dense = gen.generate(users, history)
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(2):  # sizes interleaved, so that load from elsewhere hits them alike
        for b in sizes:
            for s in range(0, requests - b + 1, max(b, requests // 16)):
                e = s + b
                t0 = time.perf_counter()
                model.score(users[s:e], ids[s:e], dense[s:e], history[s:e])
                times[b].append(time.perf_counter() - t0)
    return {b: float(np.median(t) * 1e3) for b, t in times.items()}


if __name__ == "__main__":
    t0 = time.perf_counter()
    m = DLRM()
    print(f"model built in {time.perf_counter() - t0:.2f} s, {m.nbytes / 1e6:.1f} MB")
    for b, ms in time_batches().items():
        print(f"batch {b:4d}: {ms:7.2f} ms per batch, {ms / b:6.3f} ms per request")
