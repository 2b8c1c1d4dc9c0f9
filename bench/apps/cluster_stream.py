"""The pipeline of bench/cluster_stream.py: ``Chunks`` streams, yielding
``CHUNKS`` chunks of the requested size (float32, made once and kept),
``CHUNK_GAP_S`` apart, then returning the last; the cost is off the CPU,
so the figures are the serving system's."""

import time

import numpy as np
import slipstream as ss

CHUNKS, CHUNK_GAP_S = 5, 0.020


@ss.component(max_batch_size=1, inputs={"n": ss.Tensor("int64", (-1, 1))})
class Chunks:
    def __init__(self) -> None:
        self.made: dict[int, np.ndarray] = {}

    def __call__(self, batch: ss.Batch):
        n = int(batch["n"][0, 0])
        if n not in self.made:
            self.made[n] = np.ones((1, n), dtype=np.float32)
        for i in range(CHUNKS):
            if i:
                time.sleep(CHUNK_GAP_S)
            yield {"c": self.made[n], "i": np.array([[i]], dtype=np.int64)}
        return {"c": self.made[n], "i": np.array([[CHUNKS - 1]], dtype=np.int64)}


chunks = ss.Pipeline("chunks", Chunks, slo=ss.SLO(p99_ms=2000))
