"""The planner: replicas, threads and a batch limit per stage, chosen so that
the pipelines' throughput is as high as the hardware allows within their SLOs.

`slipstream plan app.py` reads the latency profiles and a device inventory
(this machine's cores, or GPUs with their MIG layouts) and solves an integer
program with HiGHS. The objective is the Vortex formulation ("Vortex: Hosting
ML Inference and Knowledge Retrieval Services With Tight Latency and
Throughput Requirements", arXiv 2511.02062): maximise the smallest stage
throughput, then, with that one held, the next smallest, and so on
(lexicographic max-min). A pipeline runs at the rate of its slowest stage, so
the first level is the pipeline's capacity; the later levels give what is
left over (cores, GPU slices) to the next bottleneck as headroom instead of
leaving it idle or piling it on a stage that is already fast. With several
pipelines the first levels are the pipelines' rates, so none is starved.

Why an integer program: replica counts, a stage's one thread count and one
batch limit, and a GPU's one MIG layout are discrete choices that interact
through shared budgets (cores, slices, the SLO along a path); greedy rules
get the corners wrong (a stage bounded at 2 replicas wants 2 threads; a 10 GB
model does not fit a 6 GB slice) and the problems are small enough to solve
exactly in milliseconds.

The CPU model (one machine, ``C`` cores). Option ``o = (t threads, b batch)``
of stage ``s``, from its profile: one replica serves ``mu = b / (L(b,t) +
batch_cpu)`` requests/s when busy and costs ``cpu = (t L(b,t) + batch_cpu) /
b`` core-seconds per request (``L`` the profiled mean, ``batch_cpu`` the
per-batch work outside the component, from the calibration or the SLO
model's defaults). Variables: ``y[s,o]`` (binary: the stage's one option),
``n[s,o]`` replicas (integer), ``x[s,o]`` the throughput given to them
(``x <= mu n``), the stage throughput ``T_s = sum_o x``, the pipeline rate
``X_p <= T_s / demand_s``. The cores are time-shared: work, not replicas,
uses them, so ``sum cpu x + node_cpu sum X_p <= C`` (``node_cpu``: the node's
and the load generator's CPU per request), and replicas may outnumber cores,
up to ``sum t n <= 2C``: beyond that extra processes buy no throughput and
only add preemption (the SLO model's contention), and a cap keeps the
program bounded. ``T_s`` above ``X_p`` is headroom with CPU set aside for it.

The SLO rule. A batch limit is allowed only if every path through the DAG
fits: ``sum over the path of (q p99(b) + hop) + ingress <= SLO`` with ``q =
2`` (a request may wait for the batch ahead of it, then its own). It is a
linear constraint on the ``y``s (a longest-path potential per stage). The
rule is necessary, not sufficient, so the chosen plan is then run through
the SLO model (`slo.predict`: the discrete-event simulation of the node's
own policies) at 90% of its capacity, or at ``--rate``; if the model says the
SLO does not hold, the target is lowered until it does (and, failing that,
``q`` raised so that smaller batches are chosen), and the plan says so.

With ``--rate R`` the planner also finds the cheapest plan (fewest replica
threads, hence cores) that holds ``R``: ``replicas`` is what ``R`` needs and
``max_replicas`` what the machine's max plan has, so the autoscaler can grow
into it.

The GPU model. Each GPU takes one MIG layout (or none: the whole GPU).
GPUs of a model are identical, so the program counts GPUs per layout
(``g[m,l]``) rather than choosing a layout per GPU (12 GPUs x 4 layouts would
be 48 binaries with 12! symmetric solutions; aggregated it is 4 integers)
and unpacks the counts to GPU ids deterministically afterwards. ``r[s,k]``
replicas of stage ``s`` on slice type ``k`` (integer, only where the stage's
memory fits the slice; one replica per slice), ``sum_s r[s,k] <= slices of
type k``; ``T_s = sum_k mu[s,k] r[s,k]`` from the stage's GPU profile
(throughput by compute fraction of the GPU). Same objective, same path rule
(a stage's latency is that of the slowest slice type it uses).

Pure functions: no I/O but reading the files passed in; `slipstream plan`
(cli.py) prints and writes.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slipstream._internal.api import Component, Pipeline
from slipstream._internal.errors import ConfigError

INF = float("inf")
#: Relative slack with which a level's optimum is held while later levels solve.
EPS = 1e-4
#: A later level counts as higher only by this much: less is the slack of the
#: levels held before it, not spare capacity worth a replica.
RISE = 1e-3
#: The last solve (fewest replicas) holds every level this much below its
#: optimum, so that no level's few-ppm excess over a replica's exact capacity
#: costs a whole replica.
FINAL_SLACK = 2e-3
#: The SLO path rule budgets this many batch p99s per stage (queueing room).
QUEUE_FACTOR = 2.0
#: A plan is checked by the SLO model at this share of its capacity.
TARGET_LOAD = 0.9
#: Replica threads may exceed the cores by this factor (time-sharing).
OVERSUBSCRIBE = 2.0
TOL = 1e-6
Key = tuple[str, str]  # (pipeline, stage)


# --- a small MILP builder over HiGHS -------------------------------------------------

class _Infeasible(Exception):
    pass


_HIGHS_STARTED = False


def _highs() -> Any:
    """A silent HiGHS instance. HiGHS prints a banner on fd 1 when a process
    makes its first instance, before output can be turned off; `slipstream
    plan --json` must print JSON only, so fd 1 points at /dev/null meanwhile."""
    global _HIGHS_STARTED
    import highspy

    if _HIGHS_STARTED:
        h = highspy.Highs()
    else:
        sys.stdout.flush()
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 1)
            h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(null)
        _HIGHS_STARTED = True
    h.setOptionValue("output_flag", False)
    return h


class _Model:
    """Columns with bounds, rows as sparse dicts; each solve builds a fresh
    HiGHS model (the programs are small; levels add and drop rows)."""

    def __init__(self, time_limit_s: float) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.is_int: list[bool] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []
        self.time_limit_s = time_limit_s
        self.timed_out = False
        self.solves = 0
        self.holds: list[tuple[int, float]] = []  # (row, level) held by `_lex_maxmin`

    def relax_holds(self) -> None:
        """Hold the levels with FINAL_SLACK before the last solve."""
        for i, level in self.holds:
            coeffs, _, hi = self.rows[i]
            self.rows[i] = (coeffs, level * (1 - FINAL_SLACK) - TOL, hi)

    def var(self, lb: float = 0.0, ub: float = INF, integer: bool = False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.is_int.append(integer)
        return len(self.lb) - 1

    def row(self, coeffs: Mapping[int, float], lo: float = -INF, hi: float = INF) -> None:
        merged: dict[int, float] = {}
        for k, v in coeffs.items():
            merged[k] = merged.get(k, 0.0) + v
        self.rows.append(({k: v for k, v in merged.items() if v != 0.0}, lo, hi))

    def solve(self, objective: Mapping[int, float], maximize: bool) -> list[float]:
        import highspy

        h = _highs()
        n = len(self.lb)
        idx = np.arange(n, dtype=np.int32)
        h.addVars(n, np.array(self.lb, dtype=np.float64), np.array(self.ub, dtype=np.float64))
        cost = np.zeros(n)
        for k, v in objective.items():
            cost[k] += v
        h.changeColsCost(n, idx, cost)
        ints = np.array([i for i, f in enumerate(self.is_int) if f], dtype=np.int32)
        if len(ints):
            h.changeColsIntegrality(len(ints), ints, np.array([highspy.HighsVarType.kInteger] * len(ints)))
        starts: list[int] = []
        index: list[int] = []
        values: list[float] = []
        for coeffs, _, _ in self.rows:
            starts.append(len(index))
            index.extend(coeffs)
            values.extend(coeffs.values())
        h.addRows(len(self.rows), np.array([r[1] for r in self.rows], dtype=np.float64),
                  np.array([r[2] for r in self.rows], dtype=np.float64), len(index),
                  np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32),
                  np.array(values, dtype=np.float64))
        h.changeObjectiveSense(highspy.ObjSense.kMaximize if maximize else highspy.ObjSense.kMinimize)
        h.setOptionValue("time_limit", float(self.time_limit_s))
        h.setOptionValue("mip_rel_gap", 1e-6)
        h.setOptionValue("random_seed", 0)
        h.run()
        self.solves += 1
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kOptimal:
            return list(h.getSolution().col_value)
        if h.getInfo().primal_solution_status == 2:  # feasible, stopped by the time limit
            self.timed_out = True
            return list(h.getSolution().col_value)
        raise _Infeasible(h.modelStatusToString(status))


def _val(expr: Mapping[int, float], sol: Sequence[float]) -> float:
    return sum(c * sol[k] for k, c in expr.items())


def _lex_maxmin(m: _Model, entities: Mapping[Any, dict[int, float]]) -> tuple[list[float], list[tuple[float, list[Any]]]]:
    """Lexicographic max-min over linear expressions: maximise the smallest,
    hold the ones that cannot rise above it (each checked by maximising it
    alone with the others held at the level), repeat with the rest. Rows
    holding each level stay in `m` for whatever is solved next."""
    free = dict(entities)
    levels: list[tuple[float, list[Any]]] = []
    sol: list[float] = []
    prev = 0.0
    while free:
        mark = len(m.rows)
        z = m.var()
        for expr in free.values():
            m.row({**expr, z: -1.0}, lo=0.0)
        sol = m.solve({z: 1.0}, maximize=True)
        level = sol[z] if sol[z] > prev * (1 + RISE) + TOL else prev
        prev = level
        del m.rows[mark:]
        m.ub[z] = 0.0
        floor = level * (1 - EPS) - TOL
        at_min = [k for k, e in free.items() if _val(e, sol) <= level * (1 + RISE) + TOL]
        if not at_min:
            at_min = [min(free, key=lambda k: _val(free[k], sol))]
        blocked = at_min if len(free) == 1 else [k for k in at_min if not _can_rise(m, free, k, floor, level)]
        held = blocked or at_min
        for k in held:
            m.row(free.pop(k), lo=floor)
            m.holds.append((len(m.rows) - 1, level))
        levels.append((level, held))
    return sol, levels


def _can_rise(m: _Model, free: Mapping[Any, dict[int, float]], key: Any, floor: float, level: float) -> bool:
    mark = len(m.rows)
    for k, e in free.items():
        if k != key:
            m.row(e, lo=floor)
    try:
        sol = m.solve(free[key], maximize=True)
    finally:
        del m.rows[mark:]
    return _val(free[key], sol) > level * (1 + RISE) + TOL


def _path_rule(m: _Model, stages: Sequence[_StageBase], lat: Mapping[Key, dict[int, float]],
               budget_ms: Mapping[str, float | None]) -> None:
    """For every path, the sum of its stages' latency budgets fits the SLO:
    a potential F per stage, F_s >= F_parent + L_s, F_s <= budget."""
    pot = {s.key: m.var() for s in stages}
    for s in stages:
        budget = budget_ms.get(s.pipeline)
        if budget is None:
            continue
        parents: list[str | None] = list(s.parents) or [None]
        for p in parents:
            coeffs = {pot[s.key]: 1.0}
            for v, ms in lat[s.key].items():
                coeffs[v] = coeffs.get(v, 0.0) - ms
            if p is not None:
                coeffs[pot[(s.pipeline, p)]] = -1.0
            m.row(coeffs, lo=0.0)
        m.row({pot[s.key]: 1.0}, hi=budget)


# --- the plan --------------------------------------------------------------------------

@dataclass
class StagePlan:
    replicas: int
    max_replicas: int
    threads: int
    max_batch_size: int
    throughput_rps: float
    placement: list[dict[str, Any]] | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"replicas": self.replicas, "max_replicas": self.max_replicas, "threads": self.threads,
                             "max_batch_size": self.max_batch_size, "throughput_rps": round(self.throughput_rps, 2)}
        if self.placement is not None:
            d["placement"] = self.placement
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
                                       throughput_rps=float(v.get("throughput_rps", 0.0)), placement=v.get("placement"))
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


def with_components(pipe: Pipeline, comps: Mapping[str, Component]) -> Pipeline:
    """A copy of `pipe` whose stages named in `comps` are replaced."""
    g = copy.copy(pipe.graph)
    g.nodes = {n: comps.get(n, c) for n, c in pipe.graph.nodes.items()}
    p = copy.copy(pipe)
    p.graph = g
    return p


def _configured(comp: Component, sp: StagePlan) -> Component:
    replicas: int | tuple[int, int] = (sp.replicas, sp.max_replicas) if sp.max_replicas > sp.replicas \
        else sp.replicas
    return comp.options(replicas=replicas, threads=sp.threads, max_batch_size=sp.max_batch_size)


def apply_plan(pipelines: Sequence[Pipeline], plan: Plan) -> list[Pipeline]:
    """The pipelines with the plan's replicas, threads and batch limits.
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
        out.append(with_components(p, {s: _configured(p.stage(s), sp) for s, sp in planned.stages.items()}))
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


