"""The object store client (``slipstream.store``): versioned keys on the node.

Models, indices and documents live in the node's store (the contract is
docs/design/store.md). This module is the Python side of its HTTP routes,
plus the named-tensor codec the node validates on put.

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
- **One keep-alive connection per thread** (``http.client``; no
  dependency), reopened once when the node closed an idle one.
- **Errors are the ``slipstream.StoreError`` tree**, mapped from the node's
  error kind (or the HTTP status), so callers catch ``StoreNotFound``
  rather than parse messages.
"""

from __future__ import annotations

import builtins
import http.client
import json
import math
import mmap
import os
import re
import struct
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias, TypeGuard

import numpy as np

from slipstream._internal.api import DTYPES, VAR_DTYPES
from slipstream._internal.errors import (
    StoreBadRequest,
    StoreConflict,
    StoreError,
    StoreGone,
    StoreNotFound,
    StoreUnauthorized,
    StoreUnavailable,
    TensorFormatError,
)
from slipstream._internal.keys import key_problem, prefix_problem

DEFAULT_URL = "http://127.0.0.1:8000"
OCTETS = "application/octet-stream"
TENSORS = "application/x-slipstream-tensors"
TEXT = "text/plain; charset=utf-8"

#: What ``put`` stores: raw bytes, text (UTF-8), one array (stored as the
#: named tensor ``"value"``) or named arrays.
Value: TypeAlias = "bytes | bytearray | memoryview | str | np.ndarray | Mapping[str, np.ndarray]"
Buffer: TypeAlias = "bytes | bytearray | memoryview | mmap.mmap | np.ndarray"


# --- keys ------------------------------------------------------------------


def check_key(key: str, *, write: bool = False) -> str:
    """``key`` if it is a valid key, else ``StoreBadRequest`` saying why."""
    problem = key_problem(key, write=write)
    if problem is not None:
        raise StoreBadRequest(f"invalid key {key!r}: {problem}", key=key if isinstance(key, str) else None)
    return key


def check_prefix(prefix: str) -> str:
    problem = prefix_problem(prefix)
    if problem is not None:
        raise StoreBadRequest(f"invalid prefix {prefix!r}: {problem}")
    return prefix


# --- named tensors -----------------------------------------------------------

_MAGIC = b"SSTN"
_FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<4sIQ")  # magic, format version, header length
ALIGN = 64
#: The dtypes a named-tensor value may hold: the runtime's numeric ones.
TENSOR_DTYPES = tuple(d for d in DTYPES if d not in VAR_DTYPES)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def encode_tensors(tensors: Mapping[str, Any]) -> list[bytes | memoryview]:
    """Named arrays as an ``application/x-slipstream-tensors`` value, in
    pieces: the preamble and JSON header, then each array's own buffer (no
    copy when it is already C-contiguous and little-endian), with zero
    padding so every offset is a multiple of 64. ``b"".join(...)`` gives the
    value as one ``bytes`` (e.g. to write a seed file)."""
    if not isinstance(tensors, Mapping):
        raise TensorFormatError(f"named tensors are a dict of name -> array, got {type(tensors).__name__}")
    header: dict[str, dict[str, Any]] = {}
    arrays: list[np.ndarray] = []
    offset = 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise TensorFormatError(f"tensor names are non-empty strings, got {name!r}")
        a = np.asarray(value)
        if a.dtype.name not in TENSOR_DTYPES:
            raise TensorFormatError(
                f"tensor {name!r} has dtype {a.dtype}; named tensors hold {', '.join(TENSOR_DTYPES)}"
            )
        a = np.asarray(a, dtype=a.dtype.newbyteorder("<"), order="C")
        header[name] = {"dtype": a.dtype.name, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes}
        arrays.append(a)
        offset += _align(a.nbytes)
    text = json.dumps(header, separators=(",", ":")).encode()
    head = _PREAMBLE.pack(_MAGIC, _FORMAT_VERSION, len(text)) + text
    parts: list[bytes | memoryview] = [head + bytes(_align(len(head)) - len(head))]
    for i, a in enumerate(arrays):
        if a.nbytes:
            parts.append(a.reshape(-1).view(np.uint8).data)
        pad = _align(a.nbytes) - a.nbytes
        if pad and i < len(arrays) - 1:
            parts.append(bytes(pad))
    return parts


def _byte_view(buf: Buffer) -> memoryview:
    mv = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise TensorFormatError("named tensors must be read from a contiguous buffer")
        mv = mv.cast("B")
    return mv


