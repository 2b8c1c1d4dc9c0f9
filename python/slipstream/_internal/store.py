"""The object store client (``slipstream.store``): versioned keys on the node.

Models, indices and documents live in the node's store (the contract is
docs/design/store.md). This module is the Python side of its HTTP routes;
the values' content types and the named-tensor codec are
``named_tensors.py``'s, the key rules ``keys.py``'s.

Why it looks the way it does:

- **Zero copy for large values.** ``get`` first asks for the version's
  metadata; when the node says the value is a blob file and that file is
  on this machine (a worker beside its node), the file is memory-mapped
  read-only and ``Object.memoryview()`` / ``Object.tensors()`` are views
  over the map, so a 1 GB model is neither copied nor held twice. Asking
  for the metadata pins the blob against garbage collection for 60 s,
  long enough to map it; once mapped, the pages stay valid even if the node
  later removes the file. Otherwise the bytes come over HTTP, read straight
  into a 64-byte aligned buffer (tensor data then stays aligned too).
- **Pooled keep-alive connections**, shared by threads: the transport
  ``ss.Client`` uses (``http_transport.py``; no dependency).
- **Errors are the ``slipstream.StoreError`` tree**, mapped from the node's
  error kind (or the HTTP status) by ``errors.error_from_response``, so
  callers catch ``StoreNotFound`` rather than parse messages; no answer at
  all is ``StoreUnavailable``.
"""

from __future__ import annotations

import builtins
import json
import math
import mmap
import os
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias, TypeGuard

import numpy as np

from slipstream._internal.errors import (
    BadRequest,
    ClientTimeout,
    StoreBadRequest,
    StoreError,
    StoreNotFound,
    StoreUnavailable,
    TensorFormatError,
    Unreachable,
    error_from_response,
)
from slipstream._internal.http_transport import Response, Transport
from slipstream._internal.keys import check_key, check_prefix
from slipstream._internal.named_tensors import (
    OCTETS,
    TENSORS,
    TEXT,
    decode_tensors,
    encode_tensors,
)

DEFAULT_URL = "http://127.0.0.1:8000"

#: What ``put`` stores: raw bytes, text (UTF-8), one array (stored as the
#: named tensor ``"value"``) or named arrays.
Value: TypeAlias = "bytes | bytearray | memoryview | str | np.ndarray | Mapping[str, np.ndarray]"


def encode_value(value: Value, content_type: str | None = None) -> tuple[list[bytes | memoryview], str]:
    """A value to store as (body pieces, content type): bytes as they are,
    ``str`` as UTF-8 text, an array as the named tensor ``"value"``, a dict
    of arrays as named tensors."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        mv = memoryview(value)
        body = mv.cast("B") if mv.c_contiguous else memoryview(mv.tobytes())
        return [body], content_type or OCTETS
    if isinstance(value, str):
        return [value.encode("utf-8")], content_type or TEXT
    if isinstance(value, (np.ndarray, Mapping)):
        if content_type not in (None, TENSORS):
            raise StoreBadRequest(f"arrays are stored as {TENSORS}, not {content_type}")
        return encode_tensors({"value": value} if isinstance(value, np.ndarray) else value), TENSORS
    raise StoreBadRequest(
        f"cannot store a {type(value).__name__}: give bytes, str, a numpy array or a dict of numpy arrays"
    )


# --- what the node answers -----------------------------------------------------


@dataclass(frozen=True)
class Version:
    """One version of a key, as the node describes it (a put, a delete's
    tombstone, a listing entry or a version's metadata). ``timestamp`` is
    unix seconds; ``path`` is the node's blob file for large values (only in
    metadata)."""

    key: str
    version: int
    timestamp: float
    size: int = 0
    content_type: str = OCTETS
    deleted: bool = False
    path: str | None = None

    @staticmethod
    def from_json(d: Mapping[str, Any], key: str | None = None) -> Version:
        return Version(
            key=str(d.get("key", key)),
            version=int(d["version"]),
            timestamp=float(d.get("timestamp") or 0.0),
            size=int(d.get("size") or 0),
            content_type=str(d.get("content_type") or OCTETS),
            deleted=bool(d.get("deleted", False)),
            path=d.get("path") or None,
        )


@dataclass(frozen=True)
class Change:
    """One entry of the change feed: a put (``deleted`` False) or a delete
    under the watched prefix, with its node-wide sequence number."""

    seq: int
    key: str
    version: int
    timestamp: float
    deleted: bool = False

    @property
    def op(self) -> str:
        """``"put"`` or ``"delete"``, as a trigger's ``op`` input says it."""
        return "delete" if self.deleted else "put"

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Change:
        return Change(seq=int(d["seq"]), key=str(d["key"]), version=int(d["version"]),
                      timestamp=float(d.get("timestamp") or 0.0), deleted=bool(d.get("deleted", False)))


