"""Overload that clients make worse. A 429 is cheap, but a client that comes
straight back turns it into a storm that takes the CPU from admitted work
(on the no-op chain, 128 such clients left 300 answers a second). A
connection that comes back before its Retry-After has its next refusal
held for a slot of the node-wide refusal rate; a connection in good
standing is refused at once. Under overload the low class
(``x-slipstream-priority: low``) is refused first."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import pytest
import slipstream as ss

from tests.conftest import APPS, Node, wait_for

BODY = json.dumps({"inputs": {"x": [[1, 1]]}})
# A 1 ms budget behind a busy replica is predicted to miss: refused, every time.
HEADERS = {"content-type": "application/json", "x-slipstream-deadline-ms": "1"}


def busy_replica(node: Node, ms: int) -> threading.Thread:
    """Teach the stage that a batch takes ~600 ms, then keep its replica
    busy for `ms` (the route looks busy for as long as the profile says a
    batch takes)."""
    for _ in range(3):
        assert node.infer("patient", x=[[1, 600]])[0] == 200
    busy = threading.Thread(target=lambda: node.infer("patient", x=[[1, ms]]))
    busy.start()
    wait_for(lambda: node.stage("patient", "Sleepy")["replicas"][0]["outstanding"] > 0)
    return busy


def refuse(conn: http.client.HTTPConnection) -> tuple[int, float, str]:
    t0 = time.monotonic()
    conn.request("POST", "/v1/pipelines/patient/infer", BODY, HEADERS)
    r = conn.getresponse()
    r.read()
    return r.status, time.monotonic() - t0, r.getheader("x-slipstream-error-kind") or ""


def connect(node: Node) -> http.client.HTTPConnection:
    url = urlparse(node.url)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=10)


def test_a_connection_that_comes_back_early_has_its_refusals_paced() -> None:
    # Ten held refusals answered a second: one slot every 100 ms.
    with Node(str(APPS / "patient.py"), "--refusal-rate", "10") as node:
        busy = busy_replica(node, 1500)
        tries = [refuse(conn) for conn in [connect(node)] for _ in range(4)]
        assert all(s == 429 and kind == "overloaded" for s, _, kind in tries), tries
        # The first in good standing, the second to a free slot, then one slot each.
        assert tries[2][1] >= 0.07 and tries[3][1] >= 0.07, tries
        # Another connection is another client: refused at once.
        status, took, _ = refuse(connect(node))
        assert status == 429 and took < tries[2][1], (took, tries)
        held = node.status()["overload"]
        assert held["held_refusals"] >= 2 and held["refusal_rate"] == 10
        assert "slipstream_refusals_held_total" in node.request("GET", "/metrics")[2].decode()
        busy.join(10)


def test_refusals_are_answered_at_once_when_pacing_is_off() -> None:
    with Node(str(APPS / "patient.py"), "--refusal-rate", "0") as node:
        busy = busy_replica(node, 1000)
        tries = [refuse(conn) for conn in [connect(node)] for _ in range(4)]
        assert all(s == 429 for s, _, _ in tries), tries
        assert node.status()["overload"]["held_refusals"] == 0
        busy.join(10)


def test_under_overload_the_low_class_is_refused_first() -> None:
    with Node(str(APPS / "patient.py")) as node:
        for _ in range(3):  # a batch takes ~1 s
            assert node.infer("patient", x=[[1, 1000]])[0] == 200
        busy = threading.Thread(target=lambda: node.infer("patient", x=[[1, 1000]]))
        busy.start()
        wait_for(lambda: node.stage("patient", "Sleepy")["replicas"][0]["outstanding"] > 0)
        # Predicted ~2 s (what is left of the running batch, then its own) of
        # a 3 s budget: within a normal request's share, not a low one's (half).
        body = {"inputs": {"x": [[2, 1000]]}}
        ask = {"x-slipstream-deadline-ms": "3000"}
        with ThreadPoolExecutor(2) as pool:
            normal = pool.submit(node.request, "POST", "/v1/pipelines/patient/infer", body, ask)
            low = pool.submit(node.request, "POST", "/v1/pipelines/patient/infer", body,
                              {**ask, "x-slipstream-priority": "low"})
            (low_status, low_headers, _), (normal_status, _, raw) = low.result(), normal.result()
        assert low_status == 429 and low_headers["x-slipstream-error-kind"] == "overloaded"
        assert normal_status == 200, raw
        busy.join(10)
        # A class the node does not know is a bad request, and changes nothing.
        status, _, raw = node.request("POST", "/v1/pipelines/patient/infer", body, {"x-slipstream-priority": "urgent"})
        assert status == 400 and b"high, normal or low" in raw
        with node.client() as client:
            assert client.infer("patient", {"x": [[3.0, 1.0]]}, priority="high")["y"].shape == (1, 2)
            with pytest.raises(ss.BadRequest, match="priority"):
                client.infer("patient", {"x": [[3.0, 1.0]]}, priority="urgent")
