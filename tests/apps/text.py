"""Test app: string and bytes tensors through a chain."""

import numpy as np
import slipstream as ss


@ss.component(max_batch_size=16, inputs={"text": ss.Tensor("string", (-1,))})
class Shout:
    def __call__(self, batch: ss.Batch) -> dict:
        t = batch["text"]
        assert t.dtype == object and all(isinstance(x, str) for x in t)
        return {"loud": np.array([x.upper() + "!" for x in t], dtype=object),
                "n": np.array([[len(x)] for x in t], dtype=np.int64)}


@ss.component(max_batch_size=16)
class Pair:
    def __call__(self, batch: ss.Batch) -> dict:
        loud = batch["loud"]
        return {"loud": loud, "n": batch["n"], "pair": np.array([[x, x.lower()] for x in loud], dtype=str)}


@ss.component(max_batch_size=16, inputs={"blob": ss.Tensor("bytes", (-1,))})
class Reverse:
    def __call__(self, batch: ss.Batch) -> dict:
        return {"rev": np.array([bytes(reversed(b)) for b in batch["blob"]], dtype=object)}


text = ss.Pipeline("text", Shout >> Pair)
blob = ss.Pipeline("blob", Reverse)


@ss.component(max_batch_size=4, inputs={"text": ss.Tensor("string", (-1,))}, length_of="text")
class Padded:
    """Says, for each row, the longest element and the size of the batch it
    ran in (a batch holding "wait" first sleeps, so that others queue)."""

    def __call__(self, batch: ss.Batch) -> dict:
        import time

        t = list(batch["text"])
        if "wait" in t:
            time.sleep(0.6)
        longest = max(len(x.encode()) for x in t)
        return {"longest": np.full((len(t), 1), longest, dtype=np.int64),
                "size": np.full((len(t), 1), len(t), dtype=np.int64)}


padded = ss.Pipeline("padded", Padded)


@ss.component(max_batch_size=8, inputs={"text": ss.Tensor("string", (-1,))})
class TimeLeft:
    """Says, for each row, the milliseconds its request had left when the
    batch began (a batch holding "wait" first sleeps, so that others queue)."""

    def __call__(self, batch: ss.Batch) -> dict:
        import time

        left = batch.time_left()
        if "wait" in list(batch["text"]):
            time.sleep(0.3)
        per_row = np.repeat(left * 1e3, batch.sizes)
        return {"left_ms": per_row.reshape(-1, 1).astype(np.float64)}


deadline = ss.Pipeline("deadline", TimeLeft, slo=ss.SLO(p99_ms=800))
