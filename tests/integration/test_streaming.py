"""Streaming components: chunks reach the client as they are yielded."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
import slipstream as ss

APP = Path(__file__).resolve().parents[1] / "apps" / "streaming.py"


@pytest.fixture(scope="module")
def node():  # type: ignore[no-untyped-def]
    with ss.launch(APP) as server:
        yield server


def x(v: float) -> np.ndarray:
    return np.array([[v]], dtype=np.float32)


def test_chunks_come_as_they_are_yielded(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()
    t0 = time.perf_counter()
    seen = []
    with client.stream("counting", {"x": x(1.0)}) as s:
        for chunk in s:
            seen.append((time.perf_counter() - t0, float(chunk["y"][0, 0]), chunk["word"][0]))
    assert [v for _, v, _ in seen] == [2.0, 3.0, 4.0]
    assert [w for _, _, w in seen] == ["part1", "part2", "part3"]
    # The first chunk arrives before the component has finished (it sleeps
    # 2 x 100 ms after yielding it).
    assert seen[0][0] < seen[2][0] - 0.15, seen
    assert s.chunks == 3 and s.first_chunk_s is not None and s.first_chunk_s < seen[2][0]
    assert s.final is not None and s.final["y"].tolist() == [[2.0, 3.0, 4.0]] and s.final["word"][0] == "all"
    # A plain call gets the final answer (the generator's return value).
    out = client.infer("counting", {"x": x(1.0)})
    assert out["y"].tolist() == [[2.0, 3.0, 4.0]]


def test_concurrent_streams_share_batches_and_keep_their_rows(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()

    def run(v: float) -> list[float]:
        with client.stream("counting", {"x": x(v)}) as s:
            return [float(c["y"][0, 0]) for c in s]

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(run, [10.0 * i for i in range(6)]))
    assert got == [[10.0 * i + 1, 10.0 * i + 2, 10.0 * i + 3] for i in range(6)]


def test_async_generator_and_async_client(node) -> None:  # type: ignore[no-untyped-def]
    async def go() -> tuple[list[float], float]:
        async with ss.AsyncClient(node.url) as c:
            s = await c.stream("ticking", {"x": x(2.0)})
            vals = [float(chunk["t"][0, 0]) async for chunk in s]
            assert s.final is not None
            return vals, float(s.final["t"][0, 0])

    vals, final = asyncio.run(go())
    assert vals == [20.0, 21.0, 22.0] and final == 22.0


def test_an_error_mid_stream_reaches_the_client(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()
    s = client.stream("counting", {"x": x(13.0)})
    first = next(iter(s))
    assert float(first["y"][0, 0]) == 14.0
    with pytest.raises(ss.ComponentFailed, match="13 is unlucky"):
        list(s)


def test_errors_before_the_stream_are_plain_responses(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()
    with pytest.raises(ss.BadInput):
        client.stream("counting", {"x": np.array([[1.0]], dtype=np.float64)})
    with pytest.raises(ss.NotFound):
        client.stream("nope", {"x": x(1.0)})
    r = requests.post(f"{node.url}/v1/pipelines/counting/stream", data=b"{not json", timeout=10)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"


def test_pipeline_api_stream_as_server_sent_events(node) -> None:  # type: ignore[no-untyped-def]
    r = requests.post(f"{node.url}/v1/pipelines/counting/stream", json={"inputs": {"x": [[5.0]]}},
                      stream=True, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    events = [line.decode() for line in r.iter_lines() if line.startswith(b"event: ")]
    assert events == ["event: chunk"] * 3 + ["event: done"]


def test_a_streaming_stage_feeds_its_children_its_final_output(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()
    with client.stream("summing", {"x": x(1.0)}) as s:
        chunks = list(s)
    assert chunks == []  # Count2's chunks stay inside the pipeline
    assert s.final is not None and s.final["total"].tolist() == [[9.0]]


def test_a_client_that_leaves_cancels_its_request(node) -> None:  # type: ignore[no-untyped-def]
    client = node.client()

    def cancelled() -> int:
        st = client.status()
        return int(next(p for p in st["pipelines"] if p["name"] == "counting")["cancelled"])

    before = cancelled()
    s = client.stream("counting", {"x": x(1.0)})
    next(iter(s))
    s.close()
    deadline = time.time() + 5
    while cancelled() == before and time.time() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1


def test_grpc_stream_sends_each_chunk_then_the_final_answer(node) -> None:  # type: ignore[no-untyped-def]
    grpcclient = pytest.importorskip("tritonclient.grpc")
    results: list[tuple[float, object, object]] = []
    c = grpcclient.InferenceServerClient(node.grpc_url)
    t0 = time.perf_counter()
    c.start_stream(callback=lambda result, error: results.append((time.perf_counter() - t0, result, error)))
    try:
        inp = grpcclient.InferInput("x", [1, 1], "FP32")
        inp.set_data_from_numpy(x(1.0))
        c.async_stream_infer("counting", [inp], request_id="c1")
        deadline = time.time() + 10
        while len(results) < 4 and time.time() < deadline:
            time.sleep(0.02)
    finally:
        c.stop_stream()
        c.close()
    assert all(e is None for _, _, e in results), results
    assert len(results) == 4
    params = [r.get_response().parameters for _, r, _ in results]  # type: ignore[attr-defined]
    assert [p["triton_final_response"].bool_param for p in params] == [False, False, False, True]
    assert [p["slipstream_chunk"].bool_param for p in params[:3]] == [True] * 3
    ys = [r.as_numpy("y").tolist() for _, r, _ in results]  # type: ignore[attr-defined]
    assert ys == [[[2.0]], [[3.0]], [[4.0]], [[2.0, 3.0, 4.0]]]
    assert results[0][0] < results[3][0] - 0.15  # the first chunk came before the component finished
