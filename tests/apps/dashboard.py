"""Test app for the dashboard: a two-stage pipeline under an SLO whose
second stage is autoscaled, so that a few seconds of load show latency
against the SLO, batching, queues, refusals and replica decisions."""

import time

import slipstream as ss

X = {"x": ss.Tensor("float32", (-1, 8))}


@ss.component(max_batch_size=16, inputs=X)
class Embed:
    """2 ms per batch plus 0.2 ms per row: batching pays."""

    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(0.002 + 0.0002 * batch.rows)
        return {"e": batch["x"] * 0.5}


@ss.component(max_batch_size=4, replicas=(1, 2))
class Rank:
    """20 ms per batch of up to 4 (sleeping, so cores are not the limit):
    one replica serves at most ~200 requests/s."""

    def __call__(self, batch: ss.Batch) -> dict:
        time.sleep(0.02)
        return {"score": batch["e"].sum(axis=1, keepdims=True)}


# The example primes the replicas; /v1/history leaves it out (it is polled).
dash = ss.Pipeline("dash", Embed >> Rank, slo=ss.SLO(p99_ms=100), example={"x": [[0.5] * 8]})
