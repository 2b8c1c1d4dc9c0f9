"""A streaming stage on another node: its chunks reach a client of any
ingress as they are yielded, forwarded over the data plane (a call's
partial replies), before its final answer; a plain call still gets only
the final answer, and an error mid-stream still reaches the client."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import slipstream as ss
from slipstream.testing import Etcd, stop_all

from tests.conftest import Node, start_planned, wait_for

# Both streaming stages only on "far": a client of "near" is served across the nodes.
PLANNED = {"counting": {"Count": {"far": 1}}, "ticking": {"Tick": {"far": 1}}}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    etcd = Etcd(1)
    ns: dict[str, Node] = {}
    try:
        start_planned(etcd, "streaming.py", PLANNED, {"near": (), "far": ()}, tmp_path_factory.mktemp("plan"), ns)
        yield ns
    finally:
        stop_all(list(ns.values()))
        etcd.stop()


def x(v: float) -> np.ndarray:
    return np.array([[v]], dtype=np.float32)


def local_replicas(n: Node, pipeline: str, stage: str) -> int:
    st = n.status()
    stages = next(p for p in st["pipelines"] if p["name"] == pipeline)["stages"]
    reps = next(s for s in stages if s["name"] == stage)["replicas"]
    return sum(1 for r in reps if not r["node"] and not r["standby"] and not r["leaving"])


def test_chunks_of_a_stage_on_another_node_come_as_they_are_yielded(nodes: dict[str, Node]) -> None:
    near = nodes["near"]
    assert local_replicas(near, "counting", "Count") == 0, near.status()
    client = near.client()
    wait_for(lambda: client.infer("counting", {"x": x(1.0)})["y"].tolist() == [[2.0, 3.0, 4.0]], timeout=60)
    for _ in range(3):
        t0 = time.perf_counter()
        seen = []
        with client.stream("counting", {"x": x(1.0)}) as s:
            for chunk in s:
                seen.append((time.perf_counter() - t0, float(chunk["y"][0, 0]), chunk["word"][0]))
        assert [v for _, v, _ in seen] == [2.0, 3.0, 4.0], seen
        assert [w for _, _, w in seen] == ["part1", "part2", "part3"], seen
        # The first chunk crossed before the component finished (it sleeps
        # 2 x 100 ms after yielding it).
        assert seen[0][0] < seen[2][0] - 0.15, seen
        assert s.final is not None and s.final["y"].tolist() == [[2.0, 3.0, 4.0]] and s.final["word"][0] == "all"
    # An async generator's chunks too; its last chunk is its answer.
    with client.stream("ticking", {"x": x(2.0)}) as s:
        ticks = [float(c["t"][0, 0]) for c in s]
    assert ticks == [20.0, 21.0, 22.0] and s.final is not None and s.final["t"].tolist() == [[22.0]]


def test_concurrent_remote_streams_keep_their_rows(nodes: dict[str, Node]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    client = nodes["near"].client()

    def run(v: float) -> list[float]:
        with client.stream("counting", {"x": x(v)}) as s:
            return [float(c["y"][0, 0]) for c in s]

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(run, [float(v) for v in range(6)]))
    assert got == [[v + 1, v + 2, v + 3] for v in range(6)], got


def test_an_error_mid_stream_on_another_node_reaches_the_client(nodes: dict[str, Node]) -> None:
    client = nodes["near"].client()
    seen = []
    with pytest.raises(ss.ComponentFailed, match="13 is unlucky"):
        with client.stream("counting", {"x": x(13.0)}) as s:
            for chunk in s:
                seen.append(float(chunk["y"][0, 0]))
    assert seen == [14.0], seen
