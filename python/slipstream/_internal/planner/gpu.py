"""Planning for GPUs with MIG, where the choices are a layout per GPU and a
slice type per replica; the GPU inventories and models; `plan_gpu` is its
entry.

Each GPU takes one MIG layout (or none: the whole GPU). GPUs of a model are
identical, so the program counts GPUs per layout (``g[m,l]``) rather than
choosing a layout per GPU (12 GPUs x 4 layouts would be 48 binaries with 12!
symmetric solutions; aggregated it is 4 integers) and unpacks the counts to
GPU ids deterministically afterwards. ``r[s,k]`` replicas of stage ``s`` on
slice type ``k`` (integer, only where the stage's memory fits the slice; one
replica per slice), ``sum_s r[s,k] <= slices of type k``; ``T_s = sum_k
mu[s,k] r[s,k]`` from the stage's GPU profile (throughput by compute
fraction of the GPU). Same objective, same path rule (a stage's latency is
that of the slowest slice type it uses).

Across a cluster's GPU nodes (``nodes``: name -> that node's GPUs), the
GPUs of one model (and MIG setting) on every node are one group: a slice is
a slice wherever it is, so the program does not grow with the nodes. The
group's GPUs are then dealt to the nodes holding that model in turn (GPU
ids alternate between them), and since a stage takes its slices from the
lowest id up, its replicas spread over the nodes: no one node's loss
takes all of them. Each stage's path budgets a network hop more.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream._internal.api import Pipeline
from slipstream._internal.errors import ConfigError
from slipstream._internal.planner.cpu import (
    GPU_CLASS,
    NETWORK_MS,
    ONE_MACHINE,
    _add_cpu_stages,
    _bound_cpu,
    _Class,
    _classes,
    _cpu_stages,
    _CpuSolution,
    _CpuStage,
    _CpuVars,
    _Opt,
    _read_cpu,
    _spread,
    size_classes,
)
from slipstream._internal.planner.milp import (
    EPS,
    QUEUE_FACTOR,
    TOL,
    Key,
    _bounds,
    _Costs,
    _costs,
    _Infeasible,
    _lex_objective,
    _Model,
    _path_rule,
    _pipeline_rates,
    _StageBase,
    _timed_out,
)
from slipstream._internal.planner.plan import TARGET_LOAD, PipelinePlan, Plan, StagePlan

# --- GPU inventories -------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuModel:
    """A GPU model: its memory, its MIG slice types (name -> compute
    fraction, memory GB) and the layouts a GPU may take."""

    name: str
    memory_gb: float
    slices: dict[str, tuple[float, float]]
    layouts: tuple[tuple[str, ...], ...]


def _a100_like(name: str, gb: int) -> GpuModel:
    s1, s2, s3, s4, s7 = (f"1g.{gb // 8}gb", f"2g.{gb // 4}gb", f"3g.{gb // 2}gb", f"4g.{gb // 2}gb", f"7g.{gb}gb")
    return GpuModel(name, float(gb), {s1: (1 / 7, gb / 8), s2: (2 / 7, gb / 4), s3: (3 / 7, gb / 2),
                                      s4: (4 / 7, gb / 2), s7: (1.0, float(gb))},
                    ((s7,), (s4, s3), (s4, s2, s1), (s4, s1, s1, s1), (s3, s3), (s3, s2, s2), (s3, s2, s1, s1),
                     (s3, s1, s1, s1, s1), (s2, s2, s2, s1), (s2, s2, s1, s1, s1), (s1,) * 7))


#: NVIDIA's documented MIG profiles (MIG user guide), a subset of the valid
#: layouts of each model; the A30's list is complete but for the media-extension
#: (+me) variants.
GPU_MODELS: dict[str, GpuModel] = {
    "A30": GpuModel("A30", 24.0, {"1g.6gb": (0.25, 6.0), "2g.12gb": (0.5, 12.0), "4g.24gb": (1.0, 24.0)},
                    (("4g.24gb",), ("2g.12gb", "2g.12gb"), ("2g.12gb", "1g.6gb", "1g.6gb"), ("1g.6gb",) * 4)),
    "A100-40GB": _a100_like("A100-40GB", 40),
    "A100-80GB": _a100_like("A100-80GB", 80),
    "H100-80GB": _a100_like("H100-80GB", 80),
}
_ALIASES = {"A100": "A100-40GB", "H100": "H100-80GB"}
WHOLE = "whole"


@dataclass(frozen=True)
class GpuGroup:
    model: GpuModel
    count: int


def _whole(model: GpuModel) -> GpuModel:
    return GpuModel(model.name, model.memory_gb, {WHOLE: (1.0, model.memory_gb)}, ((WHOLE,),))


def _model_named(name: str, custom: Mapping[str, GpuModel]) -> GpuModel:
    key = {k.upper(): k for k in [*GPU_MODELS, *custom]}.get(_ALIASES.get(name.upper(), name).upper())
    if key is None:
        raise ConfigError(f"unknown GPU model {name!r}: known {', '.join([*GPU_MODELS, *custom])} "
                          "(describe others in a JSON inventory)")
    return custom.get(key) or GPU_MODELS[key]


def parse_inventory(spec: str) -> list[GpuGroup]:
    """``12xA30``, ``4xA100-80GB:nomig,2xH100`` (``:nomig``: whole GPUs), or
    a JSON file: ``{"gpus": [{"model": "A30", "count": 12, "mig": true}],
    "models": {"X": {"memory_gb": 16, "slices": {"a": [0.5, 8]},
    "layouts": [["a", "a"]]}}}``."""
    custom: dict[str, GpuModel] = {}
    if Path(spec).suffix == ".json" or Path(spec).is_file():
        try:
            doc = json.loads(Path(spec).read_text())
            for name, d in doc.get("models", {}).items():
                custom[name] = GpuModel(name, float(d["memory_gb"]),
                                        {k: (float(v[0]), float(v[1])) for k, v in d["slices"].items()},
                                        tuple(tuple(lay) for lay in d["layouts"]))
            items = [(str(g["model"]), int(g.get("count", 1)), bool(g.get("mig", True))) for g in doc["gpus"]]
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ConfigError(f"cannot read GPU inventory {spec}: {e!r}") from None
    else:
        items = []
        for part in spec.split(","):
            part = part.strip()
            count_s, sep, rest = part.partition("x")
            if not sep or not count_s.isdigit():
                raise ConfigError(f"GPU inventory {part!r}: write COUNTxMODEL[:nomig], e.g. 12xA30")
            name, _, flag = rest.partition(":")
            if flag not in ("", "nomig", "mig"):
                raise ConfigError(f"GPU inventory {part!r}: unknown flag {flag!r} (nomig)")
            items.append((name, int(count_s), flag != "nomig"))
    groups = []
    for name, count, mig in items:
        model = _model_named(name, custom)
        for lay in model.layouts:
            if any(s not in model.slices for s in lay):
                raise ConfigError(f"GPU model {model.name}: layout {list(lay)} names an unknown slice")
        if count < 1:
            raise ConfigError(f"GPU inventory: {name} count must be >= 1")
        groups.append(GpuGroup(model if mig else _whole(model), count))
    return groups


def spec_from_smi(lines: Sequence[str]) -> tuple[str, list[str]]:
    """A node's GPUs as ``--nodes`` writes them (``2xA30+1xA100-80GB:nomig``)
    from its ``nvidia-smi -L`` lines (what a member's record carries), and
    the GPUs left out because the planner knows no such model. A GPU with
    MIG slices listed under it is planned with MIG (its layout is the
    plan's to choose), one without as a whole GPU."""
    counts: dict[str, int] = {}
    unknown = []
    for name, slices in smi_gpus(lines):
        mig = bool(slices)
        model = _model_of(name)
        if model is None:
            unknown.append(name)
            continue
        key = model + ("" if mig else ":nomig")
        counts[key] = counts.get(key, 0) + 1
    return "+".join(f"{n}x{k}" for k, n in counts.items()), unknown


def local_smi_lines() -> list[str]:
    """This machine's ``nvidia-smi -L`` lines; none without it."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.splitlines() if out.returncode == 0 else []


def smi_gpus(lines: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Each GPU ``nvidia-smi -L``'s lines list, in order: its product name
    and the MIG profiles of the slices listed under it (none: a whole GPU).
    Lines without a UUID are skipped, as the node's own reading of them
    (`crates/slipstream-core/src/gpu.rs`) skips them."""
    gpus: list[tuple[str, list[str]]] = []
    for line in (x.strip() for x in lines):
        head, _, uuid = line.partition("(UUID:")
        if not uuid.strip(" )"):
            continue
        if line.startswith("GPU "):
            gpus.append((head.split(":", 1)[-1].strip(), []))
        elif line.startswith("MIG ") and gpus:
            gpus[-1][1].append(line[4:].split()[0] if line[4:].split() else "")
    return gpus


def local_devices(lines: Sequence[str]) -> list[tuple[int, str]]:
    """The devices a node binds workers to, in its order (``cuda:N`` is the
    Nth): (GPU number, MIG profile, or ``WHOLE`` for a GPU without slices)
    from ``nvidia-smi -L``'s lines. A GPU with MIG slices offers its slices,
    not itself (as `crates/slipstream-core/src/gpu.rs` lists them)."""
    out: list[tuple[int, str]] = []
    for n, (_, slices) in enumerate(smi_gpus(lines)):
        out.extend((n, sl) for sl in slices) if slices else out.append((n, WHOLE))
    return out


def gpu_binding(plan_inventory: Mapping[str, Any], placements: Mapping[tuple[str, str], Sequence[Mapping[str, Any]]],
                smi: Sequence[str], node: str | None = None) -> dict[tuple[str, str], list[int]]:
    """The devices (``cuda:N`` places on a machine) each replica of a GPU
    plan's stages is bound to, in replica order: stage (pipeline, name) ->
    places, from that machine's ``nvidia-smi -L`` lines (`smi`).

    One machine's plan numbers its GPUs in ``nvidia-smi -L``'s order. A
    cluster plan's GPUs are the cluster's (``gpu_nodes``), each dealt to a
    node: with `node`, only the replicas the plan puts there are bound,
    and the plan's GPUs on that node are its GPUs of the same model, in
    ``nvidia-smi -L``'s order. Every GPU the plan uses must be cut there as
    the plan cuts it (its MIG slices, in any order; or whole): otherwise
    serving the plan would put replicas on slices it did not plan, and
    this says how the two differ instead."""
    gpus = {int(g["id"]): g for g in plan_inventory.get("gpus", [])}
    where, there = ("", "this machine") if node is None else (f" on node {node}", f"node {node}")
    if node is not None:
        placements = {k: [p for p in ps if gpus.get(int(p["gpu"]), {}).get("node") == node]
                      for k, ps in placements.items()}
        placements = {k: ps for k, ps in placements.items() if ps}
    if not placements:
        return {}
    layouts = {gid: [str(x) for x in g["layout"]] for gid, g in gpus.items()}
    devices = local_devices(smi)
    if not devices:
        raise ConfigError(f"the plan binds stages to GPUs{where}, but `nvidia-smi -L` lists none on {there}; "
                          "serve it where the plan's GPUs are, or plan for the GPUs there")
    here: dict[int, list[tuple[int, str]]] = {}
    for place, (gpu, profile) in enumerate(devices):
        here.setdefault(gpu, []).append((place, profile))
    local = _local_gpus(gpus, smi, node, where)

    def cut(profiles: Sequence[str]) -> str:
        return "whole" if list(profiles) == [WHOLE] else "MIG " + " + ".join(sorted(profiles))

    for gid in sorted({int(p["gpu"]) for ps in placements.values() for p in ps}):
        if gid not in layouts:
            raise ConfigError(f"malformed plan: a stage is placed on GPU {gid}, which its inventory lacks")
        if local.get(gid) not in here:
            raise ConfigError(f"the plan uses GPU {gid}{where}, but {there} has {len(here)} GPU(s) "
                              "(`nvidia-smi -L`); plan for its GPUs")
        have = [prof for _, prof in here[local[gid]]]
        if sorted(have) != sorted(layouts[gid]):
            raise ConfigError(f"the plan cuts GPU {gid} as {cut(layouts[gid])}, but "
                              f"{'here' if node is None else 'on node ' + node} it is {cut(have)}; set its MIG "
                              "layout as planned (`nvidia-smi mig -cgi ... -C`) or plan for its GPUs")
    out: dict[tuple[str, str], list[int]] = {}
    for key, ps in placements.items():
        places = []
        for p in ps:
            gid, name, slot = int(p["gpu"]), str(p["slice"]), int(p["slot"])
            nth = layouts[gid][:slot].count(name)
            places.append([place for place, prof in here[local[gid]] if prof == name][nth])
        out[key] = places
    return out


def _local_gpus(gpus: Mapping[int, Mapping[str, Any]], smi: Sequence[str], node: str | None,
                where: str) -> dict[int, int]:
    """The plan's GPU ids -> the machine's GPU numbers (``nvidia-smi -L``
    order): the same numbers on one machine; on a cluster `node`, the
    plan's GPUs there (by id) -> that node's GPUs of the same model, in
    turn (whole ones for whole ones, MIG-cut ones for MIG-cut ones)."""
    if node is None:
        return {gid: gid for gid in gpus}
    listed = smi_gpus(smi)
    free: dict[tuple[str, bool], list[int]] = {}
    for n, (name, slices) in enumerate(listed):
        free.setdefault((_model_of(name) or name, not slices), []).append(n)
    out: dict[int, int] = {}
    for gid, g in sorted(gpus.items()):
        if g.get("node") != node:
            continue
        model, whole = str(g.get("model", "")), list(g.get("layout", [])) == [WHOLE]
        if not free.get((model, whole)):
            planned = sum(1 for x in gpus.values() if x.get("node") == node and x.get("model") == model
                          and (list(x.get("layout", [])) == [WHOLE]) == whole)
            there = ", ".join(name + ("" if not slices else f" (MIG {len(slices)} slices)")
                              for name, slices in listed) or "none"
            raise ConfigError(f"the plan puts {planned} {model} GPU(s){where} "
                              f"{'whole' if whole else 'cut into MIG slices'}, but `nvidia-smi -L` there lists "
                              f"fewer ({there}); plan for the members as they are (`slipstream plan --cluster`)")
        out[gid] = free[(model, whole)].pop(0)
    return out


def _model_of(smi_name: str) -> str | None:
    """The planner's model for an ``nvidia-smi`` product name
    (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``), if it knows one."""
    n = smi_name.upper()
    if "A30" in n:
        return "A30"
    if "A100" in n:
        return "A100-80GB" if "80GB" in n else "A100-40GB"
    if "H100" in n:
        return "H100-80GB"
    return None


def _cluster_groups(nodes: Mapping[str, str]) -> tuple[list[GpuGroup], list[list[tuple[str, int]]]]:
    """One group per GPU model and MIG setting across `nodes` (name ->
    ``4xA100+2xA30:nomig``), and which nodes hold each group's GPUs (name,
    count), in node order."""
    groups: list[GpuGroup] = []
    holders: list[list[tuple[str, int]]] = []
    index: dict[tuple[str, tuple[tuple[str, ...], ...]], int] = {}
    for node, spec in sorted(nodes.items()):
        if not node:
            raise ConfigError(f"a GPU node needs a name: {dict(nodes)}")
        for g in parse_inventory(spec.replace("+", ",")):
            key = (g.model.name, g.model.layouts)
            if key not in index:
                index[key] = len(groups)
                groups.append(GpuGroup(g.model, 0))
                holders.append([])
            i = index[key]
            groups[i] = GpuGroup(g.model, groups[i].count + g.count)
            holders[i].append((node, g.count))
    if not groups:
        raise ConfigError("no GPU nodes given")
    return groups, holders


def _deal(gpus: list[dict[str, Any]], holders: Sequence[Sequence[tuple[str, int]]]) -> None:
    """Give each GPU of the plan (by id, within its group) a node: the
    nodes holding the group's model in turn, each up to its count."""
    order: list[list[str]] = []
    for hs in holders:
        left = dict(hs)
        turn: list[str] = []
        while any(left.values()):
            for node, _ in hs:
                if left[node] > 0:
                    turn.append(node)
                    left[node] -= 1
        order.append(turn)
    taken = [0] * len(order)
    for g in gpus:
        gi = g["group"]
        g["node"] = order[gi][taken[gi]]
        taken[gi] += 1


# --- the GPU program ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Slice:
    group: int
    name: str
    fraction: float
    memory_gb: float


@dataclass(frozen=True)
class _GpuPoint:
    rps: float
    p99_ms: float
    batch: int


@dataclass
class _GpuStage(_StageBase):
    memory_gb: float = 0.0
    points: dict[int, _GpuPoint] = field(default_factory=dict)  # slice index -> point
    #: CPU its worker spends on the host per request (its profile's
    #: ``host_cpu_ms``; 0: not given), on the cores of the GPU's machine.
    host_cpu_s: float = 0.0


def _gpu_point(gp: Mapping[str, Any], model: str, fraction: float) -> _GpuPoint | None:
    """A stage's throughput and p99 on a slice of `fraction` of a `model`
    GPU: its profile's table for that model (or ``"*"``), linear between
    the listed fractions, proportional outside them."""
    tables = gp.get("models", {})
    table = tables.get(model) or tables.get("*")
    if not table:
        return None
    pts = sorted((float(f), p) for f, p in table.items())
    lo = max((pt for pt in pts if pt[0] <= fraction + TOL), default=None, key=lambda pt: pt[0])
    hi = min((pt for pt in pts if pt[0] >= fraction - TOL), default=None, key=lambda pt: pt[0])
    if lo is None or hi is None:
        edge = hi if lo is None else lo
        assert edge is not None
        f, p = edge
        return _GpuPoint(p["rps"] * fraction / f, p["p99_ms"] * f / fraction, int(p.get("batch", 1)))
    (f0, p0), (f1, p1) = lo, hi
    w = 0.0 if f1 - f0 < TOL else (fraction - f0) / (f1 - f0)
    return _GpuPoint(p0["rps"] + w * (p1["rps"] - p0["rps"]), p0["p99_ms"] + w * (p1["p99_ms"] - p0["p99_ms"]),
                     int(p0.get("batch", 1)))


def _gpu_stages(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]],
                slices: Sequence[_Slice], groups: Sequence[GpuGroup]) -> list[_GpuStage]:
    total = sum(g.count * max(len(lay) for lay in g.model.layouts) for g in groups)
    out = []
    for pipe in pipelines:
        prof = profiles.get(pipe.name)
        if prof is None:
            raise ConfigError(f"no profile for pipeline {pipe.name!r}")
        for name in pipe.graph.topological_order():
            gp = prof["stages"].get(name, {}).get("gpu")
            if gp is None:
                continue  # planned on CPU cores
            lo, hi, bounded = _bounds(pipe.stage(name), total)
            st = _GpuStage(pipe.name, name, pipe.graph.parents(name), lo, hi, bounded, float(gp.get("demand", 1.0)),
                           elastic_ms=pipe.stage(name).elastic_ms, memory_gb=float(gp["memory_gb"]),
                           host_cpu_s=float(gp.get("host_cpu_ms", 0.0)) / 1e3)
            for k, sl in enumerate(slices):
                pt = _gpu_point(gp, groups[sl.group].model.name, sl.fraction)
                if pt is not None and pt.rps > 0 and st.memory_gb <= sl.memory_gb + TOL:
                    st.points[k] = pt
            if not st.points:
                raise ConfigError(f"{pipe.name}/{name} ({st.memory_gb:g} GB) fits no slice of this inventory")
            fits = {(slices[k].group, slices[k].name) for k in st.points}
            room = sum(grp.count * max(sum((gi, sl) in fits for sl in lay) for lay in grp.model.layouts)
                       for gi, grp in enumerate(groups))
            if st.lo > room:
                raise ConfigError(f"{pipe.name}/{name} needs at least {st.lo} replica(s), one per slice, but this "
                                  f"inventory has at most {room} slice(s) its {st.memory_gb:g} GB fit")
            out.append(st)
    return out


