"""Test app for clusters: a fan-out / fan-in whose stages say which node ran them."""

import os
import time

import numpy as np
import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}
SLOW_FROM = 10_000.0


def _node(rows: int) -> np.ndarray:
    return np.array([os.environ.get("SLIPSTREAM_NODE_NAME", "?")] * rows, dtype=object)


@ss.component(max_batch_size=16, inputs=X, replicas=3)
class Fan:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        if (x < 0).any():  # x[:, 1] < 0: sleep |x| ms (an off-CPU cost)
            time.sleep(float(-x[:, 1].min()) / 1000.0)
        return {"x": np.abs(x), "fan_node": _node(batch.rows)}


@ss.component(max_batch_size=16, replicas=2)
class Sum:
    def __call__(self, batch: ss.Batch) -> dict:
        route = [f"{f}>{n}" for f, n in zip(batch["fan_node"], _node(batch.rows), strict=True)]
        return {"sum": batch["x"].sum(axis=1, keepdims=True), "sum_route": np.array(route, dtype=object)}


@ss.component(max_batch_size=16, replicas=1)  # a singleton: the cluster keeps a warm standby elsewhere
class Prod:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        if (x[:, 0] >= SLOW_FROM).any():  # x[:, 0] = SLOW_FROM + n: sleep n ms (a slow answer, off the CPU)
            time.sleep(float(x[:, 0].max() - SLOW_FROM) / 1000.0)
        return {"prod": batch["x"].prod(axis=1, keepdims=True), "prod_node": _node(batch.rows)}


@ss.component(max_batch_size=16, replicas=3)
class Join:
    def __call__(self, batch: ss.Batch) -> dict:
        route = [f"{s}|{p}>{j}" for s, p, j in zip(batch["sum_route"], batch["prod_node"], _node(batch.rows), strict=True)]
        return {"both": np.concatenate([batch["sum"], batch["prod"]], axis=1), "route": np.array(route, dtype=object)}


diamond = ss.Pipeline("diamond", Fan >> [Sum, Prod] >> Join, slo=ss.SLO(p99_ms=2000))


@ss.component(max_batch_size=4, inputs={"x": ss.Tensor("float32", (-1, 262144))})
class Big:
    """Hands its 1 MB input back without a copy (a view of it)."""

    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"], "big_node": _node(batch.rows)}


big = ss.Pipeline("big", Big)


@ss.component(max_batch_size=1, replicas=(1, 2), inputs=X)
class Elastic:
    """About 50 requests/s per replica (one 20 ms sleep at a time, off the
    CPU): the stage the cluster's autoscaler sizes."""

    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(0.02)
        return {"y": batch["x"] + 1, "elastic_node": _node(batch.rows)}


elastic = ss.Pipeline("elastic", Elastic, slo=ss.SLO(p99_ms=1000))


LABEL = {"label": ss.Tensor("int64", (-1,))}


@ss.component(max_batch_size=8, inputs=X, outputs=LABEL)
class Right:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"label": (batch["x"][:, 0] > 0).astype(np.int64)}


@ss.component(max_batch_size=8, inputs=X, outputs=LABEL)
class Wrong:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"label": (batch["x"][:, 0] <= 0).astype(np.int64)}


# Model selection: feedback on an answer is accepted by any node.
pick = ss.Pipeline("pick", ss.Select([Right, Wrong], policy="exp4"))