class KeyList(list[Version]):
    """``keys()``'s answer: the live keys' latest versions, in key order.
    ``truncated`` is True when more keys matched than the limit."""

    truncated: bool = False


class Object:
    """One version of a key's value.

    ``memoryview()`` and ``tensors()`` are read-only views (over a memory
    map of the node's blob file when ``path`` is set, else over the bytes
    read from the node); arrays made from it keep the underlying buffer
    alive on their own. ``bytes()`` copies."""

    __slots__ = ("key", "version", "timestamp", "size", "content_type", "deleted", "path", "_buf", "_tensors")

    def __init__(self, meta: Version, buf: memoryview, path: str | None = None):
        self.key = meta.key
        self.version = meta.version
        self.timestamp = meta.timestamp
        self.size = meta.size
        self.content_type = meta.content_type
        self.deleted = meta.deleted
        #: The blob file this value is mapped from, or None when it was read over HTTP.
        self.path = path
        self._buf = buf
        self._tensors: dict[str, np.ndarray] | None = None

    def bytes(self) -> builtins.bytes:
        """The value as ``bytes`` (a copy)."""
        return self._buf.tobytes()

    def memoryview(self) -> builtins.memoryview:
        """The value, read-only, without a copy."""
        return self._buf

    def text(self, encoding: str = "utf-8") -> str:
        return str(self._buf, encoding)

    def tensors(self) -> dict[str, np.ndarray]:
        """The named tensors of a tensors value, as read-only views (a put of
        one array gives ``{"value": array}``)."""
        if self._tensors is None:
            if self.content_type != TENSORS:
                raise TensorFormatError(f"{self.key} (version {self.version}) is {self.content_type}, "
                                        f"not named tensors")
            self._tensors = decode_tensors(self._buf)
        return dict(self._tensors)

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        where = f", mapped from {self.path}" if self.path else ""
        return f"Object({self.key!r}, version={self.version}, {self.size} bytes, {self.content_type}{where})"


