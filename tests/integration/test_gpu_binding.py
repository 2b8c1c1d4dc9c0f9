"""A GPU plan's replicas bound to the GPUs and MIG slices it chose
(`serve --plan`), on a machine whose `nvidia-smi -L` is a stand-in listing
an A30 cut into three MIG slices and a whole A30: each replica's worker
sees exactly its planned device (CUDA_VISIBLE_DEVICES), the status names
it, and a plan that cuts a GPU otherwise than this machine is refused
with both layouts named. On a cluster, each node binds the replicas the
plan puts there, its GPUs matched to the plan's by model."""

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


def fake_smi(tmp_path: Path, lines: str = SMI) -> dict[str, str]:
    """A stand-in `nvidia-smi` (first on PATH) that lists `lines`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncat <<'END'\n" + lines + "END\n")
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
        got = sorted((r["device"], r["gpu"]["uuid"]) for r in node.stage("bound", "Bound")["replicas"])
        # cuda:N are places in the node's list: GPU 0's three slices, then
        # GPU 1. Each replica takes one (which, depends on which worker
        # starts first).
        assert got == [("cuda:0", "MIG-aaaa0001"), ("cuda:2", "MIG-aaaa0003"), ("cuda:3", "GPU-bbbb0000")], got
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


# --- a cluster: each node binds the replicas the plan puts there ----------------------------

#: g1: an A30 cut 1g + 2g + 1g. g2: an H100, then a whole A30 (its A30 is
#: its second GPU: the plan's GPUs on a node are its GPUs of that model).
SMI_OF = {
    "g1": """GPU 0: NVIDIA A30 (UUID: GPU-g1)
  MIG 1g.6gb      Device  0: (UUID: MIG-g1-0)
  MIG 2g.12gb     Device  1: (UUID: MIG-g1-1)
  MIG 1g.6gb      Device  2: (UUID: MIG-g1-2)
""",
    "g2": """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-g2-h100)
