"""Planning for one machine's CPU cores, where the cores are time-shared and
the SLO model (`slo.predict`) can check the plan; `plan_cpu` is its entry.

The model (``C`` cores). Option ``o = (t threads, b batch)`` of stage ``s``,
from its profile: one replica serves ``mu = b / (L(b,t) + batch_cpu)``
requests/s when busy and costs ``cpu = (t L(b,t) + batch_cpu) / b``
core-seconds per request (``L`` the profiled mean, ``batch_cpu`` the
per-batch work outside the component, from the calibration or the SLO
model's defaults). Variables: ``y[s,o]`` (binary: the stage's one option),
``n[s,o]`` replicas (integer), ``x[s,o]`` the throughput given to them
(``x <= mu n``), the stage throughput ``T_s = sum_o x``, the pipeline rate
``X_p <= T_s / demand_s``. The cores are time-shared: work, not replicas,
uses them, so ``sum cpu x + node_cpu sum X_p <= C`` (``node_cpu``: the node's
and the load generator's CPU per request), and replicas may outnumber cores,
up to ``sum t n <= 2C + sum lo`` (each stage's minimum replicas, then 2C
threads beyond them: `thread_cap`): beyond that extra processes buy no throughput and
only add preemption (the SLO model's contention), and a cap keeps the
program bounded. ``T_s`` above ``X_p`` is headroom with CPU set aside for it.

The path rule (see `milp`) is necessary, not sufficient, so the chosen plan
is then run through the SLO model (the discrete-event simulation of the
node's own policies) at 90% of its capacity, or at ``--rate``; if the model
says the SLO does not hold, the target is lowered until it does (and,
failing that, ``q`` raised so that smaller batches are chosen), and the plan
says so.

With ``--rate R`` the planner also finds the cheapest plan (fewest replica
threads, hence cores) that holds ``R``: ``replicas`` is what ``R`` needs and
``max_replicas`` what the machine's max plan has, so the autoscaler can grow
into it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slipstream._internal.api import Pipeline
from slipstream._internal.errors import ConfigError
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
    _val,
)
from slipstream._internal.planner.plan import (
    TARGET_LOAD,
    PipelinePlan,
    Plan,
    StagePlan,
    stage_points,
    with_components,
)

#: Replica threads may exceed the cores by this factor (time-sharing).
OVERSUBSCRIBE = 2.0

#: What a hop between nodes adds to a stage's path in a cluster plan, ms
#: (a data-plane round trip of a small batch on one switch, with margin).
NETWORK_MS = 1.0


# --- stages and options ------------------------------------------------------------------

@dataclass(frozen=True)
class _Opt:
    threads: int
    batch: int
    mean_ms: float
    p99_ms: float
    mu: float     # requests/s of one busy replica
    cpu_s: float  # core-seconds per request
    rss_mb: float = 0.0  # the worker's resident memory at this point (0: not measured)


@dataclass
class _CpuStage(_StageBase):
    opts: list[_Opt] = field(default_factory=list)


def _cpu_stages(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]], cores: float,
                batch_cpu_us: float, max_threads_cores: float | None = None,
                skip: frozenset[Key] = frozenset()) -> list[_CpuStage]:
    """Each stage's options from its profile (but those in `skip`, planned
    on GPUs); a replica's threads at most `max_threads_cores` (the widest
    node's cores; default `cores`)."""
    max_threads = max(1, int(math.floor((cores if max_threads_cores is None else max_threads_cores) + TOL)))
    cap = max(1, int(math.floor(OVERSUBSCRIBE * cores + TOL)))
    stages = []
    for pipe in pipelines:
        prof = profiles.get(pipe.name)
        if prof is None:
            raise ConfigError(f"no profile for pipeline {pipe.name!r}: run `slipstream profile` first")
        for name in pipe.graph.topological_order():
            if (pipe.name, name) in skip:
                continue
            comp = pipe.stage(name)
            sp = prof["stages"].get(name)
            if sp is None:
                raise ConfigError(f"the profile of {pipe.name!r} lacks stage {name!r}: profile again")
            if "threads" in comp.pinned:
                thread_counts = [comp.threads]  # above the cores or not: a pinned count is served as given
            else:
                measured = {1, *(int(t) for t in sp.get("by_threads", {}))}
                thread_counts = sorted(t for t in measured if t <= max_threads)
            opts = []
            for t in thread_counts:
                for pt in stage_points(sp, t):
                    b = int(pt["batch"])
                    if b > comp.max_batch_size:
                        continue
                    busy_s = float(pt["mean_ms"]) / 1e3 + batch_cpu_us / 1e6
                    opts.append(_Opt(t, b, float(pt["mean_ms"]), float(pt["p99_ms"]), b / busy_s,
                                     (t * float(pt["mean_ms"]) / 1e3 + batch_cpu_us / 1e6) / b,
                                     float(pt.get("rss_mb") or 0.0)))
            if not opts:
                raise ConfigError(f"{pipe.name}/{name}: the profile has no point at or under max_batch_size "
                                  f"{comp.max_batch_size}: profile again")
            lo, hi, bounded = _bounds(comp, cap)
            stages.append(_CpuStage(pipe.name, name, pipe.graph.parents(name), lo, hi, bounded, 1.0,
                                    elastic_ms=comp.elastic_ms, opts=opts))
    return stages


