"""The Python client of a node: ``ss.Client`` (threads) and ``ss.AsyncClient`` (asyncio).

    with ss.Client("http://127.0.0.1:8000") as c:
        out = c.infer("demo", {"x": np.ones((4, 2), np.float32)}, deadline_ms=50)
        out["y"]                      # numpy, a view over the response body

Why it looks the way it does:

- **Binary tensors.** Requests use KServe v2's binary tensor extension
  (``/v2/models/{name}/infer``: a JSON header of
  ``Inference-Header-Content-Length`` bytes, then each input's raw bytes,
  sized by ``binary_data_size``; codec/v2.rs) and ask for binary outputs
  (``binary_data_output``). Input arrays are sent from their own memory,
  without a JSON rendering of every number, and outputs are
  ``np.frombuffer`` views over the response body: no per-element parsing
  and no copy. The synchronous client reads the tensor bytes into a 64-byte
  aligned buffer of its own, so its arrays are aligned and writable; the
  asyncio client's are views over the bytes its stream returned, read-only.
  String and bytes tensors travel in v2's layout (each element a
  little-endian u32 length, then its bytes); since v2 calls both ``BYTES``,
  the pipeline's description (``GET /v1/pipelines/{name}``, fetched once
  and cached) says whether an output is text.
- **Dtypes are the caller's.** A numpy array (or torch tensor) is sent as
  it is: a float64 array for a float32 input is the node's ``BadInput``
  rather than a silent copy. Lists and scalars, which have no dtype of
  their own, are converted to the declared one.
- **Deadlines reach the node.** ``deadline_ms`` (or ``timeout`` in
  seconds) becomes the request's ``x-slipstream-deadline-ms`` header
  (http.rs ``arrival_of``): the node schedules and admits the request
  against it and drops it at the deadline rather than answering late
  (``DeadlineExceeded``). The socket waits a little longer than the
  deadline, so that the node's 504 is what arrives.
- **Connections are kept alive and pooled**: the synchronous client keeps
  idle ``http.client`` connections for the next call of any thread (one
  per thread in use at a time); the asyncio client speaks HTTP/1.1 over
  asyncio streams with at most ``max_connections`` connections, further
  calls waiting for a free one. A kept-alive connection the node closed
  while idle is noticed before it is used, and a request whose connection
  broke before any of its answer arrived is sent once more on a new one.
- **Errors are the ``slipstream.Error`` tree**: the node's error kind (the
  ``x-slipstream-error-kind`` header) picks the class (``errors.py``
  ``REQUEST_ERRORS``), so callers catch ``ss.Overloaded`` and read its
  ``retry_after``, or ``ss.DeadlineExceeded`` (a ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import math
import os
import select
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from slipstream._internal.errors import (
    BadInput,
    BadRequest,
    ClientTimeout,
    RequestError,
    Unreachable,
    request_error,
)
from slipstream._internal.varlen import decode_var, encode_var, var_kind

DEFAULT_URL = os.environ.get("SLIPSTREAM_URL", "http://127.0.0.1:8000")
DEADLINE_HEADER = "x-slipstream-deadline-ms"
ERROR_KIND_HEADER = "x-slipstream-error-kind"
FALLBACK_HEADER = "x-slipstream-fallback"
REQUEST_ID_HEADER = "x-slipstream-request-id"
ALIGN = 64
# Bodies up to this size go out in one write with the request line and
# headers (one packet); larger ones are sent from the arrays' own memory.
_JOIN_BELOW = 64 << 10

_V2: dict[str, str] = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
    "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}
_FROM_V2 = {v: k for k, v in _V2.items()}
_VAR = ("string", "bytes")


class Outputs(dict[str, Any]):
    """A pipeline's answer: output name -> array (numpy, or torch with
    ``as_torch=True``). ``fallback`` names why the pipeline's declared
    fallback answered instead of its stages (``"overloaded"``,
    ``"deadline_exceeded"``, ``"timeout"``), else None. ``request_id`` is
    the node's id of the request, for feedback on it (``Client.feedback``)."""

    fallback: str | None = None
    request_id: int | None = None


# --- encoding ------------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _as_array(name: str, value: Any, declared: str | None) -> np.ndarray:
    """An input as the array to send: arrays and tensors as they are (their
    dtype is the caller's), anything else converted to the declared dtype."""
    if _is_torch(value):
        try:
            value = value.detach().cpu().numpy()  # a view for CPU tensors
        except (TypeError, RuntimeError) as e:  # bfloat16, sparse, ...
            raise BadInput(f"input {name!r}: {e}", status=None) from None
    if isinstance(value, np.ndarray):
        a = value
    else:
        try:
            if declared in _VAR:
                a = np.empty(np.shape(value), dtype=object)
                a[...] = value
            else:
                a = np.asarray(value, dtype=declared)  # declared None: numpy's choice
        except (TypeError, ValueError) as e:
            raise BadInput(f"input {name!r} cannot be made a {declared or ''} array: {e}".replace("  ", " "),
                           status=None) from None
    little = a.dtype.newbyteorder("<")
    if a.dtype.kind not in "OUS" and a.dtype != little:
        a = a.astype(little)  # the wire is little-endian
    return a


