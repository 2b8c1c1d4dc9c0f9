"""Test app: an async component that waits on I/O, between plain ones."""

import asyncio
import os
import time

import numpy as np
import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 1))}


@ss.component(inputs=X)
class Wait:
    """Waits x ms per batch without holding the worker (a remote call, say);
    fails the batch on x == 13; says when its wait began and ended (the
    worker's monotonic clock). One batch at a time, so overlapping is
    the worker's doing, not batching's."""

    async def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        if (x == 13).any():
            raise ValueError("13 is unlucky")
        began = time.monotonic()
        await asyncio.sleep(float(x[0, 0]) / 1000.0)
        span = np.full((batch.rows, 2), (began, time.monotonic()), dtype=np.float64)
        return {"x": x, "pid": np.full((batch.rows, 1), os.getpid(), dtype=np.int64), "span": span}


@ss.component(inputs=X)
class Block:
    """The same wait, but blocking: one batch at a time per worker."""

    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(float(batch["x"][0, 0]) / 1000.0)
        return {"x": batch["x"]}


@ss.component(max_batch_size=8)
class Plus:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"] + 1, "pid": batch["pid"], "span": batch["span"]}


waiting = ss.Pipeline("waiting", Wait >> Plus, inputs=X)
blocking = ss.Pipeline("blocking", Block, inputs=X)
