"""A real node and real workers: answers, the HTTP API, batching, fan-in."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from tests.conftest import Node


def test_chain_answers(chain_node: Node) -> None:
    status, body = chain_node.infer("chain", x=[[1, 2], [3, 4]])
    assert status == 200, body
    assert body["outputs"]["y"] == [[3.0, 5.0], [7.0, 9.0]]


def test_health_and_description(chain_node: Node) -> None:
    assert chain_node.get("/healthz") == (200, {"status": "live"})
    assert chain_node.get("/readyz")[0] == 200
    status, listing = chain_node.get("/v1/pipelines")
    assert status == 200
    assert {p["name"] for p in listing["pipelines"]} == {"chain", "diamond", "retry", "solo", "noop", "tight", "graceful"}
    status, desc = chain_node.get("/v1/pipelines/chain")
    assert status == 200
    assert desc["inputs"] == {"x": {"dtype": "float32", "shape": [-1, 2]}}
    assert desc["slo"] == {"p99_ms": 5000.0, "max_miss_rate": 0.01}
    assert [s["name"] for s in desc["stages"]] == ["Double", "AddOne"]
    assert desc["stages"][1]["parents"] == ["Double"]


def test_fan_out_fan_in_joins_per_request(chain_node: Node) -> None:
    rows = [[float(i), float(i % 7 + 1)] for i in range(40)]

    def one(r: list[float]) -> tuple[int, object]:
        return chain_node.infer("diamond", x=[r])

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, rows))
    for r, (status, body) in zip(rows, results, strict=True):
        assert status == 200, body
        assert body["outputs"]["both"] == [[r[0] + r[1], r[0] * r[1]]]


def test_concurrent_requests_are_batched(chain_node: Node) -> None:
    # A slow batch holds the worker; the requests arriving meanwhile form one batch.
    before = chain_node.stage("chain", "Double")["batches"]

    def one(i: int) -> int:
        x = [[99.0, 1.0]] if i == 0 else [[float(i + 100), 1.0]]
        return chain_node.infer("chain", x=x)[0]

    with ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(one, range(20)))
    assert statuses == [200] * 20
    st = chain_node.stage("chain", "Double")
    assert st["batch_size"]["max"] > 1
    assert st["batch_size"]["max"] <= 32
    assert st["batches"] - before < 20


def test_status_and_metrics(chain_node: Node) -> None:
    chain_node.infer("chain", x=[[1, 1]])
    st = chain_node.status()
    chain = next(p for p in st["pipelines"] if p["name"] == "chain")
    assert chain["ok"] >= 1
    stage = chain["stages"][0]
    assert stage["replicas"][0]["healthy"] is True
    assert stage["replicas"][0]["pid"] > 0
    assert stage["hop_ms"]["count"] >= 1
    status, _, raw = chain_node.request("GET", "/metrics")
    text = raw.decode()
    assert status == 200
    assert 'slipstream_requests_ok_total{pipeline="chain"}' in text
    assert 'slipstream_stage_batches_total{pipeline="chain",stage="Double"}' in text
    assert "# TYPE slipstream_stage_hop_seconds histogram" in text


def test_cli_status_prints_stages(chain_node: Node) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "slipstream._internal.cli", "status", "--url", chain_node.url],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    assert "pipeline chain" in out
    assert "Double" in out and "AddOne" in out


def test_v2_json_infer_and_metadata(chain_node: Node) -> None:
    body = {"id": "r1", "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    status, out = chain_node.post("/v2/models/chain/infer", body)
    assert status == 200, out
    assert out["model_name"] == "chain" and out["id"] == "r1"
    y = next(o for o in out["outputs"] if o["name"] == "y")
    assert y == {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [3.0, 5.0]}
    status, meta = chain_node.get("/v2/models/chain")
    assert status == 200
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
    assert chain_node.get("/v2/health/live")[0] == 200
    assert chain_node.get("/v2/health/ready")[0] == 200
    assert chain_node.get("/v2/models/chain/ready")[0] == 200


def test_v2_binary_extension_raw(chain_node: Node) -> None:
    import numpy as np

    x = np.array([[1.5, 2.5]], dtype=np.float32)
    header = json.dumps({
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }).encode()
    status, headers, raw = chain_node.request(
        "POST", "/v2/models/chain/infer", header + x.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    assert status == 200, raw
    n = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    meta = json.loads(raw[:n])
    assert meta["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert np.frombuffer(raw[n:], dtype=np.float32).tolist() == [4.0, 6.0]


def test_tritonclient_works_unchanged(chain_node: Node) -> None:
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(chain_node.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_model_ready("chain")
    x = np.array([[1, 2], [3, 4]], dtype=np.float32)
    for binary in (True, False):
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        out = httpclient.InferRequestedOutput("y", binary_data=binary)
        res = client.infer("chain", [inp], outputs=[out])
        np.testing.assert_array_equal(res.as_numpy("y"), x * 2 + 1)
    meta = client.get_model_metadata("chain")
    assert meta["inputs"][0]["datatype"] == "FP32"


def test_many_rows_and_large_tensor(chain_node: Node) -> None:
    import numpy as np

    x = np.arange(20000, dtype=np.float32).reshape(10000, 2) % 10
    status, out = chain_node.infer("chain", x=x.tolist())
    assert status == 200
    np.testing.assert_array_equal(np.array(out["outputs"]["y"], dtype=np.float32), x * 2 + 1)
