"""The object store through a running node: versions and as-of reads,
prefix listing, conditional puts from concurrent clients, triggers in
version order (with a failing one retried and recorded), affinity routing,
retention, and a model hot swap under load with no failed request."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import slipstream as ss
from slipstream.testing import Etcd, deploy, start_node

from tests.conftest import APPS, Node, wait_for


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = Node(str(APPS / "storeapp.py"), "--store", str(tmp_path_factory.mktemp("store")),
             env={"SCALE_LOAD_S": "1.0"})
    n.wait_ready(120)
    yield n
    n.stop()


@pytest.fixture()
def store(node: Node) -> ss.store.Store:
    return ss.store.Store(node.url)


def test_versions_as_of_and_listing(store: ss.store.Store) -> None:
    a = store.put("/t/doc/x", b"first")
    time.sleep(0.01)
    b = store.put("/t/doc/x", {"v": np.arange(6, dtype=np.float32).reshape(2, 3)})
    big = np.random.default_rng(0).integers(0, 255, 300_000, dtype=np.uint8).tobytes()
    c = store.put("/t/doc/x", big)
    assert (a.version, b.version, c.version) == (1, 2, 3)
    assert a.timestamp < b.timestamp < c.timestamp
    assert store.get("/t/doc/x", version=1).bytes() == b"first"
    np.testing.assert_array_equal(store.get("/t/doc/x", version=2).tensors()["v"],
                                  np.arange(6, dtype=np.float32).reshape(2, 3))
    latest = store.get("/t/doc/x")
    assert latest.version == 3 and latest.bytes() == big and latest.path is not None, "large values are mapped"
    assert store.get("/t/doc/x", as_of=(a.timestamp + b.timestamp) / 2).bytes() == b"first"
    with pytest.raises(ss.store.StoreNotFound):
        store.get("/t/doc/x", as_of=a.timestamp - 10)
    assert [v.version for v in store.versions("/t/doc/x")] == [1, 2, 3]
    store.put("/t/doc/y", "why")
    store.put("/t/other", "o")
    store.delete("/t/doc/y")
    assert [v.key for v in store.keys("/t/doc/")] == ["/t/doc/x"]
    with pytest.raises(ss.store.StoreNotFound):
        store.get("/t/doc/y")
    assert store.get("/t/doc/y", version=1).text() == "why"


def test_conditional_puts_from_concurrent_clients(node: Node) -> None:
    s = ss.store.Store(node.url)
    s.put("/t/counter", "0", if_version=0)
    with pytest.raises(ss.store.StoreConflict):
        s.put("/t/counter", "x", if_version=0)
    wins = []

    def worker() -> None:
        mine = ss.store.Store(node.url)
        for _ in range(15):
            while True:
                cur = mine.get("/t/counter")
                try:
                    mine.put("/t/counter", str(int(cur.text()) + 1), if_version=cur.version)
                    wins.append(1)
                    break
                except ss.store.StoreConflict:
                    continue

    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(worker) for _ in range(6)]:
            f.result()
    assert len(wins) == 90
    assert s.get("/t/counter").text() == "90"


def test_bad_input_is_refused_and_stores_nothing(node: Node) -> None:
    before = node.get("/v1/store")[1]["seq"]
    for path in ["/v1/store/objects/a//b", "/v1/store/objects/a/../b", "/v1/store/objects/a/%zz"]:
        status, _, _ = node.request("PUT", path, b"x")
        assert status == 400, path
    status, _, _ = node.request("PUT", "/v1/store/objects/t/q?if_version=-1", b"x")
    assert status == 400
    status, _, _ = node.request("PUT", "/v1/store/objects/t/q", b"SSTN junk",
                                headers={"Content-Type": "application/x-slipstream-tensors"})
    assert status == 400
    assert node.get("/v1/store")[1]["seq"] == before


def log_versions(store: ss.store.Store, name: str) -> list[str]:
    try:
        return [store.get(f"/log/{name}", version=v.version).text() for v in store.versions(f"/log/{name}")]
    except ss.store.StoreNotFound:
        return []


def test_triggers_fire_in_version_order(node: Node, store: ss.store.Store) -> None:
    # The log pool keeps 16 versions: stay under it.
    for i in range(12):
        store.put("/jobs/a", f"a{i}")
        store.put("/jobs/b", f"b{i}")
    store.delete("/jobs/a")
    wait_for(lambda: len(log_versions(store, "a")) == 13 and len(log_versions(store, "b")) == 12, timeout=60)
    a = log_versions(store, "a")
    assert a == [f"{i + 1} put a{i}" for i in range(12)] + ["13 delete "], a
    assert log_versions(store, "b") == [f"{i + 1} put b{i}" for i in range(12)]
    # trigger_put invokes without storing.
    assert store.trigger_put("/jobs/c", "c0") == 1
    wait_for(lambda: log_versions(store, "c") == ["0 trigger c0"], timeout=30)
    with pytest.raises(ss.store.StoreNotFound):
        store.get("/jobs/c")


def test_a_failing_trigger_is_retried_then_recorded(node: Node, store: ss.store.Store) -> None:
    store.put("/jobs/f", "fail")
    wait_for(lambda: store.keys("/_slipstream/failed-triggers/triggered/"), timeout=60)
    rec = json.loads(store.get(store.keys("/_slipstream/failed-triggers/triggered/")[0].key).bytes())
    assert rec["key"] == "/jobs/f" and rec["version"] == 1
    assert rec["error"]["kind"] == "component_error" and rec["component_failures"] == 5
    # The key's later versions still fire.
    store.put("/jobs/f", "fine")
    wait_for(lambda: log_versions(store, "f") == ["2 put fine"], timeout=30)
    stats = node.get("/v1/store")[1]["triggers"]
    assert stats["failed"] >= 1 and stats["retried"] >= 4
    _, _, metrics = node.request("GET", "/metrics")
    failed = [ln for ln in metrics.decode().splitlines() if ln.startswith('slipstream_store_triggers_total{outcome="failed"}')]
    assert failed and int(failed[0].split()[-1]) >= 1


def test_affinity_routes_a_group_to_the_replica_holding_it(node: Node, store: ss.store.Store) -> None:
    groups = ["g1", "g2", "g3", "g4"]
    for g in groups:
        for i in range(3):
            store.put(f"/corpus/{g}/{i}", f"{g}-{i}")
    pid_of: dict[str, set[int]] = {g: set() for g in groups}
    for r in range(8):
        for g in groups:
            status, out = node.infer("grouped", doc=[f"/corpus/{g}/{r % 3}"])
            assert status == 200, out
            assert out["outputs"]["members"] == [3]
            pid_of[g].add(out["outputs"]["pid"][0])
    assert all(len(p) == 1 for p in pid_of.values()), pid_of
    assert len(set().union(*pid_of.values())) == 2, "both replicas hold groups"
    # Each replica loaded each of its groups once.
    loaded: dict[int, int] = {}
    for g in groups:
        _, out = node.infer("grouped", doc=[f"/corpus/{g}/0"])
        loaded[out["outputs"]["pid"][0]] = out["outputs"]["loaded"][0]
    assert sum(loaded.values()) == 4, loaded


def test_retention_keeps_the_pools_count(store: ss.store.Store) -> None:
    for i in range(5):
        store.put("/corpus/r/x", f"{i}")
    assert [v.version for v in store.versions("/corpus/r/x")] == [4, 5]
    with pytest.raises(ss.store.StoreNotFound):
        store.get("/corpus/r/x", version=1)


def test_model_hot_swap_under_load_fails_no_request(node: Node, store: ss.store.Store) -> None:
    status, out = node.infer("scaled", x=[1.0])
    assert status == 200 and out["outputs"]["y"] == [2.0]
    first = out["outputs"]["version"][0]
    stop = threading.Event()
    per_client: list[list[tuple[int, float, int]]] = [[] for _ in range(3)]

    def client(mine: list[tuple[int, float, int]]) -> None:
        while not stop.is_set():
            status, out = node.infer("scaled", x=[1.0])
            ok = status == 200
            mine.append((status, out["outputs"]["y"][0] if ok else -1.0, out["outputs"]["version"][0] if ok else -1))

    threads = [threading.Thread(target=client, args=(mine,)) for mine in per_client]
    for t in threads:
        t.start()
    time.sleep(0.5)
    new = store.put("/models/scale", "3")
    # The replica loads the new version beside the old (1 s), then switches.
    wait_for(lambda: all(any(v == new.version for _, _, v in mine) for mine in per_client), timeout=30)
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    results = [r for mine in per_client for r in mine]
    statuses = [s for s, _, _ in results]
    assert statuses and all(s == 200 for s in statuses), f"failed: {[s for s in statuses if s != 200]}"
    assert {first, new.version} <= {v for _, _, v in results}
    # Each client's requests are sequential: old answers, then new ones, never back.
    for mine in per_client:
        versions = [v for _, _, v in mine]
        assert versions == sorted(versions), "a client saw the old model after the new one"
    assert all(y == (2.0 if v == first else 3.0) for _, y, v in results)
    # The update's gate: on one machine every version the node has is held everywhere it runs.
    gate = node.get(f"/v1/store/rollout/models/scale?version={new.version}")[1]
    assert gate == {"key": "/models/scale", "version": new.version, "held_everywhere": True, "waiting_for": []}
    for query, status in (("", 400), ("?version=x", 400), (f"?version={new.version + 99}", 404),
                          (f"?version={new.version}&timeout_ms=999999", 400)):
        assert node.request("GET", f"/v1/store/rollout/models/scale{query}")[0] == status, query


def test_a_temporary_store_goes_with_its_node_and_strays_are_swept() -> None:
    # A store left by a killed node (no such process), and one of a live one.
    tmp = Path(tempfile.gettempdir())
    dead_pid = next(p for p in range(4_000_000, 4_100_000) if not Path(f"/proc/{p}").exists())
    stray, alive = tmp / f"slipstream-store-{dead_pid}", tmp / f"slipstream-store-{os.getpid()}"
    for d in (stray, alive):
        (d / "blobs").mkdir(parents=True, exist_ok=True)
    try:
        n = Node(str(APPS / "storeapp.py"))
        try:
            n.wait_ready(120)
            path = Path(n.get("/v1/store")[1]["path"])
            assert path.is_dir() and path.name == f"slipstream-store-{n.proc.pid}"
            assert not stray.exists(), "a dead node's temporary store is swept"
            assert alive.exists(), "a live process's is not"
        finally:
            n.stop()
        assert not path.exists(), "the node removes its temporary store at exit"
    finally:
        for d in (stray, alive):
            shutil.rmtree(d, ignore_errors=True)


def test_http_refuses_writes_to_the_nodes_own_records(node: Node) -> None:
    """`/_slipstream/...` holds the node's records (failed triggers): a put or
    a trigger there is a 400 over HTTP as in the Python client, and writes
    nothing; reading and deleting stay open."""
    for method, path in (("PUT", "/v1/store/objects/_slipstream/failed-triggers/x/1"),
                         ("PUT", "/v1/store/objects/_slipstream"),
                         ("POST", "/v1/store/trigger/_slipstream/x")):
        status, headers, raw = node.request(method, path, b"{}", headers={"Content-Type": "application/json"})
        assert status == 400, (method, path, status, raw)
        assert b"node's own records" in raw
    for key in ("/_slipstream/failed-triggers/x/1", "/_slipstream"):
        assert node.request("GET", "/v1/store/objects" + key)[0] == 404, key
    # A key that only starts with the same letters is the user's.
    status, _, raw = node.request("PUT", "/v1/store/objects/_slipstreamish/a", b"1",
                                  headers={"Content-Type": "application/json"})
    assert status == 201, raw


def test_a_store_written_outside_a_cluster_is_refused_at_join(tmp_path: Path) -> None:
    """A node's store that took writes on its own (`slipstream serve
    --store DIR`) cannot join a cluster: its versions are not in etcd. The
    node says so and exits, its store untouched."""
    store_dir = tmp_path / "store"
    with Node(str(APPS / "chain.py"), "--store", str(store_dir)) as alone:
        ss.store.Store(alone.url).put("/mine/doc", b"written alone")
    etcd = Etcd(1)
    try:
        out = deploy(etcd, APPS / "cluster_store.py", wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        n = start_node(etcd, "x", "--store", str(store_dir))
        assert n.proc.wait(60) != 0, n.log()
        assert "holds 1 key(s) written outside a cluster (e.g. /mine/doc)" in n.log(), n.log()
    finally:
        etcd.stop()
    with Node(str(APPS / "chain.py"), "--store", str(store_dir)) as again:
        assert ss.store.Store(again.url).get("/mine/doc").bytes() == b"written alone"
