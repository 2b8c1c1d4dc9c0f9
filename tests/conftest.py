"""Shared fixtures: a real node (`slipstream serve`) with real worker
processes on a free port (``slipstream.testing.Node``), talked to over HTTP.
``Node`` and ``wait_for`` are imported from here by the tests.

Parallel runs: `make test` runs pytest-xdist workers with ``--dist
loadscope``: a module's tests run one after another on one worker, so its
module-scoped nodes start once, while other modules run beside it. Tests
share the machine: every node and service takes a free port, and data built
on first use is built under a lock (``examples/models``). A test marked
``alone`` (a load test whose rates are set against one replica's capacity)
runs with no other test beside it: every test holds a shared lock of the
run while it runs (setup and teardown included), an ``alone`` one an
exclusive lock, taken through a turnstile so that a stream of shared
holders cannot starve it."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slipstream.testing import CLI, Node, wait_for  # noqa: F401 (wait_for: re-exported to the tests)

# Nodes the tests start serve their apps as declared (1 replica, 1 thread
# where an app leaves them to the planner): the tests assert on replica
# counts, and profiling on first start would take seconds per app.
# test_sizing.py serves with the default (planned) sizing.
os.environ.setdefault("SLIPSTREAM_SIZING", "declared")

ROOT = Path(__file__).resolve().parent.parent
APPS = Path(__file__).resolve().parent / "apps"
SLIPSTREAM = CLI  # `slipstream ...` in this interpreter


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Run the test under the run's lock (see the module doc); a serial run has none."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    run = Path(item.config.option.basetemp).parent  # a worker's basetemp is <the run's>/popen-gwN
    with open(run / "turnstile", "a") as turnstile, open(run / "lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


def cluster_plan_file(path: Path, app: str, planned: dict[str, dict[str, dict[str, int]]],
                      nodes: dict[str, float]) -> Path:
    """A plan file as `slipstream plan --nodes` writes one, with the given
    replicas per node (pipeline -> stage -> node -> count) on `nodes`
    (name -> cores), for `slipstream deploy --plan`."""
    pipelines = {
        pipe: {"capacity_rps": 100.0, "target_rps": 90.0, "stages": {
            stage: {"replicas": sum(per.values()), "max_replicas": sum(per.values()), "threads": 1,
                    "max_batch_size": 8, "throughput_rps": 100.0, "nodes": per} for stage, per in stages.items()}}
        for pipe, stages in planned.items()}
    doc = {"version": 1, "app": app, "inventory": {"cores": float(sum(nodes.values())), "nodes": nodes},
           "pipelines": pipelines, "solve_ms": 1.0}
    path.write_text(json.dumps(doc))
    return path


def start_planned(etcd: Any, app: str, planned: dict[str, dict[str, dict[str, int]]], node_args: dict[str, tuple[str, ...]],
                  tmp: Path, into: dict[str, Node]) -> None:
    """Deploy `app` (in tests/apps) with a plan placing `planned` (pipeline
    -> stage -> node -> count), start the nodes named by `node_args` (each
    with its flags) into `into` (the caller stops them, also when this
    fails), and return once every node is ready, sees every member, and
    the placement in force is the plan's."""
    from slipstream.testing import deploy, start_node

    plan = cluster_plan_file(tmp / f"{Path(app).stem}.plan.json", app, planned, {n: 2.0 for n in node_args})
    out = deploy(etcd, APPS / app, "--plan", str(plan), wait=0)
    assert out.returncode == 0, out.stdout + out.stderr
    for name, args in node_args.items():
        into[name] = start_node(etcd, name, *args)
    for n in into.values():
        wait_for(lambda n=n: n.request("GET", "/readyz")[0] == 200
                 and len(n.status()["cluster"]["members"]) == len(node_args), timeout=180)
    want = {f"{p}/{s}": per for p, stages in planned.items() for s, per in stages.items()}
    first = next(iter(into.values()))
    wait_for(lambda: {k: v for k, v in (first.status()["cluster"]["placement"] or {}).get("stages", {}).items()
                      if k in want} == want, timeout=60)


@pytest.fixture(scope="module")
def chain_node() -> Iterator[Node]:
    node = Node(str(APPS / "chain.py"), "--request-timeout", "2", "--max-body-mb", "1")
    node.wait_ready()
    yield node
    node.stop()


def shm_files_of(pid: int, since: float = 0.0) -> list[str]:
    """The shared-memory files of the node with process id `pid`, made at
    or after `since` (a wall-clock time): a node SIGKILLed earlier under a
    process id now reused leaves files with the same prefix."""
    if not os.path.isdir("/dev/shm"):
        return []
    out = []
    for f in os.listdir("/dev/shm"):
        if f.startswith(f"slipstream-{pid}-"):
            try:
                if os.stat(f"/dev/shm/{f}").st_ctime >= since:
                    out.append(f)
            except FileNotFoundError:
                pass
    return out
