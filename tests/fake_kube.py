"""A fake Kubernetes API server with one StatefulSet, for the node-count
loop's tests (tests/unit/test_kube.py, tests/integration/test_node_scaling.py):
it answers the `scale` subresource and pod patches, records every request,
and refuses what a real server would (no token: 401; a patch that is not a
merge patch: 415; anything else: 404). `on_scale` callbacks see each new
count before it is applied, as a StatefulSet controller would act on it."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

TOKEN = "sa-token"
STS = "ss-slipstream"
NS = "serving"


class FakeApi:
    """A Kubernetes API server with one StatefulSet: records each request,
    refuses any it does not expect (404) or without the token (401)."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.calls: list[tuple[str, str, Any]] = []  # (verb, path, body)
        self.on_scale: list[Any] = []  # called with the new count before it is applied
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def _answer(self, code: int, obj: Any) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _handle(self, verb: str) -> None:
                body = self._body()
                api.calls.append((verb, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._answer(401, {"kind": "Status", "code": 401})
                if verb == "PATCH" and self.headers.get("Content-Type") != "application/merge-patch+json":
                    return self._answer(415, {"kind": "Status", "code": 415})
                scale = f"/apis/apps/v1/namespaces/{NS}/statefulsets/{STS}/scale"
                if self.path == scale and verb == "GET":
                    return self._answer(200, {"kind": "Scale", "spec": {"replicas": api.replicas}})
                if self.path == scale and verb == "PATCH":
                    for check in api.on_scale:
                        check(body["spec"]["replicas"])
                    api.replicas = body["spec"]["replicas"]
                    return self._answer(200, {"kind": "Scale", "spec": {"replicas": api.replicas}})
                if self.path.startswith(f"/api/v1/namespaces/{NS}/pods/{STS}-") and verb == "PATCH":
                    return self._answer(200, {"kind": "Pod", "metadata": body["metadata"]})
                return self._answer(404, {"kind": "Status", "code": 404})

            def do_GET(self) -> None:  # noqa: N802
                self._handle("GET")

            def do_PATCH(self) -> None:  # noqa: N802
                self._handle("PATCH")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def verbs(self) -> list[tuple[str, str]]:
        return [(v, p.rsplit("/", 1)[-1] if "/pods/" in p else p.rsplit("/", 2)[-2] + "/scale")
                for v, p, _ in self.calls]