@dataclass
class _GpuVars:
    m: _Model
    g: dict[tuple[int, int], int]       # (group, layout) -> GPUs
    r: dict[tuple[Key, int], int]       # (stage, slice) -> replicas
    rate: dict[str, int]

    def stage_tput(self, s: _GpuStage) -> dict[int, float]:
        return {v: s.points[k].rps / s.demand for (key, k), v in self.r.items() if key == s.key}


@dataclass
class _CpuPart:
    """The stages a GPU plan puts on CPU cores (no ``gpu`` section in their
    profile), and the cores: one machine's, or a cluster's size classes."""

    stages: list[_CpuStage]
    classes: dict[str, _Class]
    only: Mapping[Key, _Opt] | None = None
    n_max: Mapping[Key, int] | None = None


def _gpu_program(stages: Sequence[_GpuStage], groups: Sequence[GpuGroup], slices: Sequence[_Slice],
                 costs: _Costs, q: float, time_limit_s: float, layout_fixed: Mapping[tuple[int, int], int] | None = None,
                 r_max: Mapping[tuple[Key, int], int] | None = None,
                 cpu: _CpuPart | None = None) -> tuple[_GpuVars, _CpuVars]:
    """One program for the GPU stages' slices and, with `cpu`, the other
    stages' replicas on cores: a pipeline's rate is that of its slowest
    stage wherever it runs, and the path rule spans both."""
    m = _Model(time_limit_s)
    v = _GpuVars(m, {}, {}, {})
    c = _CpuVars(m, {}, {}, {}, {}, {}, {})
    for gi, grp in enumerate(groups):
        for li in range(len(grp.model.layouts)):
            fixed = None if layout_fixed is None else float(layout_fixed[(gi, li)])
            v.g[(gi, li)] = m.var(fixed or 0.0, grp.count if fixed is None else fixed, integer=True)
        m.row({v.g[(gi, li)]: 1.0 for li in range(len(grp.model.layouts))}, lo=grp.count, hi=grp.count)
    lat: dict[Key, dict[int, float]] = {}
    for s in stages:
        lat[s.key] = {}
        for k, pt in s.points.items():
            hi = _slots(groups, slices[k])
            if r_max is not None:
                hi = min(hi, r_max.get((s.key, k), 0))
            r = v.r[(s.key, k)] = m.var(0, hi, integer=True)
            if costs.slo_ms.get(s.pipeline) is not None:
                u = m.var(0, 1, integer=True)
                m.row({r: 1.0, u: -float(max(hi, 1))}, hi=0.0)
                lat[s.key][u] = s.path_ms(pt.p99_ms, q, costs)
        m.row({v.r[(s.key, k)]: 1.0 for k in s.points}, lo=float(s.lo), hi=float(s.hi))
    for k, sl in enumerate(slices):
        grp = groups[sl.group]
        have = {v.g[(sl.group, li)]: -float(lay.count(sl.name)) for li, lay in enumerate(grp.model.layouts)}
        m.row({**{x: 1.0 for (_, kk), x in v.r.items() if kk == k}, **have}, hi=0.0)
    both: list[_StageBase] = list(stages)
    tputs: dict[Key, dict[int, float]] = {s.key: v.stage_tput(s) for s in stages}
    if cpu is not None:
        cpu_lat, room = _add_cpu_stages(m, c, cpu.stages, costs, q, cpu.classes, cpu.only, cpu.n_max)
        lat.update(cpu_lat)
        both += cpu.stages
        tputs.update({s.key: c.stage_tput(s) for s in cpu.stages})
    v.rate.update(_pipeline_rates(m, both, lambda s: tputs[s.key]))
    if cpu is not None:
        c.rate.update(v.rate)
        # The GPU workers' own CPU, per pipeline request, on the GPU machines' cores.
        host: dict[int, float] = {}
        for s in (s for s in stages if s.host_cpu_s > 0):
            host[v.rate[s.pipeline]] = host.get(v.rate[s.pipeline], 0.0) + s.demand * s.host_cpu_s
        on_gpus = [k for k in cpu.classes if k == ONE_MACHINE or k.endswith(GPU_CLASS)]
        _bound_cpu(m, c, cpu.stages, costs, cpu.classes, room, host, on_gpus)
    _path_rule(m, both, lat, costs)
    return v, c


