"""A cluster on a real etcd: three real nodes (`slipstream node`) on
loopback, a deployment placed over them, requests that cross nodes and meet
again at a fan-in, placement changes under load with no failed request, a
node killed under load, and intruders without the cluster token refused."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from slipstream.testing import Etcd, deploy, start_node, stop_all

from tests.conftest import APPS, Node, wait_for

CLUSTER_APP = str(APPS / "cluster.py")
STAGES = {"diamond/Fan": 3, "diamond/Sum": 2, "diamond/Prod": 1, "diamond/Join": 3}


def cluster_of(n: Node) -> Any:
    return n.status()["cluster"]


def placed(n: Node) -> dict[str, dict[str, int]]:
    p = cluster_of(n)["placement"]
    return p["stages"] if p else {}


def local_counts(n: Node) -> dict[str, int]:
    """Replicas serving on this node per stage (not remote, not standbys, not leaving or draining)."""
    return {f"{p['name']}/{s['name']}": sum(1 for r in s["replicas"] if not r["node"] and not r["leaving"]
                                              and not r["standby"] and r["state"] in ("starting", "ready", "down"))
            for p in n.status()["pipelines"] for s in p["stages"]}


def prod_holder_and_warm_spare(nodes: dict[str, Node]) -> tuple[str, str]:
    """The node holding diamond/Prod's only replica and the one holding its
    standby, once that standby is warm (its member record says so)."""
    n_any = next(iter(nodes.values()))
    holder = next(iter(placed(n_any)["diamond/Prod"]))
    spare_of = lambda: cluster_of(n_any)["placement"].get("standby", {}).get("diamond/Prod", {})  # noqa: E731
    wait_for(lambda: spare_of() and next(iter(spare_of())) != holder, timeout=30)
    spare = next(iter(spare_of()))
    wait_for(lambda: cluster_of(n_any)["members"][spare].get("standby", {}).get("diamond/Prod") == 1, timeout=60)
    return holder, spare


def all_ready(n: Node) -> bool:
    return n.request("GET", "/readyz")[0] == 200


def placement_settled(ns: dict[str, Node]) -> bool:
    """Every node applies the same placement, and it places replicas on
    every node (a member joins the member list before the placement)."""
    views = [cluster_of(n) for n in ns.values()]
    if not all(v["placement"] for v in views) or len({v["placement"]["epoch"] for v in views}) != 1:
        return False
    return {name for counts in views[0]["placement"]["stages"].values() for name in counts} == set(ns)


@pytest.fixture(scope="module")
def etcd() -> Iterator[Etcd]:
    e = Etcd(3)  # three members: the failure tests kill one
    yield e
    e.stop()


@pytest.fixture(scope="module")
def nodes(etcd: Etcd) -> Iterator[dict[str, Node]]:
    out = deploy(etcd, CLUSTER_APP, "--scale-down-after", "2", wait=0)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "deployed" in out.stdout
    ns = {name: start_node(etcd, name) for name in ("n1", "n2", "n3")}
    try:
        # Generous: in CI three such clusters may start at once on two cores.
        for n in ns.values():
            try:
                wait_for(lambda n=n: all_ready(n) and len(cluster_of(n)["members"]) == 3, timeout=180)
            except AssertionError:
                logs = "\n".join(f"--- {name} ---\n{m.log()[-3000:]}" for name, m in ns.items())
                raise AssertionError(f"a node did not become ready:\n{logs}") from None
        wait_for(lambda: placement_settled(ns), timeout=60)
        yield ns
    finally:
        stop_all(list(ns.values()))


def ask(n: Node, i: int, timeout: float = 10.0) -> tuple[int, Any]:
    return n.infer("diamond", x=[[float(i), 2.0]])


def check_answer(i: int, body: Any) -> str:
    both = body["outputs"]["both"]
    assert both == [[abs(i) + 2.0, abs(i) * 2.0]], body
    return str(body["outputs"]["route"][0])


def test_nodes_join_and_the_placement_spreads_every_stage(nodes: dict[str, Node]) -> None:
    views = [cluster_of(n) for n in nodes.values()]
    assert all(sorted(v["members"]) == ["n1", "n2", "n3"] for v in views)
    epochs = {v["placement"]["epoch"] for v in views}
    assert len(epochs) == 1, "every node applies the same placement"
    stages = views[0]["placement"]["stages"]
    for key, total in STAGES.items():
        assert sum(stages[key].values()) == total, stages
        assert max(stages[key].values()) - min(stages[key].get(n, 0) for n in nodes) <= 1, stages
    # Each node runs exactly the local replicas the placement gives it.
    for name, n in nodes.items():
        wait_for(lambda n=n, name=name: local_counts(n) == {k: v.get(name, 0) for k, v in stages.items()}, timeout=20)
    m = views[0]["members"]["n2"]
    assert m["cores"] >= 1 and m["memory_bytes"] > 0 and m["data"]


def test_requests_cross_nodes_and_meet_at_the_fan_in(nodes: dict[str, Node]) -> None:
    routes: Counter[str] = Counter()
    for name, n in nodes.items():
        for i in range(40):
            status, body = ask(n, i)
            assert status == 200, body
            routes[name + ":" + check_answer(i, body)] += 1
    # Stages ran on other nodes than the ingress (the route is "fan>sum|prod>join").
    crossed = sum(c for r, c in routes.items() if any(p not in ("", r.split(":")[0])
                                                       for p in r.split(":")[1].replace("|", ">").split(">")))
    assert crossed > 0, routes
    # A node lacking one of the stages sent batches to nodes holding it, and
    # every batch sent was served by another node. Which holder serves is
    # the router's choice (by load), so a node need not serve any: one that
    # holds only stages every node holds is never sent a batch.
    placement = placed(nodes["n1"])
    views = {name: cluster_of(n) for name, n in nodes.items()}
    for name, v in views.items():
        c, dp = v["counters"], v["data_plane"]
        if any(name not in placement[key] for key in STAGES):
            assert c["sent_batches"] > 0, (name, c, placement)
        if c["sent_batches"] or c["served_batches"]:
            assert dp["frames_sent"] > 0, (name, dp)
    sent = sum(v["counters"]["sent_batches"] for v in views.values())
    served = sum(v["counters"]["served_batches"] for v in views.values())
    assert sent == served > 0, {name: v["counters"] for name, v in views.items()}


def test_a_tensor_crosses_nodes_with_one_copy_per_receive(nodes: dict[str, Node]) -> None:
    """1 MB in and out of a stage on another node: the sender writes it from
    shared memory (no copy), the receiver reads it straight into its arena
    (the one copy a network receive makes, counted as an ingress write)."""
    home = next(iter(placed(nodes["n1"])["big/Big"]))
    ingress = next(n for name, n in nodes.items() if name != home)
    mb = 262144 * 4
    # A replica the placement moved off the ingress serves until the one on
    # `home` does (make before break): wait until none is left here.
    wait_for(lambda: cluster_of(ingress)["members"][home]["ready"].get("big/Big", 0) >= 1
             and not any(not r["node"] and r["state"] in ("starting", "ready", "down")
                         for p in ingress.status()["pipelines"] if p["name"] == "big"
                         for s in p["stages"] for r in s["replicas"]), timeout=60)
    before = ingress.status()
    status, body = ingress.infer("big", x=[[1.5] * 262144])
    assert status == 200 and body["outputs"]["big_node"] == [home], body
    after = ingress.status()
    d_ingress = after["copies"]["ingress_bytes"] - before["copies"]["ingress_bytes"]
    # The request's body decoded into the arena (1 MB), and the reply received into it (1 MB).
    assert 2 * mb <= d_ingress < 2 * mb + 64 * 1024, d_ingress
    dp0, dp1 = before["cluster"]["data_plane"], after["cluster"]["data_plane"]
    assert dp1["zero_copy_tensors"] - dp0["zero_copy_tensors"] >= 1, (dp0, dp1)
    assert dp1["merge_copied_bytes"] - dp0["merge_copied_bytes"] < 4096, (dp0, dp1)
    assert dp1["bytes_received"] - dp0["bytes_received"] >= mb


def test_a_slow_singleton_is_waited_for_when_nothing_else_could_take_its_work(nodes: dict[str, Node]) -> None:
    """diamond/Prod, a singleton with a warm standby, answers one request
    slowly, twice its ingress's patience with a node: the ingress gives up
    on the replica's node and retries the batch on the standby, which is as
    slow with it. With nowhere else to go (the first node is suspected now),
    the ingress waits for that answer within the deadline instead of
    failing the request with 503 (what it did before: a second timeout
    found no replica)."""
    holder, spare = prod_holder_and_warm_spare(nodes)
    (ingress,) = [n for name, n in nodes.items() if name not in (holder, spare)]

    def prod_replicas() -> list[tuple[str, bool, bool]]:
        """The ingress's replicas of Prod that will serve: (node, standby, leaving)."""
        [stage] = [s for p in ingress.status()["pipelines"] if p["name"] == "diamond"
                   for s in p["stages"] if s["name"] == "Prod"]
        return sorted((r["node"] or "", r["standby"], r["leaving"]) for r in stage["replicas"]
                      if r["state"] not in ("draining", "stopped"))  # "": one on the ingress itself

    # Only the holder's replica and the spare's standby: no replica a move
    # left serving until its replacement did (that would be somewhere else
    # to go, and the ingress would rightly not wait).
    wait_for(lambda: prod_replicas() == sorted([(holder, False, False), (spare, True, False)]), timeout=30)
    for i in range(20):  # the remote replica learns a batch takes about a millisecond
        status, body = ask(ingress, i)
        assert status == 200, body
    before = cluster_of(ingress)["counters"]
    slow_ms = 600  # more than twice the shortest patience (250 ms)
    status, body = ingress.infer("diamond", x=[[10_000.0 + slow_ms, 2.0]])
    assert status == 200, body
    assert body["outputs"]["both"] == [[10_000.0 + slow_ms + 2.0, (10_000.0 + slow_ms) * 2.0]], body
    after = cluster_of(ingress)["counters"]
    assert after["retried"] > before["retried"], (before, after)
    assert after["patient_calls"] > before["patient_calls"], (before, after, prod_replicas())
    # The first node answers a probe and takes work again.
    wait_for(lambda: not cluster_of(ingress)["suspects"], timeout=30)
    wait_for(lambda: all_ready(ingress), timeout=30)


