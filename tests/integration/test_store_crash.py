"""The object store's durability promise (docs/design/store.md), tested on
a real node that is killed with SIGKILL in the middle of its writes:

- a put is acknowledged (201) only once it is durable: every acknowledged
  put, and every version a reader has seen, is there after a restart, with
  its bytes;
- no torn or partial version is ever visible: every value the store serves
  is one a client sent for that key, whole (each value carries the sha256
  of its body, and the test remembers what it sent);
- version numbers are consecutive and never reused, retention keeps what
  it says, and the directory holds nothing else: no files left in `tmp/`,
  and `blobs/` holds exactly the files the versions name.

`slipstream serve` runs the node inside the Python process (`_core.serve`),
so SIGKILL to that process is a crash of the node; its workers die with it.
STORE_CRASH_CYCLES (default 8) sets how many kill/restart cycles run and
STORE_CRASH_SEED fixes the random schedule (the seed is in every failure).

Also: conditional puts (`if_version`) under concurrent writers, refused bad
input that leaves the store unchanged, and write authorisation on a
non-loopback listener.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import random
import signal
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import APPS, Node

APP = str(APPS / "store.py")
CYCLES = int(os.environ.get("STORE_CRASH_CYCLES", "8"))
SEED = int(os.environ.get("STORE_CRASH_SEED", str(random.SystemRandom().randrange(1 << 30))))

MAGIC = b"SSCK"
HEAD = struct.Struct("<4sQ32s")  # magic, nonce, sha256(body)
SMALL_KEYS = [f"/crash/s/{i}" for i in range(6)]  # root pool: 16 versions kept
LARGE_KEYS = [f"/crash/l/{i}" for i in range(3)]  # root pool, blob files
FEW_KEYS = [f"/crash/few/{i}" for i in range(3)]  # a pool keeping 3 versions (tests/apps/store.py)
ALL_KEYS = SMALL_KEYS + LARGE_KEYS + FEW_KEYS
DELETED = "deleted"
# What the errors of a connection to a node that was just killed look like.
GONE = (ConnectionError, http.client.HTTPException, OSError)


def keep_of(key: str) -> int:
    return 3 if key.startswith("/crash/few/") else 16


def body_of(key: str, nonce: int, size: int) -> bytes:
    return random.Random(f"{key}|{nonce}").randbytes(size)


def value_of(key: str, nonce: int, size: int) -> bytes:
    body = body_of(key, nonce, size)
    return HEAD.pack(MAGIC, nonce, hashlib.sha256(body).digest()) + body


def whole(value: bytes) -> int | None:
    """The value's nonce if it is whole (its body matches its embedded hash), else None."""
    if len(value) < HEAD.size:
        return None
    magic, nonce, digest = HEAD.unpack_from(value)
    if magic != MAGIC or hashlib.sha256(memoryview(value)[HEAD.size:]).digest() != digest:
        return None
    return int(nonce)


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