# --- the CPU program -----------------------------------------------------------------------

def thread_cap(stages: Sequence[_CpuStage], cores: float) -> float:
    """The most replica threads a plan may have: every stage's minimum
    replicas, plus ``OVERSUBSCRIBE x cores`` threads beyond them. Counting
    the minimum apart matters for pipelines with more stages than cores: a
    light stage's one replica is mostly idle, and counted against a flat
    cap of 2 x cores it left multimodal's VisionEncoder (86 ms of CPU per
    request, 95% of the pipeline's) one replica on two cores, at half the
    machine."""
    return OVERSUBSCRIBE * cores + float(sum(s.lo for s in stages))


#: One machine's program has one node, without a name.
ONE_MACHINE = ""

#: The end of the label of a size class of nodes with GPUs.
GPU_CLASS = ", GPUs"


@dataclass
class _CpuVars:
    m: _Model
    y: dict[tuple[Key, int], int]
    #: Replicas and the throughput given to them, per (stage, option, node).
    n: dict[tuple[Key, int, str], int]
    x: dict[tuple[Key, int, str], int]
    rate: dict[str, int]
    cpu: dict[int, float]
    threads: dict[int, float]

    def stage_tput(self, s: _StageBase) -> dict[int, float]:
        return {v: 1.0 / s.demand for (k, _, _), v in self.x.items() if k == s.key}


@dataclass(frozen=True)
class _Class:
    """Nodes of one size in a cluster plan: `count` nodes of `cores` cores
    and `memory_mb` MiB each (0: memory not bounded)."""

    cores: float
    count: int
    memory_mb: float = 0.0


def _cpu_program(stages: Sequence[_CpuStage], costs: _Costs, q: float, time_limit_s: float,
                 only: Mapping[Key, _Opt] | None = None, n_max: Mapping[Key, int] | None = None,
                 nodes: Mapping[str, _Class] | None = None) -> _CpuVars:
    """The program on one machine, or on `nodes` (size classes): then each
    class's cores, threads and memory (each replica's profiled resident
    memory) bound what runs there, a replica's threads fit its node, the
    stage's option is one for all its replicas, and the ingresses' CPU is
    spread over the nodes by their share of the cores."""
    m = _Model(time_limit_s)
    v = _CpuVars(m, {}, {}, {}, {}, {}, {})
    classes = _classes(costs, nodes)
    lat, room = _add_cpu_stages(m, v, stages, costs, q, classes, only, n_max)
    v.rate.update(_pipeline_rates(m, stages, v.stage_tput))
    _bound_cpu(m, v, stages, costs, classes, room)
    _path_rule(m, stages, lat, costs)
    return v


