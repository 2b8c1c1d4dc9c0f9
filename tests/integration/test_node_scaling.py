"""The node-count loop on a real cluster, against a fake Kubernetes API
server (tests/fake_kube.py) that plays the StatefulSet controller: on a
scale patch up it starts the next ordinal's node, on one down it checks
that the leaving node holds nothing (no replica, standby or placement, no
store value short of its copies) and then stops it, as Kubernetes deletes
the pod. Three 2-core nodes, a stage of 20 req/s replicas (bounds 1..16,
tests/apps/nodescale.py) under 150 req/s: the load needs 10 replicas, the
cores allow 6, so the leader asks for a fourth node; with the load gone
it empties the fourth (cordon: its replicas move) and only then shrinks."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from slipstream.testing import Etcd, deploy, free_port, start_node, stop_all

from tests.conftest import APPS, Node, wait_for
from tests.fake_kube import NS, STS, TOKEN, FakeApi

APP = str(APPS / "nodescale.py")


def _status(n: Node) -> Any:
    return n.status()["cluster"]


def _holds(cluster: Any, node: str) -> list[str]:
    """What the cluster's view says `node` still runs or holds (empty: nothing)."""
    out = []
    p = cluster.get("placement") or {}
    out += [f"placed {k}" for k, w in (p.get("stages") or {}).items() if w.get(node, 0) > 0]
    out += [f"standby {k}" for k, w in (p.get("standby") or {}).items() if w.get(node, 0) > 0]
    m = cluster["members"].get(node) or {}
    out += [f"ready {k}" for k, c in (m.get("ready") or {}).items() if c > 0]
    repair = (cluster.get("store") or {}).get("repair") or {}
    if repair.get("under_replicated_versions", 0):
        out.append(f"{repair['under_replicated_versions']} store values short")
    return out


class Controller:
    """The StatefulSet: nodes `<STS>-<ordinal>`, as many as the fake API's scale says."""

    def __init__(self, etcd: Etcd, api: FakeApi) -> None:
        self.etcd, self.api = etcd, api
        self.nodes: dict[str, Node] = {}
        self.checked: list[tuple[int, list[str]]] = []  # (new count, what the leaving node held then)
        self.env = {"SLIPSTREAM_K8S_STATEFULSET": STS, "SLIPSTREAM_K8S_API": api.url,
                    "SLIPSTREAM_K8S_NAMESPACE": NS, "SLIPSTREAM_K8S_TOKEN": TOKEN,
                    "SLIPSTREAM_K8S_MIN_NODES": "3", "SLIPSTREAM_K8S_MAX_NODES": "4",
                    "SLIPSTREAM_K8S_DOWN_AFTER_S": "3", "SLIPSTREAM_K8S_CHECK_EVERY_S": "1",
                    "SLIPSTREAM_K8S_DRAIN_TIMEOUT_S": "60"}
        api.on_scale.append(self._scaled)

    def start(self, ordinal: int) -> Node:
        name = f"{STS}-{ordinal}"
        n = start_node(self.etcd, name, "--port", str(free_port()), env=self.env)
        self.nodes[name] = n
        return n

    def _scaled(self, count: int) -> None:
        if count > len(self.nodes):
            for i in range(len(self.nodes), count):
                threading.Thread(target=self.start, args=(i,), daemon=True).start()
        else:
            leader = self.nodes[f"{STS}-0"]
            for i in range(count, len(self.nodes)):
                name = f"{STS}-{i}"
                self.checked.append((count, _holds(_status(leader), name)))
                victim = self.nodes.pop(name)
                threading.Thread(target=victim.stop, daemon=True).start()

    def stop(self) -> None:
        stop_all(list(self.nodes.values()))