def encode_inputs(inputs: Mapping[str, Any], declared: Mapping[str, str] | None = None
                  ) -> tuple[list[dict[str, Any]], list[bytes | memoryview]]:
    """The v2 input entries (binary, ``binary_data_size`` each) and the
    buffers holding their bytes, in order. ``declared``: input name ->
    declared dtype, used for values that are not arrays."""
    if not isinstance(inputs, Mapping):
        raise BadRequest(f"inputs is a dict of name -> array, got {type(inputs).__name__}", status=None)
    entries: list[dict[str, Any]] = []
    parts: list[bytes | memoryview] = []
    for name, value in inputs.items():
        if not isinstance(name, str):
            raise BadRequest(f"input names are strings, got {name!r}", status=None)
        a = _as_array(name, value, (declared or {}).get(name))
        var = var_kind(a)
        if var is not None:
            data: bytes | memoryview = encode_var(a)
            datatype = "BYTES"
        elif a.dtype.name in _V2:
            datatype = _V2[a.dtype.name]
            data = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data  # the array's own bytes
        else:
            raise BadInput(f"input {name!r} has dtype {a.dtype}, which a node cannot take "
                           f"(one of {', '.join(_V2)}, str or bytes)", status=None)
        entries.append({"name": name, "shape": list(a.shape), "datatype": datatype,
                        "parameters": {"binary_data_size": len(data)}})
        parts.append(data)
    return entries, parts


def encode_request(inputs: Mapping[str, Any], outputs: Sequence[str] | None = None,
                   declared: Mapping[str, str] | None = None) -> tuple[bytes, list[bytes | memoryview]]:
    """A KServe v2 binary request: its JSON header (to be sent with
    ``Inference-Header-Content-Length: len(header)``) and the tensor buffers
    that follow it. All outputs, or those named, are asked for as binary."""
    entries, parts = encode_inputs(inputs, declared)
    head: dict[str, Any] = {"inputs": entries, "parameters": {"binary_data_output": True}}
    if outputs is not None:
        if isinstance(outputs, str):
            outputs = [outputs]
        head["outputs"] = [{"name": str(n), "parameters": {"binary_data": True}} for n in outputs]
    return json.dumps(head, separators=(",", ":")).encode(), parts


def _deadline(deadline_ms: float | None, timeout: float | None) -> float | None:
    """The tighter of the two ways to state a deadline, in ms (None: none)."""
    ms = [float(v) for v in (deadline_ms, None if timeout is None else timeout * 1000.0) if v is not None]
    if not ms:
        return None
    d = min(ms)
    if not (d > 0 and math.isfinite(d)):
        raise BadRequest(f"a deadline is a positive number of milliseconds, got {d!r}", status=None)
    return d


def _socket_wait(deadline: float | None, default: float) -> float:
    """How long the socket waits for an answer: past the deadline by enough
    for the node's own 504 to arrive first."""
    if deadline is None:
        return default
    return deadline / 1000.0 * 1.1 + 1.0


# --- decoding ------------------------------------------------------------------


def _error(status: int, headers: Mapping[str, str], body: bytes) -> RequestError:
    kind = headers.get(ERROR_KIND_HEADER)
    message: Any = None
    try:
        doc = json.loads(body)
        err = doc.get("error") if isinstance(doc, dict) else None
        message = err.get("message") if isinstance(err, dict) else err
        if isinstance(err, dict) and not kind:
            kind = err.get("kind")
    except ValueError:
        pass
    if not message:
        message = body.decode("utf-8", "replace").strip() or f"HTTP {status}"
    retry = headers.get("retry-after")
    try:
        retry_after = float(retry) if retry is not None else None
    except ValueError:
        retry_after = None
    return request_error(status, kind, " ".join(str(message).split()), retry_after)


def _bytes_outputs(head: Mapping[str, Any]) -> list[str]:
    return [o["name"] for o in head.get("outputs", []) if o.get("datatype") == "BYTES"]


def decode_outputs(head: Mapping[str, Any], tail: memoryview, text: Mapping[str, bool]) -> Outputs:
    """A v2 answer's outputs: views over ``tail`` (the bytes after the JSON
    header) for binary outputs, arrays from ``data`` otherwise. ``text``:
    for BYTES outputs, whether they hold strings."""
    out = Outputs()
    at = 0
    try:
        for o in head["outputs"]:
            name, datatype, shape = o["name"], o["datatype"], [int(d) for d in o["shape"]]
            size = (o.get("parameters") or {}).get("binary_data_size")
            if size is not None:
                size = int(size)
                if at + size > len(tail):
                    raise RequestError(f"output {name!r} runs past the answer", kind="bad_response")
                buf = tail[at:at + size]
                at += size
                if datatype == "BYTES":
                    try:
                        out[name] = decode_var(buf, shape, text.get(name, False))
                    except ValueError as e:
                        raise RequestError(f"output {name!r}: its BYTES data is malformed: {e}",
                                           kind="bad_response") from None
                else:
                    dt = np.dtype(_FROM_V2[datatype]).newbyteorder("<")
                    out[name] = np.frombuffer(buf, dtype=dt, count=math.prod(shape)).reshape(shape)
            elif datatype == "BYTES":
                # JSON carries bytes in base64 (codec/json.rs), text as strings.
                a = np.empty(math.prod(shape), dtype=object)
                a[:] = [x if text.get(name, True) else base64.b64decode(x) for x in np.ravel(o["data"])]
                out[name] = a.reshape(shape)
            else:
                out[name] = np.asarray(o["data"], dtype=_FROM_V2[datatype]).reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise RequestError(f"the node's answer is not a v2 answer this client understands ({e!r})",
                           kind="bad_response") from None
    return out


