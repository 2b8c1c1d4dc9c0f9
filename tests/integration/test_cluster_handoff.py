"""Stages handing work to each other directly across nodes
(crates/slipstream-cluster/src/handoff.rs): a chain A -> B -> C -> D
planned on nodes a (A, D) and b (B, C), entered at ingresses that hold no
replica. Through `i` (direct, the default) each request crosses i -> a
-> b -> a -> i: the ingress sends only A's batch and the chain's last
node delivers the answer; through `j` (`--via-ingress`) every stage's
answer comes back to it (hub and spoke). Both answer the same; an error
in the middle of a chain and a deadline passed in the middle of one
reach the client as they would hub and spoke; a request whose chain is
lost with a node runs again, hub and spoke, before its deadline."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import slipstream as ss
from slipstream.testing import TOKEN, Etcd, stop_all

from tests.conftest import Node, start_planned, wait_for

PLANNED = {"relay": {"A": {"a": 1}, "B": {"b": 1}, "C": {"b": 1}, "D": {"a": 1}}}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    etcd = Etcd(1)
    ns: dict[str, Node] = {}
    try:
        flags = ("--request-timeout", "30")
        start_planned(etcd, "relay.py", PLANNED, {"i": flags, "j": (*flags, "--via-ingress"), "a": flags, "b": flags},
                      tmp_path_factory.mktemp("plan"), ns)
        # The ingresses hold nothing, warm standbys included: a standby on an
        # ingress stands in there whenever a peer call is slow (CI load), and
        # a stage served on the ingress ends a chain. a and b stand by for
        # each other's stages.
        for name in ("i", "j"):
            cordon(etcd, ns["i"], name)
        wait_for(lambda: {"i", "j"} <= set(ns["a"].status()["cluster"]["cordoned"]), timeout=30)
        wait_for(lambda: all(not local_replicas(ns[n]) for n in ("i", "j")), timeout=60)
        yield ns
    finally:
        stop_all(list(ns.values()))
        etcd.stop()


def cordon(etcd: Etcd, n: Node, name: str) -> None:
    """Keep node `name` out of the placement (its replicas and standbys go
    to the others), as the node-count loop does before a node is removed."""
    from slipstream._internal.cluster_cli import Etcd as EtcdClient
    from slipstream._internal.cluster_cli import seal

    lease = n.status()["cluster"]["members"][name]["lease"]
    EtcdClient(etcd.url).put(f"/slipstream/default/cordon/{name}",
                             seal(TOKEN, "cordon", {"node": name, "lease": lease}))


def local_replicas(n: Node) -> list[str]:
    """The replicas and standbys of relay's stages running on node `n` itself."""
    pipe = next(p for p in n.status()["pipelines"] if p["name"] == "relay")
    return [f"{s['name']}[{r['id']}]" for s in pipe["stages"] for r in s["replicas"]
            if not r["node"] and r["state"] not in ("draining", "stopped")]


def x(v: float) -> np.ndarray:
    return np.array([[v, v + 0.5]], dtype=np.float32)


def expected(v: float) -> list[list[float]]:
    return [[(2 * w + 1) * 3 - 1 for w in (v, v + 0.5)]]


def requests_per_stage(n: Node) -> dict[str, int]:
    pipe = next(p for p in n.status()["pipelines"] if p["name"] == "relay")
    return {s["name"]: s["requests"] for s in pipe["stages"]}


def counters(n: Node) -> dict[str, Any]:
    return n.status()["cluster"]["counters"]


def answer_many(n: Node, values: list[float]) -> list[list[list[float]]]:
    def one(v: float) -> list[list[float]]:
        with n.client() as c:
            return c.infer("relay", {"x": x(v)})["y"].tolist()

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, values))