def _slots(groups: Sequence[GpuGroup], sl: _Slice) -> int:
    """The most slices of this type the group's GPUs can have."""
    grp = groups[sl.group]
    return grp.count * max(lay.count(sl.name) for lay in grp.model.layouts)


def _slice_types(groups: Sequence[GpuGroup]) -> list[_Slice]:
    out = []
    for gi, grp in enumerate(groups):
        for name, (frac, mem) in grp.model.slices.items():
            if any(name in lay for lay in grp.model.layouts):
                out.append(_Slice(gi, name, frac, mem))
    return out


@dataclass
class _GpuSolution:
    g: dict[tuple[int, int], int]
    r: dict[tuple[Key, int], int]
    tput: dict[Key, float]
    rate: dict[str, float]


def _read_gpu(stages: Sequence[_GpuStage], v: _GpuVars, sol: list[float], cpu: _CpuSolution | None = None,
              cap: Mapping[str, float] | None = None) -> _GpuSolution:
    """The solution's slices; its stage throughputs are every stage's,
    those `cpu` (the same solution's stages on cores) has too, and a
    pipeline's rate the least of them, and of `cap` (the rates the levels
    held: the cores can bound a rate below its stages' throughput, with
    the GPU workers' own CPU on them)."""
    r = {k: int(round(sol[x])) for k, x in v.r.items()}
    tput = {s.key: sum(s.points[k].rps * r[(s.key, k)] for k in s.points) / s.demand for s in stages}
    tput.update(cpu.tput if cpu is not None else {})
    rate = {p: min([t for (pp, _), t in tput.items() if pp == p] + [(cap or {}).get(p, math.inf)]) for p in v.rate}
    return _GpuSolution({k: int(round(sol[x])) for k, x in v.g.items()}, r, tput, rate)


