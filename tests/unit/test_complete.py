"""Outside a worker (profiles, the offline limit, co-location neighbours) a
component's call runs to completion the way a worker runs it: a streaming
component's chunks all run and its result is its return value or last
chunk; an async component is awaited. Before `api.complete`, profiling a
pipeline with a streaming stage (examples/audioquery.py's Speak) failed, so
`slipstream serve` could not size it on first start and bench.limit could
not measure it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import slipstream as ss
from slipstream._internal import slo
from slipstream._internal.api import Batch, complete


def test_complete_runs_every_kind_of_call_to_its_result() -> None:
    def returns() -> Iterator[dict[str, int]]:
        yield {"x": 1}
        return {"x": 9}

    def last() -> Iterator[dict[str, int]]:
        yield {"x": 1}
        yield {"x": 2}

    async def awaited() -> dict[str, int]:
        return {"x": 3}

    async def streamed() -> AsyncIterator[dict[str, int]]:
        yield {"x": 4}
        yield {"x": 5}

    seen: list[Any] = []
    assert complete(returns(), seen.append) == {"x": 9} and seen == [{"x": 1}]
    assert complete(last()) == {"x": 2}
    assert complete(awaited()) == {"x": 3}
    seen.clear()
    assert complete(streamed(), seen.append) == {"x": 5} and seen == [{"x": 4}, {"x": 5}]
    assert complete({"x": 6}) == {"x": 6}


RUNS: list[str] = []


@ss.component(max_batch_size=4, inputs={"x": ss.Tensor("float32", (-1, 2))},
              outputs={"y": ss.Tensor("float32", (-1, 2))})
class Double:
    async def __call__(self, batch: Batch) -> dict[str, np.ndarray]:
        return {"y": batch["x"] * 2}


@ss.component(max_batch_size=4, inputs={"y": ss.Tensor("float32", (-1, 2))},
              outputs={"z": ss.Tensor("float32", (-1, 2))})
class Speak:
    def __call__(self, batch: Batch) -> Iterator[dict[str, np.ndarray]]:
        yield {"z": np.zeros_like(batch["y"])}
        RUNS.append("after the first chunk")  # the work a profile must measure
        yield {"z": batch["y"] + 1}


def test_a_pipeline_with_async_and_streaming_stages_is_profiled_for_their_whole_work() -> None:
    pipe = ss.Pipeline("streams", Double >> Speak, slo=ss.SLO(p99_ms=100))
    RUNS.clear()
    prof = slo.profile_pipeline(pipe, [1, 2], iters=3, budget_s=0.05)
    assert [p["batch"] for p in prof["stages"]["Speak"]["points"]] == [1, 2]
    assert [p["batch"] for p in prof["stages"]["Double"]["points"]] == [1, 2]
    # Each batch size: one run to make the children's inputs, then the timed runs.
    assert len(RUNS) == sum(1 + p["samples"] for p in prof["stages"]["Speak"]["points"])


SEEN: list[int] = []


@ss.component(max_batch_size=2, inputs={"x": ss.Tensor("float32", (-1, 2))},
              outputs={"y": ss.Tensor("float32", (-1, 2))})
class Slow:
    def __call__(self, batch: Batch) -> dict[str, np.ndarray]:
        SEEN.append(batch.rows)
        return {"y": batch["x"] + np.arange(batch.rows, dtype=np.float32)[:, None]}


@ss.component(max_batch_size=8, inputs={"y": ss.Tensor("float32", (-1, 2))},
              outputs={"z": ss.Tensor("float32", (-1, 2))})
class Wide:
    def __call__(self, batch: Batch) -> dict[str, np.ndarray]:
        return {"z": batch["y"]}


def test_a_stage_runs_at_most_its_batch_size_for_its_children_s_profile() -> None:
    # Slow takes 2 requests at most: profiling Wide at 8 repeats Slow's 2 rows
    # of output instead of running Slow on 8 (audioquery: ASR at 1 s a
    # request was run on 16, 32 and 64 to profile the stages after it).
    pipe = ss.Pipeline("wide", Slow >> Wide, example={"x": [[1.0, 2.0]]})
    SEEN.clear()
    batches = dict(slo.stage_batches(pipe, {"Slow": Slow.cls(), "Wide": Wide.cls()}, 8))
    assert SEEN == [2]
    assert batches["Wide"].rows == 8
    assert batches["Wide"]["y"].tolist() == [[1.0, 2.0], [2.0, 3.0]] * 4
    SEEN.clear()
    prof = slo.profile_pipeline(pipe, [1, 2, 4, 8], iters=2, budget_s=0.01)
    assert max(SEEN) == 2 and [p["batch"] for p in prof["stages"]["Wide"]["points"]] == [1, 2, 4, 8]
