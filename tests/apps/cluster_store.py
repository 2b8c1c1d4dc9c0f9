"""Test app for the cluster store: ``where``, a stage that reads an
affinity group (pool ``/corpus/``, group = the second path segment) and
says which node ran it and how many objects the group held there;
``triggered``, a pipeline watching ``/jobs/`` that logs each firing; and
``model``, a stage on every node that needs ``/models/m`` (one copy per
version) and answers with the version it serves."""

import os
import tempfile
import time
from pathlib import Path

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
                    pools=[ss.Pool("/corpus/", affinity=r"^/corpus/([^/]+)/"),
                           ss.Pool("/scratch/", copies=1), ss.Pool("/weights/", copies=3, write_copies=2)])


@ss.component(max_batch_size=8, watch="/jobs/", outputs={"seen": ss.Tensor("int64", (-1,))})
class Recorder:
    """Logs every trigger it runs as one key per (key, version):
    ``/log<key>/<version>``, whose versions count the times it fired. A
    value starting with ``slow`` takes 0.25 s to fire."""

    def __init__(self) -> None:
        self.store = ss.store.Store()

    def __call__(self, batch: ss.Batch) -> dict:
        for key, version, value in zip(batch["key"], batch["version"], batch["value"], strict=True):
            if bytes(value).startswith(b"slow"):  # a firing that takes a while
                time.sleep(0.25)
            deadline = time.monotonic() + 20
            while True:  # through a node's loss (its lease not yet expired), puts are refused for a moment
                try:
                    self.store.put(f"/log{key}/{int(version)}", b"fired")
                    break
                except ss.StoreUnavailable:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
        return {"seen": np.asarray(batch["version"], dtype=np.int64)}


triggered = ss.Pipeline("triggered", Recorder, slo=ss.SLO(p99_ms=30000))


MODEL_SEED = Path(tempfile.gettempdir()) / f"slipstream-test-cluster-model-{os.getuid()}.txt"
if not MODEL_SEED.exists():  # written whole: nodes load this file at once
    _tmp = MODEL_SEED.with_name(f"{MODEL_SEED.name}.{os.getpid()}")
    _tmp.write_text("1")
    os.replace(_tmp, MODEL_SEED)


@ss.component(max_batch_size=4, replicas=3, needs={"weights": "/models/m"}, inputs={"x": ss.Tensor("float32", (-1,))},
              outputs={"node": ss.Tensor("string", (-1,)), "version": ss.Tensor("int64", (-1,))})
class Model:
    def __init__(self, weights: ss.Object) -> None:
        self.version = weights.version

    def __call__(self, batch: ss.Batch) -> dict:
        n = len(batch["x"])
        return {"node": np.array([os.environ.get("SLIPSTREAM_NODE_NAME", "?")] * n, dtype=object),
                "version": np.full(n, self.version, dtype=np.int64)}


model = ss.Pipeline("model", Model, slo=ss.SLO(p99_ms=30000), seed={"/models/m": MODEL_SEED},
                    pools=[ss.Pool("/models/", copies=1)])


@ss.component(max_batch_size=4, replicas=1, affinity="doc", inputs={"doc": ss.Tensor("string", (-1,))},
              outputs={"node": ss.Tensor("string", (-1,))})
class Near:
    """One replica of a stage that reads affinity groups (pool ``/near/``,
    one copy): the placement puts it where its groups are."""

    def __call__(self, batch: ss.Batch) -> dict:
        return {"node": np.array([os.environ.get("SLIPSTREAM_NODE_NAME", "?")] * len(batch["doc"]), dtype=object)}


near = ss.Pipeline("near", Near, slo=ss.SLO(p99_ms=30000),
                   pools=[ss.Pool("/near/", copies=1, affinity=r"^/near/([^/]+)/")])
