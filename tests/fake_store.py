"""An in-process stand-in for the node's store routes (docs/design/store.md),
for unit tests of the Python client, the worker's hot swap, the group cache
and the CLI without building or starting a node.

It follows the contract's shapes: JSON timestamps in unix seconds,
errors as ``{"error": {"kind", "message"}}`` with the kind also in the
``x-slipstream-error-kind`` header, values of at least ``blob_min`` bytes
kept as blob files whose path the metadata reports. It is not the node:
retention, pools and triggers are not modelled.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from slipstream._internal.store import TENSORS, decode_tensors


@dataclass
class Rec:
    version: int
    ts: float
    data: bytes
    content_type: str
    deleted: bool
    path: str | None


class Refused(Exception):
    def __init__(self, status: int, kind: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.kind, self.extra = status, kind, extra


class FakeStore:
    def __init__(self, blob_dir: Path, blob_min: int = 4096, token: str | None = None):
        self.blob_dir = blob_dir
        self.blob_min = blob_min
        self.token = token
        self.keys: dict[str, list[Rec]] = {}
        self.feed: list[dict[str, Any]] = []
        self.feed_floor = 0  # a `since` below this is answered 410
        self.pools: list[dict[str, Any]] = []
        self.triggers: list[tuple[str, bytes]] = []
        self.requests: list[str] = []
        self.drop_after_response = False  # close the socket without saying so (a dropped keep-alive)
        self.cond = threading.Condition()
        handler = type("Handler", (_Handler,), {"store": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def seq(self) -> int:
        return self.feed[-1]["seq"] if self.feed else 0

    def _commit(self, key: str, data: bytes, content_type: str, deleted: bool) -> Rec:
        with self.cond:
            recs = self.keys.setdefault(key, [])
            version = recs[-1].version + 1 if recs else 1
            ts = max(time.time(), recs[-1].ts + 1e-6 if recs else 0.0)
            path = None
            if not deleted and len(data) >= self.blob_min:
                p = self.blob_dir / f"blob-{len(self.feed)}-{version}"
                p.write_bytes(data)
                path = str(p)
            rec = Rec(version, ts, data, content_type, deleted, path)
            recs.append(rec)
            self.feed.append({"seq": self.seq + 1, "key": key, "version": version, "timestamp": ts, "deleted": deleted})
            self.cond.notify_all()
            return rec

    def latest(self, key: str) -> Rec | None:
        recs = self.keys.get(key)
        return recs[-1] if recs else None

    def _find(self, key: str, q: dict[str, str]) -> Rec:
        recs = self.keys.get(key, [])
        if "version" in q:
            rec = next((r for r in recs if r.version == int(q["version"])), None)
        elif "as_of" in q:
            rec = next((r for r in reversed(recs) if r.ts <= float(q["as_of"])), None)
        else:
            rec = recs[-1] if recs else None
        if rec is None:
            raise Refused(404, "not_found", f"no such key or version: {key}")
        return rec

    def _check_write(self, headers: Any) -> None:
        if self.token and headers.get("Authorization") != f"Bearer {self.token}":
            raise Refused(401, "unauthorized", "store writes need the admin token")

    def handle(self, method: str, path: str, q: dict[str, str], headers: Any, body: bytes) -> tuple[int, Any, str]:
        """(status, JSON reply or raw bytes, content type)."""
        self.requests.append(f"{method} {path}")
        if path.startswith("/v1/store/objects/"):
            key = urllib.parse.unquote(path[len("/v1/store/objects"):])
            if method == "PUT":
                self._check_write(headers)
                ctype = headers.get("Content-Type") or "application/octet-stream"
                if ctype == TENSORS:
                    try:
                        decode_tensors(body)
                    except ValueError as e:
                        raise Refused(400, "bad_request", str(e)) from None
                with self.cond:
                    cur = self.latest(key)
                    if "if_version" in q and int(q["if_version"]) != (cur.version if cur else 0):
                        raise Refused(409, "conflict", f"{key} is at version {cur.version if cur else 0}",
                                      current=cur.version if cur else 0)
                    rec = self._commit(key, body, ctype, False)
                return 201, {"key": key, "version": rec.version, "timestamp": rec.ts, "size": len(body),
                             "content_type": ctype}, ""
            if method == "DELETE":
                self._check_write(headers)
                with self.cond:
                    cur = self.latest(key)
                    if cur is None or cur.deleted:
                        raise Refused(404, "not_found", f"no such key: {key}")
                    if "if_version" in q and int(q["if_version"]) != cur.version:
                        raise Refused(409, "conflict", f"{key} is at version {cur.version}", current=cur.version)
                    rec = self._commit(key, b"", "", True)
                return 200, {"key": key, "version": rec.version, "timestamp": rec.ts, "deleted": True}, ""
            rec = self._find(key, q)
            if q.get("meta") == "1":
                return 200, {"key": key, "version": rec.version, "timestamp": rec.ts, "size": len(rec.data),
                             "content_type": rec.content_type, "deleted": rec.deleted, "path": rec.path}, ""
            if rec.deleted:
                raise Refused(404, "not_found", f"{key} is deleted")
            return 200, rec.data, rec.content_type
        if path.startswith("/v1/store/versions/"):
            key = urllib.parse.unquote(path[len("/v1/store/versions"):])
            recs = self.keys.get(key)
            if not recs:
                raise Refused(404, "not_found", f"no such key: {key}")
            return 200, {"key": key, "versions": [
                {"version": r.version, "timestamp": r.ts, "size": len(r.data), "content_type": r.content_type,
                 "deleted": r.deleted} for r in recs]}, ""
        if path == "/v1/store/keys":
            prefix, limit = q.get("prefix", "/"), int(q.get("limit", "1000"))
            live = [(k, recs[-1]) for k, recs in sorted(self.keys.items())
                    if k.startswith(prefix) and not recs[-1].deleted]
            return 200, {"keys": [{"key": k, "version": r.version, "timestamp": r.ts, "size": len(r.data),
                                   "content_type": r.content_type} for k, r in live[:limit]],
                         "truncated": len(live) > limit}, ""
        if path == "/v1/store/watch":
            prefix = q.get("prefix", "/")
            if "since" not in q:
                return 200, {"seq": self.seq, "changes": []}, ""
            since = int(q["since"])
            if since < self.feed_floor:
                raise Refused(410, "gone", f"sequence {since} is older than the feed")
            deadline = time.monotonic() + int(q.get("timeout_ms", "30000")) / 1000
            with self.cond:
                while True:
                    changes = [c for c in self.feed if c["seq"] > since and c["key"].startswith(prefix)]
                    left = deadline - time.monotonic()
                    if changes or left <= 0:
                        return 200, {"seq": self.seq, "changes": changes}, ""
                    self.cond.wait(left)
        if path.startswith("/v1/store/rollout/"):
            # One machine: every version it has is held wherever it runs.
            key = urllib.parse.unquote(path[len("/v1/store/rollout"):])
            rec = self._find(key, {"version": q.get("version", "0")})
            return 200, {"key": key, "version": rec.version, "held_everywhere": True, "waiting_for": []}, ""
        if path.startswith("/v1/store/trigger/"):
            self._check_write(headers)
            self.triggers.append((urllib.parse.unquote(path[len("/v1/store/trigger"):]), body))
            return 202, {"fired": 1}, ""
        if path == "/v1/store":
            return 200, {"path": str(self.blob_dir), "keys": len(self.keys), "versions": 0, "bytes": 0,
                         "seq": self.seq, "pools": self.pools}, ""
        raise Refused(404, "not_found", f"no route for {path}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    store: FakeStore

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            status, reply, ctype = self.store.handle(method, url.path, q, self.headers, body)
            kind = None
        except Refused as e:
            status, reply, ctype, kind = e.status, {"error": {"kind": e.kind, "message": str(e), **e.extra}}, "", e.kind
        data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype or "application/json")
        self.send_header("Content-Length", str(len(data)))
        if kind:
            self.send_header("x-slipstream-error-kind", kind)
        self.end_headers()
        self.wfile.write(data)
        if self.store.drop_after_response:
            self.close_connection = True

    def do_GET(self) -> None:
        self._serve("GET")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_POST(self) -> None:
        self._serve("POST")
