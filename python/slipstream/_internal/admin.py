"""The node's admin routes, for the command line and the SLO calibration:
set a stage's replicas, reset the metrics.

A node that has an admin token (``--admin-token``) takes admin requests
only with it as a bearer token. An error answer raises the
``ss.RequestError`` of its kind (``Unauthorized``, ``UnknownStage``, ...),
no answer at all ``ss.Unreachable``.
"""

from __future__ import annotations

import json
from typing import Any

from slipstream._internal.errors import error_from_response
from slipstream._internal.http_transport import Transport


def post(url: str, path: str, body: dict[str, Any] | None = None, *, token: str | None = None,
         timeout: float = 10.0) -> Any:
    """POST ``body`` (JSON) to an admin route of the node at ``url``; its JSON answer."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    http = Transport(url.rstrip("/"), max_idle=0)
    resp = http.request("POST", path, headers=headers, timeout=timeout,
                        body=[] if body is None else [json.dumps(body).encode()])
    if resp.status != 200:
        raise error_from_response(resp.status, resp.headers, resp.body)
    return json.loads(bytes(resp.body))


def scale(url: str, pipeline: str, stage: str, replicas: int, *, token: str | None = None) -> dict[str, Any]:
    """Set a stage's replica count: ``{"from", "replicas", "added", "draining"}``."""
    out: dict[str, Any] = post(url, "/v1/admin/scale", {"pipeline": pipeline, "stage": stage, "replicas": replicas},
                               token=token)
    return out


def reset_metrics(url: str, *, token: str | None = None, timeout: float = 5.0) -> None:
    """Start the node's latency and counter metrics afresh (between benchmark runs)."""
    post(url, "/v1/admin/reset-metrics", token=token, timeout=timeout)