def _unpack(groups: Sequence[GpuGroup], slices: Sequence[_Slice], stages: Sequence[_GpuStage],
            sol: _GpuSolution) -> tuple[list[dict[str, Any]], dict[Key, list[dict[str, Any]]]]:
    """Concrete GPU ids: groups in inventory order, layouts in table order;
    each stage takes its slices of a type from the lowest GPU id up, so a
    stage's replicas sit together."""
    gpus: list[dict[str, Any]] = []
    free: dict[int, list[tuple[int, int]]] = {k: [] for k in range(len(slices))}
    index = {(sl.group, sl.name): k for k, sl in enumerate(slices)}
    for gi, grp in enumerate(groups):
        for li, lay in enumerate(grp.model.layouts):
            for _ in range(sol.g[(gi, li)]):
                gid = len(gpus)
                gpus.append({"id": gid, "model": grp.model.name, "layout": list(lay), "stages": [None] * len(lay),
                             "group": gi})
                for slot, name in enumerate(lay):
                    free[index[(gi, name)]].append((gid, slot))
    place: dict[Key, list[dict[str, Any]]] = {s.key: [] for s in stages}
    for s in stages:
        for k in sorted(s.points):
            for _ in range(sol.r[(s.key, k)]):
                gid, slot = free[k].pop(0)
                gpus[gid]["stages"][slot] = f"{s.pipeline}/{s.name}"
                place[s.key].append({"gpu": gid, "slice": slices[k].name, "slot": slot})
    return gpus, place


