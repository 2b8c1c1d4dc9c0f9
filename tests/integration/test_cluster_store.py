"""One object store across a cluster, on a real etcd and three real nodes:
a put through one node is read through another (the bytes fetched from a
holder and checked by digest), conditional puts from all three nodes
increment one counter exactly, versions and reads by time agree on every
node, and a value with two copies survives a holder killed with SIGKILL.
The promise tested is the one docs/design/store.md states."""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import slipstream as ss
from slipstream.testing import Etcd, deploy, start_node

from tests.conftest import APPS, Node, wait_for

CLUSTER_APP = str(APPS / "cluster.py")
NAMES = ("n1", "n2", "n3")


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Node]]:
    etcd = Etcd(1)
    nodes: dict[str, Node] = {}
    try:
        out = deploy(etcd, CLUSTER_APP, wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        nodes.update({name: start_node(etcd, name) for name in NAMES})
        for n in nodes.values():
            wait_for(lambda n=n: n.is_ready() and len(n.status()["cluster"]["members"]) == 3, timeout=90)
        yield nodes
    finally:
        for n in nodes.values():
            n.stop()
        etcd.stop()


def store(n: Node) -> Any:
    return ss.store.Store(n.url)


def store_status(n: Node) -> dict[str, Any]:
    s: dict[str, Any] = n.status()["cluster"]["store"]
    return s


def test_a_put_through_one_node_is_read_through_the_others(cluster: dict[str, Node]) -> None:
    a, b, c = (store(cluster[n]) for n in NAMES)
    small = a.put("/cs/doc/1", b"hello cluster")
    big = np.random.default_rng(1).integers(0, 255, size=1 << 20, dtype=np.uint8).tobytes()
    large = a.put("/cs/blob/1", big)
    for s in (a, b, c):
        assert s.get("/cs/doc/1").bytes() == b"hello cluster"
        got = s.get("/cs/blob/1")
        assert got.version == large.version == 1
        assert hashlib.sha256(got.bytes()).digest() == hashlib.sha256(big).digest()
    meta = c.meta("/cs/blob/1")
    assert meta.timestamp == large.timestamp and small.version == 1
    # Two copies (RF 2) on two of the three nodes, named in the record.
    raw = cluster["n3"].get("/v1/store/objects/cs/blob/1?meta=1")[1]
    assert len(raw["holders"]) == 2 and set(raw["holders"]) <= set(NAMES), raw
    assert raw["digest"] == hashlib.sha256(big).hexdigest()
    # The node that holds no copy fetched one (and keeps it: a second read fetches nothing).
    outsider = next(n for n in NAMES if n not in raw["holders"])
    fetched = store_status(cluster[outsider])["fetches"]
    assert fetched >= 1
    store(cluster[outsider]).get("/cs/blob/1")
    assert store_status(cluster[outsider])["fetches"] == fetched


def test_versions_deletes_and_reads_by_time_agree_on_every_node(cluster: dict[str, Node]) -> None:
    a, b, c = (store(cluster[n]) for n in NAMES)
    v1 = a.put("/cs/doc/t", b"one")
    time.sleep(0.01)
    v2 = b.put("/cs/doc/t", b"two")
    time.sleep(0.01)
    v3 = c.delete("/cs/doc/t")
    assert (v1.version, v2.version, v3.version) == (1, 2, 3) and v3.deleted
    assert v1.timestamp < v2.timestamp < v3.timestamp
    between = (v1.timestamp + v2.timestamp) / 2
    for s in (a, b, c):
        assert [v.version for v in s.versions("/cs/doc/t")] == [1, 2, 3]
        assert s.get("/cs/doc/t", as_of=between).bytes() == b"one"
        assert s.get("/cs/doc/t", version=2).bytes() == b"two"
        with pytest.raises(ss.StoreNotFound):
            s.get("/cs/doc/t")
    # A conditional put names the version it read: stale through any node is a conflict.
    with pytest.raises(ss.StoreConflict):
        a.put("/cs/doc/t", b"late", if_version=2)
    assert c.put("/cs/doc/t", b"four", if_version=3).version == 4


def test_conditional_puts_from_three_nodes_increment_one_counter_exactly(cluster: dict[str, Node]) -> None:
    key, per_node = "/cs/counter", 15
    store(cluster["n1"]).put(key, b"0")
    conflicts = [0, 0, 0]
    errors: list[BaseException] = []

    def bump(i: int, n: Node) -> None:
        s = store(n)
        try:
            for _ in range(per_node):
                while True:
                    cur = s.get(key)
                    try:
                        s.put(key, str(int(cur.bytes()) + 1).encode(), if_version=cur.version)
                        break
                    except ss.StoreConflict:
                        conflicts[i] += 1
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=bump, args=(i, cluster[n])) for i, n in enumerate(NAMES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for n in NAMES:
        got = store(cluster[n]).get(key)
        assert int(got.bytes()) == 3 * per_node and got.version == 1 + 3 * per_node
    print(f"conflicts retried per node: {conflicts}")


def test_a_value_with_two_copies_survives_a_killed_holder(cluster: dict[str, Node]) -> None:
    value = np.random.default_rng(2).integers(0, 255, size=300_000, dtype=np.uint8).tobytes()
    # Put through a node, learn who holds it, kill one holder, read through the node holding no copy.
    put_via = cluster["n1"]
    store(put_via).put("/cs/model/w", value)
    holders = put_via.get("/v1/store/objects/cs/model/w?meta=1")[1]["holders"]
    victim = holders[0]
    reader = next(n for n in NAMES if n not in holders)
    assert store_status(cluster[reader])["fetches"] >= 0
    cluster[victim].stop(signal.SIGKILL)
    got = store(cluster[reader]).get("/cs/model/w")
    assert got.bytes() == value
    # Puts go on with the survivors once the dead node's lease expires.
    survivors = [n for n in NAMES if n != victim]
    wait_for(lambda: len(cluster[survivors[0]].status()["cluster"]["members"]) == 2, timeout=20)
    v = store(cluster[survivors[0]]).put("/cs/model/w", b"after")
    assert store(cluster[survivors[1]]).get("/cs/model/w").bytes() == b"after" and v.version == 2
