"""Pipelines for bench/cluster.py.

``scale``: one stage whose cost is off the CPU, as a GPU model's is: it
sleeps for its batch latency (40 ms + 5 ms per row, batches of up to 4),
so two cores do not cap a cluster of several nodes and the scaling measured
is the serving system's. Its replica count (for the whole cluster) comes
from ``CLUSTER_MODEL_REPLICAS`` (``1-3``: bounds the autoscaler moves in);
``CLUSTER_MODEL_LOAD_S`` makes each replica take that long to construct, as
loading a large model does.

``handoff``: ``Produce`` returns a tensor of the requested size (float32,
made once and kept) and ``Consume`` reads one column of it, so a request
measures one stage-to-stage handoff of that tensor; on two nodes the
placement puts the two stages on different nodes.
"""

import os
import time

import numpy as np
import slipstream as ss

BASE_S, PER_ROW_S = 0.040, 0.005


def _replicas(text: str) -> int | tuple[int, int]:
    """``CLUSTER_MODEL_REPLICAS``: a count (``2``) or bounds (``1-3``, autoscaled)."""
    lo, _, hi = text.partition("-")
    return (int(lo), int(hi)) if hi else int(lo)


@ss.component(max_batch_size=4, inputs={"x": ss.Tensor("float32", (-1, 16))},
              replicas=_replicas(os.environ.get("CLUSTER_MODEL_REPLICAS", "1")))
class Model:
    def __init__(self) -> None:
        # A large model's load time, when asked (bench/cluster_surge.py).
        time.sleep(float(os.environ.get("CLUSTER_MODEL_LOAD_S", "0")))

    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(BASE_S + PER_ROW_S * batch.rows)
        return {"y": batch["x"].sum(axis=1, keepdims=True)}


scale = ss.Pipeline("scale", Model, slo=ss.SLO(p99_ms=300))


@ss.component(max_batch_size=1, inputs={"n": ss.Tensor("int64", (-1, 1))})
class Produce:
    def __init__(self) -> None:
        self.made: dict[int, np.ndarray] = {}

    def __call__(self, batch: ss.Batch) -> dict:
        n = int(batch["n"][0, 0])
        if n not in self.made:
            self.made[n] = np.ones((1, n), dtype=np.float32)
        return {"t": self.made[n]}


@ss.component(max_batch_size=1)
class Consume:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"first": np.ascontiguousarray(batch["t"][:, :1])}


handoff = ss.Pipeline("handoff", Produce >> Consume, slo=ss.SLO(p99_ms=1000))
