"""The Python side of the object store, without a node: the named-tensor
codec, key rules, the spec fields apps emit, the CLI's argument handling,
and the client, hot swap and group cache against an in-process stand-in
for the node's store routes (tests/fake_store.py)."""

from __future__ import annotations

import gc
import json
import os
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import slipstream as ss
from slipstream._internal import cli, config
from slipstream._internal.app import app_spec
from slipstream._internal.errors import ERROR_KIND_HEADER, StoreError, error_from_response
from slipstream._internal.groups import GroupCache
from slipstream._internal.keys import key_problem, prefix_problem
from slipstream._internal.needs import Replica
from slipstream._internal.store import (
    TENSORS,
    Store,
    decode_tensors,
    encode_tensors,
)

from tests.fake_store import FakeStore

# --- named tensors ---------------------------------------------------------------


def joined(tensors: dict[str, Any]) -> bytes:
    return b"".join(encode_tensors(tensors))


def test_tensor_codec_round_trip_keeps_names_dtypes_shapes_and_values() -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "ids": np.arange(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "half": np.ones((2, 2), dtype=np.float16),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 4), dtype=np.uint8),
        "strided": np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2],  # not contiguous
        "big_endian": np.arange(3, dtype=">f8"),
    }
    out = decode_tensors(joined(arrays))
    assert list(out) == list(arrays)
    for name, a in arrays.items():
        assert out[name].dtype.name == a.dtype.name, name
        assert out[name].shape == a.shape, name
        np.testing.assert_array_equal(out[name], a)
        assert not out[name].flags.writeable


def test_tensor_layout_follows_the_contract() -> None:
    value = joined({"a": np.arange(3, dtype=np.int8), "b": np.ones(2, dtype=np.float64)})
    magic, version, hlen = struct.unpack_from("<4sIQ", value)
    assert (magic, version) == (b"SSTN", 1)
    header = json.loads(value[16:16 + hlen])
    assert header == {"a": {"dtype": "int8", "shape": [3], "offset": 0, "nbytes": 3},
                      "b": {"dtype": "float64", "shape": [2], "offset": 64, "nbytes": 16}}
    start = -(-(16 + hlen) // 64) * 64
    assert value[16 + hlen:start] == bytes(start - 16 - hlen)  # zero padding
    assert np.frombuffer(value, np.float64, 2, start + 64).tolist() == [1.0, 1.0]


def test_decoded_tensors_are_views_that_keep_their_buffer_alive() -> None:
    buf = bytearray(joined({"x": np.arange(4, dtype=np.float32)}))
    x = decode_tensors(buf)["x"]
    assert np.shares_memory(x, np.frombuffer(buf, np.uint8))
    del buf
    gc.collect()
    assert x.tolist() == [0, 1, 2, 3]


def corrupt_header(header: dict[str, Any], data: bytes = bytes(64)) -> bytes:
    text = json.dumps(header).encode()
    head = struct.pack("<4sIQ", b"SSTN", 1, len(text)) + text
    return head + bytes(-len(head) % 64) + data


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (b"SSTN", "shorter than the 16-byte preamble"),
        (b"NOPE" + bytes(60), "starts with b'NOPE'"),
        (struct.pack("<4sIQ", b"SSTN", 2, 0), "format version 2"),
        (struct.pack("<4sIQ", b"SSTN", 1, 1 << 62), "does not fit"),
        (struct.pack("<4sIQ", b"SSTN", 1, 3) + b"{x}", "not JSON"),
        (corrupt_header([1, 2]), "not a JSON object"),  # type: ignore[arg-type]
        (corrupt_header({"x": 5}), "not an object"),
        (corrupt_header({"x": {"dtype": "string", "shape": [1], "offset": 0, "nbytes": 4}}), "dtype 'string'"),
        (corrupt_header({"x": {"dtype": "float32", "shape": [-1], "offset": 0, "nbytes": 4}}), "shape"),
        (corrupt_header({"x": {"dtype": "float32", "shape": [True], "offset": 0, "nbytes": 4}}), "shape"),
        (corrupt_header({"x": {"dtype": "float32", "shape": [1], "offset": 8, "nbytes": 4}}), "multiple of 64"),
        (corrupt_header({"x": {"dtype": "float32", "shape": [1], "offset": -64, "nbytes": 4}}), "offset"),
        (corrupt_header({"x": {"dtype": "float32", "shape": [2], "offset": 0, "nbytes": 4}}), "nbytes 4"),
        (corrupt_header({"x": {"dtype": "float32", "shape": [32], "offset": 0, "nbytes": 128}}), "lies outside"),
        (corrupt_header({"x": {"dtype": "uint8", "shape": [1], "offset": 64, "nbytes": 1}}), "lies outside"),
        (corrupt_header({"x": {"dtype": "float64", "shape": [1 << 40, 1 << 40], "offset": 0,
                               "nbytes": 8 << 80}}), "lies outside"),
    ],
)
def test_malformed_tensor_values_are_refused_with_the_reason(value: bytes, needle: str) -> None:
    with pytest.raises(ss.TensorFormatError, match=needle) as info:
        decode_tensors(value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ss.StoreError)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ({"s": np.array(["a", "b"])}, "dtype <U1"),
        ({"o": np.array([object()])}, "dtype object"),
        ({"": np.zeros(1)}, "non-empty strings"),
        ([np.zeros(1)], "dict of name"),
    ],
)
def test_values_that_are_not_numeric_named_tensors_cannot_be_encoded(value: Any, needle: str) -> None:
    with pytest.raises(ss.TensorFormatError, match=needle):
        encode_tensors(value)


