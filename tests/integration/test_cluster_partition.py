"""A network partition between nodes, made for real: one node runs in its
own network namespace, and a blackhole route cuts it off (established
connections go silent; nothing is refused). No request may hang: each is
answered by its deadline, the cut-off node leaves the placement when its
lease expires, and once the partition heals it rejoins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import slipstream as ss
from slipstream.testing import Etcd, deploy, start_node

from tests.conftest import APPS, Node, wait_for

CLUSTER_APP = str(APPS / "cluster.py")
SLO_S = 2.0  # tests/apps/cluster.py


class Netns:
    """A network namespace joined to this one by a veth pair: this side is
    `host_ip`, the namespace's side `ns_ip`. `partition()` drops every packet
    between them (a blackhole route: established connections go silent, as
    in a real partition); `heal()` undoes it."""

    def __init__(self) -> None:
        k = os.getpid() % 200 + 20
        self.name = f"ssp{os.getpid()}"
        self.host_if, self.ns_if = f"sh{os.getpid()}"[:15], f"sn{os.getpid()}"[:15]
        self.host_ip, self.ns_ip = f"10.{k}.77.1", f"10.{k}.77.2"
        run = self.run
        run("ip", "netns", "add", self.name)
        try:
            run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            run("ip", "link", "set", self.ns_if, "netns", self.name)
            run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            run("ip", "link", "set", self.host_if, "up")
            for cmd in (["ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if],
                        ["ip", "link", "set", self.ns_if, "up"], ["ip", "link", "set", "lo", "up"]):
                run(*self.wrap, *cmd)
        except Exception:
            self.close()
            raise
        self.partitioned = False

    @property
    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    @staticmethod
    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, timeout=10)

    def partition(self) -> None:
        self.run("ip", "route", "add", "blackhole", f"{self.ns_ip}/32")
        self.partitioned = True

    def heal(self) -> None:
        if self.partitioned:
            self.run("ip", "route", "del", "blackhole", f"{self.ns_ip}/32")
            self.partitioned = False

    def close(self) -> None:
        for cmd in (["ip", "route", "del", "blackhole", f"{self.ns_ip}/32"], ["ip", "link", "del", self.host_if],
                    ["ip", "netns", "del", self.name]):
            subprocess.run(cmd, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def netns() -> Iterator[Netns]:
    try:
        ns = Netns()
    except Exception as e:  # noqa: BLE001 (any failure to make one means: not here)
        pytest.skip(f"cannot make a network namespace here (needs root and CAP_NET_ADMIN): {e}")
    yield ns
    ns.close()


@contextmanager
def cluster_across(netns: Netns) -> Iterator[dict[str, Node]]:
    """etcd and nodes n1, n2 on this side and n3 in the namespace, running
    the cluster app; stopped (and the partition healed) on exit."""
    etcd = Etcd(1, host=netns.host_ip)
    nodes: dict[str, Node] = {}
    try:
        out = deploy(etcd, CLUSTER_APP, wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        data = ("--data-listen", f"{netns.host_ip}:0")
        nodes["n1"] = start_node(etcd, "n1", *data)
        nodes["n2"] = start_node(etcd, "n2", *data)
        nodes["n3"] = start_node(etcd, "n3", "--data-listen", f"{netns.ns_ip}:0", wrap=netns.wrap)
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()
        etcd.stop()
        netns.heal()


def test_a_partition_leaves_no_request_hanging_and_heals(netns: Netns) -> None:
    with cluster_across(netns) as nodes:
        n1 = nodes["n1"]
        wait_for(lambda: len(n1.status()["cluster"]["members"]) == 3 and n1.request("GET", "/readyz")[0] == 200,
                 timeout=60)
        wait_for(lambda: "n3" in json.dumps(n1.status()["cluster"]["placement"]), timeout=30)

        results: list[tuple[float, float, int]] = []  # (sent, took, status)
        stop = threading.Event()

        def load(k: int) -> None:
            i = k
            while not stop.is_set():
                n = (nodes["n1"], nodes["n2"])[i % 2]
                t0 = time.monotonic()
                try:
                    status, _ = n.infer("diamond", x=[[float(i % 9), 2.0]])
                except OSError:
                    status = -1
                results.append((t0, time.monotonic() - t0, status))
                i += 4
                time.sleep(0.01)

        threads = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        cut = time.monotonic()
        netns.partition()
        wait_for(lambda: "n3" not in n1.status()["cluster"]["members"], timeout=30)
        wait_for(lambda: "n3" not in json.dumps(n1.status()["cluster"]["placement"]), timeout=30)
        time.sleep(3.0)
        stop.set()
        for t in threads:
            t.join(30)
        after = [r for r in results if r[0] >= cut]
        assert len(after) > 50, len(after)
        # Nothing hangs: every request is answered by its deadline (plus the
        # answer's own way back), whatever happened to it.
        slowest = max(took for _, took, _ in after)
        assert slowest < SLO_S + 1.0, slowest
        statuses: Counter[int] = Counter(s for _, _, s in after)
        assert set(statuses) <= {200, 503, 504}, statuses
        # Once the placement left n3 out, everything is answered.
        late = [s for _, _, s in after[-40:]]
        assert late and all(s == 200 for s in late), (statuses, late)
        # Healed: n3 finds its lease gone, joins again and gets work back.
        netns.heal()
        wait_for(lambda: "n3" in n1.status()["cluster"]["members"], timeout=30)
        wait_for(lambda: "n3" in json.dumps(n1.status()["cluster"]["placement"]), timeout=30)
        wait_for(lambda: n1.status()["cluster"]["members"]["n3"]["ready"], timeout=60)
        status, body = n1.infer("diamond", x=[[4.0, 2.0]])
        assert status == 200, body


def _store_call_in(netns: Netns, url: str, code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` (with `s`, an ss.store.Store on `url`) inside the namespace:
    the partitioned node's own loopback is reachable only from there."""
    prog = f"import sys, slipstream as ss\ns = ss.store.Store({url!r}, timeout=20)\n{code}"
    return subprocess.run([*netns.wrap, sys.executable, "-c", prog], capture_output=True, text=True, timeout=60)