def test_feedback_on_an_answer_is_accepted_by_any_node(nodes: dict[str, Node]) -> None:
    """Request ids name the node that answered (its tag in the high bits);
    feedback given to another node is forwarded to it, where model
    selection holds the prediction: one item, a batch over three nodes,
    and an unknown id's 404 from the node that would hold it."""

    def ask_pick(n: Node, x: float) -> int:
        status, headers, raw = n.request("POST", "/v1/pipelines/pick/infer", {"inputs": {"x": [[x, 0.0]]}})
        assert status == 200, raw
        return int({k.lower(): v for k, v in headers.items()}["x-slipstream-request-id"])

    def fed(n: Node) -> int:
        status, body = n.get("/v1/pipelines/pick/select")
        assert status == 200, body
        return int(body["selects"][0]["feedback"])

    ids = {name: ask_pick(n, 1.0) for name, n in nodes.items()}
    tags = {name: i >> 40 for name, i in ids.items()}
    assert len(set(tags.values())) == 3 and 0 not in tags.values(), ids
    assert all(i < 2 ** 53 for i in ids.values()), ids
    before = {name: fed(n) for name, n in nodes.items()}
    # One item, given to n2 about n1's answer: applied on n1.
    status, body = nodes["n2"].post("/v1/pipelines/pick/feedback", {"request_id": ids["n1"], "label": [1]})
    assert status == 200, body
    assert fed(nodes["n1"]) == before["n1"] + 1 and fed(nodes["n2"]) == before["n2"], body
    # A batch over all three nodes' answers, given to n3.
    more = {name: ask_pick(n, -1.0) for name, n in nodes.items()}
    items = [{"request_id": i, "label": [0]} for i in more.values()]
    status, body = nodes["n3"].post("/v1/pipelines/pick/feedback", {"feedback": items})
    assert (status, body) == (200, {"applied": 3, "unknown": 0, "invalid": 0, "errors": []}), body
    # An id n1 would hold but never issued: n1's own 404, through n2.
    bogus = (tags["n1"] << 40) | 7
    status, body = nodes["n2"].post("/v1/pipelines/pick/feedback", {"request_id": bogus, "label": [1]})
    assert status == 404 and body["error"]["kind"] == "not_found", body
    assert str(bogus) in body["error"]["message"], body