# --- keys ------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["/a", "/models/minilm", "/docs/x y/ü", "/a/.hidden", "/" + "k" * 1023])
def test_valid_keys(key: str) -> None:
    assert key_problem(key, write=True) is None


@pytest.mark.parametrize(
    ("key", "needle"),
    [
        ("models/x", "starts with '/'"),
        ("/", "root prefix"),
        ("/a/", "trailing '/'"),
        ("/a//b", "empty segment"),
        ("/a/../b", "'..'"),
        ("/a/./b", "'.'"),
        ("/a\nb", "control characters"),
        ("/a\x7fb", "control characters"),
        ("/" + "k" * 1024, "at most 1024 bytes"),
        ("/\udc80", "UTF-8"),
        (42, "a string"),
    ],
)
def test_invalid_keys_say_why(key: Any, needle: str) -> None:
    problem = key_problem(key)
    assert problem is not None and needle in problem


def test_reserved_keys_are_readable_and_deletable_not_writable(store: Store, fake: FakeStore) -> None:
    assert key_problem("/_slipstream/failed-triggers/p/1") is None
    assert "node's own" in str(key_problem("/_slipstream/x", write=True))
    with pytest.raises(ss.StoreBadRequest, match="node's own"):
        store.put("/_slipstream/x", b"")
    fake._commit("/_slipstream/failed-triggers/p/seq-1", b"{}", "application/json", False)
    assert store.get("/_slipstream/failed-triggers/p/seq-1").bytes() == b"{}"
    assert store.delete("/_slipstream/failed-triggers/p/seq-1").deleted


def test_keys_with_spaces_and_plus_signs_travel_percent_encoded(store: Store, fake: FakeStore) -> None:
    store.put("/docs/a b+c", b"1")
    assert "PUT /v1/store/objects/docs/a%20b%2Bc" in fake.requests
    assert [v.key for v in store.keys("/docs/a b+")] == ["/docs/a b+c"]


def test_declared_prefixes_are_whole_segments() -> None:
    assert prefix_problem("/", whole_segments=True) is None
    assert prefix_problem("/docs/", whole_segments=True) is None
    assert "ends with '/'" in str(prefix_problem("/docs", whole_segments=True))
    assert "empty segment" in str(prefix_problem("/docs//", whole_segments=True))
    assert prefix_problem("/docs", whole_segments=False) is None  # a listing's: a key, or a key and '/'
    assert prefix_problem("/docs/", whole_segments=False) is None
    assert "empty segment" in str(prefix_problem("/do//cs", whole_segments=False))
    assert "starts with '/'" in str(prefix_problem("docs", whole_segments=False))


# --- spec fields -----------------------------------------------------------------------


def comp(name: str, **kw: Any) -> ss.Component:
    cls = type(name, (), {"__init__": lambda self, **objs: setattr(self, "objs", objs),
                          "__call__": lambda self, batch: {}})
    return ss.component(cls, **kw)  # type: ignore[no-any-return]


