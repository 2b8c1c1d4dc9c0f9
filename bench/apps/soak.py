"""The fault soak's apps (bench/faults.py): a 2-replica chain and a fan-in,
every stage with two replicas, each doing real numpy work per row so that
the machine's capacity is within reach of the load generator (3x bursts)."""

import numpy as np
import slipstream as ss

D = 64
X = {"x": ss.Tensor("float32", (-1, D))}
RNG = np.random.default_rng(0)
W = (RNG.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)


def work(x: np.ndarray, rounds: int) -> np.ndarray:
    """A few dense layers: cost grows with rows, as a small model's does."""
    for _ in range(rounds):
        x = np.tanh(x @ W)
    return x


@ss.component(max_batch_size=64, replicas=2, inputs=X)
class Prep:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"h": work(batch["x"], 8)}


@ss.component(max_batch_size=64, replicas=2)
class Score:
    def __call__(self, batch: ss.Batch) -> dict:
        h = work(batch["h"], 8)
        return {"score": h.sum(axis=1, keepdims=True)}


@ss.component(max_batch_size=64, replicas=2, inputs=X)
class Split:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        return {"a": x[:, : D // 2].copy(), "b": x[:, D // 2 :].copy()}


@ss.component(max_batch_size=64, replicas=2)
class Left:
    def __call__(self, batch: ss.Batch) -> dict:
        a = batch["a"]
        return {"la": np.tanh(a * 2.0) + work(np.pad(a, ((0, 0), (0, D // 2))), 6)[:, : D // 2]}


@ss.component(max_batch_size=64, replicas=2)
class Right:
    def __call__(self, batch: ss.Batch) -> dict:
        b = batch["b"]
        return {"rb": np.tanh(b * 3.0) + work(np.pad(b, ((0, 0), (D // 2, 0))), 6)[:, D // 2 :]}


@ss.component(max_batch_size=64, replicas=2)
class Merge:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": np.concatenate([batch["la"], batch["rb"]], axis=1).sum(axis=1, keepdims=True)}


chain = ss.Pipeline("chain", Prep >> Score, slo=ss.SLO(p99_ms=100))
fanin = ss.Pipeline("fanin", Split >> [Left, Right] >> Merge, slo=ss.SLO(p99_ms=100))