# --- stages and options ------------------------------------------------------------------

@dataclass
class _StageBase:
    pipeline: str
    name: str
    parents: list[str]
    lo: int
    hi: int
    bounded: bool
    demand: float

    @property
    def key(self) -> Key:
        return (self.pipeline, self.name)


@dataclass(frozen=True)
class _Opt:
    threads: int
    batch: int
    mean_ms: float
    p99_ms: float
    mu: float     # requests/s of one busy replica
    cpu_s: float  # core-seconds per request


@dataclass
class _CpuStage(_StageBase):
    opts: list[_Opt] = field(default_factory=list)


def _topo(pipe: Pipeline) -> list[str]:
    order: list[str] = []
    while len(order) < len(pipe.graph.nodes):
        for n in pipe.graph.nodes:
            if n not in order and all(p in order for p in pipe.graph.parents(n)):
                order.append(n)
    return order


def _bounds(comp: Component, cap: int) -> tuple[int, int, bool]:
    """Declared (lo, hi) bounds are kept; a fixed count is the author's
    default, which the planner replaces (within 1..cap)."""
    if comp.autoscaled:
        return comp.min_replicas, comp.max_replicas, True
    return 1, max(1, cap), False


def _cpu_stages(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]], cores: float,
                batch_cpu_us: float) -> list[_CpuStage]:
    max_threads = max(1, int(math.floor(cores + TOL)))
    cap = max(1, int(math.floor(OVERSUBSCRIBE * cores + TOL)))
    stages = []
    for pipe in pipelines:
        prof = profiles.get(pipe.name)
        if prof is None:
            raise ConfigError(f"no profile for pipeline {pipe.name!r}: run `slipstream profile` first")
        for name in _topo(pipe):
            comp = pipe.stage(name)
            sp = prof["stages"].get(name)
            if sp is None:
                raise ConfigError(f"the profile of {pipe.name!r} lacks stage {name!r}: profile again")
            thread_counts = sorted({1, *(int(t) for t in sp.get("by_threads", {}))})
            opts = []
            for t in thread_counts:
                if t > max_threads:
                    continue
                for pt in stage_points(sp, t):
                    b = int(pt["batch"])
                    if b > comp.max_batch_size:
                        continue
                    busy_s = float(pt["mean_ms"]) / 1e3 + batch_cpu_us / 1e6
                    opts.append(_Opt(t, b, float(pt["mean_ms"]), float(pt["p99_ms"]), b / busy_s,
                                     (t * float(pt["mean_ms"]) / 1e3 + batch_cpu_us / 1e6) / b))
            if not opts:
                raise ConfigError(f"{pipe.name}/{name}: the profile has no point at or under max_batch_size "
                                  f"{comp.max_batch_size}: profile again")
            lo, hi, bounded = _bounds(comp, cap)
            stages.append(_CpuStage(pipe.name, name, pipe.graph.parents(name), lo, hi, bounded, 1.0, opts))
    return stages


