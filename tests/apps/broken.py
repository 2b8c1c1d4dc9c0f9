"""Test app whose component cannot start."""

import slipstream as ss


@ss.component(inputs={"x": ss.Tensor("float32", (-1, 2))})
class Broken:
    def __init__(self) -> None:
        raise RuntimeError("model file is missing")

    def __call__(self, batch: ss.Batch) -> dict:
        return {}


broken = ss.Pipeline("broken", Broken)