def test_needs_watch_and_affinity_are_in_the_stage_spec() -> None:
    index = comp("Index", watch="/docs/", needs={"encoder": "/models/minilm"})
    assert index.inputs == {"key": ss.Tensor("string", (-1,)), "version": ss.Tensor("int64", (-1,)),
                            "op": ss.Tensor("string", (-1,)), "value": ss.Tensor("bytes", (-1,))}
    search = comp("Search", affinity="doc", inputs={"doc": ss.Tensor(str, (-1,)), "q": ss.Tensor(str, (-1,))})
    indexing = ss.Pipeline("indexing", index)
    searching = ss.Pipeline("search", search)
    st = indexing.to_spec()["stages"][0]
    assert (st["needs"], st["watch"], st["affinity"]) == ({"encoder": "/models/minilm"}, "/docs/", None)
    assert set(indexing.to_spec()["inputs"]) == {"key", "version", "op", "value"}
    st = searching.to_spec()["stages"][0]
    assert (st["needs"], st["watch"], st["affinity"]) == ({}, None, "doc")
    # Puts invoke the first, requests the second: profile and plan skip the first.
    assert (indexing.watch, searching.watch) == ("/docs/", None)
    from slipstream._internal.cli import _request_pipelines

    assert _request_pipelines([indexing, searching], "plan") == [searching]


def test_a_watching_component_may_declare_some_trigger_inputs() -> None:
    c = comp("W", watch="/docs/", inputs={"key": ss.Tensor(str, (-1,)), "op": ss.Tensor(str, (-1,))})
    assert set(c.inputs) == {"key", "op"}
    assert set(ss.Pipeline("p", c).inputs) == {"key", "op"}


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: comp("A", needs={"enc": "models/x"}), "starts with '/'"),
        (lambda: comp("A", needs={"not-an-identifier": "/m"}), "Python identifier"),
        (lambda: comp("A", needs={"class": "/m"}), "Python identifier"),
        (lambda: comp("A", watch="/docs"), "ends with '/'"),
        (lambda: comp("A", watch="docs/"), "starts with '/'"),
        (lambda: comp("A", watch="/docs/", inputs={"text": ss.Tensor(str, (-1,))}), "'text'"),
        (lambda: comp("A", watch="/docs/", inputs={"version": ss.Tensor("int32", (-1,))}), "'version'"),
        (lambda: comp("A", affinity="doc", inputs={"x": ss.Tensor(str, (-1,))}), "string input"),
        (lambda: comp("A", affinity="doc", inputs={"doc": ss.Tensor("int64", (-1,))}), "string input"),
        (lambda: comp("A", needs={"enc": "/m"}).bind(enc=1), "come from the store"),
        (lambda: ss.Pipeline("p", comp("A", inputs={"x": ss.Tensor(str, (-1,))}) >> comp("B", watch="/d/")),
         "not the pipeline's root"),
        (lambda: ss.Pipeline("p", comp("A", affinity="doc"), inputs={"x": ss.Tensor(str, (-1,))}), "string input"),
        (lambda: ss.Pipeline("p", comp("A", watch="/d/"), inputs={"x": ss.Tensor(str, (-1,))}), "invoked by puts"),
        (lambda: ss.Pool("/docs"), "ends with '/'"),
        (lambda: ss.Pool("/_slipstream/"), "node's own"),
        (lambda: ss.Pool("/docs/", keep_versions=0), "keep_versions"),
        (lambda: ss.Pool("/docs/", keep_age_s=0), "keep_age_s"),
        (lambda: ss.Pool("/docs/", affinity="^/docs/[^/]+/"), "capture group"),
        (lambda: ss.Pool("/docs/", affinity="^/docs/([^/]+/"), "not a regular expression"),
        (lambda: ss.Pool("/docs/", copies=0), "copies must be"),
        (lambda: ss.Pool("/docs/", write_copies=True), "write_copies must be"),
        (lambda: ss.Pool("/docs/", copies=2, write_copies=3), "cannot exceed"),
    ],
)
def test_bad_store_declarations_are_config_errors(build: Any, needle: str) -> None:
    with pytest.raises(ss.ConfigError, match=needle):
        build()


def test_instantiate_passes_the_needed_objects_as_keyword_arguments() -> None:
    c = comp("A", needs={"encoder": "/m"})
    inst = c.instantiate({"encoder": "OBJ"})
    assert inst.objs == {"encoder": "OBJ"}
    with pytest.raises(ss.ConfigError, match="needs the store objects encoder"):
        c.instantiate({})


def test_outside_a_worker_needs_come_from_seed_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_NODE_URL", raising=False)
    c = comp("A", needs={"encoder": "/models/offline-only"})
    with pytest.raises(ss.ConfigError, match="seed file"):
        c.instantiate()  # what `slipstream profile` does
    f = tmp_path / "enc.bin"
    f.write_bytes(b"graph")
    ss.Pipeline("p", c, inputs={"x": ss.Tensor("float32", (-1,))}, seed={"/models/offline-only": f})
    enc = c.instantiate().objs["encoder"]
    assert (enc.key, enc.version, enc.bytes(), enc.path) == ("/models/offline-only", 0, b"graph", str(f))


