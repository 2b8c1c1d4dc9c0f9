"""The fault soak's apps (bench/faults.py): a 2-replica chain and a fan-in,
every stage with two replicas. The heavy stages do real numpy work per row,
enough that each app's capacity (about 1,500-2,000 req/s on the 2-core
development machine) is well below what the node's HTTP ingress handles:
a 3x burst then overloads the pipeline, as it should, not the node's
socket reads."""

import numpy as np
import slipstream as ss

D, HIDDEN = 64, 4096
X = {"x": ss.Tensor("float32", (-1, D))}
RNG = np.random.default_rng(0)
W_UP = (RNG.standard_normal((D, HIDDEN)) / np.sqrt(D)).astype(np.float32)
W_DOWN = (RNG.standard_normal((HIDDEN, D)) / np.sqrt(HIDDEN)).astype(np.float32)


def work(x: np.ndarray, rounds: int) -> np.ndarray:
    """A small MLP applied `rounds` times: ~35 us per row and round at a
    batch of 64 on the 2-core development machine, ~100 us alone."""
    for _ in range(rounds):
        x = np.tanh(np.tanh(x @ W_UP) @ W_DOWN)
    return x


@ss.component(max_batch_size=64, replicas=2, inputs=X)
class Prep:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"h": work(batch["x"], 6)}


@ss.component(max_batch_size=64, replicas=2)
class Score:
    def __call__(self, batch: ss.Batch) -> dict:
        h = work(batch["h"], 6)
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
        return {"la": np.tanh(a * 2.0) + work(np.pad(a, ((0, 0), (0, D // 2))), 5)[:, : D // 2]}


@ss.component(max_batch_size=64, replicas=2)
class Right:
    def __call__(self, batch: ss.Batch) -> dict:
        b = batch["b"]
        return {"rb": np.tanh(b * 3.0) + work(np.pad(b, ((0, 0), (D // 2, 0))), 5)[:, D // 2 :]}


@ss.component(max_batch_size=64, replicas=2)
class Merge:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": np.concatenate([batch["la"], batch["rb"]], axis=1).sum(axis=1, keepdims=True)}


chain = ss.Pipeline("chain", Prep >> Score, slo=ss.SLO(p99_ms=150))
fanin = ss.Pipeline("fanin", Split >> [Left, Right] >> Merge, slo=ss.SLO(p99_ms=150))