def test_the_cluster_autoscaler_grows_a_stage_under_load_and_shrinks_it_after(nodes: dict[str, Node]) -> None:
    """elastic/Elastic (bounds 1..2, ~50 req/s per replica) under ~100
    req/s through two ingresses: the leader, summing the load every node
    reports, places a second replica (promoting the warm standby it
    preloaded, when the forecast got there first); the load gone, after
    the hysteresis (--scale-down-after 2), one serving replica again."""
    leader = nodes["n1"]

    def count() -> int:
        return sum(placed(leader).get("elastic/Elastic", {}).values())

    def ready() -> int:
        return sum(m["ready"].get("elastic/Elastic", 0) for m in cluster_of(leader)["members"].values())

    assert count() == 1
    stop = threading.Event()
    statuses: Counter[int] = Counter()

    def load(k: int) -> None:
        n = (nodes["n1"], nodes["n2"])[k % 2]
        while not stop.is_set():
            status, _ = n.infer("elastic", x=[[1.0, 2.0]])
            statuses[status] += 1

    threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    try:
        # The members' reports reach the leader, whose model sees the load.
        wait_for(lambda: (cluster_of(leader)["autoscale"]["stages"].get("elastic/Elastic", {}).get("model") or {})
                 .get("level_rps", 0) > 40, timeout=30)
        wait_for(lambda: count() == 2, timeout=30)
        wait_for(lambda: ready() == 2, timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    block = cluster_of(leader)["autoscale"]["stages"]["elastic/Elastic"]
    grew = block["decisions"].get("promote", 0) + block["decisions"].get("scale_up", 0)
    assert grew >= 1, block
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] > 20, statuses
    # No load: after the hysteresis, back to one serving replica.
    wait_for(lambda: count() == 1, timeout=60)
    block = cluster_of(leader)["autoscale"]["stages"]["elastic/Elastic"]
    assert block["decisions"].get("to_standby", 0) + block["decisions"].get("scale_down", 0) >= 1, block
    events = [e["detail"] for e in leader.status()["events"] if e["what"] == "autoscale"]
    assert any("serving" in d for d in events), events