def test_a_partitioned_node_cannot_commit_and_catches_up_when_healed(netns: Netns) -> None:
    """No split brain: a node cut off from etcd refuses writes (503) rather
    than fork a key's history, while the others commit; healed, it applies
    what they committed."""
    with cluster_across(netns) as nodes:
        n1 = nodes["n1"]
        wait_for(lambda: len(n1.status()["cluster"]["members"]) == 3 and n1.is_ready(), timeout=60)
        first = ss.store.Store(n1.url).put("/p/key", b"before")
        assert first.version == 1
        n3_url = nodes["n3"].url
        seen = _store_call_in(netns, n3_url, "print(s.get('/p/key').bytes().decode())")
        assert seen.stdout.strip() == "before", seen.stderr
        netns.partition()
        refused = _store_call_in(netns, n3_url, """
try:
    s.put('/p/key', b'from the cut-off node', if_version=1)
except ss.StoreUnavailable as e:
    print('refused:', e)
    sys.exit(0)
sys.exit(3)
""")
        assert refused.returncode == 0, (refused.stdout, refused.stderr)
        # It still serves what it holds, marked as possibly stale.
        stale = _store_call_in(netns, n3_url, f"""
import urllib.request
with urllib.request.urlopen({n3_url!r} + '/v1/store/objects/p/key', timeout=20) as r:
    print(r.read().decode(), '|', r.headers.get('x-slipstream-stale'))
""")
        assert stale.stdout.strip() == "before | etcd unreachable from this node", (stale.stdout, stale.stderr)
        assert ss.store.Store(n1.url).put("/p/key", b"after", if_version=1).version == 2
        netns.heal()
        wait_for(lambda: "n3" in n1.status()["cluster"]["members"], timeout=30)
        healed = _store_call_in(netns, n3_url, "o = s.get('/p/key'); print(o.version, o.bytes().decode())")
        assert healed.stdout.strip() == "2 after", (healed.stdout, healed.stderr)
        history = [v.version for v in ss.store.Store(n1.url).versions("/p/key")]
        assert history == [1, 2], history
