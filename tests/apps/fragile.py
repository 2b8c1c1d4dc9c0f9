"""Test app: a component whose worker can be made to crash-loop.

While the file named by $SLIPSTREAM_TEST_BROKEN exists, the component's
constructor raises (a model file gone missing), so a worker that dies cannot
come back; a request with x == 66 kills the worker."""

import os

import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 2))}


@ss.component(max_batch_size=8, inputs=X)
class Fragile:
    def __init__(self) -> None:
        flag = os.environ.get("SLIPSTREAM_TEST_BROKEN", "")
        if flag and os.path.exists(flag):
            raise RuntimeError(f"model file is missing ({flag} exists)")

    def __call__(self, batch: ss.Batch) -> dict:
        if (batch["x"] == 66).any():
            os._exit(3)
        return {"y": batch["x"] * 2}


@ss.component(max_batch_size=8, inputs=X)
class Steady:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"]}


fragile = ss.Pipeline("fragile", Fragile)
steady = ss.Pipeline("steady", Steady)
