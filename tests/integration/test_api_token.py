"""The API token (`--api-token`): inference over HTTP and gRPC, feedback and
the store's routes need `Authorization: Bearer <token>` (the admin token
passes too); probes, metrics, the status and the descriptions stay open; the
node's workers read and write the store with the token it hands them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import slipstream as ss

from tests.conftest import APPS, Node, wait_for

TOKEN, ADMIN = "api-t0ken", "adm-t0ken"
X = json.dumps({"inputs": {"x": [1.5, -2.0]}}).encode()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(str(APPS / "storeapp.py"), "--port", "0", "--api-token", TOKEN)
    try:
        n.wait_ready()
        yield n
    finally:
        n.stop()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


def test_inference_needs_the_token_and_its_worker_reads_the_store_with_it(node: Node) -> None:
    status, _, body = node.request("POST", "/v1/pipelines/scaled/infer", X)
    err = json.loads(body)["error"]
    assert (status, err["kind"]) == (401, "unauthorized") and "SLIPSTREAM_API_TOKEN" in err["message"], err
    assert node.request("POST", "/v1/pipelines/scaled/infer", X, bearer("wrong"))[0] == 401
    assert node.request("POST", "/v2/models/scaled/infer", b"{}")[0] == 401, "refused before the body is read"
    # `Scale` loaded /models/scale (2) from the store in its worker, which
    # holds the token the node handed it.
    status, _, body = node.request("POST", "/v1/pipelines/scaled/infer", X, bearer(TOKEN))
    assert status == 200, body
    assert json.loads(body)["outputs"]["y"] == [3.0, -4.0]
    for path in ("/healthz", "/readyz", "/v2/health/ready", "/metrics", "/v1/status", "/v1/pipelines/scaled"):
        assert node.request("GET", path)[0] == 200, path


def test_the_client_sends_it_from_its_argument_or_the_environment(node: Node,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    x = {"x": np.array([1.0, 2.0], dtype=np.float32)}
    monkeypatch.delenv("SLIPSTREAM_API_TOKEN", raising=False)
    with ss.Client(node.url, retry=None) as c, pytest.raises(ss.Unauthorized):
        c.infer("scaled", x)
    with ss.Client(node.url, token=TOKEN) as c:
        assert c.infer("scaled", x)["y"].tolist() == [2.0, 4.0]
    monkeypatch.setenv("SLIPSTREAM_API_TOKEN", TOKEN)
    with ss.Client(node.url) as c:
        assert c.infer("scaled", x)["y"].tolist() == [2.0, 4.0]


def test_grpc_inference_needs_it_too(node: Node) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    g = grpcclient.InferenceServerClient(node.url.removeprefix("http://"))
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.array([3.0, 4.0], dtype=np.float32))
    with pytest.raises(InferenceServerException) as e:
        g.infer("scaled", [inp])
    assert "UNAUTHENTICATED" in str(e.value.status()), e.value
    assert g.is_server_ready(), "the health calls stay open"
    res = g.infer("scaled", [inp], headers={"authorization": f"Bearer {TOKEN}"})
    assert res.as_numpy("y").tolist() == [6.0, 8.0]


def test_the_store_needs_it_and_a_triggered_worker_writes_with_it(node: Node) -> None:
    assert node.request("GET", "/v1/store/objects/models/scale")[0] == 401
    assert node.request("PUT", "/v1/store/objects/jobs/a", b"one")[0] == 401
    store = ss.store.Store(node.url, token=TOKEN)
    assert store.get("/models/scale").text() == "2"
    store.put("/jobs/a", "one")
    # `Recorder` runs on the trigger and writes /log/a from its worker.

    def logged() -> str | None:
        try:
            return store.get("/log/a").text()
        except ss.StoreNotFound:
            return None

    wait_for(lambda: logged() is not None, timeout=30)
    assert (logged() or "").endswith("put one"), logged()