# --- the CPU program -----------------------------------------------------------------------

@dataclass
class _CpuVars:
    m: _Model
    y: dict[tuple[Key, int], int]
    n: dict[tuple[Key, int], int]
    x: dict[tuple[Key, int], int]
    rate: dict[str, int]
    cpu: dict[int, float]
    threads: dict[int, float]

    def stage_tput(self, s: _StageBase) -> dict[int, float]:
        return {v: 1.0 / s.demand for (k, _), v in self.x.items() if k == s.key}


@dataclass
class _Costs:
    cores: float
    node_cpu_s: float
    hop_ms: float
    ingress_ms: float
    slo_ms: dict[str, float | None]


def _cpu_program(stages: Sequence[_CpuStage], costs: _Costs, q: float, time_limit_s: float,
                 only: Mapping[Key, _Opt] | None = None, n_max: Mapping[Key, int] | None = None) -> _CpuVars:
    m = _Model(time_limit_s)
    v = _CpuVars(m, {}, {}, {}, {}, {}, {})
    lat: dict[Key, dict[int, float]] = {}
    for s in stages:
        hi = min(s.hi, n_max[s.key]) if n_max else s.hi
        lat[s.key] = {}
        ys, ns = {}, {}
        for i, o in enumerate(s.opts):
            if only is not None and o != only[s.key]:
                continue
            ys[i] = v.y[(s.key, i)] = m.var(0, 1, integer=True)
            ns[i] = v.n[(s.key, i)] = m.var(0, hi, integer=True)
            x = v.x[(s.key, i)] = m.var()
            m.row({ns[i]: 1.0, ys[i]: -float(hi)}, hi=0.0)   # n <= hi * y
            m.row({x: 1.0, ns[i]: -o.mu}, hi=0.0)                   # x <= mu * n
            v.cpu[x] = o.cpu_s
            v.threads[ns[i]] = float(o.threads)
            lat[s.key][ys[i]] = q * o.p99_ms + costs.hop_ms
        m.row(dict.fromkeys(ys.values(), 1.0), lo=1.0, hi=1.0)        # one option per stage
        m.row(dict.fromkeys(ns.values(), 1.0), lo=float(s.lo), hi=float(hi))
    for p in dict.fromkeys(s.pipeline for s in stages):
        v.rate[p] = m.var()
        v.cpu[v.rate[p]] = costs.node_cpu_s
        for s in stages:
            if s.pipeline == p:
                m.row({**v.stage_tput(s), v.rate[p]: -1.0}, lo=0.0)   # X_p <= T_s / demand
    m.row(v.cpu, hi=costs.cores)
    m.row(v.threads, hi=max(OVERSUBSCRIBE * costs.cores, float(sum(s.lo for s in stages))))
    budget = {p: (None if b is None else b - costs.ingress_ms) for p, b in costs.slo_ms.items()}
    _path_rule(m, stages, lat, budget)
    return v


