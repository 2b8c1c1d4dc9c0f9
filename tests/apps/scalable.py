"""Test app for replica sets that change at run time."""

import os
import time

import numpy as np
import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=8, inputs=X)
class Warm:
    """The first call in each process is slow (a JIT, a cold cache), later
    ones take x[:, 1] ms: a replica that was not warmed up shows."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, batch: ss.Batch) -> dict:
        self.calls += 1
        if self.calls == 1:
            time.sleep(0.6)
        time.sleep(float(batch["x"][:, 1].max()) / 1000.0)
        return {"y": batch["x"] * 2, "pid": np.full((batch.rows, 1), os.getpid(), dtype=np.int64)}


@ss.component(max_batch_size=8, inputs=X)
class Fan:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"x": batch["x"]}


@ss.component(max_batch_size=8)
class Sum:
    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(0.002)
        return {"sum": batch["x"].sum(axis=1, keepdims=True)}


@ss.component(max_batch_size=8)
class Prod:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"prod": batch["x"].prod(axis=1, keepdims=True)}


@ss.component(max_batch_size=8)
class Join:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"both": np.concatenate([batch["sum"], batch["prod"]], axis=1)}


warm = ss.Pipeline("warm", Warm, slo=ss.SLO(p99_ms=2000))
diamond = ss.Pipeline("diamond", Fan >> [Sum, Prod] >> Join)
