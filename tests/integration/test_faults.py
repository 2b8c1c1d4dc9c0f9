"""Bad input, failing components, dying workers, timeouts, shutdown."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import APPS, Node, shm_files_of, wait_for


def err(node: Node, path: str, body: object, **kw: object) -> tuple[int, str, str]:
    """(status, kind, message) of an error answer, in either protocol's shape:
    the pipeline API's `{"error": {"kind", "message"}}` or KServe v2's
    `{"error": "message"}`; both carry the kind in a header."""
    status, headers, raw = node.request("POST", path, body, **kw)  # type: ignore[arg-type]
    kind = {k.lower(): v for k, v in headers.items()}["x-slipstream-error-kind"]
    e = json.loads(raw)["error"]
    if path.startswith("/v2/"):
        assert isinstance(e, str), f"KServe v2 error bodies are {{'error': '<message>'}}, got {e!r}"
        return status, kind, e
    assert e["kind"] == kind
    return status, kind, e["message"]


def test_malformed_json(chain_node: Node) -> None:
    status, kind, msg = err(chain_node, "/v1/pipelines/chain/infer", b"{not json")
    assert (status, kind) == (400, "bad_request")
    assert "JSON" in msg


def test_unknown_pipeline(chain_node: Node) -> None:
    status, kind, msg = err(chain_node, "/v1/pipelines/nope/infer", {"inputs": {"x": [[1, 2]]}})
    assert (status, kind) == (404, "unknown_pipeline")
    assert "nope" in msg
    assert err(chain_node, "/v2/models/nope/infer", {"inputs": []})[0] == 404


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ({}, "missing input(s): x"),
        ({"x": [[1, 2]], "z": [[1]]}, "unexpected input(s): z"),
        ({"x": [["a", "b"]]}, "expects float32"),
        ({"x": [[1, 2, 3]]}, "shape [-1, 2]"),
        ({"x": [1, 2]}, "shape [-1, 2]"),
        ({"x": [[1, 2], [3]]}, "ragged"),
        ({"x": "hello"}, "array"),
    ],
)
def test_bad_inputs_name_the_problem(chain_node: Node, inputs: dict, needle: str) -> None:
    status, kind, msg = err(chain_node, "/v1/pipelines/chain/infer", {"inputs": inputs})
    assert (status, kind) == (400, "bad_input"), msg
    assert needle in msg


def test_v2_wrong_datatype_and_count(chain_node: Node) -> None:
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "INT32", "data": [1, 2]}]}
    status, kind, msg = err(chain_node, "/v2/models/chain/infer", body)
    assert (status, kind) == (400, "bad_input") and "FP32" in msg
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2, 3]}]}
    status, kind, msg = err(chain_node, "/v2/models/chain/infer", body)
    assert (status, kind) == (400, "bad_input") and "3 values" in msg


def test_oversized_body_is_refused(chain_node: Node) -> None:
    big = b'{"inputs": {"x": [' + b"[1, 2]," * 300_000 + b"[1, 2]]}}"
    status, kind, _ = err(chain_node, "/v1/pipelines/chain/infer", big)
    assert (status, kind) == (413, "payload_too_large")


def test_wrong_method_and_route(chain_node: Node) -> None:
    status, _, _ = chain_node.request("GET", "/v1/pipelines/chain/infer")
    assert status == 405
    status, _, _ = chain_node.request("GET", "/nowhere")
    assert status == 404


def test_component_error_fails_only_its_batch(chain_node: Node) -> None:
    pid = chain_node.stage("chain", "Double")["replicas"][0]["pid"]
    status, kind, msg = err(chain_node, "/v1/pipelines/chain/infer", {"inputs": {"x": [[13, 1]]}})
    assert (status, kind) == (500, "component_error")
    assert "13 is unlucky" in msg
    status, body = chain_node.infer("chain", x=[[1, 1]])
    assert status == 200 and body["outputs"]["y"] == [[3.0, 3.0]]
    assert chain_node.stage("chain", "Double")["replicas"][0]["pid"] == pid


def test_timeout_releases_half_joined_parts(chain_node: Node) -> None:
    # Prod sleeps 5 s on 77; the node's request timeout is 2 s. Sum finishes,
    # Prod does not: the request must answer 504 and free what Sum produced.
    t0 = time.monotonic()
    status, kind, _ = err(chain_node, "/v1/pipelines/diamond/infer", {"inputs": {"x": [[77, 1]]}})
    assert (status, kind) == (504, "timeout")
    assert time.monotonic() - t0 < 4.5
    # Still serving afterwards (the slow batch finishes in the background).
    wait_for(lambda: chain_node.infer("diamond", x=[[2, 3]]) == (200, {"outputs": {"both": [[5.0, 6.0]]}}), timeout=10)
    diamond = next(p for p in chain_node.status()["pipelines"] if p["name"] == "diamond")
    assert diamond["errors"].get("timeout", 0) >= 1
    # Nothing stays allocated once the node is idle: the timed-out request's
    # inputs and Sum's half of the join were released.
    wait_for(lambda: all(p["used_bytes"] == 0 for p in chain_node.status()["arena"]), timeout=10)


def test_killed_worker_is_retried_on_another_replica(chain_node: Node) -> None:
    pids = [r["pid"] for r in chain_node.stage("retry", "Slow")["replicas"]]
    assert len(set(pids)) == 2
    results: list[tuple[int, object]] = []

    def slow_request() -> None:
        results.append(chain_node.infer("retry", x=[[1, 800]]))

    t = threading.Thread(target=slow_request)
    t.start()
    # Find the replica running the slow batch and kill it mid-batch.
    busy = wait_for(lambda: [r for r in chain_node.stage("retry", "Slow")["replicas"] if r["outstanding"] > 0])
    os.kill(busy[0]["pid"], signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    status, body = results[0]
    assert status == 200, body
    survivor = body["outputs"]["pid"][0][0]  # type: ignore[index]
    assert survivor != busy[0]["pid"] and survivor in pids
    st = wait_for(lambda: (s := chain_node.stage("retry", "Slow")) and all(r["healthy"] for r in s["replicas"]) and s)
    assert st["retries"] >= 1 and st["restarts"] >= 1
    assert busy[0]["pid"] not in [r["pid"] for r in st["replicas"]]
    assert chain_node.infer("retry", x=[[2, 1]])[0] == 200


def test_killed_sole_worker_gives_503_then_recovers(chain_node: Node) -> None:
    pid = chain_node.stage("solo", "SlowSolo")["replicas"][0]["pid"]
    results: list[tuple[int, object]] = []
    t = threading.Thread(target=lambda: results.append(chain_node.infer("solo", x=[[1, 800]])))
    t.start()
    wait_for(lambda: chain_node.stage("solo", "SlowSolo")["replicas"][0]["outstanding"] > 0)
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    status, body = results[0]
    assert status == 503, body
    assert body["error"]["kind"] == "unavailable"  # type: ignore[index]
    wait_for(lambda: chain_node.infer("solo", x=[[1, 1]])[0] == 200, timeout=30)
    assert chain_node.stage("solo", "SlowSolo")["replicas"][0]["pid"] != pid


def test_worker_exit_mid_batch_is_survived(chain_node: Node) -> None:
    status, body = chain_node.infer("chain", x=[[66, 1]])
    assert status == 503 and body["error"]["kind"] == "unavailable"
    wait_for(lambda: chain_node.infer("chain", x=[[1, 1]])[0] == 200, timeout=30)


def test_broken_component_fails_startup_with_its_message() -> None:
    node = Node(str(APPS / "broken.py"))
    rc = node.proc.wait(60)
    assert rc != 0
    assert "model file is missing" in node.log()


def test_graceful_shutdown_drains_in_flight() -> None:
    started = time.time() - 1.0  # ctime has the file system's granularity
    node = Node(str(APPS / "chain.py"))
    node.wait_ready()
    serve_pid = node.proc.pid
    assert shm_files_of(serve_pid, started)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(node.infer, "solo", x=[[1, 500]]) for _ in range(3)]
        # All three must be inside the node before the signal (later ones would rightly get 503).
        wait_for(lambda: node.status()["inflight"] == 3)
        node.proc.send_signal(signal.SIGTERM)
        results = [f.result(timeout=30) for f in futures]
    assert [s for s, _ in results] == [200, 200, 200]
    assert node.proc.wait(30) == 0
    assert "draining" in node.log()
    assert shm_files_of(serve_pid, started) == []


def test_a_killed_node_s_shared_memory_is_removed_by_the_next_node() -> None:
    """A SIGKILLed node cannot remove its pool files (memory, in /dev/shm);
    the next node to start on the machine finds its lock free and does."""
    started = time.time() - 1.0
    node = Node(str(APPS / "chain.py"))
    node.wait_ready()
    pid = node.proc.pid
    files = shm_files_of(pid, started)
    assert f"slipstream-{pid}-" in files[0] and any(f.endswith(".lock") for f in files), files
    assert len(files) >= 2  # the lock and the ingress pool at least
    node.proc.kill()
    node.proc.wait(30)
    # (Another test's node starting meanwhile may already have swept them.)
    with Node(str(APPS / "chain.py")) as after:
        assert after.status()["ready"]
        assert shm_files_of(pid, started) == []
