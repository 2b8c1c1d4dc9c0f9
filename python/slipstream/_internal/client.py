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
- **Connections are kept alive and pooled** by the transport the store
  client and the CLI use too (``http_transport.py``): the synchronous
  client shares idle connections between threads, the asyncio client
  keeps at most ``max_connections``.
- **Refusals are retried, politely** (``retry.py``): a 429 or 503 is
  retried after the node's ``Retry-After`` plus jitter, within the call's
  deadline and a budget of about one retry per ten calls; ``retry=None``
  turns it off.
- **Errors are the ``slipstream.Error`` tree**: the node's error kind (the
  ``x-slipstream-error-kind`` header) picks the class
  (``errors.error_from_response``), so callers catch ``ss.Overloaded`` and
  read its ``retry_after``, or ``ss.DeadlineExceeded`` (a ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from slipstream._internal.dtypes import FROM_V2, V2_DATATYPES, VAR_DTYPES
from slipstream._internal.errors import BadInput, BadRequest, RequestError, Unreachable, error_from_response
from slipstream._internal.http_transport import (
    AsyncStreamResponse,
    AsyncTransport,
    Response,
    StreamResponse,
    Transport,
)
from slipstream._internal.retry import Retrier, RetryPolicy, RetryStats, as_retrier, remaining
from slipstream._internal.varlen import decode_var, encode_var, var_kind

DEFAULT_URL = os.environ.get("SLIPSTREAM_URL", "http://127.0.0.1:8000")
DEADLINE_HEADER = "x-slipstream-deadline-ms"
PRIORITY_HEADER = "x-slipstream-priority"
PRIORITIES = ("high", "normal", "low")
FALLBACK_HEADER = "x-slipstream-fallback"
REQUEST_ID_HEADER = "x-slipstream-request-id"


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
            if declared in VAR_DTYPES:
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
        elif a.dtype.name in V2_DATATYPES:
            datatype = V2_DATATYPES[a.dtype.name]
            data = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data  # the array's own bytes
        else:
            raise BadInput(f"input {name!r} has dtype {a.dtype}, which a node cannot take "
                           f"(one of {', '.join(V2_DATATYPES)}, str or bytes)", status=None)
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


def _raise_for_status(resp: Response) -> Response:
    """``resp`` if it is a success (200), else the exception of its error."""
    if resp.status != 200:
        raise error_from_response(resp.status, resp.headers, resp.body)
    return resp


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
                    dt = np.dtype(FROM_V2[datatype]).newbyteorder("<")
                    out[name] = np.frombuffer(buf, dtype=dt, count=math.prod(shape)).reshape(shape)
            elif datatype == "BYTES":
                # JSON carries bytes in base64 (codec/json.rs), text as strings.
                a = np.empty(math.prod(shape), dtype=object)
                a[:] = [x if text.get(name, True) else base64.b64decode(x) for x in np.ravel(o["data"])]
                out[name] = a.reshape(shape)
            else:
                out[name] = np.asarray(o["data"], dtype=FROM_V2[datatype]).reshape(shape)
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
    def __init__(self, url: str | None, timeout: float, max_connections: int,
                 retry: RetryPolicy | None | bool = True, token: str | None = None):
        url = (url or DEFAULT_URL).rstrip("/")
        if "://" not in url:
            url = "http://" + url
        if max_connections < 1:
            raise BadRequest(f"max_connections is at least 1, got {max_connections}", status=None)
        self.url = url
        self.timeout = float(timeout)
        self.max_connections = int(max_connections)
        token = os.environ.get("SLIPSTREAM_API_TOKEN") if token is None else token
        #: Sent with every request: the node's API token, when it has one.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._retrier: Retrier | None = as_retrier(retry)
        # Pipeline descriptions, cached: dtypes of inputs given as lists,
        # and which BYTES outputs are text.
        self._desc: dict[str, dict[str, Any]] = {}
        # Pipelines whose description was fetched again for unknown BYTES outputs (once each).
        self._refreshed: set[str] = set()

    def _infer_parts(self, pipeline: str, inputs: Mapping[str, Any], outputs: Sequence[str] | None,
                     deadline_ms: float | None, timeout: float | None, priority: str | None = None
                     ) -> tuple[str, dict[str, str], list[bytes | memoryview], float]:
        if priority is not None and priority not in PRIORITIES:
            raise BadRequest(f"priority is one of {', '.join(PRIORITIES)}, got {priority!r}", status=None)
        head, parts = encode_request(inputs, outputs, _declared_inputs(self._desc.get(pipeline)))
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
        d = _deadline(deadline_ms, timeout)
        if d is not None:
            headers[DEADLINE_HEADER] = f"{d:.3f}"
        if priority is not None:
            headers[PRIORITY_HEADER] = priority
        path = f"/v2/models/{urllib.parse.quote(pipeline, safe='')}/infer"
        return path, headers, [head, *parts], _socket_wait(d, self.timeout)

    @property
    def retry_stats(self) -> RetryStats:
        """What the retry policy did so far (all zero with ``retry=None``)."""
        return self._retrier.stats if self._retrier is not None else RetryStats()

    def _call_began(self, deadline_ms: float | None, timeout: float | None) -> tuple[float | None, float]:
        """A call's deadline in ms (None: none) and the instant after which
        it is not retried: its deadline, else the client's timeout."""
        d = _deadline(deadline_ms, timeout)
        if self._retrier is not None:
            self._retrier.called()
        return d, time.monotonic() + (d / 1000.0 if d is not None else self.timeout)

    def _retry_or_raise(self, err: RequestError, attempt: int, ends: float, d: float | None,
                        headers: dict[str, str]) -> tuple[float, float]:
        """Retry after ``err`` (see retry.py), or raise it: the pause, and the
        next try's socket wait, with ``headers`` carrying the deadline left
        after the pause."""
        pause = None if self._retrier is None else self._retrier.wait_before(err, attempt, remaining(ends))
        if pause is None:
            raise err
        if d is None:
            return pause, self.timeout
        left_ms = max((ends - time.monotonic() - pause) * 1000.0, 0.001)
        headers[DEADLINE_HEADER] = f"{left_ms:.3f}"
        return pause, _socket_wait(left_ms, self.timeout)

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

    def _outputs(self, pipeline: str, resp: Response, head: Mapping[str, Any], tail: memoryview,
                 as_torch: bool) -> Outputs:
        out = decode_outputs(head, tail, _text_outputs(self._desc.get(pipeline)))
        out.fallback = resp.headers.get(FALLBACK_HEADER)
        out.request_id = _request_id(resp.headers)
        return _to_torch(out) if as_torch else out

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


def _feedback_path(pipeline: str) -> str:
    return f"/v1/pipelines/{urllib.parse.quote(pipeline, safe='')}/feedback"


def _ready_path(pipeline: str | None) -> str:
    return "/readyz" if pipeline is None else f"/v2/models/{urllib.parse.quote(pipeline, safe='')}/ready"


def _ready(resp: Response) -> bool:
    """A readiness answer: 200 ready, 503 not (yet); anything else is an error."""
    if resp.status in (200, 503):
        return resp.status == 200
    raise error_from_response(resp.status, resp.headers, resp.body)


def _stream_path(pipeline: str) -> str:
    return f"/v2/models/{urllib.parse.quote(pipeline, safe='')}/infer_stream"


_STREAM_HEADERS = {"Accept": "text/event-stream"}


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

    def __init__(self, text: Mapping[str, bool], as_torch: bool, t0: float):
        self._text = text
        self._as_torch = as_torch
        self._t0 = t0
        self._events = _Events()
        #: Seconds from the request to the first chunk (None before it).
        self.first_chunk_s: float | None = None
        #: Chunks received so far.
        self.chunks = 0
        #: The final answer (the stage's output), once the stream ended.
        self.final: Outputs | None = None

    def _line(self, raw: bytes) -> Outputs | None:
        """One line of the event stream: a chunk's outputs once an event is
        complete, else None (``final`` is set at the end)."""
        if not raw:
            raise Unreachable("the node closed the stream before its end", status=None)
        ev = self._events.line(raw)
        if ev is None:
            return None
        name, data = ev
        if name == "error":
            raise error_from_response(None, {}, data.encode())
        out = decode_outputs(_json(data.encode()), memoryview(b""), self._text)
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

    def __init__(self, resp: StreamResponse, text: Mapping[str, bool], as_torch: bool, t0: float):
        super().__init__(text, as_torch, t0)
        self._resp = resp

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Outputs:
        try:
            while self.final is None:
                out = self._line(self._resp.readline())
                if out is not None:
                    return out
        except BaseException:
            self.close()
            raise
        self.close()
        raise StopIteration

    def close(self) -> None:
        """Stop reading (the node cancels the request if it still runs)."""
        self._resp.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStream(_StreamState):
    """``AsyncClient.stream``'s answer: ``async for chunk in stream``; then
    ``final``, ``chunks`` and ``first_chunk_s`` as ``Stream``'s."""

    def __init__(self, resp: AsyncStreamResponse, text: Mapping[str, bool], as_torch: bool, t0: float):
        super().__init__(text, as_torch, t0)
        self._resp = resp

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Outputs:
        try:
            while self.final is None:
                out = self._line(await self._resp.readline())
                if out is not None:
                    return out
        except BaseException:
            self.close()
            raise
        self.close()
        raise StopAsyncIteration

    def close(self) -> None:
        self._resp.close()


# --- the synchronous client ------------------------------------------------------


class Client(_Base):
    """A client of one node, for threads: thread-safe, with keep-alive
    connections shared by the threads that use it.

    ``url``: the node (default ``$SLIPSTREAM_URL``, else
    http://127.0.0.1:8000). ``timeout``: seconds to wait for an answer to a
    call without a deadline. ``max_connections``: idle connections kept for
    reuse (more threads at once open more, which close after use).
    ``retry``: how 429 and 503 are retried (``RetryPolicy``; the default
    one when True; None: never; see ``retry.py``). ``token``: the node's
    API token, if it has one (default ``$SLIPSTREAM_API_TOKEN``; the admin
    token passes too)."""

    def __init__(self, url: str | None = None, *, timeout: float = 60.0, max_connections: int = 8,
                 retry: RetryPolicy | None | bool = True, token: str | None = None):
        super().__init__(url, timeout, max_connections, retry, token)
        self._http = Transport(self.url, max_idle=self.max_connections, headers=self._auth)

    @property
    def connections_opened(self) -> int:
        """TCP connections this client has opened so far (a measure of reuse)."""
        return self._http.connections_opened

    # -- the API

    def infer(self, pipeline: str, inputs: Mapping[str, Any], *, deadline_ms: float | None = None,
              timeout: float | None = None, outputs: Sequence[str] | None = None,
              as_torch: bool = False, priority: str | None = None) -> Outputs:
        """Run ``inputs`` (name -> numpy array, list, str/bytes array or torch
        tensor; first dimension: rows) through ``pipeline``; returns its
        outputs (name -> numpy array, or torch tensor with ``as_torch``).

        ``deadline_ms`` / ``timeout`` (seconds): the request's deadline on
        the node, if tighter than the pipeline's SLO (the tighter of the two
        when both are given); past it, ``DeadlineExceeded``. ``outputs``:
        only these outputs. ``priority``: ``"high"``, ``"normal"`` (the
        node's default) or ``"low"``, the request's class for admission:
        under overload the low class is refused first. Raises the
        ``slipstream.RequestError`` subclass of the node's error kind."""
        if pipeline not in self._desc and _needs_declared(inputs):
            self.metadata(pipeline)
        d, ends = self._call_began(deadline_ms, timeout)
        path, headers, parts, wait = self._infer_parts(pipeline, inputs, outputs, d, None, priority)
        attempt = 0
        while True:
            try:
                resp = _raise_for_status(self._http.request("POST", path, headers=headers, body=parts,
                                                            timeout=wait, aligned=True))
                break
            except RequestError as e:
                attempt += 1
                pause, wait = self._retry_or_raise(e, attempt, ends, d, headers)
                time.sleep(pause)
        head, tail = self._split(resp.headers, resp.body)
        if self._needs_refresh(pipeline, head):
            self.metadata(pipeline)
        return self._outputs(pipeline, resp, head, tail, as_torch)

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
        _, headers, parts, wait = self._infer_parts(pipeline, inputs, None, deadline_ms, timeout)
        resp = self._http.open_stream("POST", _stream_path(pipeline), headers={**headers, **_STREAM_HEADERS},
                                      body=parts, timeout=wait)
        if resp.status != 200:
            raise error_from_response(resp.status, resp.headers, resp.read())
        return Stream(resp, _text_outputs(self._desc.get(pipeline)), as_torch, t0)

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
        resp = self._http.request("POST", _feedback_path(pipeline), headers={"Content-Type": "application/json"},
                                  body=[body], timeout=self.timeout)
        return _json(_raise_for_status(resp).body)

    def ready(self, pipeline: str | None = None) -> bool:
        """Whether the node (or one pipeline of it) serves: every stage has a
        ready replica. False when no node answers."""
        try:
            resp = self._http.request("GET", _ready_path(pipeline), timeout=self.timeout)
        except Unreachable:
            return False
        return _ready(resp)

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
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _get(self, path: str) -> Any:
        return _json(_raise_for_status(self._http.request("GET", path, timeout=self.timeout)).body)


# --- the asyncio client ----------------------------------------------------------


class AsyncClient(_Base):
    """A client of one node for asyncio: ``await client.infer(...)``.

    Calls share at most ``max_connections`` keep-alive HTTP/1.1 connections
    (a call waits for a free one). One client serves one event loop at a
    time; used from another loop, it starts afresh. Other arguments as
    ``Client``."""

    def __init__(self, url: str | None = None, *, timeout: float = 60.0, max_connections: int = 16,
                 retry: RetryPolicy | None | bool = True, token: str | None = None):
        super().__init__(url, timeout, max_connections, retry, token)
        self._http = AsyncTransport(self.url, max_connections=self.max_connections, headers=self._auth)

    @property
    def connections_opened(self) -> int:
        """TCP connections this client has opened so far (a measure of reuse)."""
        return self._http.connections_opened

    async def infer(self, pipeline: str, inputs: Mapping[str, Any], *, deadline_ms: float | None = None,
                    timeout: float | None = None, outputs: Sequence[str] | None = None,
                    as_torch: bool = False, priority: str | None = None) -> Outputs:
        """As ``Client.infer``. The numpy outputs are read-only views over the
        answer's bytes (``as_torch`` copies the body once to give torch
        writable memory)."""
        if pipeline not in self._desc and _needs_declared(inputs):
            await self.metadata(pipeline)
        d, ends = self._call_began(deadline_ms, timeout)
        path, headers, parts, wait = self._infer_parts(pipeline, inputs, outputs, d, None, priority)
        attempt = 0
        while True:
            try:
                resp = _raise_for_status(await self._http.request("POST", path, headers=headers, body=parts,
                                                                  timeout=wait))
                break
            except RequestError as e:
                attempt += 1
                pause, wait = self._retry_or_raise(e, attempt, ends, d, headers)
                await asyncio.sleep(pause)
        head, tail = self._split(resp.headers, memoryview(bytearray(resp.body)) if as_torch else resp.body)
        if self._needs_refresh(pipeline, head):
            await self.metadata(pipeline)
        return self._outputs(pipeline, resp, head, tail, as_torch)

    async def stream(self, pipeline: str, inputs: Mapping[str, Any], *, deadline_ms: float | None = None,
                     timeout: float | None = None, as_torch: bool = False) -> AsyncStream:
        """As ``Client.stream``: ``async for chunk in await c.stream(...)``."""
        t0 = time.perf_counter()
        if pipeline not in self._desc:
            await self.metadata(pipeline)
        _, headers, parts, wait = self._infer_parts(pipeline, inputs, None, deadline_ms, timeout)
        resp = await self._http.open_stream("POST", _stream_path(pipeline),
                                            headers={**_STREAM_HEADERS, **headers}, body=parts, timeout=wait)
        if resp.status != 200:
            raise error_from_response(resp.status, resp.headers, await resp.read())
        return AsyncStream(resp, _text_outputs(self._desc.get(pipeline)), as_torch, t0)

    async def feedback(self, pipeline: str, request_id: int | None = None, *, label: Any = None,
                       reward: float | None = None, items: Sequence[Mapping[str, Any]] | None = None,
                       select: str | None = None) -> dict[str, Any]:
        """:meth:`Client.feedback`, awaited."""
        body = feedback_body(request_id, label, reward, items, select)
        resp = await self._http.request("POST", _feedback_path(pipeline),
                                        headers={"Content-Type": "application/json"}, body=[body],
                                        timeout=self.timeout)
        return _json(_raise_for_status(resp).body)

    async def ready(self, pipeline: str | None = None) -> bool:
        """As ``Client.ready``."""
        try:
            resp = await self._http.request("GET", _ready_path(pipeline), timeout=self.timeout)
        except Unreachable:
            return False
        return _ready(resp)

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
        await self._http.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def _get(self, path: str) -> Any:
        return _json(_raise_for_status(await self._http.request("GET", path, timeout=self.timeout)).body)