def _classes(costs: _Costs, nodes: Mapping[str, _Class] | None) -> dict[str, _Class]:
    """The node size classes a program places on (one machine: one class)."""
    return dict(nodes) if nodes else {ONE_MACHINE: _Class(costs.cores, 1)}


@dataclass
class _Room:
    """What the CPU stages' variables take on each size class (bounded by
    `_bound_cpu` once the pipelines' rates exist)."""

    cpu: dict[str, dict[int, float]]
    threads: dict[str, dict[int, float]]
    memory: dict[str, dict[int, float]]


def _add_cpu_stages(m: _Model, v: _CpuVars, stages: Sequence[_CpuStage], costs: _Costs, q: float,
                    nodes: Mapping[str, _Class], only: Mapping[Key, _Opt] | None = None,
                    n_max: Mapping[Key, int] | None = None) -> tuple[dict[Key, dict[int, float]], _Room]:
    """The CPU stages' variables and rows in `m`: an option (threads, batch
    limit) per stage, replicas and the throughput given to them per size
    class; their path latencies, for the path rule, and what they take."""
    room = _Room({k: {} for k in nodes}, {k: {} for k in nodes}, {k: {} for k in nodes})
    lat: dict[Key, dict[int, float]] = {}
    for s in stages:
        hi = min(s.hi, n_max[s.key]) if n_max else s.hi
        lat[s.key] = {}
        ys: dict[int, int] = {}
        ns: list[int] = []
        for i, o in enumerate(s.opts):
            if only is not None and o != only[s.key]:
                continue
            ys[i] = v.y[(s.key, i)] = m.var(0, 1, integer=True)
            mine: dict[int, float] = {}
            for k, cls in nodes.items():
                if len(nodes) > 1 and o.threads > max(1, math.floor(cls.cores + TOL)):
                    continue  # its threads would not fit that node
                if cls.memory_mb and o.rss_mb > cls.memory_mb:
                    continue  # nor its memory
                n = v.n[(s.key, i, k)] = m.var(0, hi, integer=True)
                x = v.x[(s.key, i, k)] = m.var()
                m.row({x: 1.0, n: -o.mu}, hi=0.0)                   # x <= mu * n
                v.cpu[x] = room.cpu[k][x] = o.cpu_s
                v.threads[n] = room.threads[k][n] = float(o.threads)
                room.memory[k][n] = o.rss_mb
                mine[n] = 1.0
                ns.append(n)
            m.row({**mine, ys[i]: -float(hi)}, hi=0.0)             # its replicas <= hi * y
            lat[s.key][ys[i]] = s.path_ms(o.p99_ms, q, costs)
        m.row(dict.fromkeys(ys.values(), 1.0), lo=1.0, hi=1.0)        # one option per stage
        m.row(dict.fromkeys(ns, 1.0), lo=float(s.lo), hi=float(hi))
    return lat, room