@dataclass
class _CpuSolution:
    opt: dict[Key, _Opt]
    n: dict[Key, int]
    tput: dict[Key, float]
    rate: dict[str, float]
    cpu_used: float
    threads_used: int
    levels: list[tuple[float, list[Any]]]
    timed_out: bool = False


def _read_cpu(stages: Sequence[_CpuStage], v: _CpuVars, sol: list[float],
              levels: list[tuple[float, list[Any]]]) -> _CpuSolution:
    # Rates and throughputs are the levels' optima (the last solve holds them
    # with some slack); what no level held is read from the solution.
    held = {k: level for level, keys in levels for k in keys}
    out = _CpuSolution({}, {}, {}, {p: held.get(p, sol[x]) for p, x in v.rate.items()}, _val(v.cpu, sol), 0,
                       levels)
    for s in stages:
        for i, o in enumerate(s.opts):
            y = v.y.get((s.key, i))
            if y is not None and sol[y] > 0.5:
                out.opt[s.key] = o
                out.n[s.key] = int(round(sol[v.n[(s.key, i)]]))
                out.tput[s.key] = held.get(s.key, min(sol[v.x[(s.key, i)]], o.mu * out.n[s.key]) / s.demand)
        out.threads_used += out.n[s.key] * out.opt[s.key].threads
    out.timed_out = v.m.timed_out
    out.cpu_used = sum(out.tput[s.key] * s.demand * out.opt[s.key].cpu_s for s in stages) \
        + sum(r * v.cpu[v.rate[p]] for p, r in out.rate.items())
    return out


def _solve_cpu_max(stages: Sequence[_CpuStage], costs: _Costs, q: float, time_limit_s: float,
                   only: Mapping[Key, _Opt] | None = None, n_max: Mapping[Key, int] | None = None) -> _CpuSolution:
    """Lexicographic max-min: pipeline rates first, then stage throughputs;
    then, everything held, the fewest replica threads."""
    v = _cpu_program(stages, costs, q, time_limit_s, only, n_max)
    _, levels = _lex_maxmin(v.m, {p: {x: 1.0} for p, x in v.rate.items()})
    _, stage_levels = _lex_maxmin(v.m, {s.key: v.stage_tput(s) for s in stages})
    v.m.relax_holds()
    sol = v.m.solve(v.threads, maximize=False)
    return _read_cpu(stages, v, sol, levels + stage_levels)


def _solve_cpu_rate(stages: Sequence[_CpuStage], costs: _Costs, q: float, time_limit_s: float,
                    need: Mapping[str, float], best: _CpuSolution) -> _CpuSolution:
    """The fewest replica threads whose capacity covers `need` per pipeline,
    with the max plan's options and at most its replica counts."""
    v = _cpu_program(stages, costs, q, time_limit_s, only=best.opt, n_max=best.n)
    for p, r in need.items():
        v.m.row({v.rate[p]: 1.0}, lo=min(r, best.rate[p] * (1 - EPS)))
    sol = v.m.solve(v.threads, maximize=False)
    return _read_cpu(stages, v, sol, [])


# --- checking with the SLO model ----------------------------------------------------------

def _planned_pipe(pipe: Pipeline, sol: _CpuSolution) -> Pipeline:
    comps = {n: c.options(replicas=sol.n[(pipe.name, n)], threads=sol.opt[(pipe.name, n)].threads,
                          max_batch_size=sol.opt[(pipe.name, n)].batch)
             for n, c in pipe.graph.nodes.items()}
    return with_components(pipe, comps)