class Conn:
    """One keep-alive HTTP connection (a writer's or reader's own)."""

    def __init__(self, url: str, timeout: float = 30.0):
        host, port = url.removeprefix("http://").split(":")
        self.c = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def req(self, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        self.c.request(method, path, body=body, headers=headers or {})
        r = self.c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()

    def close(self) -> None:
        self.c.close()


@dataclass
class Books:
    """What the test knows, across every cycle."""

    # (key, version) -> sha256 of the value, or DELETED: acknowledged writes
    # and versions a reader was shown (both must survive any crash).
    durable: dict[tuple[str, int], str] = field(default_factory=dict)
    # (key, nonce) -> sha256 of the value: every put ever sent, acknowledged or not.
    sent: dict[tuple[str, int], str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    # Reads that failed on a version retention removed meanwhile.
    races: list[str] = field(default_factory=list)
    acks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def commit(self, key: str, version: int, digest: str, what: str) -> None:
        with self.lock:
            old = self.durable.get((key, version))
            if old is not None and old != digest:
                self.violations.append(f"{what}: {key} version {version} is {digest[:12]}, it was {old[:12]} before")
            self.durable[(key, version)] = digest

    def violation(self, msg: str) -> None:
        with self.lock:
            self.violations.append(msg)


def writer(url: str, books: Books, rng: random.Random, keys: list[str], sizes: list[tuple[int, int]],
           stop: threading.Event, deletes: float = 0.0) -> None:
    conn = Conn(url)
    try:
        while not stop.is_set():
            key = rng.choice(keys)
            if rng.random() < deletes:
                status, _, raw = conn.req("DELETE", "/v1/store/objects" + key)
                if status == 200:
                    out = json.loads(raw)
                    books.commit(key, out["version"], DELETED, "acknowledged delete")
                    with books.lock:
                        books.acks += 1
                elif status != 404:
                    books.violation(f"DELETE {key}: {status} {raw[:300]!r}")
                continue
            nonce = rng.getrandbits(63)
            lo, hi = rng.choice(sizes)
            value = value_of(key, nonce, rng.randint(lo, hi))
            digest = sha(value)
            with books.lock:
                books.sent[(key, nonce)] = digest
            status, _, raw = conn.req("PUT", "/v1/store/objects" + key, value,
                                      {"Content-Type": "application/octet-stream"})
            if status != 201:
                books.violation(f"PUT {key} ({len(value)} bytes): {status} {raw[:300]!r}")
                continue
            out = json.loads(raw)
            if out["size"] != len(value) or out["key"] != key:
                books.violation(f"PUT {key}: acknowledged as {out}")
            books.commit(key, out["version"], digest, "acknowledged put")
            with books.lock:
                books.acks += 1
    except GONE:
        pass  # the node was killed
    finally:
        conn.close()


def reader(url: str, books: Books, rng: random.Random, stop: threading.Event) -> None:
    """Reads while the writers write: a version is served whole or not at all."""
    conn = Conn(url)
    try:
        while not stop.is_set():
            key = rng.choice(ALL_KEYS)
            status, _, raw = conn.req("GET", "/v1/store/versions" + key)
            if status == 404:
                continue
            if status != 200:
                books.violation(f"GET versions {key}: {status} {raw[:300]!r}")
                continue
            listed = [v for v in json.loads(raw)["versions"] if not v["deleted"]]
            if not listed:
                continue
            # The oldest retained version is the one retention removes next.
            v = listed[0] if rng.random() < 0.5 else rng.choice(listed)
            status, headers, value = conn.req("GET", f"/v1/store/objects{key}?version={v['version']}")
            if status == 404:
                continue  # removed by retention since the listing
            if status != 200 or len(value) != v["size"] or whole(value) is None:
                # A read that raced retention is test_reads_racing_retention_...'s business:
                # here only a version that is still there must be served whole.
                what = f"GET {key} version {v['version']} while writing: {status}, {len(value)} bytes {value[:200]!r}"
                status2, _, raw = conn.req("GET", "/v1/store/versions" + key)
                if status2 == 200 and v["version"] not in [x["version"] for x in json.loads(raw)["versions"]]:
                    with books.lock:
                        books.races.append(what)
                    continue
                books.violation(what)
                continue
            check_served(books, key, v["version"], headers, value, "read while writing")
    except GONE:
        pass
    finally:
        conn.close()


def check_served(books: Books, key: str, version: int, headers: dict[str, str], value: bytes, what: str) -> None:
    if int(headers.get("x-slipstream-version", -1)) != version:
        books.violation(f"{what}: {key} version {version} answered as version {headers.get('x-slipstream-version')}")
    nonce = whole(value)
    if nonce is None:
        books.violation(f"{what}: {key} version {version} is torn or not ours ({len(value)} bytes)")
        return
    digest = sha(value)
    with books.lock:
        sent = books.sent.get((key, nonce))
    if sent != digest:
        books.violation(f"{what}: {key} version {version} holds a value never sent for {key}")
        return
    books.commit(key, version, digest, what)


def json_of(conn: Conn, path: str) -> tuple[int, Any]:
    status, _, raw = conn.req("GET", path)
    return status, json.loads(raw)


def verify(node: Node, store: Path, books: Books, cycle: int) -> None:
    """Everything the promise says, on a node just restarted on `store` (no writes running)."""
    conn = Conn(node.url)
    referenced: set[str] = set()
    live, versions_total = 0, 0
    try:
        for key in ALL_KEYS:
            with books.lock:
                mine = {v: d for (k, v), d in books.durable.items() if k == key}
            status, out = json_of(conn, "/v1/store/versions" + key)
            if status == 404:
                assert not mine, f"cycle {cycle}: {key} is gone, but versions {sorted(mine)} were acknowledged"
                continue
            assert status == 200, out
            listed = out["versions"]
            nums = [v["version"] for v in listed]
            latest = nums[-1]
            assert nums == list(range(nums[0], latest + 1)), f"cycle {cycle}: {key} has versions {nums}"
            assert len(nums) == min(latest, keep_of(key)), f"cycle {cycle}: {key} keeps {nums} (keep {keep_of(key)})"
            ts = [v["timestamp"] for v in listed]
            assert all(a < b for a, b in zip(ts, ts[1:], strict=False)), f"cycle {cycle}: {key} timestamps {ts}"
            # An acknowledged version at or above the first retained is listed (they are consecutive):
            # its bytes are compared below.
            if mine:
                assert max(mine) <= latest, f"cycle {cycle}: {key} acknowledged {max(mine)}, latest is {latest}"
            versions_total += len(listed)
            live += not listed[-1]["deleted"]
            for meta in listed:
                v = meta["version"]
                if meta["deleted"]:
                    assert mine.get(v, DELETED) == DELETED, f"cycle {cycle}: {key} version {v} became a tombstone"
                    books.commit(key, v, DELETED, "tombstone after restart")
                    continue
                status, headers, value = conn.req("GET", f"/v1/store/objects{key}?version={v}")
                assert status == 200, (key, v, status, value[:300])
                assert len(value) == meta["size"], f"cycle {cycle}: {key} version {v}: {len(value)} != {meta['size']}"
                check_served(books, key, v, headers, value, f"cycle {cycle} after restart")
                status, m = json_of(conn, f"/v1/store/objects{key}?meta=1&version={v}")
                assert status == 200, m
                if m["path"] is not None:
                    referenced.add(os.path.basename(m["path"]))
                    assert Path(m["path"]).parent == store / "blobs", m
                    assert os.path.getsize(m["path"]) == meta["size"], m
        status, st = json_of(conn, "/v1/store")
        assert status == 200, st
        assert (st["keys"], st["versions"]) == (live, versions_total), f"cycle {cycle}: totals {st}"
    finally:
        conn.close()
    assert not books.violations, f"seed {SEED}, cycle {cycle}:\n" + "\n".join(books.violations[:20])
    assert sorted(os.listdir(store / "tmp")) == [], f"cycle {cycle}: files left in tmp/"
    blobs = set(os.listdir(store / "blobs"))
    assert blobs == referenced, (f"cycle {cycle}: blobs/ holds {len(blobs)} files, the versions name "
                                 f"{len(referenced)}: unnamed {sorted(blobs - referenced)[:5]}, "
                                 f"missing {sorted(referenced - blobs)[:5]}")


def start(store: Path) -> Node:
    return Node(APP, "--store", str(store), env={"SLIPSTREAM_STORE": ""})


def test_acknowledged_puts_survive_sigkill_and_nothing_torn_is_visible(tmp_path: Path) -> None:
    store = tmp_path / "store"
    books = Books()
    rng = random.Random(SEED)
    small = [(100, 4096)]
    large = [(200 << 10, 3 << 20), (60 << 10, 70 << 10)]  # blob files, and sizes around the inline limit
    per_cycle: list[int] = []
    left_in_tmp = 0
    for cycle in range(CYCLES):
        node = start(store)
        try:
            verify(node, store, books, cycle)
            stop = threading.Event()
            threads = [
                *(threading.Thread(target=writer, args=(node.url, books, random.Random(rng.random()), SMALL_KEYS,
                                                        small, stop, 0.05)) for _ in range(3)),
                *(threading.Thread(target=writer, args=(node.url, books, random.Random(rng.random()), LARGE_KEYS,
                                                        large, stop)) for _ in range(2)),
                threading.Thread(target=writer, args=(node.url, books, random.Random(rng.random()), FEW_KEYS,
                                                      small + large, stop, 0.05)),
                *(threading.Thread(target=reader, args=(node.url, books, random.Random(rng.random()), stop))
                  for _ in range(2)),
            ]
            acks_before = books.acks
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.3, 1.5))
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(10)
            stop.set()
            for t in threads:
                t.join(30)
                assert not t.is_alive(), "a client hangs on a killed node"
            per_cycle.append(books.acks - acks_before)
            # What the crash left for the restart to sweep (evidence the kills land mid-write).
            left_in_tmp += len(os.listdir(store / "tmp"))
        finally:
            node.stop(signal.SIGKILL)
    node = start(store)
    try:
        verify(node, store, books, CYCLES)
        # And once more after a clean stop.
        assert node.stop(signal.SIGTERM, timeout=30) == 0, node.log()
        node = start(store)
        verify(node, store, books, CYCLES + 1)
    finally:
        node.stop()
    assert all(n > 0 for n in per_cycle), f"seed {SEED}: a cycle acknowledged nothing: {per_cycle}"
    print(f"seed {SEED}: {CYCLES} crashes, acknowledged writes per cycle {per_cycle}, "
          f"{len(books.durable)} versions checked, {left_in_tmp} half-written files swept, "
          f"{len(books.races)} reads raced retention")