def test_a_chain_crosses_each_link_once_and_answers_as_hub_and_spoke(nodes: dict[str, Node]) -> None:
    i, j = nodes["i"], nodes["j"]
    for n in (i, j):
        with n.client() as c:
            wait_for(lambda c=c: c.infer("relay", {"x": x(1.0)})["y"].tolist() == expected(1.0), timeout=60)
    before_i, before_j = requests_per_stage(i), requests_per_stage(j)
    values = [float(v) for v in range(30, 90)]  # not 13 or 99 (B misbehaves on cue)
    assert answer_many(i, values) == [expected(v) for v in values]
    assert answer_many(j, values) == [expected(v) for v in values]
    # The direct ingress ran A's batches and, for all but the few a slow
    # peer call sent hub and spoke (CI load), nothing else: B, C and D went
    # node to node. The other ingress ran every stage's.
    got_i = {k: v - before_i[k] for k, v in requests_per_stage(i).items()}
    assert got_i["A"] == 60 and max(got_i["B"], got_i["C"], got_i["D"]) <= 6, got_i
    got_j = {k: v - before_j[k] for k, v in requests_per_stage(j).items()}
    assert got_j == {"A": 60, "B": 60, "C": 60, "D": 60}, got_j
    ci, cj = counters(i), counters(j)
    assert ci["chains_delivered"] >= 54 and ci["chains_pending"] == 0, ci
    assert cj["chains_started"] == 0, cj
    # a handed requests to b (A -> B), b back to a (C -> D); B -> C stayed on b.
    assert counters(nodes["a"])["handed_on"] >= 54 and counters(nodes["b"])["handed_on"] >= 54
    assert i.status()["cluster"]["direct_handoff"] is True and j.status()["cluster"]["direct_handoff"] is False


def test_an_error_in_the_middle_of_a_chain_reaches_the_client(nodes: dict[str, Node]) -> None:
    i = nodes["i"]
    with i.client(retry=None) as c:
        with pytest.raises(ss.ComponentFailed, match="13 is unlucky"):
            c.infer("relay", {"x": x(13.0)})
        assert c.infer("relay", {"x": x(2.0)})["y"].tolist() == expected(2.0)
    wait_for(lambda: counters(i)["chains_pending"] == 0, timeout=10)


def test_a_deadline_passed_in_the_middle_of_a_chain_is_answered_at_the_deadline(nodes: dict[str, Node]) -> None:
    i = nodes["i"]
    with i.client(retry=None) as c:
        t0 = time.perf_counter()
        with pytest.raises(ss.DeadlineExceeded, match=r"stage 'A \(handed on to B, C, D\)'"):
            c.infer("relay", {"x": x(99.0)}, deadline_ms=1000)  # B sleeps 1.5 s
        took = time.perf_counter() - t0
        assert 0.9 < took < 1.4, took
        # B's queue is EDF on b, and the chain still answers the next ones.
        wait_for(lambda: c.infer("relay", {"x": x(3.0)})["y"].tolist() == expected(3.0), timeout=10)
    # The late request's entry left the ingress's table (delivered late, or swept).
    wait_for(lambda: counters(i)["chains_pending"] == 0, timeout=10)


def test_a_request_whose_chain_is_lost_with_a_node_runs_again_before_its_deadline(nodes: dict[str, Node]) -> None:
    """Last in the module: it kills node b. With no standby, B and C start
    afresh elsewhere once b's lease runs out, and the request runs again."""
    i = nodes["i"]
    got: dict[str, Any] = {}

    def ask() -> None:
        with i.client(retry=None, timeout=50) as c:
            try:
                got["y"] = c.infer("relay", {"x": x(99.0)})["y"].tolist()  # B sleeps 1.5 s on b; SLO 20 s
            except ss.Error as e:
                got["error"] = e

    t = threading.Thread(target=ask)
    t.start()
    wait_for(lambda: counters(i)["chains_pending"] >= 1, timeout=10)  # sent to a, to be handed to b
    time.sleep(0.3)  # B is sleeping on b with it (for 1.5 s)
    nodes["b"].stop(signal.SIGKILL)
    t.join(timeout=60)
    assert got.get("y") == expected(99.0), got
    assert counters(i)["chains_lost"] >= 1, counters(i)
    # B and C now run where the placement moved them, and chains go there.
    with i.client() as c:
        for v in (4.0, 5.0, 6.0):
            assert c.infer("relay", {"x": x(v)})["y"].tolist() == expected(v)
