"""Test app for the object store: triggers, a model hot swap, affinity.

- ``triggered``: ``Recorder`` watches ``/jobs/``; for each trigger it appends
  the version it saw to ``/log/<name>`` (so the versions of that log key
  are the delivery order), and raises on the value ``fail``.
- ``scaled``: ``Scale`` needs ``/models/scale`` (a number as text); it
  multiplies by it and reports which version it used. Loading takes
  ``SCALE_LOAD_S`` seconds (a large model), so a hot swap overlaps traffic.
- ``grouped``: ``Reader`` (two replicas) reads the affinity group of the
  object its input names (pool ``/corpus/``, group = the second segment)
  and reports its pid and how many groups it has loaded.
"""

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import slipstream as ss

SEED = Path(tempfile.gettempdir()) / f"slipstream-test-scale-{os.getuid()}.txt"
if not SEED.exists():  # written whole: the node and its workers load this file at once
    tmp = SEED.with_name(f"{SEED.name}.{os.getpid()}")
    tmp.write_text("2")
    os.replace(tmp, SEED)


@ss.component(max_batch_size=8, watch="/jobs/", outputs={"seen": ss.Tensor("int64", (-1,))})
class Recorder:
    def __init__(self) -> None:
        self.store = ss.store.Store()

    def __call__(self, batch: ss.Batch) -> dict:
        for key, version, op, value in zip(batch["key"], batch["version"], batch["op"], batch["value"], strict=True):
            if bytes(value) == b"fail":
                raise RuntimeError(f"told to fail on {key} v{version}")
            name = key[len("/jobs/"):].replace("/", "_")
            self.store.put(f"/log/{name}", f"{int(version)} {op} {bytes(value).decode()}")
        return {"seen": np.asarray(batch["version"], dtype=np.int64)}


@ss.component(max_batch_size=8, needs={"scale": "/models/scale"},
              inputs={"x": ss.Tensor("float32", (-1,))},
              outputs={"y": ss.Tensor("float32", (-1,)), "version": ss.Tensor("int64", (-1,))})
class Scale:
    def __init__(self, scale: ss.Object) -> None:
        time.sleep(float(os.environ.get("SCALE_LOAD_S", "0.5")))
        self.k = float(scale.text())
        self.version = scale.version

    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        return {"y": x * self.k, "version": np.full(len(x), self.version, dtype=np.int64)}


@ss.component(max_batch_size=4, replicas=2, affinity="doc", inputs={"doc": ss.Tensor("string", (-1,))},
              outputs={"pid": ss.Tensor("int64", (-1,)), "members": ss.Tensor("int64", (-1,)),
                       "loaded": ss.Tensor("int64", (-1,))})
class Reader:
    def __call__(self, batch: ss.Batch) -> dict:
        members = [len(ss.store.group(d)) for d in batch["doc"]]
        n = len(members)
        return {"pid": np.full(n, os.getpid(), dtype=np.int64), "members": np.asarray(members, dtype=np.int64),
                "loaded": np.full(n, ss.store.cache_stats()["groups_loaded"], dtype=np.int64)}


triggered = ss.Pipeline("triggered", Recorder, slo=ss.SLO(p99_ms=2000))
scaled = ss.Pipeline("scaled", Scale, slo=ss.SLO(p99_ms=2000), seed={"/models/scale": SEED})
grouped = ss.Pipeline("grouped", Reader, slo=ss.SLO(p99_ms=2000),
                      pools=[ss.Pool("/corpus/", keep_versions=2, affinity=r"^/corpus/([^/]+)/")])
