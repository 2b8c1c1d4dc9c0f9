"""Test app: chains, a fan-out / fan-in, and components that misbehave on cue."""

import os
import time

import numpy as np
import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=32, inputs=X)
class Double:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        if (x == 13).any():
            raise ValueError("13 is unlucky")
        if (x == 99).any():
            time.sleep(0.4)
        if (x == 66).any():
            os._exit(3)  # the worker dies mid-batch
        return {"x": x * 2}


@ss.component(max_batch_size=32)
class AddOne:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"] + 1, "pid": np.full((batch.rows, 1), os.getpid(), dtype=np.int64)}


@ss.component(max_batch_size=32, replicas=2, inputs=X)
class Slow:
    """Two replicas; sleeps so that a test can kill one mid-batch."""

    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(float(batch["x"][0, 1]) / 1000.0)
        return {"y": batch["x"] * 3, "pid": np.full((batch.rows, 1), os.getpid(), dtype=np.int64)}


@ss.component(max_batch_size=32, inputs=X)
class SlowSolo:
    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(float(batch["x"][0, 1]) / 1000.0)
        return {"y": batch["x"] * 3, "pid": np.full((batch.rows, 1), os.getpid(), dtype=np.int64)}


@ss.component(max_batch_size=16)
class Sum:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"sum": batch["x"].sum(axis=1, keepdims=True)}


@ss.component(max_batch_size=16)
class Prod:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        if (x == 77).any():
            time.sleep(5)  # longer than the test node's request timeout
        return {"prod": x.prod(axis=1, keepdims=True)}


@ss.component(max_batch_size=16)
class Join:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"both": np.concatenate([batch["sum"], batch["prod"]], axis=1)}


@ss.component(max_batch_size=8, inputs=X)
class Identity:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"x": batch["x"]}


@ss.component(max_batch_size=8)
class Identity2:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"]}


chain = ss.Pipeline("chain", Double >> AddOne, slo=ss.SLO(p99_ms=5000))
diamond = ss.Pipeline("diamond", Identity.options(name="Fan") >> [Sum, Prod] >> Join)
retry = ss.Pipeline("retry", Slow)
solo = ss.Pipeline("solo", SlowSolo)
noop = ss.Pipeline("noop", Identity >> Identity2)


@ss.component(max_batch_size=8, inputs=X)
class Sleepy:
    """Takes x[0, 1] milliseconds per batch."""

    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(float(batch["x"][:, 1].max()) / 1000.0)
        return {"y": batch["x"]}


# A tight SLO: requests stuck behind a slow batch are dropped once late;
# a backlog that cannot be cleared in time is refused at ingress.
tight = ss.Pipeline("tight", Sleepy, slo=ss.SLO(p99_ms=150))

# The same, answering a declared default instead of 429 / 504 (Clipper's default output).
graceful = ss.Pipeline(
    "graceful",
    Sleepy.options(name="Sleepy"),
    outputs={"y": ss.Tensor("float32", (-1, 2))},
    slo=ss.SLO(p99_ms=150),
    fallback={"y": [0.0, -1.0]},
)
