"""The benchmarks' requests as KServe v2 binary bodies (``bench.goodput.Wire.v2``,
what ``ss.Client`` sends): the same inputs as their JSON, answered alike by a
real node, through the project's generator too."""

from __future__ import annotations

import base64
import json
import struct
import urllib.request
from collections.abc import Iterator

import pytest

from bench.goodput import Wire, run_rate
from tests.conftest import APPS, Node


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(str(APPS / "text.py"))
    n.wait_ready()
    yield n
    n.stop()


def pipeline(name: str):  # type: ignore[no-untyped-def]
    from slipstream._internal.app import load_pipelines

    return next(p for p in load_pipelines(str(APPS / "text.py"))[1] if p.name == name)


def post(node: Node, wire: Wire, pipe: str, body: bytes) -> tuple[dict, bytes]:  # type: ignore[type-arg]
    """One v2 binary request: the answer's JSON header and its binary part."""
    headers = {"Content-Type": wire.content_type, **dict(wire.headers)}
    req = urllib.request.Request(node.url + wire.route.format(p=pipe), data=body, headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        n = int(r.headers["Inference-Header-Content-Length"])
        data = r.read()
    return json.loads(data[:n]), data[n:]


def var(data: bytes) -> list[bytes]:
    """v2's BYTES layout: each element a little-endian u32 length, then its bytes."""
    out, at = [], 0
    while at < len(data):
        (n,) = struct.unpack_from("<I", data, at)
        out.append(data[at + 4:at + 4 + n])
        at += 4 + n
    return out


def test_a_mix_of_lengths_shares_one_header_length_and_is_answered_as_its_json(node: Node) -> None:
    words = ["a", "héllo wörld", "x" * 300]
    bodies = [json.dumps({"inputs": {"text": [w]}}).encode() for w in words]
    wire = Wire.v2(bodies, pipeline("text"))
    assert wire.route == "/v2/models/{p}/infer" and len(wire.bodies) == 3
    n = int(dict(wire.headers)["Inference-Header-Content-Length"])
    for w, b in zip(words, wire.bodies, strict=True):
        head = json.loads(b[:n])  # padded with spaces: still one JSON document
        assert head["inputs"][0]["name"] == "text" and head["inputs"][0]["datatype"] == "BYTES"
        assert b[n:] == struct.pack("<I", len(w.encode())) + w.encode()
        out, data = post(node, wire, "text", b)
        loud = next(o for o in out["outputs"] if o["name"] == "loud")
        size = loud["parameters"]["binary_data_size"]
        at = sum(o["parameters"]["binary_data_size"] for o in out["outputs"][:out["outputs"].index(loud)])
        assert var(data[at:at + size]) == [(w.upper() + "!").encode()]
    # The generator sends them in turn with the one header: all answered.
    r = run_rate(node.url, "text", wire, 40.0, 1.0, 1000.0, warmup_s=0.2)
    assert r["errors"] == 0 and r["ok"] == r["sent"] > 20, r


def test_bytes_travel_raw_not_as_their_base64() -> None:
    blob = bytes(range(256))
    body = json.dumps({"inputs": {"blob": [base64.b64encode(blob).decode()]}}).encode()
    wire = Wire.v2([body], pipeline("blob"))
    n = int(dict(wire.headers)["Inference-Header-Content-Length"])
    assert wire.bodies[0][n:] == struct.pack("<I", 256) + blob
