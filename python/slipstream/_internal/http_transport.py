"""HTTP/1.1 to one server: the connections and requests of every Python
caller of a node (``ss.Client``, ``ss.AsyncClient``, the store client, the
CLI) and of etcd's JSON gateway (the cluster commands).

Why it looks the way it does:

- **Pooled keep-alive connections.** ``Transport`` keeps idle
  ``http.client`` connections for the next request of any thread (one per
  thread in use at a time, at most ``max_idle`` kept); it is thread-safe.
  ``AsyncTransport`` speaks HTTP/1.1 over asyncio streams with at most
  ``max_connections`` connections, further requests waiting for a free
  one. A kept-alive connection the server closed while idle is noticed
  before it is used, and a request whose connection broke before any of
  its answer arrived is sent once more on a new one.
- **Every request has a timeout**, for connecting, sending and each read
  of the answer; the caller passes it (a client derives it from the
  request's deadline).
- **Bodies without copies.** A request body is a list of buffers: up to
  64 KiB they go out in one write with the headers (one packet), larger
  ones from their own memory. With ``aligned``, a successful answer is read
  straight from the socket into a buffer whose tensor bytes start at a
  64-byte boundary (after a KServe v2 answer's JSON header, else the whole
  body), so that arrays decoded from it are aligned views.
- **Failures are the ``ss.Error`` tree's**: no answer is ``Unreachable``,
  a timeout is ``ClientTimeout``. An error *answer* is a ``Response`` like
  any other; callers turn it into an exception with
  ``errors.error_from_response``, in the tree that is theirs.
- **Streamed answers** (server-sent events) get a connection of their own
  (``open_stream``) that the caller reads line by line and closes.
"""

from __future__ import annotations

import asyncio
import http.client
import select
import ssl
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from slipstream._internal.errors import BadRequest, ClientTimeout, RequestError, Unreachable

#: Tensor bytes in an ``aligned`` answer start at a multiple of this.
ALIGN = 64
# Bodies up to this size go out in one write with the request line and
# headers (one packet); larger ones are sent from the caller's buffers.
_JOIN_BELOW = 64 << 10
_V2_HEADER_LENGTH = "inference-header-content-length"
# A kept-alive connection the server closed: worth one more try on a new one.
_DROPPED = (http.client.RemoteDisconnected, http.client.CannotSendRequest, ConnectionResetError,
            ConnectionAbortedError, BrokenPipeError)
_NODE_HINT = "; is `slipstream serve` running?"

#: A request body: buffers sent one after the other.
Body: TypeAlias = "Sequence[bytes | memoryview]"


@dataclass(frozen=True)
class Response:
    """A whole answer: status, headers (lower-case names) and body."""

    status: int
    headers: dict[str, str]
    body: memoryview


