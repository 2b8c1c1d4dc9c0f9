"""Test app for the node-count loop: one autoscaled stage whose replicas
each serve about 20 req/s (50 ms a request, off the CPU), so a modest
load needs more one-thread replicas than a few 2-core nodes have."""

import time

import slipstream as ss


@ss.component(max_batch_size=1, replicas=(1, 16), inputs={"x": ss.Tensor("float32", (-1, 2))})
class Slow:
    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(0.05)
        return {"y": batch["x"] * 2}


slow = ss.Pipeline("slow", Slow, slo=ss.SLO(p99_ms=2000))
