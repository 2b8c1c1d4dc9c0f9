"""What a plan is, apart from how it was found: the `Plan` that `slipstream
plan` writes and `slipstream serve --plan` reads, applying it to the app's
pipelines, reading profiles at a stage's thread count, and printing it.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream._internal.api import Component, Pipeline
from slipstream._internal.errors import ConfigError

#: A plan is checked by the SLO model at this share of its capacity.
TARGET_LOAD = 0.9


@dataclass
class StagePlan:
    replicas: int
    max_replicas: int
    threads: int
    max_batch_size: int
    throughput_rps: float
    #: GPU plans: the GPU slice each replica is bound to.
    placement: list[dict[str, Any]] | None = None
    #: Cluster plans: replicas per node (name -> count).
    nodes: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"replicas": self.replicas, "max_replicas": self.max_replicas, "threads": self.threads,
                             "max_batch_size": self.max_batch_size, "throughput_rps": round(self.throughput_rps, 2)}
        if self.placement is not None:
            d["placement"] = self.placement
        if self.nodes is not None:
            d["nodes"] = self.nodes
        return d


@dataclass
class PipelinePlan:
    capacity_rps: float
    target_rps: float
    stages: dict[str, StagePlan]
    predicted: dict[str, float] | None = None
    why: list[str] = field(default_factory=list)
    max_capacity_rps: float | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"capacity_rps": round(self.capacity_rps, 2), "target_rps": round(self.target_rps, 2)}
        if self.max_capacity_rps is not None:
            d["max_capacity_rps"] = round(self.max_capacity_rps, 2)
        d.update({"stages": {k: v.to_json() for k, v in self.stages.items()}, "predicted": self.predicted,
                  "why": self.why})
        return d


@dataclass
class Plan:
    """What `slipstream plan` writes and `slipstream serve --plan` runs."""

    app: str
    inventory: dict[str, Any]
    pipelines: dict[str, PipelinePlan]
    solve_ms: float
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))
    version: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "app": self.app, "created": self.created, "inventory": self.inventory,
                "pipelines": {k: v.to_json() for k, v in self.pipelines.items()}, "solve_ms": round(self.solve_ms, 1)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Plan:
        if doc.get("version") != 1:
            raise ConfigError(f"plan version {doc.get('version')!r} is not supported (this Slipstream reads 1)")
        try:
            pipes = {}
            for name, p in doc["pipelines"].items():
                stages = {s: StagePlan(replicas=int(v["replicas"]), max_replicas=int(v.get("max_replicas", v["replicas"])),
                                       threads=int(v.get("threads", 1)), max_batch_size=int(v["max_batch_size"]),
                                       throughput_rps=float(v.get("throughput_rps", 0.0)), placement=v.get("placement"),
                                       nodes=_node_counts(v.get("nodes")))
                          for s, v in p["stages"].items()}
                pipes[name] = PipelinePlan(capacity_rps=float(p.get("capacity_rps", 0.0)),
                                           target_rps=float(p.get("target_rps", 0.0)), stages=stages,
                                           predicted=p.get("predicted"), why=list(p.get("why", [])),
                                           max_capacity_rps=p.get("max_capacity_rps"))
            return cls(app=str(doc.get("app", "")), inventory=dict(doc.get("inventory", {})), pipelines=pipes,
                       solve_ms=float(doc.get("solve_ms", 0.0)), created=str(doc.get("created", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"malformed plan: {e!r}") from None

    @classmethod
    def load(cls, path: Path) -> Plan:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read plan {path}: {e}") from None
        return cls.from_json(doc)


def _node_counts(v: Any) -> dict[str, int] | None:
    """A cluster plan's replicas per node, checked (None: not a cluster plan)."""
    if v is None:
        return None
    out = {str(k): int(c) for k, c in dict(v).items()}
    if any(c < 0 for c in out.values()):
        raise ValueError(f"negative replicas in {out}")
    return out


def with_components(pipe: Pipeline, comps: Mapping[str, Component]) -> Pipeline:
    """A copy of `pipe` whose stages named in `comps` are replaced."""
    g = copy.copy(pipe.graph)
    g.nodes = {n: comps.get(n, c) for n, c in pipe.graph.nodes.items()}
    p = copy.copy(pipe)
    p.graph = g
    return p


def _configured(comp: Component, sp: StagePlan, devices: Sequence[int] = ()) -> Component:
    """`comp` sized by `sp`, its replicas bound to `devices` when given. A
    stage declared with bounds keeps them (the autoscaler moves within)
    and starts at the planned count."""
    bind: dict[str, Any] = {}
    if devices:
        if comp.device != "cuda":
            raise ConfigError(f"the plan binds {comp.name} to GPU devices, but it declares device={comp.device!r}; "
                              "declare device=\"cuda\" (the plan chooses its GPU or slice) or plan it for the CPU")
        bind["devices"] = tuple(devices)
    if comp.autoscaled:
        c = comp.options(replicas=(comp.min_replicas, comp.max_replicas), threads=sp.threads,
                         max_batch_size=sp.max_batch_size, **bind)
        c.replicas = min(max(sp.replicas, c.min_replicas), c.max_replicas)
        return c
    replicas: int | tuple[int, int] = (sp.replicas, sp.max_replicas) if sp.max_replicas > sp.replicas \
        else sp.replicas
    return comp.options(replicas=replicas, threads=sp.threads, max_batch_size=sp.max_batch_size, **bind)