@pytest.fixture()
def cluster() -> Iterator[tuple[Controller, FakeApi]]:
    etcd = Etcd(1)
    api = FakeApi(replicas=3)
    ctl = Controller(etcd, api)
    try:
        out = deploy(etcd, APP, "--scale-down-after", "2", wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        for i in range(3):
            ctl.start(i)
        leader = ctl.nodes[f"{STS}-0"]
        wait_for(lambda: len(_status(leader)["members"]) == 3 and leader.is_ready(), timeout=120)
        yield ctl, api
    finally:
        ctl.stop()
        api.server.shutdown()
        etcd.stop()


def _load(nodes: list[Node], rate: float, seconds: float) -> list[threading.Thread]:
    """Open-loop Poisson load, split over `nodes`' ingresses."""
    from slipstream import _core

    body = json.dumps({"inputs": {"x": [[1.0, 2.0]]}}).encode()
    threads = []
    for k, n in enumerate(nodes):
        cfg = {"url": f"{n.url}/v1/pipelines/slow/infer", "method": "POST", "body": list(body),
               "content_type": "application/json", "headers": [], "rates": [rate / len(nodes)],
               "duration_s": seconds, "warmup_s": 0.0, "arrival": {"kind": "poisson"}, "max_connections": 256,
               "timeout_s": 5.0, "threads": 1, "seed": 11 + k}
        t = threading.Thread(target=lambda c=cfg: _core.bench(json.dumps(c), quiet=True), daemon=True)
        t.start()
        threads.append(t)
    return threads


def test_the_leader_adds_a_node_when_the_cores_run_out_and_empties_it_before_removing_it(
        cluster: tuple[Controller, FakeApi]) -> None:
    ctl, api = cluster
    leader = ctl.nodes[f"{STS}-0"]
    newest = f"{STS}-3"
    t0 = time.monotonic()
    load = _load([leader, ctl.nodes[f"{STS}-1"]], rate=150.0, seconds=10.0)

    def model() -> dict[str, Any]:
        stage = _status(leader)["autoscale"]["stages"].get("slow/Slow") or {}
        return stage.get("model") or {}

    # The load's need outgrows the cores: the leader asks for a fourth node,
    # which joins and gets replicas.
    wait_for(lambda: model().get("need_uncapped", 0) > model().get("max_usable", 99), timeout=60, every=0.5)
    wait_for(lambda: api.replicas == 4, timeout=30, every=0.5)
    wait_for(lambda: newest in ctl.nodes and newest in _status(leader)["members"], timeout=60, every=0.5)
    wait_for(lambda: (_status(leader)["placement"]["stages"].get("slow/Slow") or {}).get(newest, 0) > 0,
             timeout=60, every=0.5)
    print(f"grown in {time.monotonic() - t0:.1f} s")
    patches = [(v, p, b) for v, p, b in api.calls if v == "PATCH"]
    assert patches[0] == ("PATCH", f"/apis/apps/v1/namespaces/{NS}/statefulsets/{STS}/scale",
                          {"spec": {"replicas": 4}}), patches
    for t in load:
        t.join(60)

    # The load gone: after the hysteresis the fourth is annotated, cordoned,
    # emptied, and only then the StatefulSet shrinks.
    t1 = time.monotonic()
    wait_for(lambda: api.replicas == 3, timeout=120, every=0.5)
    print(f"shrunk in {time.monotonic() - t1:.1f} s")
    verbs = [(v, p.rsplit("/", 1)[-1]) for v, p, _ in api.calls if v == "PATCH"]
    assert verbs == [("PATCH", "scale"), ("PATCH", newest), ("PATCH", "scale")], verbs
    assert ctl.checked == [(3, [])], ctl.checked  # the leaving node held nothing when the patch came
    assert newest in _status(leader)["cordoned"] or newest not in _status(leader)["members"]
    wait_for(lambda: newest not in _status(leader)["members"], timeout=30)
    # Every request the node took was answered: the others serve on.
    status, body = leader.infer("slow", x=[[1.0, 2.0]])
    assert status == 200, body
    said = [line.strip() for line in leader.lines if "node scaling:" in line]
    print("\n".join(said))
    assert any("3 -> 4 nodes" in s for s in said) and any("emptied; scaled to 3" in s for s in said), said


def test_a_node_waiting_for_a_deployment_is_live_and_says_why_it_is_not_ready() -> None:
    """What an orchestrator's probes see between installing the nodes and
    the first `slipstream deploy`: live (no restart loop), not ready, and
    the node then serves on the same port once deployed."""
    etcd = Etcd(1)
    node = None
    try:
        port = free_port()
        node = start_node(etcd, "early", "--port", str(port))
        assert node.url == f"http://127.0.0.1:{port}", node.log()
        status, _, body = node.request("GET", "/healthz")
        assert status == 200, body
        status, _, body = node.request("GET", "/readyz")
        assert status == 503 and "waiting for a deployment" in json.loads(body)["held_back"][0], body
        # A request that reaches it early is refused as unavailable (retry elsewhere), not "not implemented".
        status, body = node.infer("slow", x=[[1.0, 2.0]])
        assert status == 503 and body["status"] == "not ready", body
        out = deploy(etcd, APP, wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        wait_for(lambda: _ready(node), timeout=60)  # the node takes the port over from the probes
        status, body = node.infer("slow", x=[[1.0, 2.0]])
        assert status == 200 and body["outputs"]["y"] == [[2.0, 4.0]], body
    finally:
        if node is not None:
            node.stop()
        etcd.stop()


def _ready(node: Node) -> bool:
    """The readiness probe, once; a connection refused or reset (the port changing hands) is "not yet"."""
    try:
        return node.is_ready()
    except OSError:
        return False