def _bound_cpu(m: _Model, v: _CpuVars, stages: Sequence[_CpuStage], costs: _Costs,
               nodes: Mapping[str, _Class], room: _Room, host: Mapping[int, float] | None = None,
               host_on: Sequence[str] = ()) -> None:
    """Each size class's cores (its stages' CPU and its share of the
    ingresses', by the pipelines' rates `v.rate`), threads and memory; with
    `host` (rate variable -> CPU seconds a request that GPU workers spend
    on their machine's cores), the classes `host_on` together hold that
    too."""
    total = sum(c.cores * c.count for c in nodes.values())
    for x in v.rate.values():
        v.cpu[x] = costs.node_cpu_s
    share: dict[str, dict[int, float]] = {}
    for k, cls in nodes.items():
        ingress = share[k] = {x: costs.node_cpu_s * cls.cores * cls.count / total for x in v.rate.values()}
        m.row({**room.cpu[k], **ingress}, hi=cls.cores * cls.count)
        if room.threads[k]:
            m.row(room.threads[k], hi=thread_cap(stages, cls.cores) * cls.count)
        if cls.memory_mb and any(room.memory[k].values()):
            m.row(room.memory[k], hi=cls.memory_mb * cls.count)
    if host and host_on:
        coeffs: dict[int, float] = dict(host)
        for k in host_on:
            for x, c in [*room.cpu[k].items(), *share[k].items()]:
                coeffs[x] = coeffs.get(x, 0.0) + c
        m.row(coeffs, hi=sum(nodes[k].cores * nodes[k].count for k in host_on))


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
    #: Replicas per node size class (classes with none left out; one
    #: machine's is ``{"": n}``); `_spread` gives them to the nodes.
    per_class: dict[Key, dict[str, int]] = field(default_factory=dict)


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
                counts = {k: int(round(sol[n])) for (key, j, k), n in v.n.items() if key == s.key and j == i}
                out.per_class[s.key] = {k: c for k, c in counts.items() if c > 0}
                out.n[s.key] = sum(counts.values())
                given = sum(sol[x] for (key, j, _), x in v.x.items() if key == s.key and j == i)
                out.tput[s.key] = held.get(s.key, min(given, o.mu * out.n[s.key]) / s.demand)
        out.threads_used += out.n[s.key] * out.opt[s.key].threads
    out.timed_out = v.m.timed_out
    out.cpu_used = sum(out.tput[s.key] * s.demand * out.opt[s.key].cpu_s for s in stages) \
        + sum(r * v.cpu[v.rate[p]] for p, r in out.rate.items())
    return out


def _solve_cpu_max(stages: Sequence[_CpuStage], costs: _Costs, q: float, time_limit_s: float,
                   only: Mapping[Key, _Opt] | None = None, n_max: Mapping[Key, int] | None = None,
                   nodes: Mapping[str, _Class] | None = None) -> _CpuSolution:
    """Lexicographic max-min: pipeline rates first, then stage throughputs;
    then, everything held, the fewest replica threads."""
    v = _cpu_program(stages, costs, q, time_limit_s, only, n_max, nodes)
    levels = _lex_objective(v.m, v.rate, {s.key: v.stage_tput(s) for s in stages})
    sol = v.m.solve(v.threads, maximize=False)
    return _read_cpu(stages, v, sol, levels)


def _solve_cpu_rate(stages: Sequence[_CpuStage], costs: _Costs, q: float, time_limit_s: float,
                    need: Mapping[str, float], best: _CpuSolution,
                    nodes: Mapping[str, _Class] | None = None) -> _CpuSolution:
    """The fewest replica threads whose capacity covers `need` per pipeline,
    with the max plan's options and at most its replica counts."""
    v = _cpu_program(stages, costs, q, time_limit_s, only=best.opt, n_max=best.n, nodes=nodes)
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

def _solve_max_checked(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]],
                       stages: list[_CpuStage], costs: _Costs, overheads: Mapping[str, Any], check_slo: bool,
                       sim_s: float, time_limit_s: float,
                       nodes: Mapping[str, _Class] | None = None) -> tuple[_CpuSolution, float, dict[str, Any]]:
    """The max plan, with targets the SLO model accepts: if no rung holds for
    some pipeline, raise q (smaller batches) and solve again."""
    notes: dict[str, Any] = {}
    sol: _CpuSolution | None = None
    used = QUEUE_FACTOR
    for q in (QUEUE_FACTOR, 3.0, 4.0):
        try:
            attempt = _solve_cpu_max(stages, costs, q, time_limit_s, nodes=nodes)
        except _Infeasible:
            if sol is not None:
                break
            raise _no_plan(stages, costs, q) from None
        sol, used = attempt, q
        notes = {}
        ok = True
        for pipe in pipelines:
            if not check_slo:
                notes[pipe.name] = (TARGET_LOAD * sol.rate[pipe.name], None, [
                    "SLO model check skipped" if nodes is None else
                    "not checked with the SLO model, which simulates one machine (20 nodes as one took 80 s "
                    "and sent every request through one ingress): the path rule holds, with the network hop"])
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
        best = min(s.path_ms(o.p99_ms, q, costs) for o in s.opts)
        worst.append(f"{s.pipeline}/{s.name} >= {best:.1f} ms" + (f" (SLO {slo_ms:g} ms)" if slo_ms else ""))
    return ConfigError("no plan satisfies the SLO path rule (each stage budgets "
                       f"{q:g} x its batch p99 + {costs.hop_ms:.1f} ms hop, plus {costs.ingress_ms:.1f} ms ingress) "
                       f"with the declared replica bounds on {costs.cores:g} cores: " + "; ".join(worst))