def apply_plan(pipelines: Sequence[Pipeline], plan: Plan,
               devices: Mapping[tuple[str, str], Sequence[int]] | None = None) -> list[Pipeline]:
    """The pipelines with the plan's replicas, threads and batch limits,
    and with `devices` (stage (pipeline, name) -> the ``cuda:N`` places its
    replicas take: a GPU plan's binding, see ``gpu_binding``).
    Stages the plan does not name keep their declaration; a pipeline or stage
    the plan names but the app lacks is an error (a plan for another app)."""
    by_name = {p.name: p for p in pipelines}
    for name, pp in plan.pipelines.items():
        if name not in by_name:
            raise ConfigError(f"the plan names pipeline {name!r}, which the app does not define "
                              f"(pipelines: {', '.join(sorted(by_name))}); plan again for this app")
        unknown = sorted(set(pp.stages) - set(by_name[name].graph.nodes))
        if unknown:
            raise ConfigError(f"the plan names stage(s) {', '.join(unknown)} of pipeline {name!r}, which has "
                              f"only {', '.join(by_name[name].graph.nodes)}; plan again for this app")
    out = []
    for p in pipelines:
        planned = plan.pipelines.get(p.name)
        if planned is None:
            out.append(p)
            continue
        bound = devices or {}
        out.append(with_components(p, {s: _configured(p.stage(s), sp, bound.get((p.name, s), ()))
                                        for s, sp in planned.stages.items()}))
    return out


def stage_points(stage_prof: Mapping[str, Any], threads: int) -> list[dict[str, Any]]:
    """A stage's profile points at `threads` threads (``points`` is one thread;
    ``by_threads`` holds the others, from `slipstream profile --threads`)."""
    if threads == 1:
        return list(stage_prof.get("points", []))
    return list(stage_prof.get("by_threads", {}).get(str(threads), {}).get("points", []))


def profiles_for_threads(loaded: list[dict[str, Any]], paths: Sequence[Path],
                         pipelines: Sequence[Pipeline]) -> list[dict[str, Any]]:
    """The node's profiles (`app.load_profiles`) with each stage's points
    taken at its declared thread count where the profile files have them."""
    raw: dict[str, dict[str, Any]] = {}
    for path in paths:
        for prof in json.loads(Path(path).read_text()).get("pipelines", []):
            raw.setdefault(prof["pipeline"], prof)
    threads = {(p.name, n): c.threads for p in pipelines for n, c in p.graph.nodes.items()}
    out = copy.deepcopy(loaded)
    for prof in out:
        for name, st in prof["stages"].items():
            t = threads.get((prof["pipeline"], name), 1)
            pts = stage_points(raw.get(prof["pipeline"], {}).get("stages", {}).get(name, {}), t) if t != 1 else []
            if pts:
                st["points"] = [{"batch": p["batch"], "mean_ms": p["mean_ms"], "p99_ms": p["p99_ms"]} for p in pts]
    return out


# --- printing -----------------------------------------------------------------------------------

def format_plan(plan: Plan) -> str:
    """The plan as `slipstream plan` prints it: a table per pipeline, the why."""
    out = []
    inv = plan.inventory
    where = f"{inv['cores']:g} cores" if "cores" in inv else f"{len(inv.get('gpus', []))} GPUs"
    if "gpus" in inv and "cores" in inv:
        where = f"{len(inv['gpus'])} GPUs and {inv['cores']:g} cores"
    if "gpu_nodes" in inv:
        count = len(set(inv["gpu_nodes"]) | set(inv.get("cpu_nodes", {})))
        where += (f" on {count} nodes ({inv.get('network_ms', 0):g} ms per hop between them)")
    if "nodes" in inv:
        where = (f"{len(inv['nodes'])} nodes ({inv['cores']:g} cores; "
                 f"{inv.get('network_ms', 0):g} ms per hop between them)")
    out.append(f"plan for {plan.app or 'app'} on {where} (solved in {plan.solve_ms:,.0f} ms)")
    for name, pp in plan.pipelines.items():
        pred = pp.predicted
        p = (f"; SLO model at {pred['offered_rps']:,.0f} req/s: p99 {pred['p99_ms']:.1f} ms, misses "
             f"{100 * pred['miss_rate']:.2f}%") if pred else ""
        mx = f" (max plan {pp.max_capacity_rps:,.0f})" if pp.max_capacity_rps is not None else ""
        out.append(f"\n{name}: capacity {pp.capacity_rps:,.0f} req/s{mx}, target {pp.target_rps:,.0f} req/s{p}")
        out.append(f"  {'stage':<18}{'replicas':>9}{'max':>5}{'threads':>8}{'batch':>7}{'throughput/s':>14}  placement")
        for s, sp in pp.stages.items():
            place = ""
            if sp.nodes is not None:
                place = " ".join(f"{k}:{c}" for k, c in sorted(sp.nodes.items()))
            elif sp.placement:
                place = " ".join(f"gpu{q['gpu']}:{q['slice']}" for q in sp.placement[:6])
                place += f" (+{len(sp.placement) - 6})" if len(sp.placement) > 6 else ""
            out.append(f"  {s:<18}{sp.replicas:>9}{sp.max_replicas:>5}{sp.threads:>8}{sp.max_batch_size:>7}"
                       f"{sp.throughput_rps:>14,.0f}  {place}")
        out.append("  why:")
        out.extend(f"    - {line}" for line in pp.why)
    if "gpus" in inv:
        out.append("\nGPUs:")
        for g in inv["gpus"]:
            cells = ", ".join(f"{sl}={st or 'idle'}" for sl, st in zip(g["layout"], g["stages"], strict=True))
            node = f"{g['node']:<10} " if "node" in g else ""
            out.append(f"  gpu{g['id']:<3} {node}{g['model']:<10} {cells}")
    return "\n".join(out)
