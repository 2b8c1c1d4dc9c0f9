"""`ss.launch`: a node in the background from Python."""

from __future__ import annotations

import json
import urllib.request

import pytest
import slipstream as ss

from tests.conftest import APPS


def test_launch_serves_and_stops_cleanly() -> None:
    with ss.launch(APPS / "chain.py") as node:
        req = urllib.request.Request(f"{node.url}/v1/pipelines/chain/infer",
                                     data=json.dumps({"inputs": {"x": [[1, 2]]}}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            out = json.loads(r.read())["outputs"]
        assert out["y"] == [[3.0, 5.0]]
        assert out["pid"][0][0] > 0
    assert node.proc.returncode == 0


def test_launch_reports_why_a_node_did_not_start() -> None:
    with pytest.raises(ss.ServeError, match="model file is missing"):
        ss.launch(APPS / "broken.py")