def plan_cpu(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]], *, cores: float,
             overheads: Mapping[str, Any] | None = None, rate: float | None = None, app: str = "",
             check_slo: bool = True, sim_duration_s: float = 10.0, time_limit_s: float = 20.0,
             nodes: Mapping[str, float] | None = None, network_ms: float = NETWORK_MS,
             node_memory_mb: Mapping[str, float] | None = None) -> Plan:
    """Plan `pipelines` on one machine of `cores` cores (see the module doc),
    or across a cluster's `nodes` (name -> cores; `cores` is then their
    sum; `node_memory_mb`: the memory of those whose memory bounds what
    they run): replicas per node, each stage's path budgeting `network_ms`
    more per hop. `profiles` maps a pipeline's name to its profile
    (`slo.load_profile_for`); `overheads` are the SLO model's (calibration
    or `slo.DEFAULTS`)."""
    from slipstream._internal import slo

    t0 = time.perf_counter()
    over = dict(slo.DEFAULTS) | dict(overheads or {})
    if nodes:
        cores = float(sum(nodes.values()))
        over["hop_us"] = float(over["hop_us"]) + network_ms * 1e3
        check_slo = False  # see `_solve_max_checked`
    classes, members = size_classes(nodes, node_memory_mb)
    costs = _costs(pipelines, cores, over)
    widest = max(nodes.values()) if nodes else cores
    stages = _cpu_stages(pipelines, profiles, cores, float(over["batch_cpu_us"]), max_threads_cores=widest)
    best, q, notes = _solve_max_checked(pipelines, profiles, stages, costs, over, check_slo, sim_duration_s,
                                        time_limit_s, classes)
    chosen = best
    rate_notes: dict[str, list[str]] = {p.name: [] for p in pipelines}
    if rate is not None:
        chosen, rate_notes, notes = _rate_plan(pipelines, profiles, stages, costs, over, q, best, notes, rate,
                                               check_slo, sim_duration_s, time_limit_s, classes)
    per_node = _spread(stages, chosen, members) if nodes else {}
    out: dict[str, PipelinePlan] = {}
    for pipe in pipelines:
        tgt, pred, why = notes[pipe.name]
        sts = {n: StagePlan(replicas=chosen.n[(pipe.name, n)], max_replicas=max(best.n[(pipe.name, n)],
                                                                               chosen.n[(pipe.name, n)]),
                            threads=best.opt[(pipe.name, n)].threads, max_batch_size=best.opt[(pipe.name, n)].batch,
                            throughput_rps=chosen.tput[(pipe.name, n)],
                            nodes=per_node.get((pipe.name, n)) if nodes else None)
               for n in pipe.graph.topological_order()}
        out[pipe.name] = PipelinePlan(
            capacity_rps=chosen.rate[pipe.name],
            target_rps=tgt, stages=sts, predicted=_pred_json(pred),
            why=[("max plan: " if rate is not None else "") + line for line in _why_cpu(pipe, stages, best, costs, q)]
            + why + rate_notes[pipe.name] + _timed_out(best.timed_out or chosen.timed_out),
            max_capacity_rps=best.rate[pipe.name] if rate is not None else None)
    inventory: dict[str, Any] = {"cores": cores}
    if nodes:
        inventory["nodes"] = dict(nodes)
        inventory["network_ms"] = network_ms
        if node_memory_mb:
            inventory["memory_mb"] = dict(node_memory_mb)
    plan = Plan(app=app, inventory=inventory, pipelines=out, solve_ms=(time.perf_counter() - t0) * 1e3)
    return plan


