"""The planner on a simulated GPU cluster with MIG: twelve A30-class GPUs
(24 GB; 1g.6gb / 2g.12gb / 4g.24gb slices) serving a PreFLMR-shaped and an
AudioQuery-shaped pipeline, and PreFLMR alone on four A30s, the size of the
Vortex paper's multi-stage configuration (arXiv 2511.02062, Figure 6b: three
nodes of vision encoders, one node split four ways by MIG).

No GPU is used: the profiles below are assumptions with the shapes of the
real stages, written down so the placements can be argued with. Per stage:
memory (weights + activations at the batch size listed) and throughput /
p99 at each A30 slice size. Two effects decide placements and are modelled
on purpose:

- Small models do not fill a big slice (kernel launch and Python overheads,
  short sequences), so their throughput grows less than the slice: a 1g.6gb
  slice (1/4 of the GPU) gets 0.4-0.45 of a whole GPU's throughput.
- A model whose weights nearly fill a slice can only run small batches on it:
  the ~10 GB vision encoder on a 12 GB 2g slice runs batch 2 and gets 0.4 of
  a whole GPU, not 0.5.

Sources of the shapes: PreFLMR's query path (Lin et al., "PreFLMR", ACL 2024;
the ViT-G checkpoint's vision tower is CLIP ViT-bigG/14, 48 layers, 1664
wide, ~1.8 B parameters: ~3.7 GB in fp16, ~10 GB with activations and
workspace at batch 8, and roughly 1 TFLOP per 224 px image, i.e. ~70
images/s on an A30 at ~40% of its fp16 tensor peak); a BERT-base text
encoder and a one-layer cross-attention mapping network; late-interaction
search over an index shard resident on the GPU (~5 GB). AudioQuery: a
Whisper-small-like ASR (244 M parameters; autoregressive decoding leaves the
GPU underused, so small slices are relatively efficient), a MiniLM-class text
encoder, a FAISS IVF index on the GPU (~4 GB), and a FastPitch + HiFi-GAN-like
TTS. Absolute numbers are rough; the ratios between stages and slice sizes
are what the planner acts on.

Then the same two pipelines across a cluster's GPU nodes (``plan_gpu``'s
``nodes``, what ``slipstream plan --nodes g0=32/4xA30,...`` runs): three
nodes of four A30s (two with MIG, one whole GPUs), and 32 nodes (128 GPUs)
for the solve time at scale; each plan's replicas per node, and the solve
time. Then a heterogeneous cluster: the same GPU nodes and nodes without
GPUs, with AudioQuery's Search profiled on CPU cores only (an IVF index
in host memory), which the same program places on every node's cores.

    .venv/bin/python -m bench.plan_mig          # ~1 min; writes bench/results/plan_mig.{json,md}
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import slipstream as ss
from slipstream._internal import planner

from bench import harness
from bench.harness import RESULTS

# stage -> (memory GB, {A30 compute fraction: (req/s, p99 ms, batch)})
PREFLMR: dict[str, tuple[float, dict[float, tuple[float, float, int]]]] = {
    "TextEncoder": (1.5, {1.0: (1600, 25, 32), 0.5: (1100, 35, 32), 0.25: (700, 28, 16)}),
    "VisionEncoder": (10.0, {1.0: (70, 130, 8), 0.5: (28, 85, 2)}),  # 10 GB: no 1g.6gb
    "CrossAttention": (1.0, {1.0: (3000, 12, 32), 0.5: (2000, 18, 32), 0.25: (1200, 15, 16)}),
    "Search": (5.0, {1.0: (900, 40, 16), 0.5: (600, 55, 16), 0.25: (380, 45, 8)}),
}
AUDIOQUERY: dict[str, tuple[float, dict[float, tuple[float, float, int]]]] = {
    "ASR": (2.5, {1.0: (45, 250, 8), 0.5: (32, 280, 8), 0.25: (20, 260, 4)}),
    "TextEncoder": (1.0, {1.0: (2500, 15, 32), 0.5: (1700, 20, 32), 0.25: (1100, 18, 16)}),
    "Search": (4.0, {1.0: (3000, 12, 32), 0.5: (2000, 16, 32), 0.25: (1300, 14, 16)}),
    "TTS": (1.5, {1.0: (60, 180, 8), 0.5: (42, 200, 8), 0.25: (27, 190, 4)}),
}
SLO_MS = {"preflmr": 500.0, "audioquery": 1500.0}
#: AudioQuery's Search as a CPU IVF index instead (the shape of FAISS
#: IndexIVFFlat on one core a replica): (batch, mean ms, p99 ms) per batch.
CPU_SEARCH = [(1, 2.0, 3.0), (4, 5.0, 7.0), (16, 16.0, 22.0)]


def _component(name: str) -> ss.Component:
    cls = type(name, (), {"__call__": lambda self, batch: {}})
    c: ss.Component = ss.component(cls, inputs={"x": ss.Tensor("float32", (-1, 4))}, max_batch_size=32)
    return c


def _profile(name: str, stages: dict[str, tuple[float, dict[float, tuple[float, float, int]]]]) -> dict[str, Any]:
    return {"pipeline": name, "stages": {
        s: {"points": [], "gpu": {"memory_gb": mem, "models": {"A30": {
            str(f): {"rps": rps, "p99_ms": p99, "batch": b} for f, (rps, p99, b) in table.items()}}}}
        for s, (mem, table) in stages.items()}}


def pipelines_and_profiles() -> tuple[list[ss.Pipeline], dict[str, Any]]:
    c = {n: _component(n) for n in PREFLMR}
    preflmr = ss.Pipeline("preflmr", [c["TextEncoder"], c["VisionEncoder"]] >> c["CrossAttention"] >> c["Search"],
                          slo=ss.SLO(p99_ms=SLO_MS["preflmr"]))
    a = {n: _component(n) for n in AUDIOQUERY}
    audioquery = ss.Pipeline("audioquery", a["ASR"] >> a["TextEncoder"] >> a["Search"] >> a["TTS"],
                             slo=ss.SLO(p99_ms=SLO_MS["audioquery"]))
    return [preflmr, audioquery], {"preflmr": _profile("preflmr", PREFLMR),
                                   "audioquery": _profile("audioquery", AUDIOQUERY)}


def with_cpu_search(profiles: dict[str, Any]) -> dict[str, Any]:
    """The profiles with AudioQuery's Search profiled on CPU cores only (no
    GPU section): the planner puts it on the nodes' cores."""
    aq = dict(profiles["audioquery"], stages=dict(profiles["audioquery"]["stages"]))
    aq["stages"]["Search"] = {"points": [{"batch": b, "mean_ms": m, "p50_ms": m, "p99_ms": p}
                                         for b, m, p in CPU_SEARCH]}
    return {**profiles, "audioquery": aq}


