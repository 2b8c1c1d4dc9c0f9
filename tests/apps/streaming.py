"""Test app: components that stream their outputs in chunks."""

import asyncio
import time

import numpy as np
import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 1))}


@ss.component(max_batch_size=8, inputs=X)
class Count:
    """Yields x+1, x+2, x+3 (one chunk each, 100 ms apart), then returns
    all three side by side. x == 13 fails after the first chunk."""

    def __call__(self, batch: ss.Batch):
        x = batch["x"]
        parts = []
        for i in range(1, 4):
            if i > 1:
                time.sleep(0.1)
            if i == 2 and (x == 13).any():
                raise ValueError("13 is unlucky")
            y = x + i
            parts.append(y)
            yield {"y": y, "word": np.array([f"part{i}"] * batch.rows, dtype=object)}
        return {"y": np.concatenate(parts, axis=1), "word": np.array(["all"] * batch.rows, dtype=object)}


@ss.component(inputs=X)
class Tick:
    """An async generator: three chunks 50 ms apart; the last is the answer."""

    async def __call__(self, batch: ss.Batch):
        for i in range(3):
            await asyncio.sleep(0.05)
            yield {"t": batch["x"] * 10 + i}


@ss.component(max_batch_size=8)
class Total:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"total": batch["y"].sum(axis=1, keepdims=True)}


counting = ss.Pipeline("counting", Count, inputs=X)
ticking = ss.Pipeline("ticking", Tick, inputs=X)
# A streaming stage inside the pipeline: its children get its final output.
summing = ss.Pipeline("summing", Count.options(name="Count2") >> Total, inputs=X)
