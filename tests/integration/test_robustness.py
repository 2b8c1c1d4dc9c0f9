"""Regression tests for the node's books under hostile conditions: clients
that vanish mid-request, crafted KServe v2 bodies, and readiness that must
follow the workers."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import APPS, Node, wait_for


@pytest.fixture()
def fresh_node() -> Iterator[Node]:
    node = Node(str(APPS / "chain.py"), "--request-timeout", "5")
    node.wait_ready()
    yield node
    node.stop()


def send_and_vanish(url: str, path: str, body: dict, linger_s: float) -> None:
    """Send one request, wait `linger_s`, close the socket without reading
    the answer (a client whose timeout fired)."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + raw)
        time.sleep(linger_s)


def closed_loop(node: Node, pipeline: str, x: list[list[float]], clients: int, seconds: float) -> list[int]:
    """`clients` threads sending back to back for `seconds`; their statuses."""
    statuses: list[int] = []
    end = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < end:
            status, _, _ = node.request("POST", f"/v1/pipelines/{pipeline}/infer", {"inputs": {"x": x}})
            statuses.append(status)
            if status == 429:
                time.sleep(0.002)

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client) for _ in range(clients)]:
            f.result()
    return statuses


def test_clients_that_vanish_mid_request_do_not_wedge_admission(fresh_node: Node) -> None:
    """Finding 1: an admitted request whose client goes away must still leave
    the admission gate's books; otherwise the gate believes the pipeline is
    full for good and refuses most of a light load that fits easily."""
    node = fresh_node
    # Teach the stage its latency, then check the light load is admitted.
    assert closed_loop(node, "tight", [[1, 10]], 1, 0.5).count(200) > 10
    # 64 clients send 20 ms batches and leave after 30 ms, long before their answers.
    threads = [threading.Thread(target=send_and_vanish,
                                args=(node.url, "/v1/pipelines/tight/infer", {"inputs": {"x": [[i, 20]]}}, 0.03))
               for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Let the node finish (or drop) the abandoned work.
    wait_for(lambda: node.stage("tight", "Sleepy")["replicas"][0]["outstanding"] == 0, timeout=10)
    time.sleep(0.3)
    # Two clients back to back, 10 ms per batch against a 150 ms SLO: at most
    # two requests are ever in the pipeline, so every one of them fits.
    statuses = closed_loop(node, "tight", [[1, 10]], 2, 3.0)
    refused = statuses.count(429) / len(statuses)
    assert statuses.count(200) > 50, statuses
    assert refused < 0.05, f"{refused:.0%} of a light load refused after clients vanished"
    p = next(p for p in node.status()["pipelines"] if p["name"] == "tight")
    assert p["admission"]["inflight"] == 0, p["admission"]
    assert p["cancelled"] > 0, "the vanished clients' requests are counted as cancelled"


def v2_binary(node: Node, model: str, inputs: list[dict], data: bytes) -> tuple[int, dict[str, str], bytes]:
    head = json.dumps({"inputs": inputs}).encode()
    return node.request("POST", f"/v2/models/{model}/infer", head + data,
                        headers={"Inference-Header-Content-Length": str(len(head)),
                                 "Content-Type": "application/octet-stream"})


def kind_of(headers: dict[str, str]) -> str | None:
    return {k.lower(): v for k, v in headers.items()}.get("x-slipstream-error-kind")


def test_crafted_v2_sizes_are_refused_before_any_worker(chain_node: Node) -> None:
    """Finding 2: a shape whose byte size wraps to 0 passed the size check
    and reached the component (500)."""
    before = chain_node.stage("chain", "Double")["requests"]
    for shape in ([4611686018427387904, 2], [2**63, 2**63], [2**64 - 1, 2]):
        status, headers, raw = v2_binary(chain_node, "chain", [
            {"name": "x", "shape": shape, "datatype": "FP32", "parameters": {"binary_data_size": 0}}], b"")
        assert status == 400, raw
        assert kind_of(headers) == "bad_input"
        assert "error" in json.loads(raw) and isinstance(json.loads(raw)["error"], str)
    status, _, raw = v2_binary(chain_node, "chain", [
        {"name": "x", "shape": [2**62, 2], "datatype": "FP32", "data": []}], b"")
    assert status == 400, raw
    assert chain_node.stage("chain", "Double")["requests"] == before, "no crafted request reached the worker"
    assert chain_node.infer("chain", x=[[1, 1]])[0] == 200


def test_duplicate_input_names_are_refused(chain_node: Node) -> None:
    status, headers, raw = chain_node.request(
        "POST", "/v1/pipelines/chain/infer", b'{"inputs": {"x": [[1, 2]], "x": [[3, 4], [5, 6]]}}')
    assert (status, kind_of(headers)) == (400, "bad_input"), raw
    assert "more than once" in json.loads(raw)["error"]["message"]
    x = {"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}
    status, headers, raw = chain_node.request("POST", "/v2/models/chain/infer", {"inputs": [x, x]})
    assert (status, kind_of(headers)) == (400, "bad_input"), raw
    assert "more than once" in json.loads(raw)["error"]


def test_binary_sizes_past_the_body_do_not_break_the_connection() -> None:
    """Two BYTES inputs sized u64::MAX and 1: the sizes wrapped and slicing
    the body panicked the connection task (the client saw a reset)."""
    node = Node(str(APPS / "text.py"))
    try:
        node.wait_ready()
        for names, tail in ((["blob", "blob"], b""), (["blob", "blob"], b"\x01"), (["blob", "other"], b"")):
            inputs = [{"name": names[0], "shape": [1], "datatype": "BYTES",
                       "parameters": {"binary_data_size": 2**64 - 1}},
                      {"name": names[1], "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 1}}]
            try:
                status, headers, raw = v2_binary(node, "blob", inputs, tail)
            except (ConnectionError, http.client.HTTPException) as e:
                raise AssertionError(f"the node dropped the connection instead of answering: {e!r}") from e
            assert (status, kind_of(headers)) == (400, "bad_input"), raw
        assert node.infer("blob", blob=["aGk="])[0] == 200
        assert node.proc.poll() is None
    finally:
        node.stop()


def test_readiness_follows_the_workers(tmp_path: object) -> None:
    """Finding 3: readiness stayed 200 while a stage's only worker was
    crash-looping. It must be 503 then (per pipeline too), and come back."""
    import pathlib

    flag = pathlib.Path(str(tmp_path)) / "broken"
    node = Node(str(APPS / "fragile.py"), env={"SLIPSTREAM_TEST_BROKEN": str(flag)})
    try:
        node.wait_ready()
        ready = lambda path: node.request("GET", path)[0]  # noqa: E731
        assert ready("/readyz") == ready("/v2/health/ready") == 200
        assert ready("/v2/models/fragile/ready") == ready("/v2/models/steady/ready") == 200
        flag.write_text("the model file is gone")
        assert node.infer("fragile", x=[[66, 1]])[0] == 503  # the worker dies; it cannot restart
        wait_for(lambda: ready("/readyz") == 503, timeout=10)
        assert ready("/v2/health/ready") == 503
        assert ready("/v2/models/fragile/ready") == 503
        assert ready("/v2/models/steady/ready") == 200, "the other pipeline is still ready"
        status, _, raw = node.request("GET", "/readyz")
        assert "fragile/Fragile" in json.loads(raw)["stages"]
        time.sleep(1.0)
        assert ready("/readyz") == 503, "still crash-looping"
        flag.unlink()
        wait_for(lambda: ready("/readyz") == 200, timeout=20)
        assert ready("/v2/models/fragile/ready") == 200
        assert node.infer("fragile", x=[[1, 2]]) == (200, {"outputs": {"y": [[2.0, 4.0]]}})
    finally:
        node.stop()


def test_model_metadata_lists_outputs_once_known(chain_node: Node) -> None:
    """KServe v2 metadata lists a pipeline's outputs: as declared, or as the
    first answer had them when the app does not declare them."""
    status, meta = chain_node.get("/v2/models/graceful")
    assert status == 200 and meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]
    assert chain_node.infer("chain", x=[[1, 2]])[0] == 200
    status, meta = chain_node.get("/v2/models/chain")
    assert status == 200
    assert {o["name"]: (o["datatype"], o["shape"]) for o in meta["outputs"]} == {
        "y": ("FP32", [-1, 2]), "pid": ("INT64", [-1, 1])}