def plan_gpu(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]],
             inventory: str | Sequence[GpuGroup], *, rate: float | None = None, app: str = "",
             overheads: Mapping[str, Any] | None = None, time_limit_s: float = 30.0,
             nodes: Mapping[str, str] | None = None, network_ms: float = NETWORK_MS,
             cores: float = 0.0, cpu_nodes: Mapping[str, float] | None = None) -> Plan:
    """Plan `pipelines` on GPUs with MIG (see the module doc), or on a
    cluster's GPU `nodes` (name -> its GPUs, ``4xA100+2xA30:nomig``;
    `inventory` is then ignored): replicas per node, each stage's path
    budgeting `network_ms` more per hop. A stage whose profile has a
    ``gpu`` section is planned on GPU slices: ``memory_gb``, optional
    ``demand`` (calls per pipeline request), and ``models``: GPU model (or
    ``"*"``) -> compute fraction -> ``{"rps", "p99_ms", "batch"}``. The
    others are planned on CPU cores in the same program, as `plan_cpu`
    plans them: one machine's `cores`, or the cluster's `cpu_nodes` (name
    -> cores; GPU nodes' cores included)."""
    from slipstream._internal import slo

    t0 = time.perf_counter()
    holders: list[list[tuple[str, int]]] | None = None
    if nodes:
        groups, holders = _cluster_groups(nodes)
    else:
        groups = parse_inventory(inventory) if isinstance(inventory, str) else list(inventory)
    slices = _slice_types(groups)
    over = dict(slo.DEFAULTS) | {"hop_us": 300.0, "ingress_us": 400.0} | dict(overheads or {})
    if nodes:
        over["hop_us"] = float(over["hop_us"]) + network_ms * 1e3
    classes, members = size_classes(cpu_nodes, with_gpus=frozenset(nodes)) if nodes else (None, {})
    room = float(sum((cpu_nodes or {}).values())) if nodes else float(cores)
    costs = _costs(pipelines, room, over)
    stages = _gpu_stages(pipelines, profiles, slices, groups)
    on_gpu = frozenset(s.key for s in stages)
    on_cpu = [(p.name, n) for p in pipelines for n in p.graph.topological_order() if (p.name, n) not in on_gpu]
    cpu: _CpuPart | None = None
    host = [f"{s.pipeline}/{s.name}" for s in stages if s.host_cpu_s > 0]
    if host and room <= 0:
        raise ConfigError(", ".join(host) + ": host_cpu_ms in the profile, and no cores to count it on: give the "
                          "cores (--cores, or the nodes' in --nodes)")
    if on_cpu or host:
        if on_cpu and room <= 0:
            raise ConfigError(", ".join(f"{p}/{n}" for p, n in on_cpu) + ": no GPU section in the profile (\"gpu\": "
                              "memory_gb, models -> fraction -> rps, p99_ms, batch), and no cores to plan it on: "
                              "give the cores (--cores, or the nodes' in --nodes), or profile it on a GPU")
        widest = max(cpu_nodes.values()) if nodes and cpu_nodes else room
        cpu = _CpuPart(_cpu_stages(pipelines, profiles, room, float(over["batch_cpu_us"]), widest, skip=on_gpu),
                       _classes(costs, classes))
    try:
        v, c = _gpu_program(stages, groups, slices, costs, QUEUE_FACTOR, time_limit_s, cpu=cpu)
        # The GPU stages' spare slices go to them as headroom; a stage on
        # cores gets what the pipelines' rates need, not every spare core
        # (on a cluster that is every node's: 1,533 replicas of a stage
        # that four serve, in bench/plan_mig.py's 64 nodes).
        levels = _lex_objective(v.m, v.rate, {s.key: v.stage_tput(s) for s in stages})
        used = {**{x: slices[k].fraction for (_, k), x in v.r.items()}, **_cpu_cost(c)}
        sol = v.m.solve(used, maximize=False)
        cpu_best = _read_cpu(cpu.stages, c, sol, levels) if cpu else None
        held = {p: level for level, keys in levels for p in keys if p in v.rate}
        best = _read_gpu(stages, v, sol, cpu_best, held)
        timed_out = v.m.timed_out
    except _Infeasible:
        raise ConfigError("no placement fits: every stage needs a slice its memory fits (or, without a GPU "
                          "section, room on the cores), within its replica bounds and the SLO path rule "
                          "(2 x p99 + hop per stage)") from None
    chosen, cpu_chosen = best, cpu_best
    if rate is not None:
        if cpu is not None and cpu_best is not None:
            cpu = _CpuPart(cpu.stages, cpu.classes, only=cpu_best.opt, n_max=cpu_best.n)
        w, wc = _gpu_program(stages, groups, slices, costs, QUEUE_FACTOR, time_limit_s, layout_fixed=best.g,
                             r_max=best.r, cpu=cpu)
        for p, x in w.rate.items():
            w.m.row({x: 1.0}, lo=min(rate / TARGET_LOAD, best.rate[p] * (1 - EPS)))
        sol = w.m.solve({**{x: slices[k].fraction for (_, k), x in w.r.items()}, **_cpu_cost(wc)}, maximize=False)
        cpu_chosen = _read_cpu(cpu.stages, wc, sol, []) if cpu else None
        chosen = _read_gpu(stages, w, sol, cpu_chosen, best.rate)
        timed_out = timed_out or w.m.timed_out
    gpus, place = _unpack(groups, slices, stages, best)
    if holders is not None:
        _deal(gpus, holders)
    per_node_cpu = _spread(cpu.stages, cpu_chosen, members) if cpu and cpu_chosen and nodes else {}
    out = {}
    for pipe in pipelines:
        mine = [s for s in stages if s.pipeline == pipe.name]
        sts = {}
        for s in mine:
            n_best = sum(best.r[(s.key, k)] for k in s.points)
            n_rate = sum(chosen.r[(s.key, k)] for k in s.points)
            used_k = [k for k in s.points if best.r[(s.key, k)] > 0]
            order = _order(place[s.key], chosen, s, slices)
            per_node: dict[str, int] | None = None
            if holders is not None:  # the slices the plan starts first, by node
                per_node = {}
                for q in order[:n_rate]:
                    per_node[gpus[q["gpu"]]["node"]] = per_node.get(gpus[q["gpu"]]["node"], 0) + 1
                for q in order:
                    q["node"] = gpus[q["gpu"]]["node"]
            sts[s.name] = StagePlan(replicas=n_rate, max_replicas=n_best, threads=1,
                                    max_batch_size=min(s.points[k].batch for k in used_k),
                                    throughput_rps=chosen.tput[s.key], placement=order, nodes=per_node)
        cpu_why: list[str] = []
        for cs in (cpu.stages if cpu and cpu_best and cpu_chosen else []):
            if cs.pipeline != pipe.name:
                continue
            assert cpu_best is not None and cpu_chosen is not None
            o, n = cpu_best.opt[cs.key], cpu_chosen.n[cs.key]
            sts[cs.name] = StagePlan(replicas=n, max_replicas=max(cpu_best.n[cs.key], n), threads=o.threads,
                                     max_batch_size=o.batch, throughput_rps=chosen.tput[cs.key],
                                     nodes=per_node_cpu.get(cs.key) if nodes else None)
            # As the GPU stages' lines: the max plan's.
            tag = "bottleneck " if best.tput[cs.key] <= best.rate[pipe.name] * (1 + 1e-3) + TOL else ""
            cpu_why.append(f"{tag}{cs.name}: on CPU cores (no GPU section in its profile): {cpu_best.n[cs.key]} "
                           f"replica(s) x {o.threads} thread(s), batch <= {o.batch} -> {best.tput[cs.key]:,.0f} "
                           "req/s")
        slowest = min(best.tput[(pipe.name, n)] for n in pipe.graph.nodes)
        if best.rate[pipe.name] < slowest * (1 - 1e-3) - TOL:
            cpu_why.append(f"bottleneck: the cores: at {best.rate[pipe.name]:,.0f} req/s the GPU workers' own CPU "
                           f"(host_cpu_ms) and the stages on cores fill them, under the slowest stage's "
                           f"{slowest:,.0f} req/s")
        sts = {n: sts[n] for n in pipe.graph.topological_order()}
        cap = chosen.rate[pipe.name]
        out[pipe.name] = PipelinePlan(capacity_rps=cap, target_rps=rate if rate is not None else TARGET_LOAD * cap,
                                      stages=sts, predicted=None,
                                      why=(_why_gpu(pipe, mine, best, slices, groups, costs) if mine else [])
                                      + cpu_why + _timed_out(timed_out),
                                      max_capacity_rps=best.rate[pipe.name] if rate is not None else None)
    inv: dict[str, Any] = {"gpus": [{k: g[k] for k in ("id", "model", "layout", "stages", "node") if k in g}
                                    for g in gpus]}
    if cpu is not None:
        inv["cores"] = room
    if nodes:
        inv["gpu_nodes"] = dict(nodes)
        inv["network_ms"] = network_ms
        if cpu is not None:
            inv["cpu_nodes"] = dict(cpu_nodes or {})
    return Plan(app=app, inventory=inv, pipelines=out, solve_ms=(time.perf_counter() - t0) * 1e3)


