"""A GPU plan's replicas bound to the GPUs and MIG slices it chose
(`serve --plan`), on a machine whose `nvidia-smi -L` is a stand-in listing
an A30 cut into three MIG slices and a whole A30: each replica's worker
sees exactly its planned device (CUDA_VISIBLE_DEVICES), the status names
it, and a plan that cuts a GPU otherwise than this machine is refused
with both layouts named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import APPS, Node

SMI = """GPU 0: NVIDIA A30 (UUID: GPU-aaaa0000)
  MIG 1g.6gb      Device  0: (UUID: MIG-aaaa0001)
  MIG 2g.12gb     Device  1: (UUID: MIG-aaaa0002)
  MIG 1g.6gb      Device  2: (UUID: MIG-aaaa0003)
GPU 1: NVIDIA A30 (UUID: GPU-bbbb0000)
"""


def fake_smi(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncat <<'END'\n" + SMI + "END\n")
    smi.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def plan(tmp_path: Path, layout0: list[str]) -> Path:
    """Three replicas of Bound: the whole GPU 1, then the second and the
    first 1g.6gb slice of GPU 0 (in the plan's slot order)."""
    placement = [{"gpu": 1, "slice": "whole", "slot": 0},
                 {"gpu": 0, "slice": "1g.6gb", "slot": 2},
                 {"gpu": 0, "slice": "1g.6gb", "slot": 1}]
    doc = {"version": 1, "app": "gpu_bound.py",
           "inventory": {"gpus": [{"id": 0, "model": "A30", "layout": layout0, "stages": [None] * len(layout0)},
                                  {"id": 1, "model": "A30", "layout": ["whole"], "stages": ["bound/Bound"]}]},
           "pipelines": {"bound": {"capacity_rps": 100.0, "target_rps": 90.0, "stages": {
               "Bound": {"replicas": 3, "max_replicas": 3, "threads": 1, "max_batch_size": 8,
                         "throughput_rps": 100.0, "placement": placement}}}},
           "solve_ms": 1.0}
    path = tmp_path / "gpu_bound.plan.json"
    path.write_text(json.dumps(doc))
    return path


def test_each_replica_runs_on_the_slice_its_plan_chose(tmp_path: Path) -> None:
    env = fake_smi(tmp_path)
    p = plan(tmp_path, ["2g.12gb", "1g.6gb", "1g.6gb"])
    node = Node(str(APPS / "gpu_bound.py"), "--plan", str(p), env=env)
    try:
        node.wait_ready()
        replicas = sorted(node.stage("bound", "Bound")["replicas"], key=lambda r: r["id"])
        got = [(r["device"], r["gpu"]["uuid"]) for r in replicas]
        # cuda:N are places in the node's list: GPU 0's three slices, then GPU 1.
        assert got == [("cuda:3", "GPU-bbbb0000"), ("cuda:2", "MIG-aaaa0003"), ("cuda:0", "MIG-aaaa0001")], got
        seen: set[str] = set()
        for _ in range(12):
            status, body = node.infer("bound", x=[[1.0, 2.0]])
            assert status == 200, body
            assert body["outputs"]["y"] == [[2.0, 3.0]]
            seen.update(body["outputs"]["visible"])
        # Each worker saw only its device, and the 2g slice no replica was planned on is unused.
        assert seen <= {"GPU-bbbb0000", "MIG-aaaa0003", "MIG-aaaa0001"} and seen, seen
        assert "on cuda:3,cuda:2,cuda:0" in node.log()
    finally:
        node.stop()


def test_a_plan_that_cuts_a_gpu_otherwise_is_refused(tmp_path: Path) -> None:
    env = os.environ | fake_smi(tmp_path)
    p = plan(tmp_path, ["1g.6gb", "1g.6gb", "1g.6gb", "1g.6gb"])
    out = subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "serve", str(APPS / "gpu_bound.py"),
                          "--plan", str(p), "--port", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "cuts GPU 0 as MIG 1g.6gb + 1g.6gb + 1g.6gb + 1g.6gb" in out.stderr, out.stderr
    assert "here it is MIG 1g.6gb + 1g.6gb + 2g.12gb" in out.stderr, out.stderr


def test_a_gpu_plan_without_gpus_here_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "none"
    empty.mkdir()
    smi = empty / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'No devices found.'\n")
    smi.chmod(0o755)
    env = os.environ | {"PATH": f"{empty}:{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "serve", str(APPS / "gpu_bound.py"),
                          "--plan", str(plan(tmp_path, ["2g.12gb", "1g.6gb", "1g.6gb"])), "--port", "0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "lists none on this machine" in out.stderr, out.stderr
