"""The two-stage no-op chain used to measure the runtime's own overhead:
an ingress stage and a child stage, both Python components that pass their
input through (by reference, so nothing is copied).

    slipstream serve examples/noop.py
    slipstream bench --pipeline noop --rate 20000
"""

import slipstream as ss


@ss.component(max_batch_size=256, inputs={"x": ss.Tensor("float32", (-1, -1))})
class First:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"x": batch["x"]}


@ss.component(max_batch_size=256)
class Second:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"]}


noop = ss.Pipeline("noop", First >> Second, slo=ss.SLO(p99_ms=10))
