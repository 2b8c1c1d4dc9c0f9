"""Test app for a token rotation: one stage, two replicas (one per node of a
two-node cluster, so either node serves it while the other restarts)."""

import slipstream as ss


@ss.component(max_batch_size=16, inputs={"x": ss.Tensor("float32", (-1, 2))}, replicas=2)
class Affine:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"] * 2 + 1.0}


chain = ss.Pipeline("chain", Affine, slo=ss.SLO(p99_ms=2000))