class _Server:
    """A server's URL, split: where to connect and the path prefix of every request."""

    def __init__(self, url: str, what: str, hint: str, ssl_context: ssl.SSLContext | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadRequest(f"not an http(s) URL: {url!r}", status=None)
        self.url = url
        self.https = parts.scheme == "https"
        #: For https: whom to trust and which client certificate to show
        #: (None: the system's CAs, no client certificate).
        self.ssl_context = ssl_context
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.base = parts.path.rstrip("/")
        self.hostport = parts.netloc
        self.what = what
        self.hint = hint

    def target(self, path: str, query: Mapping[str, Any] | None) -> str:
        # %20 for a space: the node keeps '+' as it is (store keys may hold it).
        return self.base + path + ("?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote) if query else "")

    def unreachable(self, e: BaseException) -> Unreachable:
        return Unreachable(f"no {self.what} answers at {self.url} ({e}){self.hint}")

    def dropped(self, e: BaseException | None = None) -> Unreachable:
        return Unreachable(f"the {self.what} at {self.url} closed the connection" + (f" ({e})" if e else ""))

    def broke_off(self, e: BaseException) -> Unreachable:
        return Unreachable(f"the answer from {self.url} broke off ({e})")

    def timed_out(self, wait: float, what: str = "no answer") -> ClientTimeout:
        return ClientTimeout(f"{what} from {self.url} within {wait:.3g} s")


def _sends_length(method: str, size: int) -> bool:
    return size > 0 or method not in ("GET", "HEAD")


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection was closed (or written to) by
    the server: its socket is readable while no request is outstanding."""
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


def _read_body(resp: http.client.HTTPResponse, headers: Mapping[str, str], aligned: bool) -> memoryview:
    """The whole body; with ``aligned`` (and a known length), in a buffer of
    its own whose bytes after the v2 JSON header (or from the start) lie at
    a 64-byte boundary, read from the socket without an intermediate copy."""
    n = resp.length
    if not aligned or n is None:
        return memoryview(resp.read())
    hlen = headers.get(_V2_HEADER_LENGTH, "")
    head = int(hlen) if hlen.isdigit() and int(hlen) <= n else 0
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    start = (-(raw.ctypes.data + head)) % ALIGN
    target = raw[start:start + n].data
    got = 0
    while got < n:
        k = resp.readinto(target[got:])
        if not k:
            raise http.client.IncompleteRead(b"", n - got)
        got += k
    if not resp.isclosed():
        resp.read()  # finish the response so that the connection can be reused
    return target


class Transport:
    """Keep-alive connections to one server, shared by the threads that use it.

    ``url``: ``http(s)://host[:port][/base]``. ``max_idle``: idle
    connections kept for reuse. ``what`` and ``hint`` word the message of
    an ``Unreachable`` (``no node answers at ...; is `slipstream serve`
    running?``). ``headers``: sent with every request (a bearer token)."""

    def __init__(self, url: str, *, max_idle: int = 8, what: str = "node", hint: str = _NODE_HINT,
                 ssl_context: ssl.SSLContext | None = None, headers: Mapping[str, str] | None = None):
        self._server = _Server(url, what, hint, ssl_context)
        self._headers = dict(headers or {})
        self.max_idle = max_idle
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False
        #: TCP connections opened so far (a measure of reuse).
        self.connections_opened = 0

    def request(self, method: str, path: str, *, timeout: float, query: Mapping[str, Any] | None = None,
                headers: Mapping[str, str] | None = None, body: Body = (), aligned: bool = False) -> Response:
        """Send a request and read its whole answer. ``timeout``: seconds for
        each step. ``aligned``: see the module's docs (successes only)."""
        server = self._server
        target = server.target(path, query)
        size = sum(len(p) for p in body)
        for attempt in (0, 1):
            conn, reused = self._acquire(timeout)
            try:
                if conn.sock is None:
                    conn.connect()
                    with self._lock:
                        self.connections_opened += 1
                conn.sock.settimeout(timeout)
                conn.putrequest(method, target, skip_accept_encoding=True)
                for k, v in {**self._headers, **(headers or {})}.items():
                    conn.putheader(k, v)
                if _sends_length(method, size):
                    conn.putheader("Content-Length", str(size))
                if size < _JOIN_BELOW:
                    conn.endheaders(b"".join(body) if size else None)
                else:
                    conn.endheaders()
                    for part in body:
                        conn.sock.sendall(part)
                resp = conn.getresponse()
            except _DROPPED as e:
                conn.close()
                if reused and attempt == 0:
                    continue  # closed by the server while idle: once more on a new connection
                raise server.dropped(e) from None
            except TimeoutError:
                conn.close()
                raise server.timed_out(timeout) from None
            except OSError as e:
                conn.close()
                raise server.unreachable(e) from None
            except BaseException:
                conn.close()
                raise
            try:
                rheaders = {k.lower(): v for k, v in resp.getheaders()}
                data = _read_body(resp, rheaders, aligned and 200 <= resp.status < 300)
            except TimeoutError:
                conn.close()
                raise server.timed_out(timeout, "the answer did not finish") from None
            except (http.client.HTTPException, OSError) as e:
                conn.close()
                raise server.broke_off(e) from None
            except BaseException:
                conn.close()
                raise
            if resp.will_close:
                conn.close()
            else:
                self._release(conn)
            return Response(resp.status, rheaders, data)
        raise AssertionError("unreachable")

    def open_stream(self, method: str, path: str, *, timeout: float, headers: Mapping[str, str] | None = None,
                    body: Body = ()) -> StreamResponse:
        """Send a request on a connection of its own and return once the
        answer's head arrived; the caller reads the body and closes it."""
        server = self._server
        conn = self._connection(timeout)
        with self._lock:
            self.connections_opened += 1
        try:
            conn.putrequest(method, server.target(path, None), skip_accept_encoding=True)
            for k, v in {**self._headers, **(headers or {}), "Content-Length": str(sum(len(p) for p in body))}.items():
                conn.putheader(k, v)
            conn.endheaders()
            for part in body:
                conn.send(part)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise Unreachable(f"no answer from {server.url}: {e}", status=None) from None
        return StreamResponse(conn, resp)

    def close(self) -> None:
        """Close the idle connections; connections in use close when their request returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        server = self._server
        if server.https:
            return http.client.HTTPSConnection(server.host, server.port, timeout=timeout, context=server.ssl_context)
        return http.client.HTTPConnection(server.host, server.port, timeout=timeout)

    def _acquire(self, timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection still open (True), else a new one (False)."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connection(timeout), False
            if _closed_by_peer(conn):
                conn.close()
                continue
            conn.timeout = timeout
            return conn, True

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()


class StreamResponse:
    """A streamed answer on its own connection: the status and headers, then
    the body line by line (``http.client`` undoes the chunked encoding)."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse):
        self._conn, self._resp = conn, resp
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.getheaders()}

    def readline(self) -> bytes:
        """The next line of the body, with its newline; b"" at its end."""
        return self._resp.readline()

    def read(self) -> bytes:
        """The rest of the body (an error answer's), then the connection closes."""
        try:
            return self._resp.read()
        finally:
            self.close()

    def close(self) -> None:
        self._conn.close()


# --- asyncio -------------------------------------------------------------------------


class _Dropped(Exception):
    """The connection closed before any byte of the answer."""


class _AsyncConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    def stale(self) -> bool:
        return self.writer.is_closing() or self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, int, dict[str, str]]:
    """An answer's HTTP version, status and headers (lower-case names).
    ``_Dropped`` when the connection ended before its first byte."""
    try:
        line = await reader.readline()
    except (ConnectionResetError, BrokenPipeError) as e:
        raise _Dropped() from e
    if not line:
        raise _Dropped()
    version, status, *_ = line.decode("latin-1").split(None, 2)
    headers: dict[str, str] = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n"):
            return version, int(status), headers
        if not h:
            raise asyncio.IncompleteReadError(b"", None)
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()