def run(pipes: list[ss.Pipeline], profiles: dict[str, Any], inventory: str,
        nodes: dict[str, str] | None = None, cpu_nodes: dict[str, float] | None = None) -> dict[str, Any]:
    """Five solves of the plan for `inventory` (or the GPU `nodes` of a
    cluster, described by `inventory`, and every node's cores in
    `cpu_nodes` for the stages profiled on CPU only)."""
    times, plan = [], None
    for _ in range(5):
        t0 = time.perf_counter()
        plan = planner.plan_gpu(pipes, profiles, inventory if nodes is None else "", app="bench/plan_mig.py",
                                nodes=nodes, cpu_nodes=cpu_nodes)
        times.append((time.perf_counter() - t0) * 1e3)
    assert plan is not None
    return {"inventory": inventory, "pipelines": [p.name for p in pipes], "solve_ms_median": statistics.median(times),
            "solve_ms": times, "plan": plan.to_json(), "text": planner.format_plan(plan), "nodes": nodes,
            "cpu_nodes": cpu_nodes}


def _per_node(plan: dict[str, Any]) -> list[str]:
    """A cluster plan's replicas per stage and node, as table rows."""
    out = ["| pipeline | stage | replicas | per node |", "|---|---|---|---|"]
    for pname, pp in plan["pipelines"].items():
        for sname, st in pp["stages"].items():
            per = " ".join(f"{n}:{c}" for n, c in sorted((st.get("nodes") or {}).items()))
            out.append(f"| {pname} | {sname} | {st['replicas']} | {per} |")
        out.append(f"| {pname} | **capacity {pp['capacity_rps']:,.0f} req/s** | | |")
    return out