def size_classes(nodes: Mapping[str, float] | None, node_memory_mb: Mapping[str, float] | None = None,
                 with_gpus: frozenset[str] = frozenset()) -> tuple[dict[str, _Class] | None, dict[str, list[str]]]:
    """A cluster's nodes (name -> cores) as the size classes the program
    plans (None for one machine), and each class's nodes by name; nodes
    in `with_gpus` are classes of their own (labelled so)."""
    if not nodes:
        return None, {}
    bad = {k: c for k, c in nodes.items() if not k or not c > 0}
    if bad:
        raise ConfigError(f"every node needs a name and cores > 0: {bad}")
    sizes: dict[str, tuple[float, float]] = {}  # a size class's label -> (cores, MiB) of each of its nodes
    members: dict[str, list[str]] = {}
    for name, c in sorted(nodes.items()):
        size = (float(c), float((node_memory_mb or {}).get(name, 0.0)))
        label = f"{size[0]:g} cores" + (f", {size[1]:g} MiB" if size[1] else "") + (GPU_CLASS if name in with_gpus
                                                                                      else "")
        sizes[label] = size
        members.setdefault(label, []).append(name)
    return {label: _Class(c, len(members[label]), mib) for label, (c, mib) in sizes.items()}, members


def _spread(stages: Sequence[_CpuStage], sol: _CpuSolution, members: Mapping[str, Sequence[str]]
            ) -> dict[Key, dict[str, int]]:
    """Each size class's replicas over its nodes: the program plans nodes of
    one size together (they are interchangeable, and a program per node
    grows with their number: 20 s for 100 nodes, against well under one as
    classes), so here the heaviest stages first, each replica goes to the
    class's node with the fewest of that stage, then the least CPU given.
    A stage's replicas in a class thus sit on as many of its nodes as they
    can."""
    load = {n: 0.0 for names in members.values() for n in names}
    out: dict[Key, dict[str, int]] = {s.key: {} for s in stages}
    for s in sorted(stages, key=lambda s: -sol.opt[s.key].cpu_s * s.demand):
        per_replica = sol.tput[s.key] * s.demand * sol.opt[s.key].cpu_s / max(sol.n[s.key], 1)
        for label, count in sol.per_class.get(s.key, {}).items():
            mine = out[s.key]
            for _ in range(count):
                to = min(members[label], key=lambda n: (mine.get(n, 0), load[n], n))
                mine[to] = mine.get(to, 0) + 1
                load[to] += per_replica
    return out


def _pred_json(r: Mapping[str, Any] | None) -> dict[str, float] | None:
    if r is None:
        return None
    return {"p50_ms": round(float(r["p50_ms"]), 3), "p99_ms": round(float(r["p99_ms"]), 3),
            "miss_rate": round(float(r["miss_rate"]), 5), "offered_rps": round(float(r["offered_rps"]), 2)}


