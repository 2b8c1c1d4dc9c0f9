"""Recommendation ranking: candidate generation, then a batched DLRM ranker.

The shape of Ray Serve's published DLRM-style recommendation benchmark:
a light ingress stage builds candidates and features per request, and a
heavy ranking model scores them in large batches.

    slipstream serve examples/recsys.py
    python examples/recsys_client.py --url http://127.0.0.1:8000
    curl -d '{"inputs": {"user": [[42]], "history": [[17, 99, 3, -1, -1, -1, -1, -1]]}}' \\
        localhost:8000/v1/pipelines/recsys/infer

Inputs per request (one row per user; a request may carry several users):
- ``user``: int64 (rows, 1), any non-negative id (hashed into 100k user rows);
- ``history``: int64 (rows, 8), the user's most recent item ids, oldest
  first, padded with -1 (an empty history is all -1).

Stages:
- ``Candidates`` (ingress, batched up to 64): 32 candidate items per user from
  co-visitation with the history, a popularity list and per-user exploration
  hashing (deterministic, without the history items), plus 13 dense
  features per candidate -> ``candidates`` int64 (rows, 32) and ``dense``
  float32 (rows, 32, 13); ``user`` and ``history`` pass through by reference.
- ``Ranker`` (batched up to 256): the DLRM-style model of
  ``models/recsys_model.py`` (100k x 64 user table, 200k x 64 item table,
  1k x 64 category table, history embedding bag; bottom MLP 13-128-64,
  pairwise dot interactions, top MLP 74-128-64-1; 19.3M parameters, 77 MB,
  almost all of it embeddings; random weights from a fixed seed) scores
  the 32 candidates -> ``items`` int64 (rows, 10) and ``scores`` float32
  (rows, 10), best first; ``candidates`` (by reference) and
  ``candidate_scores`` float32 (rows, 32) for inspection.

Does batching pay? ``DLRM.score`` per call, one request = 32 candidates,
new requests every call (cold table rows), single-threaded BLAS on a shared
2-core AMD EPYC, median of interleaved runs with a load average of ~3.7
from other jobs (``python examples/models/recsys_model.py``)::

    batch      1:   0.10 ms per batch   0.102 ms per request
    batch      8:   0.42 ms per batch   0.052 ms per request
    batch     32:   1.73 ms per batch   0.054 ms per request
    batch    128:   8.24 ms per batch   0.064 ms per request
    batch    256:  15.95 ms per batch   0.062 ms per request

So a batched request costs about half of a lone one in the model (a request
already is a 32-row GEMM, so on a CPU what batching amortises is the fixed
cost of a call: ~40 numpy operations, ~50 us), and the node's per-batch
cost (one frame each way, the worker's loop, one output write per tensor)
is paid once per batch too.

Served (``slipstream bench``, Poisson arrivals, 5 s per rate, on the same
machine while other jobs kept its load average near 9, so noisy): with
these settings the pipeline answered 786 req/s of 800 offered (45 shed,
p99 48 ms) and 1,588 of 1,600; with both stages at ``max_batch_size=1`` it
answered 562 of 800 (1,149 refused at ingress as predicted SLO misses).
``python examples/recsys_client.py`` shows the batch sizes the node forms.

Start-up: the tables are generated from the seed in ~0.3 s per worker.
"""

from __future__ import annotations

import slipstream as ss
from models.recsys_model import DLRM, HISTORY, N_CANDIDATES, CandidateGenerator, Catalog, top_k

TOP_K = 10

INPUTS = {
    "user": ss.Tensor("int64", (-1, 1)),
    "history": ss.Tensor("int64", (-1, HISTORY)),
}


@ss.component(max_batch_size=64, inputs=INPUTS)
class Candidates:
    """32 candidate items and their dense features per user."""

    def __init__(self) -> None:
        self.gen = CandidateGenerator(Catalog())

    def __call__(self, batch: ss.Batch) -> dict:
        user, history = batch["user"], batch["history"]
        if (user < 0).any():
            raise ValueError("user ids must be >= 0")
        ids, dense = self.gen.generate(user[:, 0], history)
        # user and history are returned as they came: passed on by reference, not copied.
        return {"candidates": ids, "dense": dense, "user": user, "history": history}


@ss.component(max_batch_size=256)
class Ranker:
    """Score the candidates with the DLRM model; the top 10 per user."""

    def __init__(self, k: int = TOP_K) -> None:
        self.model = DLRM()
        self.k = k

    def __call__(self, batch: ss.Batch) -> dict:
        ids = batch["candidates"]
        scores = self.model.score(batch["user"][:, 0], ids, batch["dense"], batch["history"])
        items, best = top_k(ids, scores, self.k)
        return {"items": items, "scores": best, "candidates": ids, "candidate_scores": scores}


recsys = ss.Pipeline(
    "recsys",
    Candidates >> Ranker,
    inputs=INPUTS,
    outputs={
        "items": ss.Tensor("int64", (-1, TOP_K)),
        "scores": ss.Tensor("float32", (-1, TOP_K)),
        "candidates": ss.Tensor("int64", (-1, N_CANDIDATES)),
        "candidate_scores": ss.Tensor("float32", (-1, N_CANDIDATES)),
    },
    slo=ss.SLO(p99_ms=50),
    # A user with a short history: the default body of `slipstream bench`,
    # and the warm-up batch every replica runs before its first request.
    example={"user": [[4242]], "history": [[17, 99, 3, 123456, 4567, -1, -1, -1]]},
)
