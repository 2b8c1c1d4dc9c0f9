"""A cluster deployed with a plan made for its nodes (`slipstream plan
--nodes`, `slipstream deploy --plan`): the leader places each planned stage
as the plan says, replicas per node, where the balanced placement would
spread them evenly; stages the plan leaves out are placed as ever; the
pipeline answers across the nodes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from slipstream.testing import CLI, TOKEN, Etcd, deploy, start_node, stop_all

from tests.conftest import APPS, Node, cluster_plan_file, wait_for

# Uneven on purpose: "big" takes all of Fan, "small" the singleton Prod.
PLANNED = {"Fan": {"big": 3}, "Sum": {"big": 1, "small": 1}, "Prod": {"small": 1}, "Join": {"big": 2, "small": 1}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Etcd, dict[str, Node]]]:
    etcd = Etcd(1)
    ns: dict[str, Node] = {}
    try:
        plan = cluster_plan_file(tmp_path_factory.mktemp("plan") / "cluster.plan.json", "cluster.py",
                                 {"diamond": PLANNED}, {"big": 4.0, "small": 2.0})
        out = deploy(etcd, APPS / "cluster.py", "--plan", str(plan), wait=0)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "placing per the plan on big, small (big, small not a member now" in out.stderr, out.stderr
        ns = {name: start_node(etcd, name) for name in ("big", "small")}
        for n in ns.values():
            wait_for(lambda n=n: n.request("GET", "/readyz")[0] == 200
                     and len(n.status()["cluster"]["members"]) == 2, timeout=180)
        yield etcd, ns
    finally:
        stop_all(list(ns.values()))
        etcd.stop()


def placed(n: Node) -> dict[str, dict[str, int]]:
    p = n.status()["cluster"]["placement"]
    return p["stages"] if p else {}


def test_the_leader_places_planned_stages_as_planned(
        cluster: tuple[Etcd, dict[str, Node]]) -> None:
    _, ns = cluster
    want = {f"diamond/{s}": per for s, per in PLANNED.items()}
    wait_for(lambda: all({k: v for k, v in placed(n).items() if k in want} == want for n in ns.values()),
             timeout=60)
    # The stages the plan leaves out are placed as ever.
    p = placed(ns["big"])
    for stage in ("pick/Right", "pick/Wrong", "big/Big"):
        assert sum(p[stage].values()) == 1 and set(p[stage]) <= set(ns), p
    # Requests cross the nodes and meet at the fan-in, from either ingress.
    for name, n in ns.items():
        wait_for(lambda n=n: n.infer("diamond", x=[[3.0, 2.0]])[0] == 200, timeout=60)
        status, body = n.infer("diamond", x=[[3.0, 2.0]])
        assert status == 200 and body["outputs"]["both"] == [[5.0, 6.0]], (name, body)
        route = body["outputs"]["route"][0]
        assert route.startswith("big>") and "|small>" in route, route  # Fan on big, Prod on small


def test_a_plan_is_made_from_the_members_inventories(cluster: tuple[Etcd, dict[str, Node]], tmp_path: Path) -> None:
    etcd, ns = cluster
    point = {"batch": 1, "mean_ms": 1.0, "p50_ms": 1.0, "p99_ms": 2.0}
    profile = tmp_path / "diamond.profile.json"
    profile.write_text(json.dumps({"version": 1, "pipelines": [
        {"pipeline": "diamond", "stages": {s: {"points": [point]} for s in ("Fan", "Sum", "Prod", "Join")}}]}))
    out = tmp_path / "from-cluster.plan.json"
    cmd = [*CLI, "plan", f"{APPS / 'cluster.py'}:diamond", "--profile", str(profile), "--no-check", "--out",
           str(out), "--cluster", etcd.url, "--token", TOKEN]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    cores = {name: float(n.status()["cluster"]["members"][name]["cores"]) for name, n in ns.items()}
    assert "planning for cluster 'default': big (" in r.stderr, r.stderr
    doc = json.loads(out.read_text())
    assert doc["inventory"]["nodes"] == cores
    for name, st in doc["pipelines"]["diamond"]["stages"].items():
        assert sum(st["nodes"].values()) == st["replicas"] >= 1 and set(st["nodes"]) <= set(ns), (name, st)
    # A wrong token reads no inventory, and says why.
    r = subprocess.run([*cmd[:-1], "wrong"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not signed with this cluster token" in r.stderr, r.stderr
