"""Test app for the object store tests: one tiny stage (the store is the
node's, not the app's), and pools that keep only 3 versions of each key
under /crash/few/ and 1 under /race/one/ (the root pool keeps 16)."""

import slipstream as ss


@ss.component(max_batch_size=8, inputs={"x": ss.Tensor("float32", (-1, 2))})
class Echo:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"y": batch["x"]}


echo = ss.Pipeline("echo", Echo, pools=[ss.Pool("/crash/few/", keep_versions=3),
                                          ss.Pool("/race/one/", keep_versions=1)])
