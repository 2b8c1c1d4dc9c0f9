"""Test app for a token rotation: a two-stage chain, two replicas of each
(one per node of a two-node cluster, so either node serves the whole chain
while the other restarts)."""

import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=16, inputs=X, replicas=2)
class Double:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"x": batch["x"] * 2}


@ss.component(max_batch_size=16, replicas=2)
class AddOne:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"] + 1.0}


chain = ss.Pipeline("chain", Double >> AddOne, slo=ss.SLO(p99_ms=2000))
