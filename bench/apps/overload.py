"""The pipeline bench/overload.py overloads: two stages, the second one's
cost off the CPU as a GPU model's is (it sleeps for its batch latency: 4 ms
+ 0.3 ms per row, batches of up to 16, so about 1,800 requests/s per
replica). On two cores whose CPU is shared with the load generator, a
CPU-bound pipeline loses goodput to every refusal the generator makes the
node answer, whatever the node does; with the model's cost off the CPU, the
goodput measured is what overload control keeps, as on a GPU server.
"""

import time

import slipstream as ss

BASE_S, PER_ROW_S = 0.004, 0.0003


@ss.component(max_batch_size=64, inputs={"x": ss.Tensor("float32", (-1, 4))})
class Prepare:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"x": batch["x"]}


@ss.component(max_batch_size=16)
class Model:
    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(BASE_S + PER_ROW_S * batch.rows)
        return {"y": batch["x"].sum(axis=1, keepdims=True)}


offcpu = ss.Pipeline("offcpu", Prepare >> Model, slo=ss.SLO(p99_ms=50),
                     example={"x": [[1.0, 2.0, 3.0, 4.0]]})
