"""Planning again when the cluster's members change (`slipstream plan
--cluster ... --watch`): the plan is made from the members there, written
as the cluster's `plan` record, and the leader places by it; a node that
joins gets a new plan with replicas on it, and the replicas move without
any node restarting (a plan is not a new deployment)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from slipstream.testing import CLI, TOKEN, Etcd, deploy, start_node, stop_all

from tests.conftest import APPS, Node, wait_for

STAGES = ("Fan", "Sum", "Prod", "Join")


def profile_file(path: Path) -> Path:
    point = {"batch": 1, "mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 2.0}
    path.write_text(json.dumps({"version": 1, "pipelines": [
        {"pipeline": "diamond", "stages": {s: {"points": [point]} for s in STAGES}}]}))
    return path


def cluster_of(n: Node) -> dict:
    return n.status()["cluster"]


def planned_on(n: Node) -> set[str]:
    plan = cluster_of(n)["plan"]
    return {node for per in (plan["planned"] if plan else {}).values() for node in per}


def follows_plan(n: Node) -> bool:
    c = cluster_of(n)
    plan, placement = c["plan"], c["placement"]
    if not plan or not placement or plan["deploy"] != c["deploy"]:
        return False
    return all(placement["stages"].get(k) == per for k, per in plan["planned"].items())


@pytest.fixture
def etcd() -> Iterator[Etcd]:
    e = Etcd(1)
    yield e
    e.stop()


def test_a_watching_planner_plans_again_when_a_node_joins(etcd: Etcd, tmp_path: Path) -> None:
    out = deploy(etcd, APPS / "cluster.py", wait=0)
    assert out.returncode == 0, out.stdout + out.stderr
    ns: dict[str, Node] = {}
    watcher = None
    try:
        ns = {name: start_node(etcd, name) for name in ("a", "b")}
        for n in ns.values():
            wait_for(lambda n=n: n.is_ready() and len(cluster_of(n)["members"]) == 2, timeout=180)
        pids = {name: n.pid for name, n in ns.items()}
        deployed = cluster_of(ns["a"])["deploy"]
        plan_out = tmp_path / "watched.plan.json"
        cmd = [*CLI, "plan", f"{APPS / 'cluster.py'}:diamond", "--profile", str(profile_file(tmp_path / "p.json")),
               "--no-check", "--out", str(plan_out), "--cluster", etcd.url, "--token", TOKEN, "--watch", "0.5"]
        watcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        a = ns["a"]
        wait_for(lambda: planned_on(a) == {"a", "b"} and follows_plan(a), timeout=120)
        first = cluster_of(a)["plan"]
        assert first["deploy"] == deployed and "slipstream plan --watch" in first["note"], first
        assert set(first["planned"]) == {f"diamond/{s}" for s in STAGES}, first
        # A third node joins: planned again, with replicas on it, and placed so.
        ns["c"] = start_node(etcd, "c")
        wait_for(lambda: planned_on(a) == {"a", "b", "c"} and follows_plan(a), timeout=120)
        wait_for(lambda: any(n > 0 for n in cluster_of(a)["members"]["c"]["ready"].values()), timeout=120)
        doc = json.loads(plan_out.read_text())
        assert set(doc["inventory"]["nodes"]) == {"a", "b", "c"}, doc["inventory"]
        # No node restarted, no new deployment: the plan moved replicas only.
        assert {name: n.pid for name, n in ns.items() if name in pids} == pids
        assert all(n.proc.poll() is None for n in ns.values())
        assert cluster_of(a)["deploy"] == deployed
        shown = subprocess.run([*CLI, "status", "--url", a.url], capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "3 member(s): a (" in shown.stdout and "placement (epoch" in shown.stdout, shown.stdout
        prod = " ".join(f"{n}:{k}" for n, k in sorted(cluster_of(a)["plan"]["planned"]["diamond/Prod"].items()))
        assert "plan (slipstream plan --watch" in shown.stdout and f"diamond/Prod {prod}" in shown.stdout, shown.stdout
        for n in ns.values():
            wait_for(lambda n=n: n.infer("diamond", x=[[3.0, 2.0]])[0] == 200, timeout=60)
            status, body = n.infer("diamond", x=[[3.0, 2.0]])
            assert status == 200 and body["outputs"]["both"] == [[5.0, 6.0]], body
    finally:
        if watcher is not None:
            watcher.terminate()
            log = watcher.communicate(timeout=30)[0]
            print(log)
        stop_all(list(ns.values()))
    assert "plan --watch: deployment" in log and "applied to deployment" in log, log


def test_a_member_s_gpus_are_planned_from_its_record(etcd: Etcd, tmp_path: Path) -> None:
    # A node whose `nvidia-smi -L` lists twelve A30s (a stand-in on its PATH):
    # its record carries them, and `slipstream plan --cluster` plans the
    # stages on them, the node without GPUs getting none.
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA A30 (UUID: GPU-0000aaa{i})'\n" for i in range(12)))
    smi.chmod(0o755)
    out = deploy(etcd, APPS / "cluster.py", wait=0)
    assert out.returncode == 0, out.stdout + out.stderr
    ns: dict[str, Node] = {}
    try:
        ns["g"] = start_node(etcd, "g", env={"PATH": f"{fake}:{os.environ['PATH']}"})
        ns["c"] = start_node(etcd, "c")
        for n in ns.values():
            wait_for(lambda n=n: n.is_ready() and len(cluster_of(n)["members"]) == 2, timeout=180)
        assert len(cluster_of(ns["c"])["members"]["g"]["gpus"]) == 12
        table = {"1.0": {"rps": 100.0, "p99_ms": 10.0, "batch": 8}}
        profile = tmp_path / "gpu.profile.json"
        profile.write_text(json.dumps({"version": 1, "pipelines": [{"pipeline": "diamond", "stages": {
            s: {"points": [], "gpu": {"memory_gb": 2.0, "models": {"A30": table}}} for s in STAGES}}]}))
        plan_out = tmp_path / "gpu.plan.json"
        r = subprocess.run([*CLI, "plan", f"{APPS / 'cluster.py'}:diamond", "--profile", str(profile), "--no-check",
                            "--out", str(plan_out), "--cluster", etcd.url, "--token", TOKEN],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "g (" in r.stderr and "12xA30:nomig" in r.stderr, r.stderr
        doc = json.loads(plan_out.read_text())
        assert doc["inventory"]["gpu_nodes"] == {"g": "12xA30:nomig"}, doc["inventory"]
        for name, st in doc["pipelines"]["diamond"]["stages"].items():
            assert st["nodes"] == {"g": st["replicas"]}, (name, st)
    finally:
        stop_all(list(ns.values()))


def test_plan_apply_needs_a_cluster_and_a_deployment(etcd: Etcd, tmp_path: Path) -> None:
    profile = str(profile_file(tmp_path / "p.json"))
    base = [*CLI, "plan", f"{APPS / 'cluster.py'}:diamond", "--profile", profile, "--no-check",
            "--out", str(tmp_path / "x.plan.json")]
    r = subprocess.run([*base, "--apply", "--nodes", "2x2"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--apply and --watch write the plan into a cluster" in r.stderr, r.stderr
    r = subprocess.run([*base, "--watch", "0", "--cluster", etcd.url, "--token", TOKEN],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "more than 0" in r.stderr, r.stderr
    # No members yet: said, nothing written.
    r = subprocess.run([*base, "--apply", "--cluster", etcd.url, "--token", TOKEN],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "has no members now" in r.stderr, r.stderr
