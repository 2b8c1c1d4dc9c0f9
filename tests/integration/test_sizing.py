"""Serve-time sizing (issue 27): `slipstream serve app.py` with no flags
profiles the app on this machine on first start (with progress), plans
the stages the app leaves unsized, serves the plan, says what it chose in
`status`, and a second start reuses the cached profile. The first
start measures each stage beside neighbours running the others. A stage that pins
its counts keeps them. (The other tests serve as declared: conftest.py.)"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import slipstream as ss
from slipstream._internal import sizing
from slipstream._internal.app import load_pipelines
from slipstream._internal.serve_cli import model_overheads

from tests.conftest import APPS, SLIPSTREAM, Node

APP = str(APPS / "sized.py")
PLAN_ENV = {"SLIPSTREAM_SIZING": "plan"}


def _serve(cache: Path) -> tuple[Node, float]:
    t0 = time.monotonic()
    node = Node(APP, env={**PLAN_ENV, "SLIPSTREAM_CACHE_DIR": str(cache)}, ready_timeout=240)
    node.wait_ready(240)
    return node, time.monotonic() - t0


def _stages(node: Node) -> dict[str, dict]:
    (p,) = node.status()["pipelines"]
    return {s["name"]: s for s in p["stages"]}


def test_first_start_profiles_plans_and_serves_and_the_second_reuses_the_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    node, first_s = _serve(cache)
    try:
        log = node.log()
        assert "profiling pipeline sized on this machine" in log, log
        assert "Heavy batch 8" in log, log  # the profiler's progress, per batch size
        (cached,) = (cache / "profiles").glob("sized-*.json")
        prof = json.loads(cached.read_text())
        assert {s for p in prof["pipelines"] for s in p["stages"]} == {"Heavy", "Light"}
        # Measured as served: beside neighbours running the pipeline's stages, at every thread count.
        (near,) = [p["colocated"] for p in prof["pipelines"]]
        assert set(near) == {str(t) for t in sizing.thread_counts(load_pipelines(APP)[1][0], sizing.usable_cores())}
        assert all(n["neighbours"] >= 1 and n["neighbour_batches"] > 0 for n in near.values()), near
        stages = _stages(node)
        # Light pins 1 replica x 1 thread; Heavy is the planner's (1..2 x cores replicas).
        assert len(stages["Light"]["replicas"]) == 1 and stages["Light"]["threads"] == 1
        # Heavy is the planner's: what the same plan, made here from the cached profile, gives.
        monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(cache))
        _, pipes = load_pipelines(APP)
        planned = sizing.size(APP, pipes, cores=None, overheads=model_overheads(APP), log=lambda _: None)
        assert planned.profiles == [cached]
        heavy = planned.pipelines[0].stage("Heavy")
        assert len(stages["Heavy"]["replicas"]) == heavy.replicas and stages["Heavy"]["threads"] == heavy.threads
        assert 1 <= heavy.replicas <= 2 * sizing.usable_cores()
        (p,) = node.status()["pipelines"]
        assert p["sizing"][0].startswith("planned for"), p["sizing"]
        assert str(cached) in p["sizing"][0] and "Light 1 x 1 thread(s), batch <= " in p["sizing"][0]
        assert "replicas, threads pinned" in p["sizing"][0]
        out = ss.Client(node.url).infer("sized", {"x": [[1.0, 2.0], [3.0, 4.0]]})
        assert out["y"].tolist() == [[3.0, 5.0], [7.0, 9.0]]
        status = subprocess.run([*SLIPSTREAM, "status", "--url", node.url], capture_output=True, text=True,
                                timeout=30)
        assert "sized: planned for" in status.stdout, status.stdout
        heavy_first = len(stages["Heavy"]["replicas"])
    finally:
        node.stop()
    node, second_s = _serve(cache)
    try:
        log = node.log()
        assert "profiling pipeline" not in log and f"profile of this machine from {cached}" in log, log
        assert len(_stages(node)["Heavy"]["replicas"]) == heavy_first  # the same profile, the same plan
    finally:
        node.stop()
    assert second_s < first_s, (first_s, second_s)


def test_declared_sizing_serves_the_declaration(tmp_path: Path) -> None:
    with Node(APP, "--sizing", "declared", env={"SLIPSTREAM_CACHE_DIR": str(tmp_path)}) as node:
        stages = _stages(node)
        assert [len(stages[s]["replicas"]) for s in ("Heavy", "Light")] == [1, 1]
        assert node.status()["pipelines"][0]["sizing"] == ["as declared (--sizing declared)"]
    assert not (tmp_path / "profiles").exists()


def test_what_the_author_gives_is_pinned_and_the_rest_planned() -> None:
    _, (pipe,) = load_pipelines(APP)
    heavy, light = pipe.stage("Heavy"), pipe.stage("Light")
    assert heavy.pinned == frozenset() and light.pinned == {"replicas", "threads"}
    assert sizing.needs_plan(pipe)
    assert heavy.options(name="H2").pinned == frozenset()  # a copy leaves the planned parts planned
    assert heavy.options(replicas=3).pinned == {"replicas"}
    bounded = heavy.options(replicas=(1, 4))
    assert bounded.pinned == frozenset() and (bounded.min_replicas, bounded.max_replicas) == (1, 4)
    assert not sizing.needs_plan(ss.Pipeline("p", light, inputs={"x": ss.Tensor("float32", (-1, 2))}))
    # A profile's cache key follows the components' versions: another batch limit, another file.
    one = sizing.profile_path(pipe, [1, 2])
    assert sizing.profile_path(pipe, [1, 2]) == one
    other = ss.Pipeline("sized", heavy.options(max_batch_size=4) >> light)
    assert sizing.profile_path(other, [1, 2]) != one


def test_the_cache_key_follows_the_environment_the_source_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """An app configured by environment variables (rag_late's re-rank
    budget) gets another profile when one its source names is set or
    changed; variables it does not name leave the key alone."""
    _, (pipe,) = load_pipelines(APP)
    monkeypatch.delenv("SIZED_SPIN_MS", raising=False)
    unset = sizing.profile_path(pipe, [1])
    monkeypatch.setenv("SOME_OTHER_SETTING", "1")
    assert sizing.profile_path(pipe, [1]) == unset
    monkeypatch.setenv("SIZED_SPIN_MS", "2")
    two = sizing.profile_path(pipe, [1])
    monkeypatch.setenv("SIZED_SPIN_MS", "3")
    assert len({unset, two, sizing.profile_path(pipe, [1])}) == 3


class _Lookup:
    """A stage whose cost follows its data: the index it needs from the store."""

    def __init__(self, index: ss.Object) -> None:
        self.index = index

    def __call__(self, batch: dict) -> dict:
        return {"y": batch["x"]}


def test_the_cache_key_follows_the_data_a_stage_needs(tmp_path: Path) -> None:
    """A stage's latency follows the data it is seeded with (RAG's Search:
    0.6 ms a query on the slice, 2.4 on the full index), so a profile of
    one index is not reused for another: the key includes each seed file
    of the stage's needs by path, size and modification time. A stage
    without needs keeps its key."""
    index = tmp_path / "index.bin"
    index.write_bytes(b"1" * 10)
    io = {"inputs": {"x": ss.Tensor("float32", (-1, 2))}, "outputs": {"y": ss.Tensor("float32", (-1, 2))}}

    def pipe(seed: Path) -> ss.Pipeline:
        lookup = ss.component(_Lookup, needs={"index": "/index/test"}, **io)
        return ss.Pipeline("seeded", lookup, seed={"/index/test": seed})

    first = sizing.profile_path(pipe(index), [1])
    assert sizing.profile_path(pipe(index), [1]) == first
    index.write_bytes(b"1" * 20)  # rebuilt: another size
    rebuilt = sizing.profile_path(pipe(index), [1])
    other = tmp_path / "other.bin"
    other.write_bytes(b"2" * 20)
    assert len({first, rebuilt, sizing.profile_path(pipe(other), [1])}) == 3
    # Without needs, the data does not count.
    plain = ss.component(type("Plain", (), {"__call__": lambda self, b: {"y": b["x"]}}), **io)
    assert sizing.profile_path(ss.Pipeline("seeded", plain, seed={"/index/test": index}), [1]) == \
        sizing.profile_path(ss.Pipeline("seeded", plain), [1])


def test_a_planned_stage_with_bounds_keeps_them() -> None:
    from slipstream._internal.planner import StagePlan
    from slipstream._internal.planner.plan import _configured

    _, (pipe,) = load_pipelines(APP)
    c = _configured(pipe.stage("Heavy").options(replicas=(1, 4)), StagePlan(3, 3, 1, 4, 100.0))
    assert (c.replicas, c.min_replicas, c.max_replicas, c.max_batch_size) == (3, 1, 4, 4)


@pytest.mark.parametrize("cores,want", [(1, [1]), (2, [1, 2]), (16, [1, 2, 4])])
def test_thread_counts_profiled(cores: int, want: list[int]) -> None:
    _, (pipe,) = load_pipelines(APP)
    assert sizing.thread_counts(pipe, cores) == want
