"""The planner (`slipstream plan`): HiGHS solves real programs here, on
synthetic profiles whose answers are known by hand, on MIG inventories, and
on the recsys example's measured profile through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import slipstream as ss
from slipstream._internal import planner
from slipstream._internal.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
# No overheads outside the components: the hand calculations stay exact.
BARE = {"batch_cpu_us": 0.0, "cpu_per_request_us": 0.0, "hop_us": 0.0, "ingress_us": 0.0}


def comp(name: str, **kw: Any) -> ss.Component:
    cls = type(name, (), {"__call__": lambda self, batch: {}})
    c: ss.Component = ss.component(cls, inputs={"x": ss.Tensor("float32", (-1, 4))}, **kw)
    return c


def points(per_request_ms: float, batches: tuple[int, ...] = (1,), p99_ms: dict[int, float] | None = None,
           speedup: float = 1.0) -> list[dict[str, Any]]:
    """Latency linear in the batch: `per_request_ms` per row, divided by `speedup`."""
    out = []
    for b in batches:
        mean = per_request_ms * b / speedup
        out.append({"batch": b, "mean_ms": mean, "p50_ms": mean, "p99_ms": (p99_ms or {}).get(b, mean)})
    return out


def two_stage(a: ss.Component, b: ss.Component, slo_ms: float = 1000.0) -> ss.Pipeline:
    return ss.Pipeline("p", a >> b, slo=ss.SLO(p99_ms=slo_ms))


def profile(**stages: Any) -> dict[str, Any]:
    return {"pipeline": "p", "stages": stages}


def cpu_plan(pipe: ss.Pipeline, prof: dict[str, Any], cores: float, **kw: Any) -> planner.Plan:
    kw.setdefault("check_slo", False)
    return planner.plan_cpu([pipe], {pipe.name: prof}, cores=cores, overheads=BARE, **kw)


def test_heavier_stage_gets_replicas_in_proportion_to_its_cost() -> None:
    # A costs 3 ms per request, B 1 ms, on 4 cores: 1,000 req/s uses all
    # four, and A needs 3 busy replicas for it, B one.
    pipe = two_stage(comp("A", max_batch_size=8), comp("B", max_batch_size=8))
    plan = cpu_plan(pipe, profile(A={"points": points(3.0)}, B={"points": points(1.0)}), cores=4)
    pp = plan.pipelines["p"]
    assert (pp.stages["A"].replicas, pp.stages["B"].replicas) == (3, 1)
    assert pp.capacity_rps == pytest.approx(1000, rel=1e-3)
    assert any("bottleneck: the cores" in line for line in pp.why)


def test_second_level_gives_spare_cores_to_the_next_bottleneck() -> None:
    # A may have at most 2 replicas: 667 req/s, 2 cores. The 2 cores left go
    # to B at the second level (2,000 req/s of headroom), not left idle.
    pipe = two_stage(comp("A", replicas=(1, 2)), comp("B"))
    plan = cpu_plan(pipe, profile(A={"points": points(3.0)}, B={"points": points(1.0)}), cores=4)
    pp = plan.pipelines["p"]
    assert pp.stages["A"].replicas == 2
    assert pp.capacity_rps == pytest.approx(2000 / 3, rel=1e-3)
    assert pp.stages["B"].throughput_rps == pytest.approx(2000, rel=1e-3)
    assert pp.stages["B"].replicas == 2
    assert any("replicas bound: A" in line for line in pp.why)
    assert any("headroom" in line and "B 2,000" in line for line in pp.why)


def test_threads_when_replicas_are_bounded() -> None:
    # A may have at most 2 replicas: 667 req/s at one thread. Two threads
    # make a replica 1.8x faster for 1.11x the CPU per request (3.33 ms), so
    # with two threads the 4 cores, not the bound, set the rate:
    # 4 / (3.33 + 0.5) ms = 1,043 req/s.
    pipe = two_stage(comp("A", replicas=(1, 2)), comp("B"))
    a = {"points": points(3.0), "by_threads": {"2": {"points": points(3.0, speedup=1.8)}}}
    plan = cpu_plan(pipe, profile(A=a, B={"points": points(0.5)}), cores=4)
    st = plan.pipelines["p"].stages["A"]
    assert (st.replicas, st.threads) == (2, 2)
    assert plan.pipelines["p"].capacity_rps == pytest.approx(4 / (2 * 3 / 1.8 + 0.5) * 1000, rel=1e-3)
    # With threads unprofiled, the bound holds it at 667 req/s.
    plan = cpu_plan(pipe, profile(A={"points": points(3.0)}, B={"points": points(0.5)}), cores=4)
    assert plan.pipelines["p"].capacity_rps == pytest.approx(2000 / 3, rel=1e-3)


def test_a_cluster_plan_places_replicas_per_node_within_each_node_s_cores() -> None:
    # A 3 ms, B 1 ms per request on nodes of 3 and 1 cores: the cluster's 4
    # cores hold 1,000 req/s as one 4-core machine does; every replica is
    # on a named node, and no node gets more work than its cores.
    pipe = two_stage(comp("A", max_batch_size=8), comp("B", max_batch_size=8))
    prof = profile(A={"points": points(3.0)}, B={"points": points(1.0)})
    plan = cpu_plan(pipe, prof, cores=0, nodes={"big": 3.0, "small": 1.0}, network_ms=0.0)
    pp = plan.pipelines["p"]
    assert pp.capacity_rps == pytest.approx(1000, rel=1e-3)
    assert plan.inventory == {"cores": 4.0, "nodes": {"big": 3.0, "small": 1.0}, "network_ms": 0.0}
    for st in pp.stages.values():
        assert st.nodes is not None and set(st.nodes) <= {"big", "small"} and sum(st.nodes.values()) == st.replicas
    # Busy replicas each take a core: the small node holds at most one's worth.
    assert (pp.stages["A"].replicas, pp.stages["B"].replicas) == (3, 1)
    assert pp.stages["A"].nodes.get("small", 0) + pp.stages["B"].nodes.get("small", 0) <= 2
    assert "big:" in planner.format_plan(plan) and "2 nodes (4 cores" in planner.format_plan(plan)
    # The plan file keeps the counts per node.
    again = planner.Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.pipelines["p"].stages["A"].nodes == pp.stages["A"].nodes
    with pytest.raises(ConfigError, match="cores > 0"):
        cpu_plan(pipe, prof, cores=0, nodes={"big": 3.0, "small": 0.0})


def test_a_replica_s_threads_fit_the_node_it_is_placed_on() -> None:
    # One replica (pinned) of A, 3.6x faster at 4 threads: only the 4-core
    # node can run it so; the 2-core node could run it at 2 threads only.
    pipe = ss.Pipeline("p", comp("A", replicas=1), slo=ss.SLO(p99_ms=1000))
    a = {"points": points(4.0), "by_threads": {"2": {"points": points(4.0, speedup=1.9)},
                                               "4": {"points": points(4.0, speedup=3.6)}}}
    plan = cpu_plan(pipe, profile(A=a), cores=0, nodes={"n0": 2.0, "n1": 4.0})
    st = plan.pipelines["p"].stages["A"]
    assert (st.threads, st.nodes) == (4, {"n1": 1})
    assert plan.pipelines["p"].capacity_rps == pytest.approx(3.6 / 4.0 * 1000, rel=1e-3)


def test_a_node_s_memory_bounds_the_replicas_placed_there() -> None:
    # A: 1 ms per request and 1,000 MiB a worker. On two 2-core nodes it
    # would run 2 busy replicas on each (4,000 req/s); "tight" has room
    # for one worker, so its second core stays idle (3,000 req/s).
    pipe = ss.Pipeline("p", comp("A", max_batch_size=1))
    pts = [{**p, "rss_mb": 1000.0} for p in points(1.0)]
    roomy = cpu_plan(pipe, profile(A={"points": pts}), cores=0, nodes={"tight": 2.0, "wide": 2.0})
    assert roomy.pipelines["p"].capacity_rps == pytest.approx(4000, rel=1e-3)
    plan = cpu_plan(pipe, profile(A={"points": pts}), cores=0, nodes={"tight": 2.0, "wide": 2.0},
                    node_memory_mb={"tight": 1500.0, "wide": 8192.0})
    st = plan.pipelines["p"].stages["A"]
    assert st.nodes is not None and st.nodes.get("tight", 0) <= 1, st.nodes
    assert plan.pipelines["p"].capacity_rps == pytest.approx(3000, rel=1e-3)
    assert plan.inventory["memory_mb"] == {"tight": 1500.0, "wide": 8192.0}


def test_the_network_hop_counts_on_a_cluster_plan_s_path() -> None:
    # Batch 4's p99 (4 ms) fits a 10 ms SLO on one machine (2 x 4 ms); with
    # 3 ms per hop between nodes it does not, and batch 1 (1 ms) is chosen.
    pipe = ss.Pipeline("p", comp("A", max_batch_size=4), slo=ss.SLO(p99_ms=10))
    a = {"points": [{"batch": b, "mean_ms": 0.5 + 0.1 * b, "p50_ms": 0.5, "p99_ms": float(b)} for b in (1, 4)]}
    assert cpu_plan(pipe, profile(A=a), cores=2).pipelines["p"].stages["A"].max_batch_size == 4
    far = cpu_plan(pipe, profile(A=a), cores=0, nodes={"n0": 1.0, "n1": 1.0}, network_ms=3.0)
    assert far.pipelines["p"].stages["A"].max_batch_size == 1


def test_slo_rule_excludes_a_batch_that_cannot_fit() -> None:
    # Batch 16 is cheapest per request but its p99 (40 ms) cannot fit a 50 ms
    # SLO with queueing room (2 x p99 per stage); batch 4 (p99 10 ms) can.
    pipe = two_stage(comp("A", max_batch_size=16), comp("B", max_batch_size=16), slo_ms=50)
    cheap = {b: 1.0 * b for b in (1, 4, 16)}
    a = {"points": [{"batch": b, "mean_ms": 0.5 + 0.1 * b, "p50_ms": 0.5, "p99_ms": 2.5 * b} for b in (1, 4, 16)]}
    plan = cpu_plan(pipe, profile(A=a, B={"points": points(0.01, (1, 4, 16), p99_ms=cheap)}), cores=2)
    pp = plan.pipelines["p"]
    assert pp.stages["A"].max_batch_size == 4
    assert any("SLO batch limit: A at batch 16" in line for line in pp.why)
    # Without an SLO, batch 16 is chosen.
    free = ss.Pipeline("p", comp("A", max_batch_size=16) >> comp("B", max_batch_size=16))
    plan = cpu_plan(free, profile(A=a, B={"points": points(0.01, (1, 4, 16))}), cores=2)
    assert plan.pipelines["p"].stages["A"].max_batch_size == 16


def test_an_elastic_stage_is_counted_at_its_floor_on_the_path() -> None:
    # B spends 40 ms on any batch when unhurried (a re-rank under a time
    # budget), with a 100 ms SLO. Planned at its p99, it leaves A 20 ms
    # (2 x p99 <= 100 - 80): A's batch 4 (p99 10 ms); declared elastic with
    # a 5 ms floor, it leaves A 90 ms: batch 16 (p99 40 ms), cheaper.
    a = {"points": [{"batch": b, "mean_ms": 1.0 + 1.0 * b, "p50_ms": 1.0 + b, "p99_ms": 2.5 * b}
                    for b in (1, 4, 16)]}
    b_prof = {"points": [{"batch": n, "mean_ms": 40.0, "p50_ms": 40.0, "p99_ms": 40.0} for n in (1, 4, 16)]}
    plain = two_stage(comp("A", max_batch_size=16), comp("B", max_batch_size=16), slo_ms=100)
    elastic = two_stage(comp("A", max_batch_size=16), comp("B", max_batch_size=16, elastic_ms=5), slo_ms=100)
    p0 = cpu_plan(plain, profile(A=a, B=b_prof), cores=2).pipelines["p"]
    p1 = cpu_plan(elastic, profile(A=a, B=b_prof), cores=2).pipelines["p"]
    assert p0.stages["A"].max_batch_size == 4
    assert p1.stages["A"].max_batch_size == 16
    assert p1.capacity_rps > p0.capacity_rps
    assert any("B: elastic" in line and "5 ms" in line for line in p1.why), p1.why
    # The SLO model is told, and clips B's batches as B does (the Rust
    # model's own tests): at a rate the plan holds, no request misses.
    from slipstream._internal import slo

    assert slo.model_config(elastic, profile(A=a, B=b_prof), 100, cores=2, duration_s=1)["stages"][1]["elastic_ms"] == 5
    for pipe, missed in ((plain, True), (elastic, False)):
        r = slo.predict(pipe, profile(A=a, B=b_prof), [200], cores=2, duration_s=2.0, **BARE)[0]
        assert (r["miss_rate"] > 0.05) is missed, (pipe.stage("B").elastic_ms, r)


def test_no_batch_fits_is_a_clear_error() -> None:
    pipe = two_stage(comp("A"), comp("B"), slo_ms=5)
    with pytest.raises(ConfigError, match="SLO path rule"):
        cpu_plan(pipe, profile(A={"points": points(1.0, p99_ms={1: 10.0})}, B={"points": points(1.0)}), cores=2)


def test_rate_gives_the_cheapest_plan_and_the_max_as_bound() -> None:
    pipe = two_stage(comp("A", max_batch_size=8), comp("B", max_batch_size=8))
    prof = profile(A={"points": points(3.0)}, B={"points": points(1.0)})
    full = cpu_plan(pipe, prof, cores=8).pipelines["p"]
    cheap = cpu_plan(pipe, prof, cores=8, rate=500).pipelines["p"]
    assert (full.stages["A"].replicas, full.stages["B"].replicas) == (6, 2)
    # 500 req/s at <= 90% load: A needs ceil(500 / 0.9 / 333) = 2, B 1.
    assert (cheap.stages["A"].replicas, cheap.stages["B"].replicas) == (2, 1)
    assert (cheap.stages["A"].max_replicas, cheap.stages["B"].max_replicas) == (6, 2)
    assert cheap.target_rps == 500 and cheap.max_capacity_rps == pytest.approx(2000, rel=1e-3)


def test_declared_replica_bounds_are_respected() -> None:
    pipe = two_stage(comp("A", replicas=(2, 3)), comp("B", replicas=(2, 5)))
    plan = cpu_plan(pipe, profile(A={"points": points(1.0)}, B={"points": points(0.2)}), cores=16)
    st = plan.pipelines["p"].stages
    assert 2 <= st["A"].replicas <= 3 and 2 <= st["B"].replicas <= 5
    assert st["A"].replicas == 3  # A is the bottleneck at its bound, with cores to spare


def test_slo_model_checks_the_plan() -> None:
    pipe = two_stage(comp("A", max_batch_size=8), comp("B", max_batch_size=8), slo_ms=100)
    prof = profile(A={"points": points(2.0, (1, 2, 4, 8))}, B={"points": points(1.0, (1, 2, 4, 8))})
    plan = planner.plan_cpu([pipe], {"p": prof}, cores=2, sim_duration_s=1.0)
    pp = plan.pipelines["p"]
    assert pp.predicted is not None and pp.predicted["p99_ms"] <= 100
    assert 0 < pp.target_rps <= 0.9 * pp.capacity_rps * 1.0001


def batched(fixed_ms: float, per_row_ms: float, batches: tuple[int, ...]) -> list[dict[str, Any]]:
    """A fixed cost per call (which batching spreads) plus a cost per row."""
    return [{"batch": b, "mean_ms": fixed_ms + per_row_ms * b, "p50_ms": fixed_ms + per_row_ms * b,
             "p99_ms": 1.5 * (fixed_ms + per_row_ms * b)} for b in batches]


def test_plan_json_round_trip_and_apply_plan() -> None:
    a, b = comp("A", max_batch_size=8), comp("B", max_batch_size=8)
    pipe = two_stage(a, b)
    plan = cpu_plan(pipe, profile(A={"points": batched(2.0, 1.0, (1, 8))}, B={"points": batched(1.0, 0.2, (1, 8))}),
                    cores=8, rate=500, app="app.py")
    again = planner.Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.to_json() == plan.to_json()
    [out] = planner.apply_plan([pipe], again)
    ca, cb = out.stage("A"), out.stage("B")
    assert (ca.replicas, ca.max_replicas, ca.autoscaled) == (again.pipelines["p"].stages["A"].replicas,
                                                           again.pipelines["p"].stages["A"].max_replicas, True)
    assert ca.max_batch_size == 8 and cb.threads == 1
    assert out.graph.edges == pipe.graph.edges and out.to_spec()["stages"][0]["replicas"] == ca.replicas
    assert pipe.stage("A") is a and a.replicas == 1  # the declaration is untouched


def test_apply_plan_refuses_unknown_pipelines_and_stages() -> None:
    pipe = two_stage(comp("A"), comp("B"))
    doc = {"version": 1, "pipelines": {"p": {"stages": {"C": {"replicas": 2, "max_batch_size": 4}}}}}
    with pytest.raises(ConfigError, match="stage.*C.*of pipeline 'p'"):
        planner.apply_plan([pipe], planner.Plan.from_json(doc))
    doc = {"version": 1, "pipelines": {"q": {"stages": {}}}}
    with pytest.raises(ConfigError, match="pipeline 'q'"):
        planner.apply_plan([pipe], planner.Plan.from_json(doc))
    with pytest.raises(ConfigError, match="version"):
        planner.Plan.from_json({"version": 7, "pipelines": {}})
    # Stages the plan leaves out keep their declaration.
    doc = {"version": 1, "pipelines": {"p": {"stages": {"A": {"replicas": 3, "max_batch_size": 2}}}}}
    [out] = planner.apply_plan([pipe], planner.Plan.from_json(doc))
    assert out.stage("A").replicas == 3 and out.stage("B") is pipe.stage("B")


# --- GPUs and MIG ----------------------------------------------------------------------------

def gpu_stage(memory_gb: float, rps_full: float, p99_ms: float = 10.0, exponent: float = 1.0) -> dict[str, Any]:
    table = {str(f): {"rps": rps_full * f ** exponent, "p99_ms": p99_ms / f ** exponent, "batch": 8}
             for f in (0.25, 0.5, 1.0)}
    return {"points": [], "gpu": {"memory_gb": memory_gb, "models": {"A30": table}}}


def test_inventory_specs_and_layouts() -> None:
    [g] = planner.parse_inventory("12xA30")
    assert g.count == 12 and len(g.model.layouts) == 4
    for lay in g.model.layouts:  # every A30 layout uses exactly the GPU's four compute slices
        assert sum(g.model.slices[s][0] for s in lay) == pytest.approx(1.0)
        assert sum(g.model.slices[s][1] for s in lay) <= 24.0
    groups = planner.parse_inventory("2xA100-80GB:nomig,1xH100")
    assert [gr.model.layouts for gr in groups][0] == (("whole",),) and groups[1].model.name == "H100-80GB"
    for gr in planner.GPU_MODELS.values():
        for lay in gr.layouts:
            assert sum(gr.slices[s][0] for s in lay) <= 1.0 + 1e-9
    with pytest.raises(ConfigError, match="unknown GPU model"):
        planner.parse_inventory("2xV100")
    with pytest.raises(ConfigError, match="COUNTxMODEL"):
        planner.parse_inventory("A30")


def test_memory_forces_the_big_stage_onto_whole_gpus() -> None:
    # Two A30s. Big needs 20 GB: only a 4g.24gb slice fits it, so one GPU
    # stays whole; Small (2 GB, and more efficient on small slices) gets the
    # other GPU as four 1g.6gb slices.
    pipe = ss.Pipeline("p", comp("Big") >> comp("Small"))
    prof = profile(Big=gpu_stage(20, 100), Small=gpu_stage(2, 100, exponent=0.5))
    plan = planner.plan_gpu([pipe], {"p": prof}, "2xA30")
    gpus = plan.inventory["gpus"]
    assert sorted(tuple(g["layout"]) for g in gpus) == [("1g.6gb",) * 4, ("4g.24gb",)]
    st = plan.pipelines["p"].stages
    assert [q["slice"] for q in st["Big"].placement or []] == ["4g.24gb"]
    assert [q["slice"] for q in st["Small"].placement or []] == ["1g.6gb"] * 4
    assert plan.pipelines["p"].capacity_rps == pytest.approx(100)
    assert st["Small"].throughput_rps == pytest.approx(4 * 100 * 0.5)


def test_gpu_rate_plan_starts_a_subset_of_the_max_plan() -> None:
    pipe = ss.Pipeline("p", comp("Big") >> comp("Small"))
    prof = profile(Big=gpu_stage(10, 100), Small=gpu_stage(2, 400))
    plan = planner.plan_gpu([pipe], {"p": prof}, "4xA30", rate=60)
    st = plan.pipelines["p"].stages
    assert st["Big"].replicas < st["Big"].max_replicas
    assert plan.pipelines["p"].capacity_rps >= 60 / 0.9 - 1e-6


def test_a_cluster_s_gpu_nodes_are_planned_per_node_and_spread() -> None:
    # Two GPU nodes of A30s (one MIG, one whole GPUs) and a node without
    # GPUs: the stages go on the GPU nodes only, each replica on a GPU of
    # the node the plan names, a stage's replicas over both nodes.
    pipe = ss.Pipeline("p", comp("Big") >> comp("Small"))
    prof = profile(Big=gpu_stage(10, 100), Small=gpu_stage(2, 400))
    nodes = {"g0": "2xA30", "g1": "2xA30", "g2": "1xA30:nomig"}
    plan = planner.plan_gpu([pipe], {"p": prof}, "", nodes=nodes, network_ms=2.0)
    gpus = plan.inventory["gpus"]
    assert sorted(g["node"] for g in gpus) == ["g0", "g0", "g1", "g1", "g2"]
    assert plan.inventory["gpu_nodes"] == nodes and plan.inventory["network_ms"] == 2.0
    for name, st in plan.pipelines["p"].stages.items():
        assert st.nodes is not None and sum(st.nodes.values()) == st.replicas >= 1, (name, st)
        placed = st.placement or []
        for q in placed:
            assert gpus[q["gpu"]]["node"] == q["node"] and gpus[q["gpu"]]["layout"][q["slot"]] == q["slice"]
        started: dict[str, int] = {}
        for q in placed[:st.replicas]:
            started[q["node"]] = started.get(q["node"], 0) + 1
        assert started == st.nodes
    # The same GPUs in one machine plan the same capacity: the program is
    # one per GPU model, not per node.
    one = planner.plan_gpu([pipe], {"p": prof}, "4xA30,1xA30:nomig")
    assert plan.pipelines["p"].capacity_rps == pytest.approx(one.pipelines["p"].capacity_rps)
    big = plan.pipelines["p"].stages["Big"]
    assert big.replicas >= 2 and len(big.nodes or {}) >= 2, ("a stage's replicas spread over the nodes", big)
    text = planner.format_plan(plan)
    assert "on 3 nodes (2 ms per hop" in text and "g0" in text


def test_a_cluster_gpu_plan_binds_each_node_s_replicas_to_its_own_slices() -> None:
    from slipstream._internal.cluster_cli import bound_per_node, gpu_plan_of
    from slipstream._internal.planner.gpu import gpu_binding, local_devices

    pipe = ss.Pipeline("p", comp("Big") >> comp("Small"))
    prof = profile(Big=gpu_stage(10, 100), Small=gpu_stage(2, 400))
    plan = planner.plan_gpu([pipe], {"p": prof}, "", nodes={"g0": "2xA30", "g1": "1xA30:nomig+1xA30"})
    gpus = plan.inventory["gpus"]

    def smi_of(node: str) -> list[str]:
        """The node's `nvidia-smi -L`, cut as planned, each GPU's slices
        listed in the reverse of the plan's order, whole GPUs first; g1
        has an H100 first."""
        lines = ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-h)"] if node == "g1" else []
        for g in sorted((g for g in gpus if g["node"] == node), key=lambda g: g["layout"] != ["whole"]):
            lines.append(f"GPU {len(lines)}: NVIDIA A30 (UUID: GPU-{node}-{g['id']})")
            if g["layout"] != ["whole"]:
                lines += [f"  MIG {sl} Device {i}: (UUID: MIG-{node}-{g['id']}-{i})"
                          for i, sl in enumerate(reversed(g["layout"]))]
        return lines

    bound = bound_per_node(plan, {n: smi_of(n) for n in ("g0", "g1")})
    placed = {(p, s): sp.placement for p, pp in plan.pipelines.items() for s, sp in pp.stages.items()}
    for node in ("g0", "g1"):
        devices = local_devices(smi_of(node))
        taken: list[int] = []
        for (p, s), ps in placed.items():
            mine = [q for q in ps or [] if q["node"] == node]
            places = bound.get(f"{p}/{s}", {}).get(node, [])
            # One place per replica the plan puts there, each a slice of the planned kind.
            assert [devices[d][1] for d in places] == [q["slice"] for q in mine], (node, s)
            taken += places
        assert len(taken) == len(set(taken)), ("one replica per slice", node, taken)
        assert all(devices[d][0] != 0 for d in taken) or node == "g0", "g1's H100 is not the plan's A30"
    # What a node that joins later binds by is in the record, and gives the same.
    g1 = gpu_binding(gpu_plan_of(plan), {tuple(k.split("/")): v for k, v in gpu_plan_of(plan)["placement"].items()},
                     smi_of("g1"), "g1")
    assert {f"{p}/{s}": {"g1": v} for (p, s), v in g1.items()} == {k: {"g1": v["g1"]} for k, v in bound.items()
                                                                    if "g1" in v}
    with pytest.raises(ConfigError, match="puts 1 A30 GPU.s. on node g1 cut into MIG slices, but `nvidia-smi -L` there lists fewer"):
        bound_per_node(plan, {"g1": ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-h)"]})


def test_stages_without_a_gpu_profile_go_on_the_cores_in_the_same_program() -> None:
    # Big is profiled on A30s (100 req/s a whole one); Post only on CPU
    # cores, 40 ms a request at any batch: on 4 cores it holds 100 req/s,
    # the pipeline's bottleneck, so the plan gives it every core and the
    # GPUs' 200 req/s are headroom.
    pipe = ss.Pipeline("p", comp("Big") >> comp("Post", max_batch_size=8))
    prof = profile(Big=gpu_stage(10, 100), Post={"points": points(40.0, (1, 2, 4, 8))})
    plan = planner.plan_gpu([pipe], {"p": prof}, "2xA30", cores=4, overheads=BARE)
    st = plan.pipelines["p"].stages
    assert list(st) == ["Big", "Post"]
    assert st["Post"].placement is None and st["Post"].replicas == 4 and st["Post"].threads == 1
    assert st["Big"].placement and st["Big"].throughput_rps == pytest.approx(200)
    assert plan.pipelines["p"].capacity_rps == pytest.approx(100, rel=0.02)
    why = "\n".join(plan.pipelines["p"].why)
    assert "bottleneck Post: on CPU cores" in why and "bottleneck Big" not in why, why
    assert plan.inventory["cores"] == 4
    # The SLO path rule spans both: a 150 ms SLO leaves Post's batches of 8
    # (320 ms) out, and Big's 2 x p99 counts against the same budget.
    tight = ss.Pipeline("p", comp("Big") >> comp("Post", max_batch_size=8), slo=ss.SLO(p99_ms=150))
    tplan = planner.plan_gpu([tight], {"p": prof}, "2xA30", cores=4, overheads=BARE)
    assert tplan.pipelines["p"].stages["Post"].max_batch_size == 1
    # Without cores to put it on, the stage without a GPU profile is named.
    with pytest.raises(ConfigError, match="p/Post: no GPU section in the profile.*no cores to plan it on"):
        planner.plan_gpu([pipe], {"p": prof}, "2xA30")
    # A cluster: the GPU node's GPUs and every node's cores. Big's two A30s
    # bound it at 200 req/s, for which Post needs 8 cores: the CPU node's
    # 6 first, then 2 of the GPU node's (whose cores feed its GPU workers).
    plan = planner.plan_gpu([pipe], {"p": prof}, "", nodes={"g0": "2xA30"}, cpu_nodes={"g0": 4.0, "c0": 6.0},
                            overheads=BARE, network_ms=1.0)
    st = plan.pipelines["p"].stages
    assert st["Big"].nodes == {"g0": 2} and st["Post"].nodes == {"c0": 6, "g0": 2}, st
    assert plan.pipelines["p"].capacity_rps == pytest.approx(200, rel=0.02)
    assert plan.inventory["cpu_nodes"] == {"g0": 4.0, "c0": 6.0}
    from slipstream._internal.cluster_cli import planned_per_node
    assert set(planned_per_node(plan)) == {"p/Big", "p/Post"}


def test_gpu_workers_own_cpu_counts_on_their_machine_s_cores() -> None:
    # Big's worker spends 10 ms of host CPU a request (pre- and
    # post-processing): one core holds 100 req/s of it, under the GPUs' 200.
    pipe = ss.Pipeline("p", comp("Big"))
    host = gpu_stage(10, 100)
    host["gpu"]["host_cpu_ms"] = 10.0
    plan = planner.plan_gpu([pipe], {"p": profile(Big=host)}, "2xA30", cores=1, overheads=BARE)
    assert plan.pipelines["p"].capacity_rps == pytest.approx(100, rel=0.02)
    assert any(line.startswith("bottleneck: the cores: at 100 req/s") for line in plan.pipelines["p"].why)
    with pytest.raises(ConfigError, match="p/Big: host_cpu_ms in the profile, and no cores"):
        planner.plan_gpu([pipe], {"p": profile(Big=host)}, "2xA30")
    # Beside a CPU stage (Post, 40 ms a request on 4 cores): 50 ms a request in all.
    both = ss.Pipeline("p", comp("Big") >> comp("Post", max_batch_size=8))
    prof = profile(Big=host, Post={"points": points(40.0, (1, 2, 4, 8))})
    plan = planner.plan_gpu([both], {"p": prof}, "2xA30", cores=4, overheads=BARE)
    assert plan.pipelines["p"].capacity_rps == pytest.approx(80, rel=0.02)
    # A cluster: the host CPU is the GPU node's. At 20 ms a request it takes
    # g0's 4 cores at 200 req/s, so Post has only c0's 6 cores: 0.06 s a
    # request over 10 cores, 167 req/s.
    host["gpu"]["host_cpu_ms"] = 20.0
    plan = planner.plan_gpu([both], {"p": prof}, "", nodes={"g0": "2xA30"}, cpu_nodes={"g0": 4.0, "c0": 6.0},
                            overheads=BARE, network_ms=1.0)
    assert plan.pipelines["p"].capacity_rps == pytest.approx(1000 / 6, rel=0.03)


def test_a_member_s_gpus_are_read_from_its_nvidia_smi_lines() -> None:
    lines = ["GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaa)",
             "MIG 3g.40gb     Device  0: (UUID: MIG-bbbb)",
             "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-cccc)",
             "GPU 2: NVIDIA A30 (UUID: GPU-dddd)",
             "GPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-eeee)",
             "GPU 4: NVIDIA L4 (UUID: GPU-ffff)"]
    spec, unknown = planner.spec_from_smi(lines)
    assert spec == "1xA100-80GB+1xA100-80GB:nomig+1xA30:nomig+1xH100-80GB:nomig" and unknown == ["NVIDIA L4"]
    groups = planner.parse_inventory(spec.replace("+", ","))
    assert [g.count for g in groups] == [1, 1, 1, 1] and groups[1].model.layouts == (("whole",),)
    assert planner.spec_from_smi([]) == ("", [])


def test_a_gpu_plan_binds_each_replica_to_a_device_of_this_machine() -> None:
    from slipstream._internal.planner.gpu import gpu_binding, local_devices

    lines = ["GPU 0: NVIDIA A30 (UUID: GPU-a)", "  MIG 1g.6gb Device 0: (UUID: MIG-a1)",
             "  MIG 2g.12gb Device 1: (UUID: MIG-a2)", "  MIG 1g.6gb Device 2: (UUID: MIG-a3)",
             "GPU 1: NVIDIA A30 (UUID: GPU-b)", "No UUID here"]
    assert local_devices(lines) == [(0, "1g.6gb"), (0, "2g.12gb"), (0, "1g.6gb"), (1, "whole")]
    inv = {"gpus": [{"id": 0, "layout": ["2g.12gb", "1g.6gb", "1g.6gb"]}, {"id": 1, "layout": ["whole"]}]}
    placed = {("p", "S"): [{"gpu": 0, "slice": "1g.6gb", "slot": 2}, {"gpu": 0, "slice": "1g.6gb", "slot": 1}],
              ("p", "B"): [{"gpu": 1, "slice": "whole", "slot": 0}, {"gpu": 0, "slice": "2g.12gb", "slot": 0}]}
    # The nth slice of a profile in the plan's layout is the nth listed here.
    assert gpu_binding(inv, placed, lines) == {("p", "S"): [2, 0], ("p", "B"): [3, 1]}
    with pytest.raises(ConfigError, match="cuts GPU 1 as MIG 1g.6gb, but here it is whole"):
        gpu_binding({"gpus": [inv["gpus"][0], {"id": 1, "layout": ["1g.6gb"]}]}, placed, lines)
    with pytest.raises(ConfigError, match="uses GPU 2, but this machine has 2 GPU"):
        gpu_binding({"gpus": [*inv["gpus"], {"id": 2, "layout": ["whole"]}]},
                    {("p", "S"): [{"gpu": 2, "slice": "whole", "slot": 0}]}, lines)
    with pytest.raises(ConfigError, match="lists none"):
        gpu_binding(inv, placed, [])
    # A stage the plan binds must be declared for a GPU.
    pipe = ss.Pipeline("p", comp("S"))
    plan = planner.Plan.from_json({"version": 1, "inventory": inv, "solve_ms": 1, "pipelines": {"p": {"stages": {
        "S": {"replicas": 2, "max_batch_size": 4, "placement": placed[("p", "S")]}}}}})
    with pytest.raises(ConfigError, match="declares device='cpu'"):
        planner.apply_plan([pipe], plan, {("p", "S"): [2, 0]})
    gpu_pipe = ss.Pipeline("p", comp("S").options(device="cuda"))
    served = planner.apply_plan([gpu_pipe], plan, {("p", "S"): [2, 0]})[0]
    assert (served.stage("S").replicas, served.stage("S").devices) == (2, (2, 0))
    assert served.to_spec()["stages"][0]["devices"] == [2, 0]
    assert "devices" not in gpu_pipe.to_spec()["stages"][0]


def test_a_gpu_plan_says_which_stage_needs_more_slices_than_there_are() -> None:
    pipe = ss.Pipeline("p", comp("Big").options(replicas=5) >> comp("Small"))
    prof = profile(Big=gpu_stage(10, 100), Small=gpu_stage(2, 400))
    with pytest.raises(ConfigError, match=r"p/Big needs at least 5 replica\(s\).*at most 4 slice"):
        planner.plan_gpu([pipe], {"p": prof}, "2xA30")


def preflmr_audioquery() -> tuple[list[ss.Pipeline], dict[str, Any]]:
    from bench import plan_mig

    pipes, profiles = plan_mig.pipelines_and_profiles()
    return pipes, profiles


def test_twelve_a30s_with_preflmr_and_audioquery() -> None:
    pipes, profiles = preflmr_audioquery()
    t0 = time.perf_counter()
    plan = planner.plan_gpu(pipes, profiles, "12xA30", time_limit_s=30)
    assert time.perf_counter() - t0 < 30
    groups = planner.parse_inventory("12xA30")
    layouts = {tuple(lay) for lay in groups[0].model.layouts}
    slices = groups[0].model.slices
    gpus = plan.inventory["gpus"]
    assert [g["id"] for g in gpus] == list(range(12))
    assert all(tuple(g["layout"]) in layouts for g in gpus)
    memory = {(p, s): profiles[p]["stages"][s]["gpu"]["memory_gb"] for p in profiles for s in profiles[p]["stages"]}
    taken = set()
    for pname, pp in plan.pipelines.items():
        assert pp.capacity_rps > 0
        for sname, st in pp.stages.items():
            assert st.placement is not None and len(st.placement) == st.max_replicas >= 1
            for q in st.placement:
                assert gpus[q["gpu"]]["layout"][q["slot"]] == q["slice"]
                assert memory[(pname, sname)] <= slices[q["slice"]][1]
                assert (q["gpu"], q["slot"]) not in taken
                taken.add((q["gpu"], q["slot"]))


# --- the command line ----------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slipstream._internal.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_cli_plan_recsys_and_serve_plan_parsing(tmp_path: Path) -> None:
    from slipstream._internal.app import load_pipelines
    from slipstream._internal.cli import build_parser
    from slipstream._internal.serve_cli import apply_plan_file

    out = tmp_path / "recsys.plan.json"
    r = cli("plan", "examples/recsys.py", "--cores", "2", "--out", str(out), "--sim-duration", "1")
    assert r.returncode == 0, r.stderr
    assert "Candidates" in r.stdout and "why:" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and doc["inventory"] == {"cores": 2.0}
    stages = doc["pipelines"]["recsys"]["stages"]
    assert set(stages) == {"Candidates", "Ranker"}
    assert all(s["replicas"] >= 1 and s["max_batch_size"] >= 1 for s in stages.values())

    r = cli("plan", "examples/recsys.py", "--cores", "2", "--out", str(out), "--json", "--no-check")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pipelines"]["recsys"]["predicted"] is None

    a = build_parser().parse_args(["serve", "examples/recsys.py", "--plan", str(out)])
    assert a.plan == str(out)
    _, pipelines = load_pipelines("examples/recsys.py")
    [planned] = apply_plan_file(pipelines, Path(a.plan))
    for name, st in doc["pipelines"]["recsys"]["stages"].items():
        c = planned.stage(name)
        assert (c.replicas, c.max_batch_size, c.threads) == (st["replicas"], st["max_batch_size"], st["threads"])


def test_cli_plans_across_nodes_and_refuses_bad_inventories(tmp_path: Path) -> None:
    out = tmp_path / "recsys.plan.json"
    r = cli("plan", "examples/recsys.py", "--nodes", "2x1,big=2", "--out", str(out), "--no-check")
    assert r.returncode == 0, r.stderr
    assert "3 nodes (4 cores" in r.stdout, r.stdout
    doc = json.loads(out.read_text())
    assert doc["inventory"]["nodes"] == {"n0": 1.0, "n1": 1.0, "big": 2.0}
    for st in doc["pipelines"]["recsys"]["stages"].values():
        assert sum(st["nodes"].values()) == st["replicas"] and set(st["nodes"]) <= {"n0", "n1", "big"}
    r = cli("plan", "examples/recsys.py", "--nodes", "a=1:512M,2x1:2GiB", "--out", str(out), "--no-check")
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["inventory"]["memory_mb"] == {"a": 512.0, "n1": 2048.0, "n2": 2048.0}
    for bad, why in (("n0=0", "cores > 0"), ("n0=2,n0=4", "named twice"), ("eight", "NAME=CORES"),
                     ("n0=2:lots", "NAME=CORES[:MEMORY]")):
        r = cli("plan", "examples/recsys.py", "--nodes", bad, "--out", str(out))
        assert r.returncode == 2 and why in r.stderr, (bad, r.stderr)
    r = cli("plan", "examples/recsys.py", "--network-ms", "2", "--out", str(out))
    assert r.returncode != 0 and "give --nodes or --cluster too" in r.stderr
    r = cli("plan", "examples/recsys.py", "--nodes", "g0=8/2xV100", "--out", str(out))
    assert r.returncode == 2 and "unknown GPU model" in r.stderr, r.stderr
    r = cli("plan", "examples/recsys.py", "--nodes", "g0=8/2xA30", "--gpus", "2xA30", "--out", str(out))
    assert r.returncode != 0 and "--gpus is one machine's GPUs" in r.stderr, r.stderr


def test_profile_by_threads_is_read_for_planned_threads(tmp_path: Path) -> None:
    pipe = two_stage(comp("A"), comp("B"))
    pipe = planner.with_components(pipe, {"A": pipe.stage("A").options(threads=2)})
    raw = {"pipelines": [{"pipeline": "p", "stages": {
        "A": {"points": points(2.0), "by_threads": {"2": {"points": points(2.0, speedup=2.0)}}},
        "B": {"points": points(1.0)}}}]}
    path = tmp_path / "p.profile.json"
    path.write_text(json.dumps(raw))
    loaded = [{"pipeline": "p", "stages": {n: {"points": st["points"]} for n, st in raw["pipelines"][0]["stages"].items()}}]
    [prof] = planner.profiles_for_threads(loaded, [path], [pipe])
    assert prof["stages"]["A"]["points"][0]["mean_ms"] == pytest.approx(1.0)
    assert prof["stages"]["B"]["points"][0]["mean_ms"] == pytest.approx(1.0)


def test_profile_by_threads_from_the_command_line(tmp_path: Path) -> None:
    import shutil

    shutil.copy(ROOT / "tests" / "apps" / "chain.py", tmp_path / "chain.py")
    r = subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "profile", "chain.py", "--pipeline", "chain",
                        "--batches", "1,4", "--iters", "3", "--budget", "0.1", "--threads", "2"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    prof = json.loads((tmp_path / "chain.profile.json").read_text())["pipelines"][0]
    for st in prof["stages"].values():
        assert [p["batch"] for p in st["points"]] == [1, 4]  # one thread, as before
        assert [p["batch"] for p in st["by_threads"]["2"]["points"]] == [1, 4]
    assert "2 thread(s)" in r.stderr