def _cpu_cost(c: _CpuVars) -> dict[int, float]:
    """What a plan's replica threads on cores cost in its last solve: a
    thread on a GPU node's cores half again as much as one on a node
    without GPUs, whose cores no GPU worker needs (the program does not
    count the GPU workers' own CPU yet)."""
    return {n: c.threads[n] * (1.5 if label.endswith(GPU_CLASS) else 1.0) for (_, _, label), n in c.n.items()}


def _order(place: list[dict[str, Any]], chosen: _GpuSolution, s: _GpuStage,
           slices: Sequence[_Slice]) -> list[dict[str, Any]]:
    """The max plan's slices of a stage, the ones the rate plan starts first."""
    want = {slices[k].name: chosen.r[(s.key, k)] for k in s.points}
    first, rest = [], []
    for p in place:
        if want.get(p["slice"], 0) > 0:
            want[p["slice"]] -= 1
            first.append(p)
        else:
            rest.append(p)
    return first + rest


def _why_gpu(pipe: Pipeline, mine: Sequence[_GpuStage], sol: _GpuSolution, slices: Sequence[_Slice],
             groups: Sequence[GpuGroup], costs: _Costs) -> list[str]:
    low = sol.rate[pipe.name]  # its slowest stage's, on a GPU or not
    lines = []
    for s in mine:
        used = ", ".join(f"{sol.r[(s.key, k)]} x {slices[k].name}" for k in s.points if sol.r[(s.key, k)])
        tag = "bottleneck " if sol.tput[s.key] <= low * (1 + 1e-3) + TOL else ""
        lines.append(f"{tag}{s.name}: {used} -> {sol.tput[s.key]:,.0f} req/s ({s.memory_gb:g} GB: fits "
                     + ", ".join(sorted({slices[k].name for k in s.points})) + ")")
    lines.append(f"capacity {sol.rate[pipe.name]:,.0f} req/s; every GPU takes one layout; one replica per slice")
    if costs.slo_ms.get(pipe.name) is not None:
        lines.append(f"SLO {costs.slo_ms[pipe.name]:g} ms checked by the path rule (2 x p99 + hop per stage); the "
                     "SLO model simulates CPU cores, not GPUs, so no simulated p99")
    return lines