def map_blob(path: str, size: int) -> memoryview | None:
    """A read-only memory map of ``path`` if it is a file of ``size`` bytes on
    this machine, else None (the caller reads over HTTP instead)."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    with f:
        if os.fstat(f.fileno()).st_size != size:
            return None
        if size == 0:
            return memoryview(b"")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if len(m) != size:
        return None
    return memoryview(m)


# --- the client ------------------------------------------------------------------


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


class Store:
    """A client of one node's object store. Thread-safe: threads share its
    keep-alive connections.

    ``url`` defaults to ``$SLIPSTREAM_NODE_URL`` (set in workers), else
    http://127.0.0.1:8000; ``token`` (the node's admin token, needed for
    writes when the node has one) to ``$SLIPSTREAM_STORE_TOKEN``, else
    ``$SLIPSTREAM_ADMIN_TOKEN``. ``timeout`` is seconds per request (a
    watch waits its ``timeout_ms`` on top)."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("SLIPSTREAM_NODE_URL") or DEFAULT_URL).rstrip("/")
        try:
            self._http = Transport(self.url)
        except BadRequest:
            raise StoreBadRequest(f"a node URL looks like http://127.0.0.1:8000, got {self.url!r}") from None
        if token is None:
            token = os.environ.get("SLIPSTREAM_STORE_TOKEN") or os.environ.get("SLIPSTREAM_ADMIN_TOKEN") or None
        self.token = token
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # -- objects

    def put(self, key: str, value: Value, *, if_version: int | None = None,
            content_type: str | None = None) -> Version:
        """Store ``value`` as the next version of ``key``. ``if_version``: only
        if the key's latest version (tombstones count, 0 = never written) is
        that one, else ``StoreConflict`` with ``.current``."""
        check_key(key, write=True)
        body, ctype = encode_value(value, content_type)
        query = {} if if_version is None else {"if_version": _nonneg(if_version, "if_version")}
        reply = self._json("PUT", _object_path(key), query=query, body=body,
                           headers={"Content-Type": ctype}, key=key)
        return Version.from_json(reply, key)

    def meta(self, key: str, *, version: int | None = None, as_of: float | None = None) -> Version:
        """The metadata of ``key``'s latest version (or ``version``, or the one
        current at unix time ``as_of``), without its value."""
        check_key(key)
        query: dict[str, Any] = {"meta": 1, **_version_query(version, as_of)}
        return Version.from_json(self._json("GET", _object_path(key), query=query, key=key), key)

    def get(self, key: str, *, version: int | None = None, as_of: float | None = None) -> Object:
        """``key``'s latest value (or ``version``'s, or the one current at unix
        time ``as_of``). A large value on this machine is memory-mapped, not
        copied (see the module's docs). ``StoreNotFound`` when absent or
        deleted."""
        meta = self.meta(key, version=version, as_of=as_of)
        if meta.deleted:
            raise StoreNotFound(f"{key} is deleted (version {meta.version})", status=404, key=key)
        if meta.path:
            mapped = map_blob(meta.path, meta.size)
            if mapped is not None:
                return Object(meta, mapped, meta.path)
        resp = self._send("GET", _object_path(key), query={"version": meta.version}, key=key, aligned=True)
        buf = resp.body.toreadonly()
        return Object(replace(meta, size=len(buf)), buf)

    def delete(self, key: str, *, if_version: int | None = None) -> Version:
        """Write a tombstone version of ``key`` (``StoreNotFound`` if absent or
        already deleted). The node's own records (``/_slipstream/...``, e.g.
        failed triggers) may be deleted once handled."""
        check_key(key)
        query = {} if if_version is None else {"if_version": _nonneg(if_version, "if_version")}
        return Version.from_json(self._json("DELETE", _object_path(key), query=query, body=[], key=key), key)

    def versions(self, key: str) -> list[Version]:
        """The versions of ``key`` that retention kept, oldest first (tombstones included)."""
        check_key(key)
        reply = self._json("GET", "/v1/store/versions" + _quote(key), key=key)
        return [Version.from_json(v, key) for v in reply.get("versions", [])]

    def keys(self, prefix: str = "/", limit: int = 1000) -> KeyList:
        """The live keys under ``prefix`` (a plain string prefix) in key order,
        each with its latest version; at most ``limit`` (1..100000)."""
        check_prefix(prefix)
        if not _is_int(limit) or not 1 <= limit <= 100_000:
            raise StoreBadRequest(f"limit is an integer in 1..100000, got {limit!r}")
        reply = self._json("GET", "/v1/store/keys", query={"prefix": prefix, "limit": limit})
        out = KeyList(Version.from_json(v) for v in reply.get("keys", []))
        out.truncated = bool(reply.get("truncated", False))
        return out

    ls = keys

    # -- change feed

    def watch(self, prefix: str, since: int | None = None, timeout_ms: int = 30_000) -> tuple[int, list[Change]]:
        """Changes under ``prefix`` after sequence number ``since``, waiting up
        to ``timeout_ms`` (at most 300000) for one: ``(seq, changes)``; pass
        ``seq`` as the next ``since``. Without ``since``: the current
        sequence number and no changes (see ``cursor``). ``StoreGone`` when
        ``since`` is older than the feed the node keeps."""
        check_prefix(prefix)
        if not _is_int(timeout_ms) or not 0 <= timeout_ms <= 300_000:
            raise StoreBadRequest(f"timeout_ms is an integer in 0..300000, got {timeout_ms!r}")
        query: dict[str, Any] = {"prefix": prefix, "timeout_ms": timeout_ms}
        if since is not None:
            query["since"] = _nonneg(since, "since")
        reply = self._json("GET", "/v1/store/watch", query=query, timeout=self.timeout + timeout_ms / 1000)
        return int(reply["seq"]), [Change.from_json(c) for c in reply.get("changes", [])]

    def rollout(self, key: str, version: int, timeout_ms: int = 30_000) -> list[str]:
        """A model update's gate: wait up to ``timeout_ms`` until every node
        placed to run a stage that needs ``key`` holds its ``version``.
        Returns the nodes still without it (empty: every one holds it; on
        one machine at once)."""
        reply = self._json("GET", "/v1/store/rollout" + _quote(key), key=key,
                           query={"version": version, "timeout_ms": timeout_ms},
                           timeout=self.timeout + timeout_ms / 1000)
        return [str(n) for n in reply.get("waiting_for", [])]

    def cursor(self, prefix: str = "/") -> int:
        """The current sequence number: ``watch(prefix, since=cursor(prefix))``
        then sees exactly the changes made after this call."""
        return self.watch(prefix, timeout_ms=0)[0]

    def trigger_put(self, key: str, value: Value, *, content_type: str | None = None) -> int:
        """Fire the watchers of ``key`` with ``value`` as if it were put,
        without storing it; returns how many pipelines were invoked."""
        check_key(key, write=True)
        body, ctype = encode_value(value, content_type)
        reply = self._json("POST", "/v1/store/trigger" + _quote(key), body=body,
                           headers={"Content-Type": ctype}, key=key)
        return int(reply.get("fired", 0))

    def stats(self) -> dict[str, Any]:
        """The store's totals: ``path``, ``keys``, ``versions``, ``bytes``,
        ``seq`` and ``pools``."""
        reply: dict[str, Any] = self._json("GET", "/v1/store")
        return reply

    def close(self) -> None:
        """Close the idle connections (those in use close when their request returns)."""
        self._http.close()

    # -- HTTP

    def _send(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
              body: Sequence[builtins.bytes | memoryview] = (), headers: Mapping[str, str] | None = None,
              timeout: float | None = None, key: str | None = None, aligned: bool = False) -> Response:
        """Send a request; the answer of a success, else the mapped error."""
        if self.token:
            headers = {**(headers or {}), "Authorization": f"Bearer {self.token}"}
        try:
            resp = self._http.request(method, path, query=query, headers=headers, body=body, aligned=aligned,
                                      timeout=self.timeout if timeout is None else timeout)
        except (Unreachable, ClientTimeout) as e:
            raise StoreUnavailable(str(e), key=key) from None
        if resp.status >= 300:
            raise error_from_response(resp.status, resp.headers, resp.body, tree=StoreError, key=key)
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._send(method, path, **kw)
        try:
            return json.loads(bytes(resp.body))
        except ValueError:
            raise StoreError(f"the node answered {method} {path} with something not JSON", status=resp.status,
                             key=kw.get("key")) from None


