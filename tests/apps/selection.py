"""Test app for Clipper's layer: model selection with feedback, straggler-
bounded ensembles, the prediction cache.

The question every candidate answers: is ``x[0] > 0`` (label 1) or not (0)?
``Right`` knows, ``Wrong`` always says the opposite, ``Coin`` says 1, and
``Slow`` knows but takes 400 ms when ``x[1] > 0``.

- ``pick``: Exp3 over Right, Wrong and Coin.
- ``vote``: an Exp4 ensemble of Right, Right2, Wrong and Slow that waits at
  most 80 ms for stragglers.
- ``per_user``: an Exp4 ensemble of Right and Wrong with one state per ``user``.
- ``sturdy``: an Exp4 ensemble of Right, Right2 and ``Broken`` (which raises).
- ``cached``: ``Scale`` (x * the number in ``/models/scale``) with a cache;
  it reports its worker's pid and how many batches it has run.
"""

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import slipstream as ss

SEED = Path(tempfile.gettempdir()) / f"slipstream-test-select-scale-{os.getuid()}.txt"
if not SEED.exists():  # written whole: the node and its workers load this file at once
    tmp = SEED.with_name(f"{SEED.name}.{os.getpid()}")
    tmp.write_text("2")
    os.replace(tmp, SEED)

X = {"x": ss.Tensor("float32", (-1, 2))}
LABEL = {"label": ss.Tensor("int64", (-1,)), "proba": ss.Tensor("float32", (-1, 2))}


def answer(truth: np.ndarray) -> dict:
    proba = np.zeros((len(truth), 2), dtype=np.float32)
    proba[np.arange(len(truth)), truth] = 1.0
    return {"label": truth.astype(np.int64), "proba": proba}


@ss.component(max_batch_size=8, inputs=X, outputs=LABEL)
class Right:
    def __call__(self, batch: ss.Batch) -> dict:
        return answer((batch["x"][:, 0] > 0).astype(np.int64))


Right2 = Right.options(name="Right2")


@ss.component(max_batch_size=8, inputs=X, outputs=LABEL)
class Wrong:
    def __call__(self, batch: ss.Batch) -> dict:
        return answer((batch["x"][:, 0] <= 0).astype(np.int64))


@ss.component(max_batch_size=8, inputs=X, outputs={"label": ss.Tensor("int64", (-1,))})
class Coin:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"label": np.ones(batch.rows, dtype=np.int64)}


@ss.component(max_batch_size=8, inputs=X, outputs=LABEL)
class Slow:
    def __call__(self, batch: ss.Batch) -> dict:
        x = batch["x"]
        if (x[:, 1] > 0).any():
            time.sleep(0.4)
        return answer((x[:, 0] > 0).astype(np.int64))


@ss.component(max_batch_size=8, inputs=X, outputs=LABEL)
class Broken:
    def __call__(self, batch: ss.Batch) -> dict:
        raise RuntimeError("this model is broken")


pick = ss.Pipeline("pick", ss.Select([Right, Wrong, Coin], policy="exp3", eta=0.5))
vote = ss.Pipeline("vote", ss.Select([Right, Right2, Wrong, Slow], policy="exp4", wait_ms=80),
                   slo=ss.SLO(p99_ms=2000))
sturdy = ss.Pipeline("sturdy", ss.Select([Right, Right2, Broken], policy="exp4"))
per_user = ss.Pipeline("per_user", ss.Select([Right, Wrong], policy="exp4", context="user", eta=0.5),
                       inputs={**X, "user": ss.Tensor("string", (-1,))})


@ss.component(max_batch_size=8, needs={"scale": "/models/scale"}, cache=True,
              inputs={"x": ss.Tensor("float32", (-1,))},
              outputs={"y": ss.Tensor("float32", (-1,)), "pid": ss.Tensor("int64", (-1,)),
                       "calls": ss.Tensor("int64", (-1,))})
class Scale:
    def __init__(self, scale: ss.Object) -> None:
        self.k = float(scale.text())
        self.calls = 0

    def __call__(self, batch: ss.Batch) -> dict:
        self.calls += 1
        n = batch.rows
        return {"y": batch["x"] * self.k, "pid": np.full(n, os.getpid(), dtype=np.int64),
                "calls": np.full(n, self.calls, dtype=np.int64)}


cached = ss.Pipeline("cached", Scale, seed={"/models/scale": str(SEED)})