GPU 1: NVIDIA A30 (UUID: GPU-g2-a30)
""",
}


def cluster_plan(tmp_path: Path, g1_layout: list[str],
                 g1_slices: tuple[tuple[str, int], ...] = (("1g.6gb", 2), ("1g.6gb", 1))) -> Path:
    """A plan as `slipstream plan --nodes g1=...,g2=...` writes one: Bound on
    `g1_slices` of g1's A30 (profile, slot in its layout; by default its
    second and first 1g.6gb) and on g2's whole A30."""
    gpus = [{"id": 0, "model": "A30", "layout": g1_layout, "stages": [None] * len(g1_layout), "node": "g1"},
            {"id": 1, "model": "A30", "layout": ["whole"], "stages": ["bound/Bound"], "node": "g2"},
            {"id": 2, "model": "H100-80GB", "layout": ["whole"], "stages": [None], "node": "g2"}]
    first, *rest = [{"gpu": 0, "slice": sl, "slot": slot, "node": "g1"} for sl, slot in g1_slices]
    placement = [first, {"gpu": 1, "slice": "whole", "slot": 0, "node": "g2"}, *rest]
    doc = {"version": 1, "app": "gpu_bound.py",
           "inventory": {"gpus": gpus, "gpu_nodes": {"g1": "1xA30", "g2": "1xH100-80GB:nomig+1xA30:nomig"},
                         "network_ms": 0.5},
           "pipelines": {"bound": {"capacity_rps": 100.0, "target_rps": 90.0, "stages": {
               "Bound": {"replicas": 3, "max_replicas": 3, "threads": 1, "max_batch_size": 8,
                         "throughput_rps": 100.0, "placement": placement, "nodes": {"g1": 2, "g2": 1}}}}},
           "solve_ms": 1.0}
    path = tmp_path / "gpu_bound.cluster.plan.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_cluster_plan_binds_each_nodes_replicas_to_its_slices(tmp_path: Path) -> None:
    from slipstream._internal.cluster_cli import Etcd as EtcdClient
    from slipstream._internal.cluster_cli import unseal
    from slipstream.testing import TOKEN, Etcd, deploy, start_node, stop_all

    from tests.conftest import wait_for

    etcd = Etcd(1)
    nodes = {}
    env = {}
    for name, smi in SMI_OF.items():
        (tmp_path / name).mkdir()
        env[name] = fake_smi(tmp_path / name, smi)
    try:
        # A plan that cuts g1's GPU otherwise: g1 refuses to serve it, saying how.
        out = deploy(etcd, APPS / "gpu_bound.py", "--plan", str(cluster_plan(tmp_path, ["1g.6gb"] * 4)), wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        refused = start_node(etcd, "g1", env=env["g1"])
        assert refused.proc.wait(timeout=60) != 0
        assert "cuts GPU 0 as MIG 1g.6gb + 1g.6gb + 1g.6gb + 1g.6gb, but on node g1 it is " \
               "MIG 1g.6gb + 1g.6gb + 2g.12gb" in refused.log(), refused.log()
        # The plan as g1 is cut: each node binds the replicas placed there
        # when it starts (neither was a member when it was deployed).
        out = deploy(etcd, APPS / "gpu_bound.py", "--plan",
                     str(cluster_plan(tmp_path, ["2g.12gb", "1g.6gb", "1g.6gb"])), wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        for name in SMI_OF:
            nodes[name] = start_node(etcd, name, env=env[name])

        def devices(name: str) -> list[tuple[str, str]]:
            reps = [r for r in nodes[name].stage("bound", "Bound")["replicas"]
                    if r["node"] is None and not r["standby"] and r["state"] == "ready"]
            return sorted((r["device"], (r.get("gpu") or {}).get("uuid", "")) for r in reps)

        wait_for(lambda: len(devices("g1")) == 2 and len(devices("g2")) == 1, timeout=120)
        # g1: its first and third devices (the plan's slots 1 and 2 of its
        # layout); g2: its second device, the A30, not the H100 at cuda:0.
        assert devices("g1") == [("cuda:0", "MIG-g1-0"), ("cuda:2", "MIG-g1-2")]
        assert devices("g2") == [("cuda:1", "GPU-g2-a30")]
        assert "bound to the plan's slices here: bound/Bound on cuda:2,cuda:0" in nodes["g1"].log()
        seen: set[str] = set()
        for _ in range(24):
            status, body = nodes["g1"].infer("bound", x=[[1.0, 2.0]])
            assert status == 200, body
            assert body["outputs"]["y"] == [[2.0, 3.0]]
            seen.update(body["outputs"]["visible"])
        assert seen <= {"MIG-g1-0", "MIG-g1-2", "GPU-g2-a30"} and seen, seen
        # Applied again with both members in, the record binds them from
        # their own `nvidia-smi -L` lines (what running nodes apply at once).
        out = deploy(etcd, APPS / "gpu_bound.py", "--plan",
                     str(cluster_plan(tmp_path, ["2g.12gb", "1g.6gb", "1g.6gb"])), wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        record = unseal([TOKEN], "plan", EtcdClient(etcd.url).get("/slipstream/default/plan"))
        assert record["devices"] == {"bound/Bound": {"g1": [2, 0], "g2": [1]}}, record
        assert "binding GPU replicas: g1: bound/Bound on cuda:2,cuda:0; g2: bound/Bound on cuda:1" in out.stderr
        # A new plan moves g1's replica off its first 1g slice onto the 2g
        # half: the running node replaces it there, make before break.
        moved = cluster_plan(tmp_path, ["2g.12gb", "1g.6gb", "1g.6gb"], (("1g.6gb", 2), ("2g.12gb", 0)))
        out = deploy(etcd, APPS / "gpu_bound.py", "--plan", str(moved), wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        wait_for(lambda: devices("g1") == [("cuda:1", "MIG-g1-1"), ("cuda:2", "MIG-g1-2")], timeout=120)
        assert devices("g2") == [("cuda:1", "GPU-g2-a30")]
        events = [e["detail"] for e in nodes["g1"].status()["events"]]
        assert any("not in the plan's binding" in e for e in events), events
    finally:
        stop_all(list(nodes.values()))
        etcd.stop()