def markdown(runs: list[dict[str, Any]]) -> str:
    out = ["# The planner on simulated A30 clusters with MIG", "",
           "Profiles are assumptions (see `bench/plan_mig.py`); no GPU was used. "
           "`python -m bench.plan_mig` regenerates this file.", ""]
    for r in runs:
        plan = r["plan"]
        if r.get("nodes"):
            gpus = plan["inventory"]["gpus"]
            spec = ", ".join(f"{n}={s}" for n, s in sorted(r["nodes"].items())) if len(r["nodes"]) <= 4 else (
                f"{len(r['nodes'])} nodes, {len(gpus)} GPUs")
            if r.get("cpu_nodes"):
                cpu_only = sorted(set(r["cpu_nodes"]) - set(r["nodes"]))
                spec += (f"; cores: {sum(r['cpu_nodes'].values()):g} on {len(r['cpu_nodes'])} nodes, "
                         f"{len(cpu_only)} of them without GPUs ({', '.join(cpu_only[:4])}"
                         f"{', ...' if len(cpu_only) > 4 else ''}); AudioQuery's Search profiled on CPU only")
            out += [f"## {' + '.join(r['pipelines'])} across GPU nodes: {r['inventory']}", "",
                    f"`--nodes` {spec}. Solve time: median {r['solve_ms_median']:.0f} ms of 5 (HiGHS, this "
                    f"machine).", "", *_per_node(plan), ""]
            if len(r["nodes"]) <= 4:
                out += ["| GPU | node | layout | stages |", "|---|---|---|---|"]
                for g in gpus:
                    cells = ", ".join(f"{sl}: {st or 'idle'}" for sl, st in zip(g["layout"], g["stages"], strict=True))
                    out.append(f"| {g['id']} | {g['node']} | {' + '.join(g['layout'])} | {cells} |")
                out.append("")
            continue
        out += [f"## {' + '.join(r['pipelines'])} on {r['inventory']}", "",
                f"Solve time: median {r['solve_ms_median']:.0f} ms of 5 (HiGHS, this machine).", "",
                "| GPU | layout | stages |", "|---|---|---|"]
        for g in plan["inventory"]["gpus"]:
            cells = ", ".join(f"{sl}: {st or 'idle'}" for sl, st in zip(g["layout"], g["stages"], strict=True))
            out.append(f"| {g['id']} | {' + '.join(g['layout'])} | {cells} |")
        out += ["", "| pipeline | stage | replicas | slices | req/s |", "|---|---|---|---|---|"]
        for pname, pp in plan["pipelines"].items():
            for sname, st in pp["stages"].items():
                kinds: dict[str, int] = {}
                for q in st["placement"]:
                    kinds[q["slice"]] = kinds.get(q["slice"], 0) + 1
                out.append(f"| {pname} | {sname} | {st['replicas']} | "
                           f"{', '.join(f'{n} x {k}' for k, n in kinds.items())} | {st['throughput_rps']:,.0f} |")
            out.append(f"| {pname} | **capacity** | | | **{pp['capacity_rps']:,.0f}** |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS / "plan_mig", help="results path without suffix")
    a = ap.parse_args()
    machine = harness.machine()
    pipes, profiles = pipelines_and_profiles()
    three = {"g0": "4xA30", "g1": "4xA30", "g2": "4xA30:nomig"}
    many = {f"m{i:02d}": "4xA30" if i % 2 else "4xA30:nomig" for i in range(32)}
    runs = [run(pipes[:1], {"preflmr": profiles["preflmr"]}, "4xA30"), run(pipes, profiles, "12xA30"),
            run(pipes, profiles, "3 nodes of 4 A30s, two with MIG", three),
            run(pipes, profiles, "32 nodes of 4 A30s, half with MIG (128 GPUs)", many),
            run(pipes, with_cpu_search(profiles), "3 GPU nodes and 2 CPU nodes (heterogeneous)", three,
                {"g0": 32.0, "g1": 32.0, "g2": 32.0, "c0": 16.0, "c1": 16.0}),
            run(pipes, with_cpu_search(profiles), "32 GPU nodes and 32 CPU nodes (heterogeneous)", many,
                {**{n: 32.0 for n in many}, **{f"c{i:02d}": 16.0 for i in range(32)}})]
    for r in runs:
        print(f"\n=== {' + '.join(r['pipelines'])} on {r['inventory']}: solve median {r['solve_ms_median']:.0f} ms"
              f" (5 runs: {', '.join(f'{t:.0f}' for t in r['solve_ms'])})")
        print(r["text"])
    json_path, md_path = harness.write_results(
        a.out, {"runs": [{k: v for k, v in r.items() if k != "text"} for r in runs]}, markdown(runs), machine)
    print(f"\nwrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
