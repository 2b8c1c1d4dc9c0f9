"""Async components: many batches in flight on one worker's event loop."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import slipstream as ss

APP = Path(__file__).resolve().parents[1] / "apps" / "asyncapp.py"


@pytest.fixture(scope="module")
def node():  # type: ignore[no-untyped-def]
    with ss.launch(APP) as server:
        yield server


def _burst(client: ss.Client, pipeline: str, n: int, ms: float) -> tuple[float, list[dict]]:
    x = np.array([[ms]], dtype=np.float32)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda _: client.infer(pipeline, {"x": x}), range(n)))
    return time.perf_counter() - t0, outs


def test_async_batches_overlap_on_one_worker(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()
    n, ms = 16, 200.0
    took, outs = _burst(client, "waiting", n, ms)
    # One replica, one request per batch: run one by one this would take
    # n x 200 ms = 3.2 s. The waits themselves, timed in the worker, say
    # whether they overlapped (a loaded machine may spread the arrivals,
    # but not serialise them: run one by one, at most one is in flight);
    # the wall clock is a loose second check.
    spans = sorted((float(o["span"][0, 0]), float(o["span"][0, 1])) for o in outs)
    most = max(sum(1 for b, e in spans if b <= t < e) for t, _ in spans)
    assert most >= 2, f"at most {most} of {n} waits were in flight at once: {spans}"
    assert took < n * ms / 1000 / 2, f"{n} waits of {ms} ms took {took:.2f} s"
    assert all(float(o["y"][0, 0]) == ms + 1 for o in outs)
    assert len({int(o["pid"][0, 0]) for o in outs}) == 1  # one worker did them all
    status = client.status()
    stage = next(s for p in status["pipelines"] if p["name"] == "waiting" for s in p["stages"] if s["name"] == "Wait")
    assert stage["concurrency"] == 16


def test_blocking_component_runs_one_batch_at_a_time(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()
    n, ms = 4, 150.0
    took, _ = _burst(client, "blocking", n, ms)
    assert took >= n * ms / 1000 * 0.9, f"a plain component overlapped batches ({took:.2f} s)"


def test_an_async_failure_fails_its_batch_only(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()
    ok = np.array([[100.0]], dtype=np.float32)
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(client.infer, "waiting", {"x": ok}) for _ in range(6)]
        with pytest.raises(ss.ComponentFailed, match="13 is unlucky"):
            client.infer("waiting", {"x": np.array([[13.0]], dtype=np.float32)})
        assert all(float(f.result()["y"][0, 0]) == 101.0 for f in good)


def test_many_requests_through_the_async_client(node) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    async def go() -> list[float]:
        async with ss.AsyncClient(node.url) as c:
            xs = [np.array([[50.0 + i]], dtype=np.float32) for i in range(64)]
            outs = await asyncio.gather(*(c.infer("waiting", {"x": x}) for x in xs))
            return [float(o["y"][0, 0]) for o in outs]

    assert asyncio.run(go()) == [51.0 + i for i in range(64)]


def test_concurrency_needs_an_async_call() -> None:
    class Plain:
        def __call__(self, batch: ss.Batch) -> dict:
            return {}

    with pytest.raises(ss.ConfigError, match="needs an `async def __call__`"):
        ss.component(concurrency=4)(Plain)

    class Async:
        async def __call__(self, batch: ss.Batch) -> dict:
            return {}

    assert ss.component(Async).concurrency == 16
    assert ss.component(concurrency=3)(Async).concurrency == 3
    with pytest.raises(ss.ConfigError, match="from 1 to 1024"):
        ss.component(concurrency=0)(Async)