# --- conditional puts, bad input, authorisation --------------------------------------------


@pytest.fixture(scope="module")
def store_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = Node(APP, "--store", str(tmp_path_factory.mktemp("store")), env={"SLIPSTREAM_STORE": ""})
    yield node
    node.stop()


def test_conditional_puts_under_concurrent_writers(store_node: Node) -> None:
    key, threads, each = "/cas/counter", 8, 25
    conn = Conn(store_node.url)
    assert conn.req("PUT", f"/v1/store/objects{key}?if_version=0", b"0")[0] == 201
    assert conn.req("PUT", f"/v1/store/objects{key}?if_version=0", b"0")[0] == 409
    conn.close()
    wins: list[int] = []
    errors: list[str] = []

    def incr() -> None:
        c = Conn(store_node.url)
        done = 0
        try:
            while done < each:
                status, headers, raw = c.req("GET", "/v1/store/objects" + key)
                assert status == 200, raw
                version = int(headers["x-slipstream-version"])
                status, headers, out = c.req("PUT", f"/v1/store/objects{key}?if_version={version}",
                                             str(int(raw) + 1).encode())
                if status == 201:
                    assert json.loads(out)["version"] == version + 1, out
                    done += 1
                elif status == 409:
                    err = json.loads(out)["error"]
                    if err["kind"] != "conflict" or headers.get("x-slipstream-error-kind") != "conflict":
                        errors.append(f"409 as {out!r}")
                    if "current" in err:
                        if not err["current"] > version:
                            errors.append(f"409 names current {err['current']}, expected > {version}")
                    elif f"expected version {version}" not in err["message"]:
                        errors.append(f"409 message {err['message']!r}")
                else:
                    errors.append(f"{status} {out[:300]!r}")
                    return
        finally:
            wins.append(done)
            c.close()

    ts = [threading.Thread(target=incr) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors[:10]
    assert sum(wins) == threads * each
    status, headers, raw = store_node.request("GET", "/v1/store/objects" + key)
    assert status == 200
    assert int(raw) == threads * each
    assert int({k.lower(): v for k, v in headers.items()}["x-slipstream-version"]) == threads * each + 1

    # A key created by a race of if_version=0 puts: exactly one wins.
    results: list[int] = []

    def create(i: int) -> None:
        c = Conn(store_node.url)
        results.append(c.req("PUT", "/v1/store/objects/cas/created?if_version=0", str(i).encode())[0])
        c.close()

    ts = [threading.Thread(target=create, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert sorted(results) == [201] + [409] * 15, results


def test_reads_racing_retention_are_whole_or_not_found(store_node: Node) -> None:
    """A read that races the put whose retention removes the version it
    found gets that version whole, or 404 (removed), never a partial value or
    a 5xx. Under /race/one/ (1 version kept) every put removes the previous
    one, so a plain GET of the latest races every put."""
    stop = threading.Event()
    bad: list[str] = []
    counts: dict[str, int] = {}
    keys = {"/race/one/small": 1000, "/race/one/large": 100_000, "/crash/few/race": 1000}

    def put(key: str, size: int) -> None:
        c = Conn(store_node.url)
        rng = random.Random(key)
        try:
            while not stop.is_set():
                status, _, raw = c.req("PUT", "/v1/store/objects" + key, value_of(key, rng.getrandbits(63), size))
                if status != 201:
                    bad.append(f"PUT {key}: {status} {raw[:200]!r}")
        finally:
            c.close()

    def get(key: str, oldest: bool) -> None:
        c = Conn(store_node.url)
        try:
            while not stop.is_set():
                path = "/v1/store/objects" + key
                if oldest:
                    status, _, raw = c.req("GET", "/v1/store/versions" + key)
                    path += f"?version={json.loads(raw)['versions'][0]['version']}"
                status, _, value = c.req("GET", path)
                ok = status == 200 and whole(value) is not None and len(value) == keys[key] + HEAD.size
                outcome = "whole" if ok else "not found" if status == 404 and oldest else f"{status}/{len(value)} B"
                counts[outcome] = counts.get(outcome, 0) + 1
                if outcome not in ("whole", "not found"):
                    bad.append(f"GET {path}: {status}, {len(value)} bytes {value[:160]!r}")
        finally:
            c.close()

    for key, size in keys.items():
        assert store_node.request("PUT", "/v1/store/objects" + key, value_of(key, 0, size))[0] == 201
    ts = [threading.Thread(target=put, args=(k, n)) for k, n in keys.items()]
    ts += [threading.Thread(target=get, args=(k, k.startswith("/crash/"))) for k in keys for _ in range(2)]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline and len(bad) < 5:
        time.sleep(0.05)
    stop.set()
    for t in ts:
        t.join(30)
    assert not bad, f"{len(bad)} bad reads of {sum(counts.values())} ({counts}):\n" + "\n".join(bad[:8])


def _tensors(header: bytes, data: bytes = b"", *, fmt: int = 1, header_len: int | None = None) -> bytes:
    v = b"SSTN" + struct.pack("<IQ", fmt, len(header) if header_len is None else header_len) + header
    return v + b"\0" * (-len(v) % 64) + data


TENSORS = "application/x-slipstream-tensors"
GOOD_HEADER = b'{"x":{"dtype":"float32","shape":[2,2],"offset":0,"nbytes":16}}'
BAD_PUTS: list[tuple[str, bytes, dict[str, str]]] = [
    # Keys.
    ("/v1/store/objects/a//b", b"x", {}),
    ("/v1/store/objects/a/../b", b"x", {}),
    ("/v1/store/objects/../a", b"x", {}),
    ("/v1/store/objects/a/./b", b"x", {}),
    ("/v1/store/objects/a/%2e%2e/b", b"x", {}),
    ("/v1/store/objects/a%2F%2Fb", b"x", {}),
    ("/v1/store/objects/a/", b"x", {}),
    ("/v1/store/objects/a%0Ab", b"x", {}),
    ("/v1/store/objects/a%zz", b"x", {}),
    ("/v1/store/objects/a%ff", b"x", {}),
    ("/v1/store/objects/" + "k" * 1100, b"x", {}),
    # Conditions.
    ("/v1/store/objects/ok?if_version=abc", b"x", {}),
    ("/v1/store/objects/ok?if_version=-1", b"x", {}),
    ("/v1/store/objects/ok?if_version=1.5", b"x", {}),
    ("/v1/store/objects/ok?if_version=", b"x", {}),
    ("/v1/store/objects/ok?if_version=99999999999999999999999", b"x", {}),
    ("/v1/store/objects/ok?if_version=5", b"x", {}),  # 409: the key was never written
    # Named tensors that are not.
    ("/v1/store/objects/t", b"junk junk junk junk", {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", b"", {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", b"SSTN", {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER, b"\0" * 16, fmt=2), {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER, b"\0" * 16, header_len=(1 << 64) - 1), {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER, b"\0" * 16, header_len=1 << 40), {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(b"not json", b"\0" * 16), {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER, b"\0" * 8), {"Content-Type": TENSORS}),  # data short
    ("/v1/store/objects/t", _tensors(GOOD_HEADER.replace(b'"nbytes":16', b'"nbytes":12'), b"\0" * 16),
     {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER.replace(b'"offset":0', b'"offset":8'), b"\0" * 32),
     {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER.replace(b"float32", b"nope"), b"\0" * 16), {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER.replace(b"[2,2]", b"[4611686018427387904,4]"), b"\0" * 16),
     {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(GOOD_HEADER.replace(b'"offset":0', b'"offset":18446744073709551552'),
                                     b"\0" * 16), {"Content-Type": TENSORS}),
    ("/v1/store/objects/t", _tensors(b'{"x":{"dtype":"float32","shape":[2,2]}}', b"\0" * 16), {"Content-Type": TENSORS}),
    # Content types the node cannot keep.
    ("/v1/store/objects/ct", b"x", {"Content-Type": "x" * 300}),
]


def _totals(node: Node) -> tuple[int, int, int]:
    st = node.get("/v1/store")[1]
    return st["keys"], st["versions"], st["seq"]


def test_bad_input_is_refused_and_nothing_is_stored(store_node: Node) -> None:
    # The valid named-tensors value is taken (the cases below differ from it in one thing).
    status, _, raw = store_node.request("PUT", "/v1/store/objects/good/t", _tensors(GOOD_HEADER, b"\0" * 16),
                                        headers={"Content-Type": TENSORS})
    assert status == 201, raw
    before = _totals(store_node)

    def once(method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        # A connection each: the node may close one whose body it did not read.
        conn = Conn(store_node.url)
        try:
            return conn.req(method, path, body, headers)
        finally:
            conn.close()

    for path, body, headers in BAD_PUTS:
        for method in ("PUT", "DELETE") if "Content-Type" not in headers else ("PUT",):
            status, h, raw = once(method, path, body if method == "PUT" else None, headers)
            # (409: the key was never written, so no condition on a version holds.)
            assert status == (409 if "if_version=5" in path else 400), (method, path[:80], status, raw[:300])
            assert h.get("x-slipstream-error-kind") == ("conflict" if status == 409 else "bad_request"), h
            assert "error" in json.loads(raw), raw[:300]
    for path in ("/v1/store/objects/t", "/v1/store/objects/ok", "/v1/store/objects/ct",
                 "/v1/store/objects/ok?version=abc", "/v1/store/objects/good/t?version=1&as_of=1",
                 "/v1/store/objects/good/t?as_of=nan", "/v1/store/objects/good/t?version=0",
                 "/v1/store/objects/good/t?version=2", "/v1/store/versions/a//b", "/v1/store/keys?prefix=a",
                 "/v1/store/keys?limit=0", "/v1/store/watch?since=x"):
        status, _, raw = once("GET", path)
        assert 400 <= status < 500, (path, status, raw[:300])
    assert _totals(store_node) == before
    for key in ("/a/b", "/b", "/a", "/ok", "/t", "/ct"):
        assert store_node.request("GET", "/v1/store/objects" + key)[0] == 404, key


def test_writes_on_a_non_loopback_listener_need_the_token() -> None:
    open_node = Node(APP, "--host", "0.0.0.0", env={"SLIPSTREAM_ADMIN_TOKEN": "", "SLIPSTREAM_STORE": ""})
    try:
        before = _totals(open_node)
        status, h, raw = open_node.request("PUT", "/v1/store/objects/x", b"v")
        assert status == 403, raw
        assert open_node.request("DELETE", "/v1/store/objects/x")[0] == 403
        assert open_node.request("POST", "/v1/store/trigger/x", b"v")[0] == 403
        assert open_node.request("PUT", "/v1/store/objects/x", b"v", headers={"Authorization": "Bearer T"})[0] == 403
        assert _totals(open_node) == before
        assert open_node.request("GET", "/v1/store/objects/x")[0] == 404  # reads are open
    finally:
        open_node.stop()
    node = Node(APP, "--host", "0.0.0.0", "--admin-token", "T", env={"SLIPSTREAM_STORE": ""})
    try:
        before = _totals(node)
        assert node.request("PUT", "/v1/store/objects/x", b"v")[0] == 401
        assert node.request("PUT", "/v1/store/objects/x", b"v", headers={"Authorization": "Bearer U"})[0] == 401
        assert node.request("PUT", "/v1/store/objects/x", b"v", headers={"Authorization": "T"})[0] == 401
        assert _totals(node) == before
        status, _, raw = node.request("PUT", "/v1/store/objects/x", b"v", headers={"Authorization": "Bearer T"})
        assert status == 201, raw
        assert node.request("GET", "/v1/store/objects/x")[2] == b"v"
        assert node.request("DELETE", "/v1/store/objects/x")[0] == 401
        assert node.request("DELETE", "/v1/store/objects/x", headers={"Authorization": "Bearer T"})[0] == 200
    finally:
        node.stop()