def test_outside_a_worker_needs_come_from_the_named_node(fake: FakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream._internal import store as store_module

    monkeypatch.setenv("SLIPSTREAM_NODE_URL", fake.url)
    monkeypatch.setattr(store_module, "_default", None)
    Store(fake.url).put("/models/online", b"v1")
    assert comp("A", needs={"m": "/models/online"}).instantiate().objs["m"].version == 1


@pytest.fixture()
def app_file(tmp_path: Path) -> str:
    f = tmp_path / "app.py"
    f.write_text("")
    return str(f)


def test_app_spec_merges_pools_and_seeds_over_pipelines(tmp_path: Path, app_file: str) -> None:
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    tensors = tmp_path / "t.sstn"
    tensors.write_bytes(joined({"x": np.zeros(2)}))
    docs = ss.Pool("/docs/", keep_versions=4, affinity=r"^/docs/([^/]+)/")
    x = {"x": ss.Tensor("float32", (-1,))}
    p1 = ss.Pipeline("p1", comp("A"), inputs=x, pools=[docs, ss.Pool("/models/", keep_age_s=3600)],
                     seed={"/models/m": model, "/models/t": str(tensors)})
    p2 = ss.Pipeline("p2", comp("B"), inputs=x, pools=[ss.Pool("/docs/", keep_versions=4, affinity=r"^/docs/([^/]+)/")],
                     seed={"/models/m": (str(model), "application/octet-stream"), "/notes": (model, "text/plain")})
    spec = app_spec(app_file, [p1, p2])
    assert spec["store"]["pools"] == [
        {"prefix": "/docs/", "keep_versions": 4, "keep_age_s": None, "affinity": "^/docs/([^/]+)/", "copies": None,
         "write_copies": None},
        {"prefix": "/models/", "keep_versions": 16, "keep_age_s": 3600, "affinity": None, "copies": None,
         "write_copies": None},
    ]
    assert spec["store"]["seed"] == [
        {"key": "/models/m", "path": str(model), "content_type": "application/octet-stream"},
        {"key": "/models/t", "path": str(tensors), "content_type": TENSORS},
        {"key": "/notes", "path": str(model), "content_type": "text/plain"},
    ]
    assert app_spec(app_file, [ss.Pipeline("p", comp("A"), inputs=x)])["store"] == {"pools": [], "seed": []}


def test_conflicting_pools_or_seeds_across_pipelines_are_config_errors(tmp_path: Path, app_file: str) -> None:
    x = {"x": ss.Tensor("float32", (-1,))}
    a = ss.Pipeline("a", comp("A"), inputs=x, pools=[ss.Pool("/docs/", keep_versions=4)])
    b = ss.Pipeline("b", comp("B"), inputs=x, pools=[ss.Pool("/docs/", keep_versions=8)])
    with pytest.raises(ss.ConfigError, match="declared differently"):
        app_spec(app_file, [a, b])
    f1, f2 = tmp_path / "1", tmp_path / "2"
    f1.write_bytes(b"1")
    f2.write_bytes(b"2")
    c = ss.Pipeline("c", comp("A"), inputs=x, seed={"/m": f1})
    d = ss.Pipeline("d", comp("B"), inputs=x, seed={"/m": f2})
    with pytest.raises(ss.ConfigError, match="seeded differently"):
        app_spec(app_file, [c, d])
    with pytest.raises(ss.ConfigError, match="pool prefix twice"):
        ss.Pipeline("e", comp("A"), inputs=x, pools=[ss.Pool("/d/"), ss.Pool("/d/", keep_versions=2)])


@pytest.mark.parametrize(
    ("seed", "needle"),
    [
        ({"/m": "/no/such/file"}, "no such file"),
        ({"/m": "."}, "no such file"),
        ({"m": __file__}, "starts with '/'"),
        ({"/_slipstream/m": __file__}, "node's own"),
        ({"/m": 42}, "file path"),
        ({"/m": (__file__,)}, "path or \\(path, content_type\\)"),
    ],
)
def test_bad_seeds_are_config_errors(seed: dict[str, Any], needle: str) -> None:
    with pytest.raises(ss.ConfigError, match=needle):
        ss.Pipeline("p", comp("A"), inputs={"x": ss.Tensor("float32", (-1,))}, seed=seed)


# --- the client against a stand-in node ------------------------------------------------


@pytest.fixture()
def fake(tmp_path: Path) -> Iterator[FakeStore]:
    f = FakeStore(tmp_path, blob_min=4096)
    yield f
    f.close()


@pytest.fixture()
def store(fake: FakeStore) -> Store:
    return Store(fake.url, timeout=5)


@pytest.fixture(autouse=True)
def short_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Background watchers poll briefly, so they notice close() soon."""
    monkeypatch.setattr(Replica, "WATCH_MS", 200)
    monkeypatch.setattr(GroupCache, "WATCH_MS", 200)


def test_put_and_get_each_kind_of_value(store: Store) -> None:
    v = store.put("/raw", b"\x00\x01")
    assert (v.key, v.version, v.size, v.content_type) == ("/raw", 1, 2, "application/octet-stream")
    assert abs(v.timestamp - time.time()) < 60
    store.put("/text", "héllo")
    store.put("/arr", np.arange(3, dtype=np.int16))
    store.put("/named", {"a": np.eye(2, dtype=np.float32), "b": np.array([1, 2], np.uint64)})
    raw = store.get("/raw")
    assert raw.bytes() == b"\x00\x01" and raw.path is None and raw.memoryview().readonly
    assert store.get("/text").text() == "héllo"
    assert store.get("/text").content_type == "text/plain; charset=utf-8"
    assert store.get("/arr").tensors()["value"].tolist() == [0, 1, 2]
    named = store.get("/named").tensors()
    assert named["a"].tolist() == [[1, 0], [0, 1]] and named["b"].dtype == np.uint64
    assert not named["a"].flags.writeable
    with pytest.raises(ss.TensorFormatError, match="not named tensors"):
        raw.tensors()
    with pytest.raises(ss.StoreBadRequest, match="cannot store a int"):
        store.put("/x", 42)  # type: ignore[arg-type]


def test_large_values_are_memory_mapped_from_the_blob_file(store: Store, fake: FakeStore) -> None:
    big = np.arange(1 << 16, dtype=np.float32)
    store.put("/models/big", {"w": big})
    obj = store.get("/models/big")
    assert obj.path is not None and obj.path == fake.latest("/models/big").path  # type: ignore[union-attr]
    w = obj.tensors()["w"]
    np.testing.assert_array_equal(w, big)
    assert not w.flags.writeable and w.ctypes.data % 64 == 0
    requests = len(fake.requests)
    assert all("meta" not in r for r in fake.requests[requests:])
    # The map outlives the Object and the file.
    del obj
    gc.collect()
    os.unlink(fake.latest("/models/big").path)  # type: ignore[arg-type, union-attr]
    assert float(w[-1]) == float(big[-1])


def test_a_blob_of_the_wrong_size_or_elsewhere_is_read_over_http(store: Store, fake: FakeStore) -> None:
    store.put("/b", b"x" * 5000)
    path = fake.latest("/b").path  # type: ignore[union-attr]
    assert path is not None
    Path(path).write_bytes(b"short")
    obj = store.get("/b")
    assert obj.path is None and obj.bytes() == b"x" * 5000
    os.unlink(path)
    assert store.get("/b").path is None


def test_http_reads_are_aligned_for_tensors(store: Store) -> None:
    store.put("/small", {"x": np.arange(5, dtype=np.float64)})
    x = store.get("/small").tensors()["x"]
    assert x.ctypes.data % 64 == 0 and x.tolist() == [0, 1, 2, 3, 4]


def test_versions_as_of_delete_and_not_found(store: Store) -> None:
    store.put("/k", b"1")
    time.sleep(0.01)
    t = time.time()
    time.sleep(0.01)
    store.put("/k", b"2")
    assert store.get("/k").bytes() == b"2"
    assert store.get("/k", version=1).bytes() == b"1"
    assert store.get("/k", as_of=t).bytes() == b"1"
    gone = store.delete("/k")
    assert gone.deleted and gone.version == 3
    with pytest.raises(ss.StoreNotFound) as info:
        store.get("/k")
    assert isinstance(info.value, LookupError) and info.value.key == "/k"
    assert [(v.version, v.deleted) for v in store.versions("/k")] == [(1, False), (2, False), (3, True)]
    with pytest.raises(ss.StoreNotFound):
        store.delete("/k")
    with pytest.raises(ss.StoreBadRequest, match="not both"):
        store.get("/k", version=1, as_of=t)


def test_if_version_conflicts_carry_the_current_version(store: Store) -> None:
    assert store.put("/c", b"a", if_version=0).version == 1
    with pytest.raises(ss.StoreConflict) as info:
        store.put("/c", b"b", if_version=0)
    assert info.value.current == 1 and info.value.status == 409 and info.value.kind == "conflict"
    assert store.put("/c", b"b", if_version=1).version == 2


def test_keys_lists_live_keys_in_order_and_says_when_truncated(store: Store) -> None:
    for k in ("/d/b", "/d/a", "/d/c", "/e/a"):
        store.put(k, b"")
    store.delete("/d/c")
    listing = store.keys("/d/")
    assert [v.key for v in listing] == ["/d/a", "/d/b"] and not listing.truncated
    assert store.ls("/", limit=2).truncated
    with pytest.raises(ss.StoreBadRequest, match="limit"):
        store.keys("/", limit=0)


def test_watch_and_cursor(store: Store, fake: FakeStore) -> None:
    store.put("/w/old", b"")
    since = store.cursor("/w/")
    store.put("/w/a", b"1")
    store.put("/elsewhere", b"")
    store.delete("/w/a")
    seq, changes = store.watch("/w/", since=since, timeout_ms=1000)
    assert [(c.key, c.version, c.op) for c in changes] == [("/w/a", 1, "put"), ("/w/a", 2, "delete")]
    t0 = time.monotonic()
    assert store.watch("/w/", since=seq, timeout_ms=200) == (seq, [])
    assert time.monotonic() - t0 >= 0.15
    fake.feed_floor = seq + 1
    with pytest.raises(ss.StoreGone):
        store.watch("/w/", since=seq)


def test_writes_need_the_token_when_the_node_has_one(fake: FakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.token = "s3cret"
    monkeypatch.delenv("SLIPSTREAM_STORE_TOKEN", raising=False)
    monkeypatch.delenv("SLIPSTREAM_ADMIN_TOKEN", raising=False)
    with pytest.raises(ss.StoreUnauthorized) as info:
        Store(fake.url).put("/k", b"")
    assert isinstance(info.value, PermissionError)
    monkeypatch.setenv("SLIPSTREAM_STORE_TOKEN", "s3cret")
    assert Store(fake.url).put("/k", b"").version == 1
    assert Store(fake.url, token="s3cret").trigger_put("/k", b"x") == 1
    assert fake.triggers == [("/k", b"x")]


def test_a_dropped_keep_alive_connection_is_reopened_once(store: Store, fake: FakeStore) -> None:
    store.put("/r", b"1")
    fake.drop_after_response = True
    for i in range(3):  # each request finds the previous connection closed by the node
        assert store.put("/r", str(i)).version == i + 2
    assert store.get("/r").text() == "2"


def test_no_node_is_store_unavailable() -> None:
    with pytest.raises(ss.StoreUnavailable, match="no node answers") as info:
        Store("http://127.0.0.1:9", timeout=2).meta("/k")
    assert isinstance(info.value, ConnectionError)


def test_errors_map_from_kind_or_status() -> None:
    def store_error(status: int, kind: str | None, raw: bytes, key: str | None = None) -> StoreError:
        headers = {} if kind is None else {ERROR_KIND_HEADER: kind}
        e = error_from_response(status, headers, raw, tree=StoreError, key=key)
        assert isinstance(e, StoreError)
        return e

    e = store_error(409, None, b'{"error": "stale", "kind": "conflict", "current": 7}', "/k")
    assert isinstance(e, ss.StoreConflict) and e.current == 7 and str(e) == "stale"
    e = store_error(409, "conflict", b'{"error": {"kind": "conflict", "message": '
                    b'"version conflict on /k: expected version 0, the key is at 3"}}')
    assert isinstance(e, ss.StoreConflict) and e.current == 3
    assert isinstance(store_error(400, "bad_request", b"{}"), ss.StoreBadRequest)
    assert isinstance(store_error(413, None, b"too\nbig"), ss.StoreBadRequest)
    assert str(store_error(413, None, b"too\nbig")) == "too big"
    assert isinstance(store_error(503, "shutting_down", b""), ss.StoreUnavailable)
    assert isinstance(store_error(403, None, b""), ss.StoreUnauthorized)
    e = store_error(500, "internal", b'{"error": {"kind": "internal", "message": "boom"}}')
    assert type(e) is ss.StoreError and str(e) == "boom" and e.status == 500


def test_bad_urls_and_arguments_fail_before_sending() -> None:
    with pytest.raises(ss.StoreBadRequest, match="node URL"):
        Store("127.0.0.1:8000")
    s = Store("http://127.0.0.1:9")
    for call in (lambda: s.get("nope"), lambda: s.get("/k", version=0), lambda: s.watch("/", timeout_ms=-1),
                 lambda: s.put("/k", b"", if_version=-1), lambda: s.get("/k", as_of=float("nan"))):
        with pytest.raises(ss.StoreBadRequest):
            call()


def test_module_functions_use_the_node_in_the_environment(fake: FakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream._internal import store as store_module

    monkeypatch.setenv("SLIPSTREAM_NODE_URL", fake.url)
    monkeypatch.setattr(store_module, "_default", None)
    ss.store.put("/m", b"v")
    assert ss.store.get("/m").bytes() == b"v"
    assert [v.key for v in ss.store.ls("/")] == ["/m"]
    assert ss.store.stats()["seq"] == 1


# --- hot swap ---------------------------------------------------------------------------------


class Model:
    builds: list[int] = []

    def __init__(self, weights: ss.Object):
        if weights.bytes() == b"broken":
            raise RuntimeError("cannot load")
        self.version = weights.version
        Model.builds.append(weights.version)

    def __call__(self, batch: ss.Batch) -> dict[str, Any]:
        return {}


def wait_until(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_a_new_version_builds_a_new_instance_swapped_in_between_batches(store: Store,
                                                                        request: pytest.FixtureRequest) -> None:
    store.put("/models/m", b"v1")
    Model.builds = []
    replica = Replica(ss.component(Model, needs={"weights": "/models/m"}), "p/Model[0]", store)
    request.addfinalizer(replica.close)
    first = replica.current()
    assert first.version == 1 and ss.loaded_versions() == {"weights": 1}
    store.put("/models/other", b"")  # a key the prefix /models/m does not name exactly
    store.put("/models/m2", b"")
    store.put("/models/m", b"v2")
    wait_until(lambda: replica._pending is not None)
    assert ss.loaded_versions() == {"weights": 1}  # not before the next batch
    second = replica.current()
    assert second is not first and second.version == 2 and ss.loaded_versions() == {"weights": 2}
    store.put("/models/m", b"broken")  # a failed build keeps the serving instance
    store.delete("/models/m")  # deletes build nothing
    time.sleep(0.3)
    assert replica.current() is second and Model.builds == [1, 2]


def test_a_missing_needed_object_fails_the_start_clearly(store: Store) -> None:
    with pytest.raises(ss.StoreNotFound, match="needs weights=/models/none, which has no live version"):
        Replica(ss.component(Model, needs={"weights": "/models/none"}), "p/Model[0]", store)


# --- the group cache ------------------------------------------------------------------------


def test_groups_load_together_stay_fresh_and_evict_together(store: Store, request: pytest.FixtureRequest) -> None:
    for k in ("/docs/a/text", "/docs/a/vec", "/docs/b/text", "/docs/bb/text", "/notes/x"):
        store.put(k, b"0123456789")
    cache = GroupCache(lambda: store, budget_bytes=35)
    request.addfinalizer(cache.close)
    cache.configure([ss.Pool("/docs/", affinity=r"^/docs/([^/]+)/")])
    a = cache.group("/docs/a/vec")
    assert list(a) == ["/docs/a/text", "/docs/a/vec"] and a["/docs/a/text"].bytes() == b"0123456789"
    assert cache.group("/docs/a/text").keys() == a.keys()
    assert cache.stats()["hits"] == 1 and cache.stats()["groups_loaded"] == 1
    assert list(cache.group("/docs/b/text")) == ["/docs/b/text"]  # not /docs/bb/
    assert list(cache.group("/notes/x")) == ["/notes/x"]  # no affinity: a group of its own
    st = cache.stats()
    assert st["groups_loaded"] == 3 and st["evictions"] == 1 and st["bytes"] <= 35  # group a went first
    cache.group("/docs/b/text")
    assert cache.stats()["hits"] == 2
    store.put("/docs/b/vec", b"new")
    wait_until(lambda: cache.stats()["groups"] == 1)  # the change feed dropped group b
    assert list(cache.group("/docs/b/text")) == ["/docs/b/text", "/docs/b/vec"]


def test_group_pools_come_from_the_node_outside_a_worker(store: Store, fake: FakeStore,
                                                         request: pytest.FixtureRequest) -> None:
    fake.pools = [{"prefix": "/u/", "keep_versions": 16, "keep_age_s": None, "affinity": "^/u/([0-9]+)/"}]
    store.put("/u/1/a", b"")
    store.put("/u/1/b", b"")
    store.put("/u/2/a", b"")
    cache = GroupCache(lambda: store)
    request.addfinalizer(cache.close)
    assert list(cache.group("/u/1/a")) == ["/u/1/a", "/u/1/b"]


# --- the CLI ---------------------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_argument_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["get", "/k", "--version", "1", "--as-of", "2"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["get", "/k", "--as-of", "yesterday"])
    with pytest.raises(SystemExit):
        cli.main(["put", "/k"])
    assert "not allowed with argument --version" in capsys.readouterr().err
    rc, _, err = run_cli(capsys, "put", "no-slash", "-", "--url", "http://127.0.0.1:9")
    assert rc == 1 and err.strip() == "slipstream: error: invalid key 'no-slash': a key starts with '/'"
    rc, _, err = run_cli(capsys, "put", "/k", str(tmp_path / "missing"), "--url", "http://127.0.0.1:9")
    assert rc == 1 and "cannot read" in err and "No such file" in err and err.count("\n") == 1
    rc, _, err = run_cli(capsys, "put", "/k", str(tmp_path), "--url", "http://127.0.0.1:9")
    assert rc == 1 and "is not a file" in err
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    rc, _, err = run_cli(capsys, "put", "/k", str(tmp_path / "x.npz"), "--npz", "--url", "http://127.0.0.1:9")
    assert rc == 1 and "cannot read" in err
    rc, _, err = run_cli(capsys, "ls", "--url", "http://127.0.0.1:9")
    assert rc == 1 and "no node answers at http://127.0.0.1:9" in err and err.count("\n") == 1


def test_cli_serve_store_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_STORE", raising=False)
    a = cli.build_parser().parse_args(["serve", "app.py"])
    cfg = config.resolve(a)
    assert (cfg["store"], cfg["store_max_value_mb"]) == (None, 1024)
    monkeypatch.setenv("SLIPSTREAM_STORE", "/var/lib/ss")
    a = cli.build_parser().parse_args(["serve", "app.py", "--store-max-value-mb", "64"])
    cfg = config.resolve(a)
    assert (cfg["store"], cfg["store_max_value_mb"]) == ("/var/lib/ss", 64)
    assert cfg.sources["store"] == "env SLIPSTREAM_STORE"


def test_cli_put_get_ls_versions_rm(capsys: pytest.CaptureFixture[str], fake: FakeStore, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url = ("--url", fake.url)
    src = tmp_path / "w.bin"
    src.write_bytes(b"weights")
    rc, out, _ = run_cli(capsys, "put", "/models/w", str(src), *url)
    assert rc == 0 and out.startswith("/models/w version 1 (7 B, application/octet-stream)")
    rc, _, err = run_cli(capsys, "put", "/models/w", str(src), "--if-version", "0", *url)
    assert rc == 1 and "version 1" in err
    np.savez(tmp_path / "t.npz", a=np.zeros((2, 3), np.float32), b=np.arange(4))
    rc, out, _ = run_cli(capsys, "put", "/models/t", str(tmp_path / "t.npz"), "--npz", *url)
    assert rc == 0 and TENSORS in out
    rc, out, _ = run_cli(capsys, "get", "/models/t", *url)
    assert rc == 0 and "a" in out and "float32  [2, 3]" in out and "int64    [4]" in out
    dst = tmp_path / "out.bin"
    rc, _, err = run_cli(capsys, "get", "/models/w", "-o", str(dst), *url)
    assert rc == 0 and dst.read_bytes() == b"weights" and "wrote" in err
    stdout = tmp_path / "stdout"
    with open(stdout, "w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        assert cli.main(["get", "/models/w", *url]) == 0
    assert stdout.read_bytes() == b"weights"
    monkeypatch.undo()
    rc, out, _ = run_cli(capsys, "ls", "/models/", *url)
    assert rc == 0 and [line.split()[0] for line in out.splitlines()] == ["/models/t", "/models/w"]
    rc, out, _ = run_cli(capsys, "rm", "/models/w", *url)
    assert rc == 0 and "tombstone version 2" in out
    rc, out, _ = run_cli(capsys, "versions", "/models/w", *url)
    assert rc == 0 and out.splitlines()[1].endswith("deleted")
    rc, _, err = run_cli(capsys, "get", "/models/w", *url)
    assert rc == 1 and "deleted" in err


def test_content_type_of_a_file() -> None:
    from slipstream._internal.named_tensors import guess_content_type

    assert guess_content_type(b"SSTN", "weights.txt") == ss.store.TENSORS  # the bytes decide first
    assert guess_content_type(b"hi", "notes.txt") == "text/plain; charset=utf-8"
    assert guess_content_type(b"{}", "a.json") == "application/json"
    assert guess_content_type(b"\x1f\x8b", "a.tar.gz") == ss.store.OCTETS  # compressed: not its inner type
    assert guess_content_type(b"xx", None) == guess_content_type(b"xx", "model.onnx") == ss.store.OCTETS
