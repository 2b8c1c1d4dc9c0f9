"""Test app for the Prometheus test (tests/integration/test_prometheus.py).

Each request asks for its own service time (x[0, 1] milliseconds; a batch
takes its slowest request's), so a client controls the spread of latencies.
The SLO target, 37 ms, is not on the node's standard bucket ladder, so the
test can check that it became a boundary of the latency histogram; late
answers are kept (drop_late=False) so some answers miss it.
"""

import time

import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=8, inputs=X)
class Wait:
    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(float(batch["x"][:, 1].max()) / 1000.0)
        return {"x": batch["x"]}


@ss.component(max_batch_size=8)
class Tag:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"] + 1}


metered = ss.Pipeline("metered", Wait >> Tag, slo=ss.SLO(p99_ms=37, drop_late=False))
