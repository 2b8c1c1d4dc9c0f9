"""A placement move is make before break: a node joins a one-node cluster,
the leader's balancing moves a replica of the slowly constructed stage `X`
to it, and requests through the first node keep being answered (within the
1 s SLO) while the new replica spends seconds starting; the old one drains
only once the new one serves. Without standbys, so that nothing but the
old replica could stand in."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from slipstream.testing import Etcd, deploy, start_node, stop_all

from tests.conftest import APPS, Node, wait_for

LOAD_S = 3.0  # X's construction: longer than the 2 s a replica placed elsewhere used to serve for


@pytest.fixture()
def etcd() -> Iterator[Etcd]:
    e = Etcd(1)
    yield e
    e.stop()


def placed(n: Node) -> dict[str, dict[str, int]]:
    p = n.status()["cluster"]["placement"]
    return p["stages"] if p else {}


def test_a_moved_replica_serves_until_its_replacement_does(etcd: Etcd) -> None:
    out = deploy(etcd, APPS / "moves.py", wait=0)
    assert out.returncode == 0, out.stdout + out.stderr
    env = {"MOVE_LOAD_S": str(LOAD_S)}
    nodes: list[Node] = []
    try:
        a = start_node(etcd, "a", "--no-standbys", env=env)
        nodes.append(a)
        wait_for(lambda: a.request("GET", "/readyz")[0] == 200, timeout=120)
        assert placed(a) == {"moves/X": {"a": 1}, "moves/Y": {"a": 1}}
        results: list[tuple[int, str]] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                status, body = a.infer("moves", x=[[1.0, 2.0]])
                ok = status == 200 and body["outputs"]["y"] == [[4.0, 6.0]]
                results.append((status if ok or status != 200 else 0, body["outputs"]["x_node"][0] if ok else str(body)))
                time.sleep(0.02)

        threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        b = start_node(etcd, "b", "--no-standbys", env=env)
        nodes.append(b)
        # The balancing moves X (the first of two stages tied for the move) to b.
        wait_for(lambda: placed(a).get("moves/X") == {"b": 1}, timeout=120)
        wait_for(lambda: any(node == "b" for _, node in results[-5:]), timeout=60)
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(30)
        statuses = Counter(s for s, _ in results)
        assert statuses == {200: len(results)}, (statuses, [r for r in results if r[0] != 200][:5])
        served_by = Counter(node for _, node in results)
        assert served_by["a"] > 0 and served_by["b"] > 0, served_by
    finally:
        stop_all(nodes)