def _to_torch(out: Outputs) -> Outputs:
    import torch

    res = Outputs()
    res.fallback, res.request_id = out.fallback, out.request_id
    for k, a in out.items():
        if a.dtype == object:
            res[k] = a  # torch has no string tensors
            continue
        if not a.flags.aligned or not a.flags.writeable:
            a = a.copy()
        res[k] = torch.from_numpy(a)
    return res


def _request_id(headers: Mapping[str, str]) -> int | None:
    v = headers.get(REQUEST_ID_HEADER)
    return int(v) if v is not None and v.isdigit() else None


def feedback_body(request_id: int | None, label: Any, reward: float | None,
                  items: Sequence[Mapping[str, Any]] | None, select: str | None) -> bytes:
    """The JSON of a feedback call: one item, or ``{"feedback": items}``."""
    def one(rid: Any, label: Any, reward: Any, select: Any) -> dict[str, Any]:
        if (label is None) == (reward is None):
            raise ValueError("feedback gives one of label= and reward=")
        item: dict[str, Any] = {"request_id": int(rid)}
        if label is not None:
            item["label"] = np.asarray(label).tolist()
        else:
            item["reward"] = float(reward)
        if select is not None:
            item["select"] = select
        return item

    if items is not None:
        if request_id is not None or label is not None or reward is not None:
            raise ValueError("feedback takes items= or one request_id with label= or reward=, not both")
        body: Any = {"feedback": [one(i["request_id"], i.get("label"), i.get("reward"), i.get("select", select))
                                  for i in items]}
    elif request_id is None:
        raise ValueError("feedback needs the request's id (Outputs.request_id) or items=")
    else:
        body = one(request_id, label, reward, select)
    return json.dumps(body).encode()


def _needs_declared(inputs: Mapping[str, Any]) -> bool:
    """Whether some input has no dtype of its own (a list, a scalar)."""
    return isinstance(inputs, Mapping) and any(
        not isinstance(v, np.ndarray) and not _is_torch(v) for v in inputs.values())


def _declared_inputs(desc: Mapping[str, Any] | None) -> dict[str, str]:
    return {k: v["dtype"] for k, v in ((desc or {}).get("inputs") or {}).items()}


def _text_outputs(desc: Mapping[str, Any] | None) -> dict[str, bool]:
    return {k: v["dtype"] == "string" for k, v in ((desc or {}).get("outputs") or {}).items()}


class _Base:
    def __init__(self, url: str | None, timeout: float, max_connections: int):
        url = (url or DEFAULT_URL).rstrip("/")
        if "://" not in url:
            url = "http://" + url
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise BadRequest(f"not an http(s) URL: {url!r}", status=None)
        if max_connections < 1:
            raise BadRequest(f"max_connections is at least 1, got {max_connections}", status=None)
        self.url = url
        self.timeout = float(timeout)
        self.max_connections = int(max_connections)
        self._https = u.scheme == "https"
        self._host = u.hostname
        self._port = u.port or (443 if self._https else 80)
        self._base = u.path.rstrip("/")
        self._hostport = u.netloc
        #: TCP connections this client has opened so far (a measure of reuse).
        self.connections_opened = 0
        # Pipeline descriptions, cached: dtypes of inputs given as lists,
        # and which BYTES outputs are text.
        self._desc: dict[str, dict[str, Any]] = {}
        # Pipelines whose description was fetched again for unknown BYTES outputs (once each).
        self._refreshed: set[str] = set()

    def _infer_parts(self, pipeline: str, inputs: Mapping[str, Any], outputs: Sequence[str] | None,
                     deadline_ms: float | None, timeout: float | None
                     ) -> tuple[str, dict[str, str], list[bytes | memoryview], float]:
        head, parts = encode_request(inputs, outputs, _declared_inputs(self._desc.get(pipeline)))
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
        d = _deadline(deadline_ms, timeout)
        if d is not None:
            headers[DEADLINE_HEADER] = f"{d:.3f}"
        path = f"/v2/models/{urllib.parse.quote(pipeline, safe='')}/infer"
        return path, headers, [head, *parts], _socket_wait(d, self.timeout)

    def _needs_refresh(self, pipeline: str, head: Mapping[str, Any]) -> bool:
        """Whether to fetch the description again: a BYTES output it does not
        list (the node lists undeclared outputs once it has answered)."""
        if pipeline in self._refreshed:
            return False
        known = (self._desc.get(pipeline) or {}).get("outputs") or {}
        if all(n in known for n in _bytes_outputs(head)):
            return False
        self._refreshed.add(pipeline)
        return True

    @staticmethod
    def _split(headers: Mapping[str, str], body: memoryview) -> tuple[dict[str, Any], memoryview]:
        hlen = headers.get("inference-header-content-length")
        n = len(body) if hlen is None else int(hlen)
        return _json(body[:n]), body[n:]