class AsyncTransport:
    """Keep-alive connections to one server for asyncio: at most
    ``max_connections`` at once, a request waiting for a free one. One
    transport serves one event loop at a time; used from another loop, it
    starts afresh. ``what``, ``hint`` and ``headers``: as ``Transport``'s."""

    def __init__(self, url: str, *, max_connections: int = 16, what: str = "node", hint: str = _NODE_HINT,
                 headers: Mapping[str, str] | None = None):
        self._server = _Server(url, what, hint)
        self._headers = dict(headers or {})
        self.max_connections = max_connections
        self._idle: list[_AsyncConnection] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None
        #: TCP connections opened so far (a measure of reuse).
        self.connections_opened = 0

    async def request(self, method: str, path: str, *, timeout: float, headers: Mapping[str, str] | None = None,
                      body: Body = ()) -> Response:
        """Send a request and read its whole answer (``timeout``: seconds to connect, and for the exchange)."""
        server = self._server
        size = sum(len(p) for p in body)
        lines = [f"{method} {server.target(path, None)} HTTP/1.1", f"Host: {server.hostport}"]
        lines += [f"{k}: {v}" for k, v in {**self._headers, **(headers or {})}.items()]
        if _sends_length(method, size):
            lines.append(f"Content-Length: {size}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        async with self._slots_here():
            for attempt in (0, 1):
                try:
                    conn, reused = await asyncio.wait_for(self._acquire(), timeout)
                except asyncio.TimeoutError:
                    raise server.timed_out(timeout, "could not connect") from None
                except OSError as e:
                    raise server.unreachable(e) from None
                keep = False
                try:
                    status, rheaders, data, keep = await asyncio.wait_for(
                        self._roundtrip(conn, [head, *body], size), timeout)
                except _Dropped:
                    if reused and attempt == 0:
                        continue  # closed by the server while idle: once more on a new connection
                    raise server.dropped() from None
                except asyncio.TimeoutError:
                    raise server.timed_out(timeout) from None
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
                    raise server.broke_off(e) from None
                finally:
                    if keep:
                        self._idle.append(conn)
                    else:
                        conn.close()
                return Response(status, rheaders, memoryview(data))
        raise AssertionError("unreachable")

    async def open_stream(self, method: str, path: str, *, timeout: float, headers: Mapping[str, str] | None = None,
                          body: Body = ()) -> AsyncStreamResponse:
        """As ``Transport.open_stream``: a connection of its own, returned
        once the answer's head arrived."""
        server = self._server
        lines = [f"{method} {server.target(path, None)} HTTP/1.1", f"Host: {server.hostport}",
                 f"Content-Length: {sum(len(p) for p in body)}",
                 *(f"{k}: {v}" for k, v in {**self._headers, **(headers or {})}.items())]
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(server.host, server.port, ssl=True if server.https else None), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            raise Unreachable(f"no answer from {server.url}: {e}", status=None) from None
        self.connections_opened += 1
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            for part in body:
                writer.write(part)
            await writer.drain()
            _, status, rheaders = await asyncio.wait_for(_read_head(reader), timeout)
        except BaseException as e:
            writer.close()
            if isinstance(e, (OSError, _Dropped, asyncio.IncompleteReadError, asyncio.TimeoutError)):
                raise Unreachable(f"no answer from {server.url}: {e!r}", status=None) from None
            raise
        if status == 200 and rheaders.get("transfer-encoding", "").lower() != "chunked":
            writer.close()
            raise RequestError("the node's stream is not chunked", kind="bad_response")
        return AsyncStreamResponse(server.url, reader, writer, status, rheaders, timeout)

    async def close(self) -> None:
        """Close the idle connections (those in use close when their request returns)."""
        idle, self._idle = self._idle, []
        for c in idle:
            c.close()
        for c in idle:
            try:
                await c.writer.wait_closed()
            except (OSError, ssl.SSLError):
                pass

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

    async def _acquire(self) -> tuple[_AsyncConnection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.stale():
                return conn, True
            conn.close()
        server = self._server
        reader, writer = await asyncio.open_connection(server.host, server.port, ssl=True if server.https else None,
                                                       limit=1 << 20)
        self.connections_opened += 1
        return _AsyncConnection(reader, writer), False

    @staticmethod
    async def _roundtrip(conn: _AsyncConnection, parts: list[bytes | memoryview], size: int
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
        except (ConnectionResetError, BrokenPipeError) as e:
            raise _Dropped() from e
        version, status, headers = await _read_head(reader)
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


class AsyncStreamResponse:
    """``AsyncTransport.open_stream``'s answer: status and headers, then the
    body line by line, decoded from HTTP/1.1 chunked transfer as it comes."""

    def __init__(self, url: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                 headers: dict[str, str], timeout: float):
        self.status = status
        self.headers = headers
        self._url = url
        self._reader, self._writer, self._timeout = reader, writer, timeout
        self._pending = b""  # chunk-encoded data not yet split into lines
        self._left = 0  # bytes left in the current HTTP chunk
        self._eof = False

    async def readline(self) -> bytes:
        """The next line of the body, with its newline; b"" at its end."""
        while b"\n" not in self._pending:
            if self._eof:
                line, self._pending = self._pending, b""
                return line
            if self._left == 0:
                size = await asyncio.wait_for(self._reader.readline(), self._timeout)
                self._left = int(size.split(b";")[0].strip() or b"0", 16)
                if self._left == 0:
                    self._eof = True
                    continue
            data = await asyncio.wait_for(self._reader.read(self._left), self._timeout)
            if not data:
                self._eof = True
                continue
            self._left -= len(data)
            self._pending += data
            if self._left == 0:
                await self._reader.readexactly(2)  # the chunk's CRLF
        line, _, self._pending = self._pending.partition(b"\n")
        return line + b"\n"

    async def read(self) -> bytes:
        """The rest of a sized body (an error answer's), then the connection closes."""
        try:
            n = int(self.headers.get("content-length", "0"))
            return await asyncio.wait_for(self._reader.readexactly(n), self._timeout)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            raise Unreachable(f"no answer from {self._url}: {e!r}", status=None) from None
        finally:
            self.close()

    def close(self) -> None:
        self._writer.close()