def _prof_view(pipe: Pipeline, prof: Mapping[str, Any], sol: _CpuSolution) -> dict[str, Any]:
    """The profile as the SLO model reads it, at each stage's planned thread count."""
    return {"pipeline": pipe.name,
            "stages": {n: {"points": stage_points(prof["stages"][n], sol.opt[(pipe.name, n)].threads)}
                       for n in pipe.graph.nodes}}


def _predict(pipe: Pipeline, prof: Mapping[str, Any], sol: _CpuSolution, rate: float, cores: float,
             overheads: Mapping[str, Any], sim_s: float) -> dict[str, Any]:
    from slipstream._internal import slo

    planned = _planned_pipe(pipe, sol)
    kw = {k: v for k, v in overheads.items() if k in ("hop_us", "batch_cpu_us", "ingress_us", "cpu_per_request_us",
                                                          "external_us")}
    r: dict[str, Any] = slo.predict(planned, _prof_view(pipe, prof, sol), [rate], cores=cores, duration_s=sim_s,
                                    **kw)[0]
    return r


def _holds(r: Mapping[str, Any], pipe: Pipeline) -> bool:
    assert pipe.slo is not None
    return bool(r["answered"] > 0 and r["p99_ms"] <= pipe.slo.p99_ms and r["miss_rate"] <= pipe.slo.max_miss_rate)


def _pipe_cores(stages: Sequence[_CpuStage], sol: _CpuSolution, costs: _Costs, pipe: str) -> float:
    """The cores a pipeline's simulation gets: all of them for one pipeline;
    with several, its share of the CPU the plan sets aside."""
    if len(sol.rate) == 1:
        return costs.cores
    mine = sum(sol.tput[s.key] * s.demand * sol.opt[s.key].cpu_s for s in stages if s.pipeline == pipe)
    mine += sol.rate[pipe] * costs.node_cpu_s
    return max(costs.cores * mine / max(sol.cpu_used, TOL), 0.1)


LADDER = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


def _target(pipe: Pipeline, prof: Mapping[str, Any], sol: _CpuSolution, cores: float,
            overheads: Mapping[str, Any], sim_s: float) -> tuple[float, dict[str, Any] | None, list[str]]:
    """The highest rung of the ladder (share of capacity) at which the SLO
    model says the SLO holds."""
    cap = sol.rate[pipe.name]
    if pipe.slo is None:
        return TARGET_LOAD * cap, None, ["no SLO declared: target is 90% of capacity, unchecked"]
    first: dict[str, Any] | None = None
    for f in LADDER:
        r = _predict(pipe, prof, sol, f * cap, cores, overheads, sim_s)
        first = first or r
        if _holds(r, pipe):
            note = [] if f == LADDER[0] else [
                f"the SLO model says 90% of capacity ({0.9 * cap:,.0f} req/s) misses the SLO (p99 "
                f"{first['p99_ms']:.1f} ms, misses {100 * first['miss_rate']:.2f}%): target lowered to "
                f"{f:.0%} of capacity"]
            return f * cap, r, note
    return 0.0, first, []


# --- the CPU planner --------------------------------------------------------------------------

def _costs(pipelines: Sequence[Pipeline], cores: float, overheads: Mapping[str, Any]) -> _Costs:
    return _Costs(cores=float(cores), node_cpu_s=float(overheads.get("cpu_per_request_us", 60.0)) / 1e6,
                  hop_ms=float(overheads.get("hop_us", 300.0)) / 1e3,
                  ingress_ms=float(overheads.get("ingress_us", 400.0)) / 1e3,
                  slo_ms={p.name: (p.slo.p99_ms if p.slo else None) for p in pipelines})


def _solve_max_checked(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]],
                       stages: list[_CpuStage], costs: _Costs, overheads: Mapping[str, Any], check_slo: bool,
                       sim_s: float, time_limit_s: float) -> tuple[_CpuSolution, float, dict[str, Any]]:
    """The max plan, with targets the SLO model accepts: if no rung holds for
    some pipeline, raise q (smaller batches) and solve again."""
    notes: dict[str, Any] = {}
    sol: _CpuSolution | None = None
    used = QUEUE_FACTOR
    for q in (QUEUE_FACTOR, 3.0, 4.0):
        try:
            attempt = _solve_cpu_max(stages, costs, q, time_limit_s)
        except _Infeasible:
            if sol is not None:
                break
            raise _no_plan(stages, costs, q) from None
        sol, used = attempt, q
        notes = {}
        ok = True
        for pipe in pipelines:
            if not check_slo:
                notes[pipe.name] = (TARGET_LOAD * sol.rate[pipe.name], None, ["SLO model check skipped"])
                continue
            cores = _pipe_cores(stages, sol, costs, pipe.name)
            tgt, pred, why = _target(pipe, profiles[pipe.name], sol, cores, overheads, sim_s)
            if q != QUEUE_FACTOR:
                why.insert(0, f"batch limits chosen with {q:g} x p99 per stage (2 x p99 held nowhere on the ladder)")
            notes[pipe.name] = (tgt, pred, why)
            ok = ok and (pipe.slo is None or tgt > 0)
        if ok:
            break
    assert sol is not None
    return sol, used, notes


def _no_plan(stages: Sequence[_CpuStage], costs: _Costs, q: float) -> ConfigError:
    worst = []
    for s in stages:
        slo_ms = costs.slo_ms.get(s.pipeline)
        best = min(q * o.p99_ms + costs.hop_ms for o in s.opts)
        worst.append(f"{s.pipeline}/{s.name} >= {best:.1f} ms" + (f" (SLO {slo_ms:g} ms)" if slo_ms else ""))
    return ConfigError("no plan satisfies the SLO path rule (each stage budgets "
                       f"{q:g} x its batch p99 + {costs.hop_ms:.1f} ms hop, plus {costs.ingress_ms:.1f} ms ingress) "
                       f"with the declared replica bounds on {costs.cores:g} cores: " + "; ".join(worst))


