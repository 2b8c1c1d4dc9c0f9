"""Test app for the cluster store: a stage that reads an affinity group
(pool ``/corpus/``, group = the second path segment) and says which node
ran it and how many objects the group held there."""

import os

import numpy as np
import slipstream as ss


@ss.component(max_batch_size=4, replicas=3, affinity="doc", inputs={"doc": ss.Tensor("string", (-1,))},
              outputs={"node": ss.Tensor("string", (-1,)), "members": ss.Tensor("int64", (-1,))})
class Where:
    def __call__(self, batch: ss.Batch) -> dict:
        members = [len(ss.store.group(d)) for d in batch["doc"]]
        node = os.environ.get("SLIPSTREAM_NODE_NAME", "?")
        return {"node": np.array([node] * len(members), dtype=object),
                "members": np.asarray(members, dtype=np.int64)}


where = ss.Pipeline("where", Where, slo=ss.SLO(p99_ms=3000),
                    pools=[ss.Pool("/corpus/", affinity=r"^/corpus/([^/]+)/")])