def _quote(key: str) -> str:
    return urllib.parse.quote(key, safe="/")


def _object_path(key: str) -> str:
    return "/v1/store/objects" + _quote(key)


def _nonneg(v: Any, what: str) -> int:
    if not _is_int(v) or v < 0:
        raise StoreBadRequest(f"{what} is a non-negative integer, got {v!r}")
    return int(v)


def _version_query(version: int | None, as_of: float | None) -> dict[str, Any]:
    if version is not None and as_of is not None:
        raise StoreBadRequest("give version or as_of, not both")
    if version is not None:
        if not _is_int(version) or version < 1:
            raise StoreBadRequest(f"version is an integer >= 1, got {version!r}")
        return {"version": version}
    if as_of is not None:
        if isinstance(as_of, bool) or not isinstance(as_of, (int, float)) or not math.isfinite(as_of):
            raise StoreBadRequest(f"as_of is unix time in seconds, got {as_of!r}")
        return {"as_of": repr(float(as_of))}
    return {}


# --- the default client ------------------------------------------------------------

_default: Store | None = None
_default_lock = threading.Lock()


def default_store() -> Store:
    """The client the module-level functions use, made on first use from
    ``$SLIPSTREAM_NODE_URL`` and ``$SLIPSTREAM_STORE_TOKEN`` /
    ``$SLIPSTREAM_ADMIN_TOKEN`` (in a worker: its own node)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Store()
        return _default


def put(key: str, value: Value, *, if_version: int | None = None, content_type: str | None = None) -> Version:
    """``Store.put`` on the default store."""
    return default_store().put(key, value, if_version=if_version, content_type=content_type)


def get(key: str, *, version: int | None = None, as_of: float | None = None) -> Object:
    """``Store.get`` on the default store."""
    return default_store().get(key, version=version, as_of=as_of)


def meta(key: str, *, version: int | None = None, as_of: float | None = None) -> Version:
    """``Store.meta`` on the default store."""
    return default_store().meta(key, version=version, as_of=as_of)


def delete(key: str, *, if_version: int | None = None) -> Version:
    """``Store.delete`` on the default store."""
    return default_store().delete(key, if_version=if_version)


def versions(key: str) -> list[Version]:
    """``Store.versions`` on the default store."""
    return default_store().versions(key)


def keys(prefix: str = "/", limit: int = 1000) -> KeyList:
    """``Store.keys`` on the default store."""
    return default_store().keys(prefix, limit)


ls = keys


def watch(prefix: str, since: int | None = None, timeout_ms: int = 30_000) -> tuple[int, list[Change]]:
    """``Store.watch`` on the default store."""
    return default_store().watch(prefix, since, timeout_ms)


def cursor(prefix: str = "/") -> int:
    """``Store.cursor`` on the default store."""
    return default_store().cursor(prefix)


def trigger_put(key: str, value: Value, *, content_type: str | None = None) -> int:
    """``Store.trigger_put`` on the default store."""
    return default_store().trigger_put(key, value, content_type=content_type)


def stats() -> dict[str, Any]:
    """``Store.stats`` on the default store."""
    return default_store().stats()
