"""Count every payload copy from request body to response body.

Designed count (docs/design/data-path.md):
- ingress: 1 per request (the body's bytes are written once into the arena;
  for JSON this write is the decode itself);
- batch gather: 0 when a batch's tensors already lie side by side in the
  arena (always for a batch of one, and for a child stage fed by one parent
  batch in order), else 1 per batch input;
- worker: 0 for an output that is (a slice of) an input, passed by
  reference; else 1 (the component's array into the worker's pool);
- egress: 0 for binary v2 outputs (the socket reads the arena block).
"""

from __future__ import annotations

import json

import numpy as np

from tests.conftest import Node


def copies(node: Node) -> dict[str, int]:
    return node.status()["copies"]


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("body_join", "ingress", "gather", "worker", "egress", "total")}


def v2_binary(node: Node, model: str, x: np.ndarray, out: str) -> np.ndarray:
    header = json.dumps({
        "inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes}}],
        "outputs": [{"name": out, "parameters": {"binary_data": True}}],
    }).encode()
    status, headers, raw = node.request(
        "POST", f"/v2/models/{model}/infer", header + x.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200, raw
    n = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    return np.frombuffer(raw[n:], dtype=np.float32).reshape(x.shape)


def test_pass_through_chain_copies_payload_once(chain_node: Node) -> None:
    x = np.arange(2048, dtype=np.float32).reshape(1024, 2)  # 8 KiB payload
    before = copies(chain_node)
    for _ in range(10):
        y = v2_binary(chain_node, "noop", x, "y")
        np.testing.assert_array_equal(y, x)
    d = delta(copies(chain_node), before)
    # One copy per request, at ingress: stage handoffs, both workers and egress copy nothing.
    assert d == {"body_join": 0, "ingress": 10, "gather": 0, "worker": 0, "egress": 0, "total": 10}


def test_computing_chain_copies_each_new_output_once(chain_node: Node) -> None:
    x = np.ones((4, 2), dtype=np.float32)
    before = copies(chain_node)
    for _ in range(5):
        np.testing.assert_array_equal(v2_binary(chain_node, "chain", x, "y"), x * 2 + 1)
    d = delta(copies(chain_node), before)
    # Per request: ingress 1; Double writes x (1); AddOne writes y and pid (2).
    assert d == {"body_join": 0, "ingress": 5, "gather": 0, "worker": 15, "egress": 0, "total": 20}
