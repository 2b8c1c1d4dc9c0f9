"""Test app for the autoscaler: a stage whose replicas each serve at most
~50 requests/s (one 20 ms call at a time, sleeping, so the machine's cores
are not what limits it), declared with bounds; and a stage with a thread
budget that reports the environment its worker got."""

import os
import time

import numpy as np
import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=1, replicas=(1, 2), inputs=X)
class Slow:
    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(0.02)
        return {"y": batch["x"] + 1}


@ss.component(max_batch_size=4, threads=2, inputs=X)
class Threads:
    def __call__(self, batch: ss.Batch) -> dict:
        seen = [ss.worker_threads(), int(os.environ.get("OMP_NUM_THREADS", "0"))]
        return {"threads": np.tile(np.array(seen, dtype=np.int64), (batch.rows, 1))}


elastic = ss.Pipeline("elastic", Slow, slo=ss.SLO(p99_ms=500))
threads = ss.Pipeline("threads", Threads, example={"x": [[0.0, 0.0]]})
