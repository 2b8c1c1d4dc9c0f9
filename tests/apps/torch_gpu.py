"""Test app: a torch component bound to a GPU (`device="cuda"`)."""

import os

import numpy as np
import slipstream as ss


@ss.component(max_batch_size=16, replicas=2, inputs={"x": ss.Tensor("float32", (-1, 3))},
              tensors="torch", device="cuda")
class OnGpu:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        assert x.device.type == "cuda", x.device
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        return {"y": x * 2, "visible": np.full((batch.rows,), visible, dtype=object)}


gpu = ss.Pipeline("gpu", OnGpu)