class Load:
    """Requests from a few threads to the given ingresses until stopped; counts outcomes."""

    def __init__(self, targets: list[Node], threads: int = 4) -> None:
        self.targets = targets
        self.stop_ev = threading.Event()
        self.outcomes: Counter[int] = Counter()
        self.failures: list[str] = []
        self.slowest = 0.0  # seconds, of any answer
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(k,), daemon=True) for k in range(threads)]
        for t in self.threads:
            t.start()

    def run(self, k: int) -> None:
        i = k
        while not self.stop_ev.is_set():
            n = self.targets[i % len(self.targets)]
            t0 = time.monotonic()
            try:
                status, body = ask(n, i % 50)
            except OSError as e:
                status, body = -1, str(e)
            with self.lock:
                self.slowest = max(self.slowest, time.monotonic() - t0)
                self.outcomes[status] += 1
                if status != 200:
                    self.failures.append(f"{status}: {json.dumps(body)[:300]}")
            i += len(self.threads)
            time.sleep(0.005)

    def finish(self) -> Counter[int]:
        self.stop_ev.set()
        for t in self.threads:
            t.join(30)
        return self.outcomes


def test_placement_changes_under_load_fail_no_request(etcd: Etcd, nodes: dict[str, Node]) -> None:
    load = Load(list(nodes.values()))
    n4 = start_node(etcd, "n4")
    try:
        wait_for(lambda: "n4" in json.dumps(placed(nodes["n1"])), timeout=60)
        wait_for(lambda: cluster_of(nodes["n1"])["members"].get("n4", {}).get("ready"), timeout=60)
        time.sleep(3)  # traffic over the new placement, the moved replicas drained
        assert any(r.get("node") == "n4" for p in nodes["n1"].status()["pipelines"]
                   for s in p["stages"] for r in s["replicas"]), "n1 routes to n4's replicas"
    finally:
        n4.stop()  # leaves gracefully: lease revoked, its replicas placed again
    wait_for(lambda: "n4" not in json.dumps(placed(nodes["n1"])), timeout=30)
    time.sleep(3)
    outcomes = load.finish()
    assert outcomes[200] > 100, outcomes
    assert set(outcomes) == {200}, (outcomes, load.failures[:5])


