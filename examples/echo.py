"""The smallest pipelines: a two-stage chain and a fan-out / fan-in.

    slipstream serve examples/echo.py
    curl -d '{"inputs": {"x": [[3, 4]]}}' localhost:8000/v1/pipelines/demo/infer
    curl -d '{"inputs": {"x": [[3, 4]]}}' localhost:8000/v1/pipelines/stats/infer
"""

import numpy as np
import slipstream as ss


@ss.component(max_batch_size=64, replicas=2, inputs={"x": ss.Tensor("float32", (-1, -1))})
class Normalize:
    """Scale each row to unit length."""

    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]  # a read-only view over shared memory, shape (rows, d)
        return {"y": x / np.linalg.norm(x, axis=1, keepdims=True)}


@ss.component(max_batch_size=64)
class Score:
    """Score each unit row against a fixed direction."""

    def __call__(self, batch: ss.Batch) -> dict:
        y = batch["y"]
        w = np.ones(y.shape[1], dtype=y.dtype) / np.sqrt(y.shape[1])
        return {"y": y, "score": (y @ w)[:, None]}


# Fan-out to two parallel stages, fan-in to a third that joins their outputs.
@ss.component(max_batch_size=64)
class Mean:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"mean": batch["x"].mean(axis=1, keepdims=True)}


@ss.component(max_batch_size=64)
class Spread:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        return {"spread": (x.max(axis=1) - x.min(axis=1))[:, None]}


@ss.component(max_batch_size=64)
class Summary:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"summary": np.concatenate([batch["mean"], batch["spread"]], axis=1)}


demo = ss.Pipeline("demo", Normalize >> Score, slo=ss.SLO(p99_ms=50))
stats = ss.Pipeline(
    "stats",
    [Mean, Spread] >> Summary,
    inputs={"x": ss.Tensor("float32", (-1, -1))},
    slo=ss.SLO(p99_ms=50),
)
