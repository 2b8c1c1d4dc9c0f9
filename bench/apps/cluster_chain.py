"""The pipeline of bench/cluster_chain.py: three stages in a chain, each
passing its input on (a new output array of the same bytes), so that what
is measured is how the tensor travels between the nodes, not compute."""

import numpy as np
import slipstream as ss


@ss.component(max_batch_size=1, inputs={"x": ss.Tensor("float32", (-1, -1))})
class First:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"a": np.array(batch["x"])}


@ss.component(max_batch_size=1)
class Second:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"b": np.array(batch["a"])}


@ss.component(max_batch_size=1)
class Third:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": np.array(batch["b"])}


chain3 = ss.Pipeline("chain3", First >> Second >> Third, slo=ss.SLO(p99_ms=5000))
