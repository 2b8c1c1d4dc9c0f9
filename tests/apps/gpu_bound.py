"""Test app: a stage declared for a GPU whose code needs none (numpy), so
that a stand-in `nvidia-smi` can show which device each replica is bound
to (its worker's CUDA_VISIBLE_DEVICES), on a machine without a GPU."""

import os

import numpy as np
import slipstream as ss


@ss.component(max_batch_size=8, inputs={"x": ss.Tensor("float32", (-1, 2))}, device="cuda")
class Bound:
    def __call__(self, batch: ss.Batch) -> dict:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return {"y": batch["x"] + 1, "visible": np.full((batch.rows,), visible, dtype=object)}


bound = ss.Pipeline("bound", Bound)
