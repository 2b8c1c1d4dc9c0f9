"""Test app for placement moves: `X` takes `MOVE_LOAD_S` seconds to construct
(a model that loads slowly), so a replica moved to a node that joins is
seconds from ready there; `Y` follows it. Each says which node ran it."""

import os
import time

import numpy as np
import slipstream as ss


def _node(rows: int) -> np.ndarray:
    return np.array([os.environ.get("SLIPSTREAM_NODE_NAME", "?")] * rows, dtype=object)


@ss.component(max_batch_size=8, inputs={"x": ss.Tensor("float32", (-1, 2))})
class X:
    def __init__(self) -> None:
        time.sleep(float(os.environ.get("MOVE_LOAD_S", "0")))

    def __call__(self, batch: ss.Batch) -> dict:
        return {"x": batch["x"] + 1, "x_node": _node(batch.rows)}


@ss.component(max_batch_size=8)
class Y:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"] * 2, "x_node": batch["x_node"]}


moves = ss.Pipeline("moves", X >> Y, slo=ss.SLO(p99_ms=1000))