def plan_cpu(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]], *, cores: float,
             overheads: Mapping[str, Any] | None = None, rate: float | None = None, app: str = "",
             check_slo: bool = True, sim_duration_s: float = 10.0, time_limit_s: float = 20.0) -> Plan:
    """Plan `pipelines` on one machine of `cores` cores (see the module doc).
    `profiles` maps a pipeline's name to its profile (`slo.load_profile_for`);
    `overheads` are the SLO model's (calibration or `slo.DEFAULTS`)."""
    from slipstream._internal import slo

    t0 = time.perf_counter()
    over = dict(slo.DEFAULTS) | dict(overheads or {})
    costs = _costs(pipelines, cores, over)
    stages = _cpu_stages(pipelines, profiles, cores, float(over["batch_cpu_us"]))
    best, q, notes = _solve_max_checked(pipelines, profiles, stages, costs, over, check_slo, sim_duration_s,
                                        time_limit_s)
    chosen = best
    rate_notes: dict[str, list[str]] = {p.name: [] for p in pipelines}
    if rate is not None:
        chosen, rate_notes, notes = _rate_plan(pipelines, profiles, stages, costs, over, q, best, notes, rate,
                                               check_slo, sim_duration_s, time_limit_s)
    out: dict[str, PipelinePlan] = {}
    for pipe in pipelines:
        tgt, pred, why = notes[pipe.name]
        sts = {n: StagePlan(replicas=chosen.n[(pipe.name, n)], max_replicas=max(best.n[(pipe.name, n)],
                                                                               chosen.n[(pipe.name, n)]),
                            threads=best.opt[(pipe.name, n)].threads, max_batch_size=best.opt[(pipe.name, n)].batch,
                            throughput_rps=chosen.tput[(pipe.name, n)])
               for n in _topo(pipe)}
        out[pipe.name] = PipelinePlan(
            capacity_rps=chosen.rate[pipe.name],
            target_rps=tgt, stages=sts, predicted=_pred_json(pred),
            why=[("max plan: " if rate is not None else "") + line for line in _why_cpu(pipe, stages, best, costs, q)]
            + why + rate_notes[pipe.name] + _timed_out(best.timed_out or chosen.timed_out),
            max_capacity_rps=best.rate[pipe.name] if rate is not None else None)
    plan = Plan(app=app, inventory={"cores": cores}, pipelines=out, solve_ms=(time.perf_counter() - t0) * 1e3)
    return plan


def _timed_out(flag: bool) -> list[str]:
    return ["the solver hit its time limit: the plan is feasible but may not be optimal"] if flag else []


def _pred_json(r: Mapping[str, Any] | None) -> dict[str, float] | None:
    if r is None:
        return None
    return {"p50_ms": round(float(r["p50_ms"]), 3), "p99_ms": round(float(r["p99_ms"]), 3),
            "miss_rate": round(float(r["miss_rate"]), 5), "offered_rps": round(float(r["offered_rps"]), 2)}


def _rate_plan(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]], stages: list[_CpuStage],
               costs: _Costs, over: Mapping[str, Any], q: float, best: _CpuSolution, notes: dict[str, Any],
               rate: float, check_slo: bool, sim_s: float,
               time_limit_s: float) -> tuple[_CpuSolution, dict[str, list[str]], dict[str, Any]]:
    """The cheapest plan holding `rate`: provision for rate / load, with the
    load lowered from 90% until the SLO model says the SLO holds at `rate`
    (or the max plan is reached)."""
    out_notes: dict[str, list[str]] = {p.name: [] for p in pipelines}
    new_notes = dict(notes)
    beyond = [p.name for p in pipelines if rate > max(notes[p.name][0], TOL) * (1 + EPS)]
    sol = best
    preds: dict[str, dict[str, Any]] = {}
    for load in (TARGET_LOAD, 0.8, 0.7, 0.6, 0.5):
        sol = _solve_cpu_rate(stages, costs, q, time_limit_s, {p.name: rate / load for p in pipelines}, best)
        if not check_slo:
            break
        preds = {p.name: _predict(p, profiles[p.name], sol, rate, _pipe_cores(stages, sol, costs, p.name), over, sim_s)
                 for p in pipelines if p.slo is not None}
        if all(_holds(preds[p.name], p) for p in pipelines if p.slo is not None) or sol.n == best.n:
            break
    # What the started replicas can do on this machine (their capacity, not the rate asked for).
    cap = _solve_cpu_max(stages, costs, q, time_limit_s, only=best.opt, n_max=sol.n)
    sol = _CpuSolution(sol.opt, sol.n, cap.tput, cap.rate, cap.cpu_used, sol.threads_used, [])
    for p in pipelines:
        mine = [s for s in stages if s.pipeline == p.name]
        cores_needed = rate * (sum(s.demand * sol.opt[s.key].cpu_s for s in mine) + costs.node_cpu_s)
        pred = preds.get(p.name)
        counts = ", ".join(f"{s.name} {sol.n[s.key]}" for s in mine)
        out_notes[p.name].append(f"--rate {rate:,.0f} req/s needs ~{cores_needed:.2f} cores of compute: replicas "
                                 f"{counts}; max_replicas is the max plan's, for the autoscaler to grow into")
        if p.name in beyond:
            out_notes[p.name].append(f"{rate:,.0f} req/s is beyond what this machine holds within the SLO "
                                     f"(max plan: {notes[p.name][0]:,.0f} req/s): planned at the max")
        elif pred is not None and not _holds(pred, p):
            out_notes[p.name].append(f"the SLO model says even this provision misses at {rate:,.0f} req/s "
                                     f"(p99 {pred['p99_ms']:.1f} ms)")
        new_notes[p.name] = (rate, pred, [f"max plan: {line}" for line in notes[p.name][2]])
    return sol, out_notes, new_notes