def decode_tensors(buf: Buffer) -> dict[str, np.ndarray]:
    """The arrays of an ``application/x-slipstream-tensors`` value, as
    read-only views over ``buf`` (no copy; each array keeps ``buf`` alive).
    Every field is checked; a malformed value raises ``TensorFormatError``
    saying what is wrong, never an out-of-bounds read."""
    mv = _byte_view(buf)
    n = len(mv)
    if n < _PREAMBLE.size:
        raise TensorFormatError(f"named tensors: {n} bytes is shorter than the {_PREAMBLE.size}-byte preamble")
    magic, version, hlen = _PREAMBLE.unpack_from(mv, 0)
    if magic != _MAGIC:
        raise TensorFormatError(f"named tensors: the value starts with {bytes(magic)!r}, not {_MAGIC!r}")
    if version != _FORMAT_VERSION:
        raise TensorFormatError(f"named tensors: format version {version} (this client reads {_FORMAT_VERSION})")
    if hlen > n - _PREAMBLE.size:
        raise TensorFormatError(f"named tensors: a {hlen}-byte header does not fit in a {n}-byte value")
    try:
        header = json.loads(bytes(mv[_PREAMBLE.size:_PREAMBLE.size + hlen]))
    except (UnicodeDecodeError, ValueError) as e:
        raise TensorFormatError(f"named tensors: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise TensorFormatError("named tensors: the header is not a JSON object")
    start = _align(_PREAMBLE.size + hlen)
    data_len = max(0, n - start)
    out: dict[str, np.ndarray] = {}
    for name, entry in header.items():
        dtype, shape, offset, nbytes = _check_entry(name, entry)
        if offset + nbytes > data_len:
            raise TensorFormatError(
                f"named tensors: {name!r} (data bytes {offset}..{offset + nbytes}) lies outside the "
                f"value's {data_len} bytes of data"
            )
        count = math.prod(shape)
        if count == 0:
            a = np.zeros(shape, dtype=dtype)
        else:
            a = np.frombuffer(mv, dtype=dtype, count=count, offset=start + offset).reshape(shape)
        a.flags.writeable = False
        out[name] = a
    return out


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(name: str, entry: Any) -> tuple[np.dtype[Any], list[int], int, int]:
    """One header entry, checked: (dtype, shape, offset, nbytes)."""
    what = f"named tensors: {name!r}"
    if not isinstance(entry, dict):
        raise TensorFormatError(f"{what}: the entry is not an object")
    dtype = entry.get("dtype")
    if dtype not in TENSOR_DTYPES:
        raise TensorFormatError(f"{what}: dtype {dtype!r} is not one of {', '.join(TENSOR_DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise TensorFormatError(f"{what}: shape {shape!r} is not a list of non-negative integers")
    offset, nbytes = entry.get("offset"), entry.get("nbytes")
    if not _is_int(offset) or offset < 0 or offset % ALIGN:
        raise TensorFormatError(f"{what}: offset {offset!r} is not a non-negative multiple of {ALIGN}")
    dt = np.dtype(dtype).newbyteorder("<")
    if not _is_int(nbytes) or nbytes != math.prod(shape) * dt.itemsize:
        raise TensorFormatError(
            f"{what}: nbytes {nbytes!r} is not prod(shape) x itemsize = {math.prod(shape) * dt.itemsize}"
        )
    return dt, shape, offset, nbytes


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


def guess_content_type(head: bytes, name: str | None = None) -> str:
    """The content type of a file: named tensors by their magic, else what
    its name says (``notes.txt``: text/plain), else octets."""
    if head[:4] == _MAGIC:
        return TENSORS
    if name:
        import mimetypes

        guessed, encoding = mimetypes.guess_type(name)
        if guessed and encoding is None:
            return f"{guessed}; charset=utf-8" if guessed.startswith("text/") else guessed
    return OCTETS


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


# --- errors ----------------------------------------------------------------------

_BY_KIND: dict[str, type[StoreError]] = {
    "not_found": StoreNotFound,
    "conflict": StoreConflict,
    "gone": StoreGone,
    "bad_request": StoreBadRequest,
    "bad_input": StoreBadRequest,
    "payload_too_large": StoreBadRequest,
    "unauthorized": StoreUnauthorized,
    "forbidden": StoreUnauthorized,
    "unavailable": StoreUnavailable,
    "store_unavailable": StoreUnavailable,
    "shutting_down": StoreUnavailable,
    "overloaded": StoreUnavailable,
}
_BY_STATUS: dict[int, type[StoreError]] = {
    400: StoreBadRequest, 401: StoreUnauthorized, 403: StoreUnauthorized, 404: StoreNotFound,
    409: StoreConflict, 410: StoreGone, 413: StoreBadRequest, 429: StoreUnavailable, 503: StoreUnavailable,
}


def error_from_response(status: int, kind: str | None, raw: builtins.bytes, key: str | None = None) -> StoreError:
    """The exception for an error answer. The node's bodies are
    ``{"error": {"kind", "message"}}`` (and the kind is also in the
    ``x-slipstream-error-kind`` header, passed as ``kind``); the flat
    ``{"error": message, "kind": kind}`` is read too. A conflict's
    ``current`` may sit at either level."""
    message: str | None = None
    current: Any = None
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            kind = kind or err.get("kind")
            message = err.get("message")
            current = err.get("current")
        elif isinstance(err, str):
            message = err
        kind = kind or body.get("kind")
        current = body.get("current", current)
    if not message:
        message = raw.decode("utf-8", "replace").strip() or f"HTTP {status}"
    message = " ".join(str(message).split())  # one line
    cls = _BY_KIND.get(kind or "") or _BY_STATUS.get(status, StoreError)
    if cls is StoreConflict:
        if not _is_int(current):  # the node's message names it: "..., the key is at 7"
            m = re.search(r"the key is at (\d+)", message)
            current = int(m.group(1)) if m else None
        return StoreConflict(message, status=status, key=key, current=current)
    return cls(message, status=status, key=key)


# --- the client ------------------------------------------------------------------

_DROPPED = (http.client.RemoteDisconnected, http.client.CannotSendRequest, ConnectionResetError,
            ConnectionAbortedError, BrokenPipeError)


class Store:
    """A client of one node's object store. Thread-safe: each thread keeps
    its own keep-alive connection.

    ``url`` defaults to ``$SLIPSTREAM_NODE_URL`` (set in workers), else
    http://127.0.0.1:8000; ``token`` (the node's admin token, needed for
    writes when the node has one) to ``$SLIPSTREAM_STORE_TOKEN``, else
    ``$SLIPSTREAM_ADMIN_TOKEN``. ``timeout`` is seconds per request (a
    watch waits its ``timeout_ms`` on top)."""

    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get("SLIPSTREAM_NODE_URL") or DEFAULT_URL).rstrip("/")
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StoreBadRequest(f"a node URL looks like http://127.0.0.1:8000, got {self.url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._base = parts.path.rstrip("/")
        if token is None:
            token = os.environ.get("SLIPSTREAM_STORE_TOKEN") or os.environ.get("SLIPSTREAM_ADMIN_TOKEN") or None
        self.token = token
        self.timeout = float(timeout)
        self._local = threading.local()

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
        resp = self._open("GET", _object_path(key), query={"version": meta.version}, key=key)
        buf = self._read_aligned(resp)
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
        """Close this thread's connection (others close with their threads)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    # -- HTTP

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout)
            self._local.conn = conn
        return conn

    def _open(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
              body: Sequence[builtins.bytes | memoryview] | None = None, headers: Mapping[str, str] | None = None,
              timeout: float | None = None, key: str | None = None) -> http.client.HTTPResponse:
        """Send a request and return the response of a success (its body
        unread: the caller reads all of it), or raise the mapped error."""
        # %20 for a space: the node keeps '+' as it is (keys may hold it).
        target = self._base + path + ("?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote) if query else "")
        wait = self.timeout if timeout is None else timeout
        for attempt in (0, 1):
            conn = self._connection()
            reused = conn.sock is not None
            try:
                conn.timeout = wait
                if conn.sock is not None:
                    conn.sock.settimeout(wait)
                conn.putrequest(method, target, skip_accept_encoding=True)
                if self.token:
                    conn.putheader("Authorization", f"Bearer {self.token}")
                for k, v in (headers or {}).items():
                    conn.putheader(k, v)
                size = sum(len(p) for p in body or ())
                if body is not None:
                    conn.putheader("Content-Length", str(size))
                if size < 2000:  # one packet with the headers
                    conn.endheaders(b"".join(body or ()))
                else:
                    conn.endheaders()
                    for part in body or ():
                        conn.send(part)
                resp = conn.getresponse()
                break
            except _DROPPED as e:
                # A keep-alive connection the node closed while idle: open a
                # new one and send again, once.
                self.close()
                if reused and attempt == 0:
                    continue
                raise StoreUnavailable(f"the node at {self.url} closed the connection ({e})", key=key) from None
            except TimeoutError:
                self.close()
                raise StoreUnavailable(f"no answer from {self.url} within {wait:g} s", key=key) from None
            except OSError as e:
                self.close()
                raise StoreUnavailable(f"no node answers at {self.url} ({e}); is `slipstream serve` running?",
                                       key=key) from None
        if resp.status >= 300:
            raw = self._read_all(resp)
            raise error_from_response(resp.status, resp.getheader("x-slipstream-error-kind"), raw, key)
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._open(method, path, **kw)
        raw = self._read_all(resp)
        try:
            return json.loads(raw)
        except ValueError:
            raise StoreError(f"the node answered {method} {path} with something not JSON", status=resp.status,
                             key=kw.get("key")) from None

    def _read_all(self, resp: http.client.HTTPResponse) -> builtins.bytes:
        try:
            return resp.read()
        except (http.client.HTTPException, OSError) as e:
            self.close()
            raise StoreUnavailable(f"the answer from {self.url} broke off ({e})") from None

    def _read_aligned(self, resp: http.client.HTTPResponse) -> memoryview:
        """The response body in a 64-byte aligned, read-only buffer."""
        n = resp.length
        if n is None:  # not sized: read it whole
            return memoryview(self._read_all(resp))
        raw = np.empty(n + ALIGN, dtype=np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        view = raw[start:start + n]
        target = view.data
        got = 0
        try:
            while got < n:
                k = resp.readinto(target[got:])
                if not k:
                    raise http.client.IncompleteRead(b"", n - got)
                got += k
            if not resp.isclosed():  # an empty body: finish the response so the connection can be reused
                resp.read()
        except (http.client.HTTPException, OSError) as e:
            self.close()
            raise StoreUnavailable(f"the answer from {self.url} broke off after {got} of {n} bytes ({e})") from None
        view.flags.writeable = False
        return view.data


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
