"""Test app for serve-time sizing (test_sizing.py): a CPU-bound stage that
leaves its replicas and threads to the planner, and a light one that pins
both."""

import os
import time

import slipstream as ss

#: CPU a row takes in Heavy, ms (its profile's cache key follows it).
SPIN_S = float(os.environ.get("SIZED_SPIN_MS", "2")) / 1e3

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=8, inputs=X)
class Heavy:
    """About 2 ms of CPU per row (a spin, so batching saves nothing and only
    replicas add throughput)."""

    def __call__(self, batch: ss.Batch) -> dict:
        end = time.perf_counter() + SPIN_S * batch.rows
        while time.perf_counter() < end:
            pass
        return {"x": batch["x"] * 2}


@ss.component(max_batch_size=8, replicas=1, threads=1)
class Light:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"] + 1}


sized = ss.Pipeline("sized", Heavy >> Light, slo=ss.SLO(p99_ms=500))