def _why_cpu(pipe: Pipeline, stages: Sequence[_CpuStage], sol: _CpuSolution, costs: _Costs, q: float) -> list[str]:
    mine = [s for s in stages if s.pipeline == pipe.name]
    cap = sol.rate[pipe.name]
    low = min(sol.tput[s.key] for s in mine)
    neck = [s for s in mine if sol.tput[s.key] <= low * (1 + 1e-3) + TOL]
    lines = []
    if sol.cpu_used >= costs.cores * (1 - 1e-3):
        per = ", ".join(f"{s.name} {sol.opt[s.key].cpu_s * 1e6:,.0f}" for s in mine)
        heavy = max(mine, key=lambda s: sol.opt[s.key].cpu_s * s.demand)
        lines.append(f"bottleneck: the cores: all {costs.cores:g} are used at {cap:,.0f} req/s (us CPU per request: "
                     f"{per}, node {costs.node_cpu_s * 1e6:,.0f}); the heaviest stage is {heavy.name}")
        neck = mine
    else:
        lines.append(f"capacity {cap:,.0f} req/s; {costs.cores - sol.cpu_used:.2f} of {costs.cores:g} cores unused")
    for s in neck:
        o = sol.opt[s.key]
        lines.append(f"{s.name}: {sol.n[s.key]} replica(s) x {o.threads} thread(s), batch <= {o.batch}: "
                     f"{o.mu:,.0f} req/s per busy replica, {o.cpu_s * 1e6:,.0f} us CPU per request")
        if sol.n[s.key] >= s.hi and s.bounded:
            lines.append(f"binding: replicas bound: {s.name} is at its declared max_replicas {s.hi}")
        bigger = [b for b in s.opts if b.threads == o.threads and b.batch > o.batch and b.cpu_s < o.cpu_s]
        if bigger and costs.slo_ms.get(s.pipeline) is not None and _breaks_path(mine, sol, costs, q, s, bigger):
            b = min(bigger, key=lambda b: b.batch)
            lines.append(f"binding: SLO batch limit: {s.name} at batch {b.batch} (p99 {b.p99_ms:.1f} ms) breaks "
                         f"the path rule ({q:g} x p99 + hop per stage <= {costs.slo_ms[s.pipeline]:g} ms)")
    if sol.threads_used >= OVERSUBSCRIBE * costs.cores * (1 - 1e-3):
        lines.append(f"binding: replica threads at the cap ({OVERSUBSCRIBE:g} x {costs.cores:g} cores)")
    rest = [s for s in mine if sol.tput[s.key] > low * (1 + 1e-3) + TOL]
    if rest:
        lines.append("headroom (spare capacity given to the next bottlenecks): "
                     + ", ".join(f"{s.name} {sol.tput[s.key]:,.0f} req/s" for s in rest))
    for s in mine:
        if s.bounded:
            lines.append(f"{s.name}: declared replicas ({s.lo}, {s.hi}) respected")
    return lines


def _breaks_path(mine: Sequence[_CpuStage], sol: _CpuSolution, costs: _Costs, q: float, stage: _CpuStage,
                 bigger: Sequence[_Opt]) -> bool:
    """Whether the next bigger batch of `stage` breaks the SLO path rule."""
    b = min(bigger, key=lambda o: o.batch)
    lat = {s.name: q * (b if s is stage else sol.opt[s.key]).p99_ms + costs.hop_ms for s in mine}
    done: dict[str, float] = {}
    for s in mine:  # topological order
        done[s.name] = lat[s.name] + max((done[p] for p in s.parents), default=0.0)
    slo_ms = costs.slo_ms.get(stage.pipeline)
    return slo_ms is not None and max(done.values()) + costs.ingress_ms > slo_ms + TOL


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
    if lo is None and hi is not None:
        f, p = hi
        return _GpuPoint(p["rps"] * fraction / f, p["p99_ms"] * f / fraction, int(p.get("batch", 1)))
    if hi is None and lo is not None:
        f, p = lo
        return _GpuPoint(p["rps"] * fraction / f, p["p99_ms"] * f / fraction, int(p.get("batch", 1)))
    assert lo is not None and hi is not None
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
        for name in _topo(pipe):
            gp = prof["stages"].get(name, {}).get("gpu")
            if gp is None:
                raise ConfigError(f"{pipe.name}/{name}: the profile has no GPU section (\"gpu\": memory_gb, "
                                  "models -> fraction -> rps, p99_ms, batch)")
            lo, hi, bounded = _bounds(pipe.stage(name), total)
            st = _GpuStage(pipe.name, name, pipe.graph.parents(name), lo, hi, bounded, float(gp.get("demand", 1.0)),
                           float(gp["memory_gb"]))
            for k, sl in enumerate(slices):
                pt = _gpu_point(gp, groups[sl.group].model.name, sl.fraction)
                if pt is not None and pt.rps > 0 and st.memory_gb <= sl.memory_gb + TOL:
                    st.points[k] = pt
            if not st.points:
                raise ConfigError(f"{pipe.name}/{name} ({st.memory_gb:g} GB) fits no slice of this inventory")
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


