"""The cluster token rotated without downtime, on a real etcd and two real
nodes under load (each running a replica of the one stage: what is tested is
the token change, not a singleton's failover, which test_cluster.py and
test_image.py cover): three rolling restarts (accept the new token; sign with
it, accepting the old; then the new alone) with `slipstream reseal`
between the second and the third. Every request sent meanwhile is answered
correctly; afterwards every record in etcd is signed with the new token
only, and a node holding only the old one is refused."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from slipstream._internal.cluster_cli import Etcd as EtcdClient
from slipstream._internal.cluster_cli import signed_by
from slipstream._internal.reseal import KINDS
from slipstream.testing import CLI, Etcd, deploy, start_node, stop_all

from tests.conftest import APPS, Node, wait_for

APP = str(APPS / "rotate.py")
OLD, NEW = "token-before-rotation", "token-after-rotation"


def ready(n: Node, members: int) -> bool:
    return n.request("GET", "/readyz")[0] == 200 and len(n.status()["cluster"]["members"]) == members


def settled(nodes: dict[str, Node]) -> bool:
    """Every node applies the same placement, and it gives each node a
    replica of the stage (so either serves it alone)."""
    views = [n.status()["cluster"] for n in nodes.values()]
    if not all(v["placement"] for v in views) or len({v["placement"]["epoch"] for v in views}) != 1:
        return False
    return all(set(per_node) == set(nodes) for per_node in views[0]["placement"]["stages"].values())


def wait_ready(nodes: dict[str, Node], name: str) -> None:
    try:
        wait_for(lambda: ready(nodes[name], len(nodes)), timeout=90)
        wait_for(lambda: settled(nodes) and all(ready(n, len(nodes)) for n in nodes.values()), timeout=60)
    except AssertionError:
        logs = "\n".join(f"--- {k} ---\n{n.log()[-2500:]}" for k, n in nodes.items())
        raise AssertionError(f"{name} did not become ready:\n{logs}") from None


class Load:
    """Requests, one after the other, to whichever node is not being restarted."""

    def __init__(self, nodes: dict[str, Node]) -> None:
        self.nodes = nodes
        self.avoid: str | None = None
        self.sent = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            name = next(n for n in sorted(self.nodes) if n != self.avoid)
            i += 1
            try:
                status, body = self.nodes[name].infer("chain", x=[[float(i), 1.0]])
            except OSError as e:
                if "refused" in str(e):  # picked just as the node closed: nothing sent, as a balancer retries
                    continue
                self.failures.append(f"{name}: {e}")
                continue
            self.sent += 1
            if status != 200 or body["outputs"]["y"] != [[2.0 * i + 1.0, 3.0]]:
                self.failures.append(f"{name}: {status} {str(body)[:200]}")


@pytest.fixture()
def etcd() -> Iterator[Etcd]:
    e = Etcd(1)
    yield e
    e.stop()


def test_a_token_is_rotated_by_three_rolling_restarts_failing_no_request(etcd: Etcd) -> None:
    out = deploy(etcd, APP, token=OLD, wait=0)
    assert out.returncode == 0, out.stdout + out.stderr
    nodes = {name: start_node(etcd, name, token=OLD) for name in ("n1", "n2")}
    load: Load | None = None
    try:
        for name in nodes:
            wait_ready(nodes, name)
        load = Load(nodes)
        phases = [("accept the new token", OLD, [NEW]), ("sign with the new token", NEW, [OLD]),
                  ("drop the old token", NEW, [])]
        for step, (what, token, accept) in enumerate(phases):
            if step == 2:
                r = __import__("subprocess").run(
                    [*CLI, "reseal", "--cluster", etcd.url, "--token", NEW, "--accept-token", OLD],
                    capture_output=True, text=True, timeout=60)
                assert r.returncode == 0 and "re-signed" in r.stdout, r.stdout + r.stderr
            for name in sorted(nodes):
                load.avoid = name
                # As a balancer's endpoints catch up before the stop (the
                # chart's preStop): requests already headed there finish first.
                sent = load.sent
                wait_for(lambda sent=sent: load is not None and load.sent >= sent + 2, timeout=30)
                nodes[name].stop()
                extra = [a for t in accept for a in ("--accept-token", t)]
                nodes[name] = start_node(etcd, name, *extra, token=token)
                wait_ready(nodes, name)
                load.avoid = None
            assert not load.failures, (what, load.failures[:5])
        load.stop.set()
        load.thread.join(30)
        assert not load.failures, load.failures[:5]
        print(f"{load.sent} requests across 6 restarts, all answered correctly")
        # Everything etcd holds for the cluster is signed with the new token alone.
        client = EtcdClient(etcd.url)
        records = [json.loads(v) for k, v, _ in client.records("/slipstream/default/")
                   if v.startswith(b"{") and set(json.loads(v)) == {"body", "sig"}]
        assert records
        for env in records:
            assert any(signed_by(NEW, kind, env) for kind in KINDS), env
            assert not any(signed_by(OLD, kind, env) for kind in KINDS), env
        # A node with only the old token cannot read the deployment.
        stale = start_node(etcd, "n3", token=OLD)
        assert stale.proc.wait(30) != 0
        assert "not signed with this cluster token" in stale.log()
    finally:
        if load is not None:
            load.stop.set()
        stop_all(nodes.values())