def test_a_killed_node_leaves_and_its_singleton_s_standby_takes_over_losing_no_request(
        etcd: Etcd, nodes: dict[str, Node]) -> None:
    """SIGKILL the node holding the only replica of diamond/Prod: the warm
    standby the placement keeps on another node stands in at once (no 503
    while the victim's lease runs out), then becomes the stage's replica."""
    victim, spare = prod_holder_and_warm_spare(nodes)
    survivors = [n for name, n in nodes.items() if name != victim]
    observer = survivors[0]
    load = Load(survivors)
    time.sleep(1.0)
    etcd.kill(0)  # and an etcd member with it: the nodes carry on through the other two
    killed_at = time.monotonic()
    nodes[victim].stop(signal.SIGKILL)
    # Its lease (3 s) expires; the placement moves its replicas to the survivors,
    # the singleton to the node whose standby stood in.
    wait_for(lambda: victim not in cluster_of(observer)["members"], timeout=30)
    left_after = time.monotonic() - killed_at
    wait_for(lambda: victim not in json.dumps(placed(observer)), timeout=30)
    for key, total in STAGES.items():
        wait_for(lambda key=key, total=total: sum(placed(observer)[key].values()) == total, timeout=30)
    assert placed(observer)["diamond/Prod"] == {spare: 1}, placed(observer)
    time.sleep(2)
    outcomes = load.finish()
    assert left_after < 10, left_after
    assert outcomes[200] > 50, outcomes
    assert set(outcomes) == {200}, (outcomes, load.failures[:5])
    # Nobody waited for a replica to start: the slowest answer is far below
    # the lease and a worker's start-up.
    assert load.slowest < 2.0, load.slowest
    # It comes back and rejoins.
    nodes[victim] = start_node(etcd, victim)
    wait_for(lambda: victim in json.dumps(placed(nodes["n1"])), timeout=60)
    wait_for(lambda: all_ready(nodes[victim]), timeout=60)
    status, body = ask(nodes[victim], 5)
    assert status == 200, body
    etcd.start(0)


def test_intruders_without_the_token_are_refused(etcd: Etcd, nodes: dict[str, Node]) -> None:
    n1 = nodes["n1"]
    before = cluster_of(n1)["counters"]
    # 1. A node with another token cannot read the deployment: it does not start.
    intruder = start_node(etcd, "intruder", token="not-the-token")
    assert intruder.proc.wait(30) != 0
    assert "not signed with this cluster token" in intruder.log()
    # 2. A member record written straight into etcd without the key is ignored.
    from slipstream._internal.cluster_cli import Etcd as EtcdClient

    EtcdClient(etcd.url).put("/slipstream/default/members/mallory", json.dumps(
        {"body": json.dumps({"node": "mallory"}), "sig": "00" * 32}).encode())
    wait_for(lambda: cluster_of(n1)["counters"]["refused_records"] > before["refused_records"], timeout=10)
    assert "mallory" not in cluster_of(n1)["members"]
    # 3. A connection to the data plane without the token gets no further than the handshake.
    host, port = cluster_of(n1)["data"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"SSPR" + b"\x00" * 64)
        s.settimeout(5)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass
    wait_for(lambda: cluster_of(n1)["counters"]["refused_handshakes"] > before["refused_handshakes"], timeout=10)
    status, body = ask(n1, 3)
    assert status == 200, body