def _json(raw: bytes | memoryview) -> Any:
    try:
        return json.loads(bytes(raw))
    except ValueError:
        raise RequestError("the node answered with something that is not JSON", kind="bad_response") from None


# --- streamed answers ----------------------------------------------------------


class _Events:
    """Server-sent events from the node's streamed answers (stream.rs): each
    ``event:``/``data:`` pair, dispatched at the blank line after it."""

    def __init__(self) -> None:
        self.name = ""
        self.data: list[str] = []

    def line(self, raw: bytes) -> tuple[str, str] | None:
        text = raw.decode("utf-8").rstrip("\r\n")
        if not text:
            if not self.data:
                return None
            ev = (self.name or "message", "\n".join(self.data))
            self.name, self.data = "", []
            return ev
        field, _, value = text.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self.name = value
        elif field == "data":
            self.data.append(value)
        return None


class _StreamState:
    """What a stream has seen: chunk count, time to the first, the final answer."""

    def __init__(self, text: Mapping[str, bool], as_torch: bool):
        self._text = text
        self._as_torch = as_torch
        self._t0 = time.perf_counter()
        #: Seconds from the request to the first chunk (None before it).
        self.first_chunk_s: float | None = None
        #: Chunks received so far.
        self.chunks = 0
        #: The final answer (the stage's output), once the stream ended.
        self.final: Outputs | None = None

    def event(self, name: str, data: str) -> Outputs | None:
        """A chunk's outputs; None for the end (``final`` is set then)."""
        doc = _json(data.encode())
        if name == "error":
            err = doc.get("error") or {}
            raise request_error(None, err.get("kind"), str(err.get("message", "the stream failed")), None)
        out = decode_outputs(doc, memoryview(b""), self._text)
        out = _to_torch(out) if self._as_torch else out
        if name == "done":
            self.final = out
            return None
        if self.first_chunk_s is None:
            self.first_chunk_s = time.perf_counter() - self._t0
        self.chunks += 1
        return out


class Stream(_StreamState):
    """A streamed answer (``Client.stream``): iterate for the chunks as they
    come; afterwards ``final`` holds the final answer, ``chunks`` the count
    and ``first_chunk_s`` the time to the first chunk."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                 text: Mapping[str, bool], as_torch: bool, t0: float):
        super().__init__(text, as_torch)
        self._t0 = t0
        self._conn, self._resp = conn, resp

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Outputs:
        events = _Events()
        while self.final is None:
            raw = self._resp.readline()
            if not raw:
                self.close()
                raise Unreachable("the node closed the stream before its end", status=None)
            ev = events.line(raw)
            if ev is not None:
                try:
                    out = self.event(*ev)
                except BaseException:
                    self.close()
                    raise
                if out is not None:
                    return out
        self.close()
        raise StopIteration

    def close(self) -> None:
        """Stop reading (the node cancels the request if it still runs)."""
        self._conn.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStream(_StreamState):
    """``AsyncClient.stream``'s answer: ``async for chunk in stream``; then
    ``final``, ``chunks`` and ``first_chunk_s`` as ``Stream``'s."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, text: Mapping[str, bool],
                 as_torch: bool, t0: float, wait: float):
        super().__init__(text, as_torch)
        self._t0 = t0
        self._reader, self._writer, self._wait = reader, writer, wait
        self._pending = b""  # chunk-encoded data not yet split into lines
        self._left = 0  # bytes left in the current HTTP chunk
        self._eof = False

    async def head(self) -> tuple[int, dict[str, str]]:
        """The status and headers (lower-case names)."""
        raw = await asyncio.wait_for(self._reader.readuntil(b"\r\n\r\n"), self._wait)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k:
                headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding", "").lower() != "chunked" and status == 200:
            raise RequestError("the node's stream is not chunked", kind="bad_response")
        return status, headers

    async def _line(self) -> bytes:
        """One line of the event stream, decoded from HTTP/1.1 chunked transfer."""
        while b"\n" not in self._pending:
            if self._eof:
                line, self._pending = self._pending, b""
                return line
            if self._left == 0:
                size = await asyncio.wait_for(self._reader.readline(), self._wait)
                self._left = int(size.split(b";")[0].strip() or b"0", 16)
                if self._left == 0:
                    self._eof = True
                    continue
            data = await asyncio.wait_for(self._reader.read(self._left), self._wait)
            if not data:
                self._eof = True
                continue
            self._left -= len(data)
            self._pending += data
            if self._left == 0:
                await self._reader.readexactly(2)  # the chunk's CRLF
        line, _, self._pending = self._pending.partition(b"\n")
        return line + b"\n"

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Outputs:
        events = _Events()
        try:
            while self.final is None:
                raw = await self._line()
                if not raw:
                    raise Unreachable("the node closed the stream before its end", status=None)
                ev = events.line(raw)
                if ev is not None:
                    out = self.event(*ev)
                    if out is not None:
                        return out
        except BaseException:
            self.close()
            raise
        self.close()
        raise StopAsyncIteration

    def close(self) -> None:
        self._writer.close()


