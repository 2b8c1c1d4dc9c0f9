"""The store benchmark's app (bench/store.py): one tiny stage (the store is
the node's), and a pool keeping one version of each key under /bench/, so
that a put replaces the value as a Redis SET does (and disk use stays
bounded)."""

import slipstream as ss


@ss.component(inputs={"x": ss.Tensor("float32", (-1, 2))})
class Echo:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"]}


echo = ss.Pipeline("echo", Echo, pools=[ss.Pool("/bench/", keep_versions=1)])