def _rate_plan(pipelines: Sequence[Pipeline], profiles: Mapping[str, Mapping[str, Any]], stages: list[_CpuStage],
               costs: _Costs, over: Mapping[str, Any], q: float, best: _CpuSolution, notes: dict[str, Any],
               rate: float, check_slo: bool, sim_s: float, time_limit_s: float,
               nodes: Mapping[str, _Class] | None = None) -> tuple[_CpuSolution, dict[str, list[str]], dict[str, Any]]:
    """The cheapest plan holding `rate`: provision for rate / load, with the
    load lowered from 90% until the SLO model says the SLO holds at `rate`
    (or the max plan is reached)."""
    out_notes: dict[str, list[str]] = {p.name: [] for p in pipelines}
    new_notes = dict(notes)
    beyond = [p.name for p in pipelines if rate > max(notes[p.name][0], TOL) * (1 + EPS)]
    sol = best
    preds: dict[str, dict[str, Any]] = {}
    for load in (TARGET_LOAD, 0.8, 0.7, 0.6, 0.5):
        sol = _solve_cpu_rate(stages, costs, q, time_limit_s, {p.name: rate / load for p in pipelines}, best, nodes)
        if not check_slo:
            break
        preds = {p.name: _predict(p, profiles[p.name], sol, rate, _pipe_cores(stages, sol, costs, p.name), over, sim_s)
                 for p in pipelines if p.slo is not None}
        if all(_holds(preds[p.name], p) for p in pipelines if p.slo is not None) or sol.n == best.n:
            break
    # What the started replicas can do on this machine (their capacity, not the rate asked for).
    cap = _solve_cpu_max(stages, costs, q, time_limit_s, only=best.opt, n_max=sol.n, nodes=nodes)
    sol = _CpuSolution(sol.opt, sol.n, cap.tput, cap.rate, cap.cpu_used, sol.threads_used, [],
                       per_class=sol.per_class)
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
        if sol.n[s.key] >= s.hi and s.bounded and s.lo < s.hi:  # (a pinned count is said below)
            lines.append(f"binding: replicas bound: {s.name} is at its declared max_replicas {s.hi}")
        bigger = [b for b in s.opts if b.threads == o.threads and b.batch > o.batch and b.cpu_s < o.cpu_s]
        if bigger and costs.slo_ms.get(s.pipeline) is not None and _breaks_path(mine, sol, costs, q, s, bigger):
            b = min(bigger, key=lambda b: b.batch)
            lines.append(f"binding: SLO batch limit: {s.name} at batch {b.batch} (p99 {b.p99_ms:.1f} ms) breaks "
                         f"the path rule ({q:g} x p99 + hop per stage <= {costs.slo_ms[s.pipeline]:g} ms)")
    tcap = thread_cap(stages, costs.cores)
    if sol.threads_used >= tcap * (1 - 1e-3):
        lines.append(f"binding: replica threads at the cap ({tcap:g}: {OVERSUBSCRIBE:g} x {costs.cores:g} cores "
                     "beyond each stage's minimum replicas)")
    rest = [s for s in mine if sol.tput[s.key] > low * (1 + 1e-3) + TOL]
    if rest:
        lines.append("headroom (spare capacity given to the next bottlenecks): "
                     + ", ".join(f"{s.name} {sol.tput[s.key]:,.0f} req/s" for s in rest))
    for s in mine:
        if s.elastic_ms is not None:
            lines.append(f"{s.name}: elastic (it answers by its batch's deadline): counted at most "
                         f"{s.elastic_ms:g} ms of p99 on the path, not its profiled "
                         f"{sol.opt[s.key].p99_ms:.1f} ms")
        if s.bounded:
            lines.append(f"{s.name}: declared replicas " + (f"{s.lo} pinned" if s.lo == s.hi else
                                                            f"({s.lo}, {s.hi}) respected"))
    return lines


def _breaks_path(mine: Sequence[_CpuStage], sol: _CpuSolution, costs: _Costs, q: float, stage: _CpuStage,
                 bigger: Sequence[_Opt]) -> bool:
    """Whether the next bigger batch of `stage` breaks the SLO path rule."""
    b = min(bigger, key=lambda o: o.batch)
    lat = {s.name: s.path_ms((b if s is stage else sol.opt[s.key]).p99_ms, q, costs) for s in mine}
    done: dict[str, float] = {}
    for s in mine:  # topological order
        done[s.name] = lat[s.name] + max((done[p] for p in s.parents), default=0.0)
    slo_ms = costs.slo_ms.get(stage.pipeline)
    return slo_ms is not None and max(done.values()) + costs.ingress_ms > slo_ms + TOL
