"""Torch components served by a real node (tests/apps/torchapp.py): torch
tensors in and out, zero-copy on the CPU (copy counters as in
test_copies.py), mixed numpy/torch chains, torch loaded only where used,
and GPU binding (`device="cuda"`): a clear failure at start on a machine
without a GPU, one GPU per replica on a machine with one."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest

from tests.conftest import APPS, Node

pytest.importorskip("torch")

COUNTS = ("body_join", "ingress", "gather", "worker", "egress", "total")


def _gpus() -> list[str]:
    """UUIDs `nvidia-smi -L` lists (whole GPUs and MIG slices), none without it."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return []
    return [line.split("(UUID:")[1].strip(" )") for line in out.stdout.splitlines() if "(UUID:" in line]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(str(APPS / "torchapp.py"), "--request-timeout", "30", ready_timeout=120)
    n.wait_ready(120)
    yield n
    n.stop()


def copies(node: Node) -> dict[str, int]:
    c = node.status()["copies"]
    return {k: c[k] for k in COUNTS}


def test_torch_chain_is_zero_copy_on_the_cpu(node: Node) -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    before = copies(node)
    for _ in range(5):
        status, body = node.infer("torch_chain", x=x.tolist())
        assert status == 200, body
        np.testing.assert_array_equal(np.array(body["outputs"]["y"], dtype=np.float32), x * 2 + 1)
    after = copies(node)
    # Per request: ingress 1; TorchPass returns a slice of its input tensor, which the
    # worker recognises as a view of the ingress block and passes by reference (0);
    # TorchAffine's new tensor is copied once into its pool (1); nothing else copies.
    assert {k: after[k] - before[k] for k in COUNTS} == \
        {"body_join": 0, "ingress": 5, "gather": 0, "worker": 5, "egress": 0, "total": 10}
    # Writable views, so torch.from_numpy has nothing to warn about.
    assert "not writable" not in node.log()


def test_mixed_numpy_torch_numpy_chain(node: Node) -> None:
    x = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float32)
    status, body = node.infer("mixed", x=x.tolist())
    assert status == 200, body
    out = body["outputs"]
    np.testing.assert_array_equal(np.array(out["y"], dtype=np.float32), (x + 1) * 2 - 1)
    np.testing.assert_array_equal(np.array(out["t"], dtype=np.float32), (x + 1)[:, :2])
    # The numpy stages' workers never imported torch, though their neighbour did.
    assert out["first_torch"] == [[False], [False]]
    assert out["last_torch"] == [[False], [False]]


def test_numpy_component_may_return_torch_tensors(node: Node) -> None:
    x = np.array([[1, 2, 3]], dtype=np.float32)
    status, body = node.infer("np_torch", x=x.tolist())
    assert status == 200, body
    assert body["outputs"]["y"] == (x * 3).tolist()
    assert body["outputs"]["x0"] == x[:, :1].tolist()


def test_strings_stay_numpy_in_torch_mode(node: Node) -> None:
    status, body = node.infer("torch_text", s=["ab", "cde"], x=[[0, 0, 0], [1, 1, 1]])
    assert status == 200, body
    assert body["outputs"] == {"n": [[2], [3]], "s": ["ab", "cde"]}


def test_status_shows_each_replicas_device(node: Node) -> None:
    for r in node.stage("torch_chain", "TorchPass")["replicas"]:
        assert r["device"] == "cpu" and r["gpu"] is None


@pytest.mark.skipif(bool(_gpus()), reason="this machine has a GPU")
def test_cuda_stage_without_a_gpu_fails_at_start() -> None:
    node = Node(str(APPS / "torch_gpu.py"))
    try:
        assert node.proc.wait(60) != 0
    finally:
        node.stop()
    log = node.log()
    assert "OnGpu" in log and 'device="cuda"' in log and "no GPU" in log, log
    assert "ready, serving" not in log


@pytest.mark.skipif(not _gpus(), reason="needs a GPU (nvidia-smi -L)")
def test_cuda_stage_binds_each_replica_to_one_gpu() -> None:
    gpus = _gpus()
    node = Node(str(APPS / "torch_gpu.py"), ready_timeout=180)
    try:
        node.wait_ready(180)
        replicas = node.stage("gpu", "OnGpu")["replicas"]
        # Round-robin over the machine's devices, by replica id.
        for r in replicas:
            want = r["id"] % len(gpus)
            assert r["device"] == f"cuda:{want}" and r["gpu"]["uuid"] == gpus[want], r
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        seen = set()
        for _ in range(8):
            status, body = node.infer("gpu", x=x.tolist())
            assert status == 200, body
            np.testing.assert_array_equal(np.array(body["outputs"]["y"], dtype=np.float32), x * 2)
            seen.update(body["outputs"]["visible"])
        # Each worker saw exactly one device, named by its UUID.
        assert seen <= {r["gpu"]["uuid"] for r in replicas}
    finally:
        node.stop()
