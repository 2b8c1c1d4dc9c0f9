"""One stage that sleeps x[0, 1] ms per batch, under a 10 s SLO: a request
can keep the replica busy for seconds without being dropped, and a request
that asks for a 1 ms deadline behind it is refused, every time
(tests/integration/test_overload.py)."""

import time

import slipstream as ss


@ss.component(max_batch_size=8, inputs={"x": ss.Tensor("float32", (-1, 2))})
class Sleepy:
    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(float(batch["x"][:, 1].max()) / 1000.0)
        return {"y": batch["x"]}


patient = ss.Pipeline("patient", Sleepy, slo=ss.SLO(p99_ms=10_000))