def _gpu_program(stages: Sequence[_GpuStage], groups: Sequence[GpuGroup], slices: Sequence[_Slice],
                 costs: _Costs, q: float, time_limit_s: float, layout_fixed: Mapping[tuple[int, int], int] | None = None,
                 r_max: Mapping[tuple[Key, int], int] | None = None) -> _GpuVars:
    m = _Model(time_limit_s)
    v = _GpuVars(m, {}, {}, {})
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
                lat[s.key][u] = q * pt.p99_ms + costs.hop_ms
        m.row({v.r[(s.key, k)]: 1.0 for k in s.points}, lo=float(s.lo), hi=float(s.hi))
    for k, sl in enumerate(slices):
        grp = groups[sl.group]
        have = {v.g[(sl.group, li)]: -float(lay.count(sl.name)) for li, lay in enumerate(grp.model.layouts)}
        m.row({**{x: 1.0 for (_, kk), x in v.r.items() if kk == k}, **have}, hi=0.0)
    for p in dict.fromkeys(s.pipeline for s in stages):
        v.rate[p] = m.var()
        for s in stages:
            if s.pipeline == p:
                m.row({**v.stage_tput(s), v.rate[p]: -1.0}, lo=0.0)
    budget = {p: (None if b is None else b - costs.ingress_ms) for p, b in costs.slo_ms.items()}
    _path_rule(m, stages, lat, budget)
    return v


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


def _read_gpu(stages: Sequence[_GpuStage], v: _GpuVars, sol: list[float]) -> _GpuSolution:
    r = {k: int(round(sol[x])) for k, x in v.r.items()}
    tput = {s.key: sum(s.points[k].rps * r[(s.key, k)] for k in s.points) / s.demand for s in stages}
    return _GpuSolution({k: int(round(sol[x])) for k, x in v.g.items()}, r, tput,
                        {p: min(tput[s.key] for s in stages if s.pipeline == p) for p in v.rate})


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
                gpus.append({"id": gid, "model": grp.model.name, "layout": list(lay), "stages": [None] * len(lay)})
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
             overheads: Mapping[str, Any] | None = None, time_limit_s: float = 30.0) -> Plan:
    """Plan `pipelines` on GPUs with MIG (see the module doc). Each stage's
    profile has a ``gpu`` section: ``memory_gb``, optional ``demand`` (calls
    per pipeline request), and ``models``: GPU model (or ``"*"``) ->
    compute fraction -> ``{"rps", "p99_ms", "batch"}``."""
    t0 = time.perf_counter()
    groups = parse_inventory(inventory) if isinstance(inventory, str) else list(inventory)
    slices = _slice_types(groups)
    over = {"hop_us": 300.0, "ingress_us": 400.0} | dict(overheads or {})
    costs = _costs(pipelines, 0.0, over)
    stages = _gpu_stages(pipelines, profiles, slices, groups)
    try:
        v = _gpu_program(stages, groups, slices, costs, QUEUE_FACTOR, time_limit_s)
        _lex_maxmin(v.m, {p: {x: 1.0} for p, x in v.rate.items()})
        _lex_maxmin(v.m, {s.key: v.stage_tput(s) for s in stages})
        v.m.relax_holds()
        used = {x: slices[k].fraction for (_, k), x in v.r.items()}
        best = _read_gpu(stages, v, v.m.solve(used, maximize=False))
        timed_out = v.m.timed_out
    except _Infeasible:
        raise ConfigError("no placement fits: every stage needs a slice its memory fits, within its replica "
                          "bounds and the SLO path rule (2 x p99 + hop per stage)") from None
    chosen = best
    if rate is not None:
        w = _gpu_program(stages, groups, slices, costs, QUEUE_FACTOR, time_limit_s, layout_fixed=best.g, r_max=best.r)
        for p, x in w.rate.items():
            w.m.row({x: 1.0}, lo=min(rate / TARGET_LOAD, best.rate[p] * (1 - EPS)))
        chosen = _read_gpu(stages, w, w.m.solve({x: slices[k].fraction for (_, k), x in w.r.items()}, maximize=False))
        timed_out = timed_out or w.m.timed_out
    gpus, place = _unpack(groups, slices, stages, best)
    out = {}
    for pipe in pipelines:
        mine = [s for s in stages if s.pipeline == pipe.name]
        sts = {}
        for s in mine:
            n_best = sum(best.r[(s.key, k)] for k in s.points)
            n_rate = sum(chosen.r[(s.key, k)] for k in s.points)
            used_k = [k for k in s.points if best.r[(s.key, k)] > 0]
            sts[s.name] = StagePlan(replicas=n_rate, max_replicas=n_best, threads=1,
                                    max_batch_size=min(s.points[k].batch for k in used_k),
                                    throughput_rps=chosen.tput[s.key], placement=_order(place[s.key], chosen, s, slices))
        cap = chosen.rate[pipe.name]
        out[pipe.name] = PipelinePlan(capacity_rps=cap, target_rps=rate if rate is not None else TARGET_LOAD * cap,
                                      stages=sts, predicted=None,
                                      why=_why_gpu(pipe, mine, best, slices, groups, costs) + _timed_out(timed_out),
                                      max_capacity_rps=best.rate[pipe.name] if rate is not None else None)
    inv = {"gpus": [{k: g[k] for k in ("id", "model", "layout", "stages")} for g in gpus]}
    return Plan(app=app, inventory=inv, pipelines=out, solve_ms=(time.perf_counter() - t0) * 1e3)


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
    low = min(sol.tput[s.key] for s in mine)
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


# --- printing -----------------------------------------------------------------------------------

def format_plan(plan: Plan) -> str:
    """The plan as `slipstream plan` prints it: a table per pipeline, the why."""
    out = []
    inv = plan.inventory
    where = f"{inv['cores']:g} cores" if "cores" in inv else f"{len(inv.get('gpus', []))} GPUs"
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
            if sp.placement:
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
            out.append(f"  gpu{g['id']:<3} {g['model']:<10} {cells}")
    return "\n".join(out)
