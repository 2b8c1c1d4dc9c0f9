"""What both planners' integer programs are made of, so that the CPU and GPU
models state only their own variables: a small MILP builder over HiGHS, the
objective (lexicographic max-min: pipeline rates, then stage throughputs),
the pipeline-rate rows and the SLO path rule.

The SLO path rule. A batch limit is allowed only if every path through the
DAG fits: ``sum over the path of (q p99(b) + hop) + ingress <= SLO`` with
``q = 2`` (a request may wait for the batch ahead of it, then its own). It is
a linear constraint on the option binaries (a longest-path potential per
stage). An elastic stage (``elastic_ms``: it answers by its batch's
deadline) counts at most ``q elastic_ms``: what it would spend unhurried is
not its cost (`path_ms`). The rule is necessary, not sufficient: the CPU
planner checks its plan with the SLO model as well (see `cpu`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from slipstream._internal.api import Component, Pipeline

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


def _lex_objective(m: _Model, rates: Mapping[str, int],
                   stage_tputs: Mapping[Key, dict[int, float]]) -> list[tuple[float, list[Any]]]:
    """The planners' objective: pipeline rates, then stage throughputs, each
    by lexicographic max-min; then every level is held with FINAL_SLACK for
    the last solve (the fewest replicas or slices), which the caller makes."""
    _, levels = _lex_maxmin(m, {p: {x: 1.0} for p, x in rates.items()})
    _, stage_levels = _lex_maxmin(m, stage_tputs)
    m.relax_holds()
    return levels + stage_levels


# --- what both programs share: stages, costs, rates, the SLO path rule ----------------

@dataclass
class _StageBase:
    pipeline: str
    name: str
    parents: list[str]
    lo: int
    hi: int
    bounded: bool
    demand: float
    #: The component's ``elastic_ms`` (None: not elastic).
    elastic_ms: float | None = None

    @property
    def key(self) -> Key:
        return (self.pipeline, self.name)

    def path_ms(self, p99_ms: float, q: float, costs: _Costs) -> float:
        """What a batch of this stage whose p99 is `p99_ms` counts for on a
        path under the path rule: ``q`` of it plus the hop; an elastic
        stage's p99 at most its ``elastic_ms``."""
        counted = p99_ms if self.elastic_ms is None else min(p99_ms, self.elastic_ms)
        return q * counted + costs.hop_ms


def _bounds(comp: Component, cap: int) -> tuple[int, int, bool]:
    """Declared (lo, hi) bounds are kept; a count the author gave is kept
    (pinned); otherwise the planner chooses within 1..cap."""
    if comp.autoscaled:
        return comp.min_replicas, comp.max_replicas, True
    if "replicas" in comp.pinned:
        return comp.replicas, comp.replicas, True
    return 1, max(1, cap), False


@dataclass
class _Costs:
    cores: float
    node_cpu_s: float
    hop_ms: float
    ingress_ms: float
    slo_ms: dict[str, float | None]


def _costs(pipelines: Sequence[Pipeline], cores: float, overheads: Mapping[str, Any]) -> _Costs:
    return _Costs(cores=float(cores), node_cpu_s=float(overheads.get("cpu_per_request_us", 60.0)) / 1e6,
                  hop_ms=float(overheads.get("hop_us", 300.0)) / 1e3,
                  ingress_ms=float(overheads.get("ingress_us", 400.0)) / 1e3,
                  slo_ms={p.name: (p.slo.p99_ms if p.slo else None) for p in pipelines})


S = TypeVar("S", bound=_StageBase)


def _pipeline_rates(m: _Model, stages: Sequence[S], stage_tput: Callable[[S], Mapping[int, float]]) -> dict[str, int]:
    """A rate variable per pipeline, ``X_p <= T_s / demand_s`` for each of
    its stages: a pipeline runs at the rate of its slowest stage."""
    rate: dict[str, int] = {}
    for p in dict.fromkeys(s.pipeline for s in stages):
        rate[p] = m.var()
        for s in stages:
            if s.pipeline == p:
                m.row({**stage_tput(s), rate[p]: -1.0}, lo=0.0)
    return rate


def _path_rule(m: _Model, stages: Sequence[_StageBase], lat: Mapping[Key, dict[int, float]], costs: _Costs) -> None:
    """For every path, the sum of its stages' latency budgets plus the ingress
    fits the SLO: a potential F per stage, F_s >= F_parent + L_s, F_s <= SLO -
    ingress (`lat` maps a stage to its binaries' latency budgets)."""
    pot = {s.key: m.var() for s in stages}
    for s in stages:
        slo_ms = costs.slo_ms.get(s.pipeline)
        if slo_ms is None:
            continue
        parents: list[str | None] = list(s.parents) or [None]
        for p in parents:
            coeffs = {pot[s.key]: 1.0}
            for v, ms in lat[s.key].items():
                coeffs[v] = coeffs.get(v, 0.0) - ms
            if p is not None:
                coeffs[pot[(s.pipeline, p)]] = -1.0
            m.row(coeffs, lo=0.0)
        m.row({pot[s.key]: 1.0}, hi=slo_ms - costs.ingress_ms)


def _timed_out(flag: bool) -> list[str]:
    return ["the solver hit its time limit: the plan is feasible but may not be optimal"] if flag else []
