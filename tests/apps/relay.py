"""Test app: a chain of four stages for nodes to hand requests along
(tests/integration/test_cluster_handoff.py), each stage's arithmetic
distinct so that an answer shows every stage ran once, in order; B fails
on cue and sleeps 1.5 s on cue."""

import time

import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=16, inputs=X)
class A:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"a": batch["x"] * 2}


@ss.component(max_batch_size=16)
class B:
    def __call__(self, batch: ss.Batch) -> dict:
        a = batch["a"]
        if (a == 26).any():
            raise ValueError("13 is unlucky")
        if (a == 198).any():
            time.sleep(1.5)  # past a short deadline; a node can be killed meanwhile
        return {"b": a + 1}


@ss.component(max_batch_size=16)
class C:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"c": batch["b"] * 3}


@ss.component(max_batch_size=16)
class D:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["c"] - 1}


# Time to spare: a request whose chain is lost with a node runs again
# before its deadline (tests that want a short one send it per request).
relay = ss.Pipeline("relay", A >> B >> C >> D, slo=ss.SLO(p99_ms=20000))