# --- the synchronous client ------------------------------------------------------

_DROPPED = (http.client.RemoteDisconnected, http.client.CannotSendRequest, ConnectionResetError,
            ConnectionAbortedError, BrokenPipeError)


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection was closed (or written to) by
    the node: its socket is readable while no request is outstanding."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):
            p = select.poll()
            p.register(sock, select.POLLIN)
            return bool(p.poll(0))
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


class Client(_Base):
    """A client of one node, for threads: thread-safe, with keep-alive
    connections shared by the threads that use it.

    ``url``: the node (default ``$SLIPSTREAM_URL``, else
    http://127.0.0.1:8000). ``timeout``: seconds to wait for an answer to a
    call without a deadline. ``max_connections``: idle connections kept for
    reuse (more threads at once open more, which close after use)."""

    def __init__(self, url: str | None = None, *, timeout: float = 60.0, max_connections: int = 8):
        super().__init__(url, timeout, max_connections)
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- the API

    def infer(self, pipeline: str, inputs: Mapping[str, Any], *, deadline_ms: float | None = None,
              timeout: float | None = None, outputs: Sequence[str] | None = None,
              as_torch: bool = False) -> Outputs:
        """Run ``inputs`` (name -> numpy array, list, str/bytes array or torch
        tensor; first dimension: rows) through ``pipeline``; returns its
        outputs (name -> numpy array, or torch tensor with ``as_torch``).

        ``deadline_ms`` / ``timeout`` (seconds): the request's deadline on
        the node, if tighter than the pipeline's SLO (the tighter of the two
        when both are given); past it, ``DeadlineExceeded``. ``outputs``:
        only these outputs. Raises the ``slipstream.RequestError`` subclass
        of the node's error kind."""
        if pipeline not in self._desc and _needs_declared(inputs):
            self.metadata(pipeline)
        path, headers, parts, wait = self._infer_parts(pipeline, inputs, outputs, deadline_ms, timeout)
        status, rheaders, body = self._exchange("POST", path, headers, parts, wait, aligned=True)
        if status != 200:
            raise _error(status, rheaders, bytes(body))
        head, tail = self._split(rheaders, body)
        if self._needs_refresh(pipeline, head):
            self.metadata(pipeline)
        out = decode_outputs(head, tail, _text_outputs(self._desc.get(pipeline)))
        out.fallback = rheaders.get(FALLBACK_HEADER)
        out.request_id = _request_id(rheaders)
        return _to_torch(out) if as_torch else out

    def stream(self, pipeline: str, inputs: Mapping[str, Any], *, deadline_ms: float | None = None,
               timeout: float | None = None, as_torch: bool = False) -> Stream:
        """Run ``inputs`` through ``pipeline`` and receive a streaming
        component's chunks as they come (server-sent events from
        ``/v2/models/{name}/infer_stream``): ``for chunk in c.stream(...)``.
        A pipeline that does not stream sends no chunks, only its final
        answer (``Stream.final``). Errors before the stream begins raise
        here; errors during it raise from the iteration. Each stream uses a
        connection of its own."""
        t0 = time.perf_counter()
        if pipeline not in self._desc:
            self.metadata(pipeline)  # which BYTES outputs are text, dtypes of list inputs
        path, headers, parts, wait = self._infer_parts(pipeline, inputs, None, deadline_ms, timeout)
        path = path[: -len("/infer")] + "/infer_stream"
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=wait)
        self.connections_opened += 1
        try:
            conn.putrequest("POST", self._base + path, skip_accept_encoding=True)
            for k, v in {**headers, "Content-Length": str(sum(len(p) for p in parts)),
                         "Accept": "text/event-stream"}.items():
                conn.putheader(k, v)
            conn.endheaders()
            for part in parts:
                conn.send(part)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise Unreachable(f"no answer from {self.url}: {e}", status=None) from None
        if resp.status != 200:
            body = resp.read()
            conn.close()
            raise _error(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body)
        return Stream(conn, resp, _text_outputs(self._desc.get(pipeline)), as_torch, t0)

    def feedback(self, pipeline: str, request_id: int | None = None, *, label: Any = None,
                 reward: float | None = None, items: Sequence[Mapping[str, Any]] | None = None,
                 select: str | None = None) -> dict[str, Any]:
        """Tell ``pipeline``'s model selection how an answer did: the true
        ``label`` (one per row) or a ``reward`` in [0, 1] (exp3), for the
        request ``request_id`` (``Outputs.request_id``); or many at once,
        ``items=[{"request_id": ..., "label": ...}, ...]``. Returns
        ``{"applied", "unknown", "invalid", "errors"}``; one unknown id raises
        ``NotFound``."""
        body = feedback_body(request_id, label, reward, items, select)
        path = f"/v1/pipelines/{urllib.parse.quote(pipeline, safe='')}/feedback"
        status, headers, resp = self._exchange("POST", path, {"Content-Type": "application/json"}, [body],
                                               self.timeout)
        if status != 200:
            raise _error(status, headers, bytes(resp))
        return _json(resp)

    def ready(self, pipeline: str | None = None) -> bool:
        """Whether the node (or one pipeline of it) serves: every stage has a
        ready replica. False when no node answers."""
        path = "/readyz" if pipeline is None else f"/v2/models/{urllib.parse.quote(pipeline, safe='')}/ready"
        try:
            status, headers, body = self._exchange("GET", path, {}, [], self.timeout)
        except Unreachable:
            return False
        if status in (200, 503):
            return status == 200
        raise _error(status, headers, bytes(body))

    def pipelines(self) -> list[dict[str, Any]]:
        """Every pipeline's description (as ``metadata``)."""
        descs: list[dict[str, Any]] = self._get("/v1/pipelines")["pipelines"]
        for d in descs:
            self._desc[d["name"]] = d
        return descs

    def metadata(self, pipeline: str) -> dict[str, Any]:
        """A pipeline's description: stages, inputs and outputs (dtypes,
        shapes), SLO, timeout (``GET /v1/pipelines/{name}``)."""
        d: dict[str, Any] = self._get(f"/v1/pipelines/{urllib.parse.quote(pipeline, safe='')}")
        self._desc[pipeline] = d
        return d

    def status(self) -> dict[str, Any]:
        """The node's status (``GET /v1/status``; ``slipstream status`` prints it)."""
        st: dict[str, Any] = self._get("/v1/status")
        return st

    def close(self) -> None:
        """Close the idle connections; connections in use close when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- HTTP

    def _get(self, path: str) -> Any:
        status, headers, body = self._exchange("GET", path, {}, [], self.timeout)
        if status != 200:
            raise _error(status, headers, bytes(body))
        return _json(body)

    def _acquire(self) -> tuple[http.client.HTTPConnection, bool]:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                return cls(self._host, self._port, timeout=self.timeout), False
            if _closed_by_peer(conn):
                conn.close()
                continue
            return conn, True

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_connections:
                self._idle.append(conn)
                return
        conn.close()

    def _exchange(self, method: str, path: str, headers: Mapping[str, str], parts: Sequence[bytes | memoryview],
                  wait: float, aligned: bool = False) -> tuple[int, dict[str, str], memoryview]:
        """Send a request, read its whole answer: (status, headers with
        lower-case names, body). With ``aligned``, the bytes after the v2
        JSON header land in a 64-byte aligned buffer."""
        size = sum(len(p) for p in parts)
        for attempt in (0, 1):
            conn, reused = self._acquire()
            try:
                conn.timeout = wait
                if conn.sock is None:
                    conn.connect()
                    with self._lock:
                        self.connections_opened += 1
                conn.sock.settimeout(wait)
                conn.putrequest(method, self._base + path, skip_accept_encoding=True)
                for k, v in headers.items():
                    conn.putheader(k, v)
                if method == "POST":
                    conn.putheader("Content-Length", str(size))
                if size < _JOIN_BELOW:
                    conn.endheaders(b"".join(parts) if parts else None)
                else:
                    conn.endheaders()
                    for p in parts:
                        conn.sock.sendall(p)
                resp = conn.getresponse()
            except _DROPPED as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # closed by the node while idle: once more on a new connection
                raise Unreachable(f"the node at {self.url} closed the connection ({e})") from None
            except TimeoutError:
                conn.close()
                raise ClientTimeout(f"no answer from {self.url} within {wait:.3g} s") from None
            except OSError as e:
                conn.close()
                raise Unreachable(f"no node answers at {self.url} ({e}); is `slipstream serve` running?") from None
            except BaseException:
                conn.close()
                raise
            try:
                rheaders = {k.lower(): v for k, v in resp.getheaders()}
                body = self._read_body(resp, rheaders, aligned and resp.status == 200)
            except TimeoutError:
                conn.close()
                raise ClientTimeout(f"the answer from {self.url} did not finish within {wait:.3g} s") from None
            except (http.client.HTTPException, OSError) as e:
                conn.close()
                raise Unreachable(f"the answer from {self.url} broke off ({e})") from None
            except BaseException:
                conn.close()
                raise
            if resp.will_close:
                conn.close()
            else:
                self._release(conn)
            return resp.status, rheaders, body
        raise AssertionError("unreachable")

    @staticmethod
    def _read_body(resp: http.client.HTTPResponse, headers: Mapping[str, str], aligned: bool) -> memoryview:
        n = resp.length
        hlen = headers.get("inference-header-content-length")
        if not aligned or n is None or hlen is None or not hlen.isdigit() or int(hlen) > n:
            return memoryview(resp.read())
        h = int(hlen)
        head = resp.read(h) if h else b""
        if len(head) != h:
            raise http.client.IncompleteRead(head, h - len(head))
        # The tensors' bytes, straight from the socket into an aligned buffer
        # of their own (the arrays are views over it).
        k = n - h
        raw = np.empty(h + k + ALIGN, dtype=np.uint8)
        start = (-(raw.ctypes.data + h)) % ALIGN
        buf = raw[start:start + h + k]
        buf[:h] = np.frombuffer(head, dtype=np.uint8)
        target = buf[h:].data
        got = 0
        while got < k:
            r = resp.readinto(target[got:])
            if not r:
                raise http.client.IncompleteRead(b"", k - got)
            got += r
        if not resp.isclosed():
            resp.read()  # finish the response so that the connection can be reused
        return buf.data


# --- the asyncio client ----------------------------------------------------------


class _Dropped(Exception):
    """The connection closed before any byte of the answer."""


class _AConn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def stale(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class AsyncClient(_Base):
    """A client of one node for asyncio: ``await client.infer(...)``.

    Calls share at most ``max_connections`` keep-alive HTTP/1.1 connections
    (a call waits for a free one). One client serves one event loop at a
    time; used from another loop, it starts afresh. Other arguments as
    ``Client``."""

    def __init__(self, url: str | None = None, *, timeout: float = 60.0, max_connections: int = 16):
        super().__init__(url, timeout, max_connections)
        self._idle: list[_AConn] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None

    async def infer(self, pipeline: str, inputs: Mapping[str, Any], *, deadline_ms: float | None = None,
                    timeout: float | None = None, outputs: Sequence[str] | None = None,
                    as_torch: bool = False) -> Outputs:
        """As ``Client.infer``. The numpy outputs are read-only views over the
        answer's bytes (``as_torch`` copies the body once to give torch
        writable memory)."""
        if pipeline not in self._desc and _needs_declared(inputs):
            await self.metadata(pipeline)
        path, headers, parts, wait = self._infer_parts(pipeline, inputs, outputs, deadline_ms, timeout)
        status, rheaders, body = await self._exchange("POST", path, headers, parts, wait)
        if status != 200:
            raise _error(status, rheaders, body)
        head, tail = self._split(rheaders, memoryview(bytearray(body) if as_torch else body))
        if self._needs_refresh(pipeline, head):
            await self.metadata(pipeline)
        out = decode_outputs(head, tail, _text_outputs(self._desc.get(pipeline)))
        out.fallback = rheaders.get(FALLBACK_HEADER)
        out.request_id = _request_id(rheaders)
        return _to_torch(out) if as_torch else out

    async def stream(self, pipeline: str, inputs: Mapping[str, Any], *, deadline_ms: float | None = None,
                     timeout: float | None = None, as_torch: bool = False) -> AsyncStream:
        """As ``Client.stream``: ``async for chunk in await c.stream(...)``."""
        t0 = time.perf_counter()
        if pipeline not in self._desc:
            await self.metadata(pipeline)
        path, headers, parts, wait = self._infer_parts(pipeline, inputs, None, deadline_ms, timeout)
        path = path[: -len("/infer")] + "/infer_stream"
        lines = [f"POST {self._base + path} HTTP/1.1", f"Host: {self._hostport}", "Accept: text/event-stream",
                 f"Content-Length: {sum(len(p) for p in parts)}", *(f"{k}: {v}" for k, v in headers.items())]
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port, ssl=True if self._https else None), wait)
        except (OSError, asyncio.TimeoutError) as e:
            raise Unreachable(f"no answer from {self.url}: {e}", status=None) from None
        self.connections_opened += 1
        st = AsyncStream(reader, writer, _text_outputs(self._desc.get(pipeline)), as_torch, t0, wait)
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            for part in parts:
                writer.write(part)
            await writer.drain()
            status, rheaders = await st.head()
            if status != 200:
                n = int(rheaders.get("content-length", "0"))
                body = await asyncio.wait_for(reader.readexactly(n), wait)
                raise _error(status, rheaders, body)
        except BaseException as e:
            st.close()
            if isinstance(e, (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError)):
                raise Unreachable(f"no answer from {self.url}: {e!r}", status=None) from None
            raise
        return st

    async def feedback(self, pipeline: str, request_id: int | None = None, *, label: Any = None,
                       reward: float | None = None, items: Sequence[Mapping[str, Any]] | None = None,
                       select: str | None = None) -> dict[str, Any]:
        """:meth:`Client.feedback`, awaited."""
        body = feedback_body(request_id, label, reward, items, select)
        path = f"/v1/pipelines/{urllib.parse.quote(pipeline, safe='')}/feedback"
        status, headers, resp = await self._exchange("POST", path, {"Content-Type": "application/json"}, [body],
                                                     self.timeout)
        if status != 200:
            raise _error(status, headers, resp)
        return _json(resp)

    async def ready(self, pipeline: str | None = None) -> bool:
        """As ``Client.ready``."""
        path = "/readyz" if pipeline is None else f"/v2/models/{urllib.parse.quote(pipeline, safe='')}/ready"
        try:
            status, headers, body = await self._exchange("GET", path, {}, [], self.timeout)
        except Unreachable:
            return False
        if status in (200, 503):
            return status == 200
        raise _error(status, headers, body)

    async def pipelines(self) -> list[dict[str, Any]]:
        """As ``Client.pipelines``."""
        descs: list[dict[str, Any]] = (await self._get("/v1/pipelines"))["pipelines"]
        for d in descs:
            self._desc[d["name"]] = d
        return descs

    async def metadata(self, pipeline: str) -> dict[str, Any]:
        """As ``Client.metadata``."""
        d: dict[str, Any] = await self._get(f"/v1/pipelines/{urllib.parse.quote(pipeline, safe='')}")
        self._desc[pipeline] = d
        return d

    async def status(self) -> dict[str, Any]:
        """As ``Client.status``."""
        st: dict[str, Any] = await self._get("/v1/status")
        return st

    async def close(self) -> None:
        """Close the idle connections (those in use close when their call returns)."""
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        for c in idle:
            try:
                await c.writer.wait_closed()
            except (OSError, ssl.SSLError):
                pass

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -- HTTP

    async def _get(self, path: str) -> Any:
        status, headers, body = await self._exchange("GET", path, {}, [], self.timeout)
        if status != 200:
            raise _error(status, headers, body)
        return _json(body)

    def _slots_here(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._slots is None:
            # Connections and the semaphore belong to the loop that made them.
            for c in self._idle:
                try:
                    c.writer.transport.abort()
                except RuntimeError:  # that loop is closed
                    pass
            self._idle = []
            self._loop = loop
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._slots

    async def _acquire(self) -> tuple[_AConn, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn, True
            conn.close()
        reader, writer = await asyncio.open_connection(self._host, self._port, ssl=True if self._https else None,
                                                       limit=1 << 20)
        self.connections_opened += 1
        return _AConn(reader, writer), False

    async def _exchange(self, method: str, path: str, headers: Mapping[str, str],
                        parts: Sequence[bytes | memoryview], wait: float) -> tuple[int, dict[str, str], bytes]:
        size = sum(len(p) for p in parts)
        lines = [f"{method} {self._base + path} HTTP/1.1", f"Host: {self._hostport}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if method == "POST":
            lines.append(f"Content-Length: {size}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        async with self._slots_here():
            for attempt in (0, 1):
                try:
                    conn, reused = await asyncio.wait_for(self._acquire(), wait)
                except asyncio.TimeoutError:
                    raise ClientTimeout(f"could not connect to {self.url} within {wait:.3g} s") from None
                except OSError as e:
                    raise Unreachable(f"no node answers at {self.url} ({e}); is `slipstream serve` running?") \
                        from None
                keep = False
                try:
                    status, rheaders, body, keep = await asyncio.wait_for(
                        self._roundtrip(conn, [head, *parts], size), wait)
                except _Dropped:
                    if reused and attempt == 0:
                        continue  # closed by the node while idle: once more on a new connection
                    raise Unreachable(f"the node at {self.url} closed the connection") from None
                except asyncio.TimeoutError:
                    raise ClientTimeout(f"no answer from {self.url} within {wait:.3g} s") from None
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
                    raise Unreachable(f"the answer from {self.url} broke off ({e!r})") from None
                finally:
                    if keep:
                        self._idle.append(conn)
                    else:
                        conn.close()
                return status, rheaders, body
        raise AssertionError("unreachable")

    @staticmethod
    async def _roundtrip(conn: _AConn, parts: list[bytes | memoryview], size: int
                         ) -> tuple[int, dict[str, str], bytes, bool]:
        """Send one request, read its answer: (status, headers, body, keep-alive).
        ``_Dropped`` when the connection ended before any byte of the answer."""
        reader = conn.reader
        try:
            if size < _JOIN_BELOW:
                conn.writer.write(b"".join(parts))
            else:
                for p in parts:
                    conn.writer.write(p)
            await conn.writer.drain()
            line = await reader.readline()
        except (ConnectionResetError, BrokenPipeError) as e:
            raise _Dropped() from e
        if not line:
            raise _Dropped()
        version, status_s, *_ = line.decode("latin-1").split(None, 2)
        status = int(status_s)
        headers: dict[str, str] = {}
        while True:
            h = await reader.readline()
            if h in (b"\r\n", b"\n"):
                break
            if not h:
                raise asyncio.IncompleteReadError(b"", None)
            k, _, v = h.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        keep = headers.get("connection", "").lower() != "close" and version.upper() == "HTTP/1.1"
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                n = int((await reader.readline()).split(b";")[0].strip(), 16)
                if n == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                chunks.append(await reader.readexactly(n))
                await reader.readexactly(2)
            body = b"".join(chunks)
        else:
            body = await reader.read()
            keep = False
        return status, headers, body, keep
