"""String and bytes tensors: JSON, KServe v2 JSON and binary, batching."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import APPS, Node


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(str(APPS / "text.py"))
    n.wait_ready()
    yield n
    n.stop()


def test_strings_through_a_chain(node: Node) -> None:
    status, out = node.infer("text", text=["héllo wörld", "", "a\"quote"])
    assert status == 200, out
    assert out["outputs"]["loud"] == ["HÉLLO WÖRLD!", "!", 'A"QUOTE!']
    assert out["outputs"]["n"] == [[11], [0], [7]]
    assert out["outputs"]["pair"] == [["HÉLLO WÖRLD!", "héllo wörld!"], ["!", "!"], ['A"QUOTE!', 'a"quote!']]


def test_batched_strings_go_back_to_their_requests(node: Node) -> None:
    words = [f"word-{i}-" + "x" * (i % 7) for i in range(40)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda w: node.infer("text", text=[w]), words))
    for w, (status, out) in zip(words, results, strict=True):
        assert status == 200
        assert out["outputs"]["loud"] == [w.upper() + "!"]


def test_bytes_are_base64_in_json(node: Node) -> None:
    raw = bytes(range(256))
    status, out = node.infer("blob", blob=[base64.b64encode(raw).decode()])
    assert status == 200, out
    assert base64.b64decode(out["outputs"]["rev"][0]) == raw[::-1]
    status, out = node.infer("blob", blob=["not base64!!"])
    assert status == 400 and "base64" in out["error"]["message"]


def test_string_type_errors(node: Node) -> None:
    status, out = node.infer("text", text=[1, 2])
    assert status == 400 and "string" in out["error"]["message"]


def test_v2_bytes_json_and_binary(node: Node) -> None:
    body = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["ab", "cd"]}]}
    status, out = node.post("/v2/models/text/infer", body)
    assert status == 200, out
    loud = next(o for o in out["outputs"] if o["name"] == "loud")
    assert loud == {"name": "loud", "datatype": "BYTES", "shape": [2], "data": ["AB!", "CD!"]}
    # Binary extension: elements are u32 length + bytes.
    payload = b"".join(struct.pack("<I", len(s)) + s for s in (b"xy", b"z"))
    header = json.dumps({
        "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "parameters": {"binary_data_size": len(payload)}}],
        "outputs": [{"name": "loud", "parameters": {"binary_data": True}}],
    }).encode()
    status, headers, raw = node.request(
        "POST", "/v2/models/text/infer", header + payload,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200, raw
    n = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    assert raw[n:] == struct.pack("<I", 3) + b"XY!" + struct.pack("<I", 2) + b"Z!"
    bad = struct.pack("<I", 1) + b"\xff"
    header = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(bad)}}]}).encode()
    status, _, raw = node.request("POST", "/v2/models/text/infer", header + bad,
                                  headers={"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and b"UTF-8" in raw


def test_tritonclient_bytes(node: Node) -> None:
    import numpy as np
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(node.url.removeprefix("http://"))
    x = np.array(["one", "two"], dtype=object)
    for binary in (True, False):
        inp = httpclient.InferInput("text", [2], "BYTES")
        inp.set_data_from_numpy(x, binary_data=binary)
        res = client.infer("text", [inp], outputs=[httpclient.InferRequestedOutput("loud", binary_data=binary)])
        got = [v.decode() if isinstance(v, bytes) else v for v in res.as_numpy("loud")]
        assert got == ["ONE!", "TWO!"]


def test_queued_requests_are_batched_with_others_of_similar_length(node: Node) -> None:
    """`length_of`: while a replica is busy, short and long requests queue
    in alternation; each batch then holds one length, not the next four in
    deadline order (which would pad every short request to the long one)."""
    import threading
    import time

    results: dict[int, tuple[int, dict]] = {}

    def send(i: int, text: str) -> None:
        results[i] = node.infer("padded", text=[text])

    blocker = threading.Thread(target=send, args=(-1, "wait"))
    blocker.start()
    time.sleep(0.15)  # the replica is now running the blocker's batch
    texts = ["short" if i % 2 == 0 else "L" * 200 for i in range(8)]
    senders = []
    for i, text in enumerate(texts):
        senders.append(threading.Thread(target=send, args=(i, text)))
        senders[-1].start()
        time.sleep(0.02)  # arrive in this order
    for t in [blocker, *senders]:
        t.join(timeout=30)
    assert results[-1][0] == 200, results[-1]
    for i, text in enumerate(texts):
        status, out = results[i]
        assert status == 200, out
        assert out["outputs"]["longest"] == [[len(text)]], (i, text[:8], out["outputs"])
    assert sorted(out["outputs"]["size"][0][0] for _, out in results.values())[-1] == 4



def test_a_component_reads_how_long_its_requests_have_left(node: Node) -> None:
    """`batch.time_left()`: a fresh request has about its SLO (800 ms) left;
    one that queued behind a 300 ms batch has about 300 ms less."""
    import threading
    import time

    status, out = node.infer("deadline", text=["now"])
    assert status == 200, out
    (fresh,) = out["outputs"]["left_ms"][0]
    assert 600 < fresh <= 800, fresh

    results: dict[str, tuple[int, dict]] = {}

    def send(text: str) -> None:
        results[text] = node.infer("deadline", text=[text])

    blocker = threading.Thread(target=send, args=("wait",))
    blocker.start()
    time.sleep(0.1)  # the replica is running the blocker's 300 ms batch
    send("queued")
    blocker.join(timeout=30)
    status, out = results["queued"]
    assert status == 200, out
    (queued,) = out["outputs"]["left_ms"][0]
    assert queued < fresh - 100, (queued, fresh)
    assert queued > 0, queued
