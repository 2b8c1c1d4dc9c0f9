"""The queueing ceiling: how much of the offline limit any server could
serve within the SLO when requests arrive at random.

The offline limit (bench.limit) is a throughput: every core busy all the
time, each request costing the CPU its stages take at their best batch
sizes. Serving it under a latency objective is another matter: requests
from independent clients arrive as a Poisson process, and a queue that is
never empty at 100% load grows without bound; at 90% it is long enough to
break a tight SLO. How tight depends on the ratio of the SLO to the
request's own cost: RAG's 200 ms against 6.6 ms of CPU leaves room for
thirty requests' wait, multimodal's 500 ms against 119 ms for three.

The ceiling is the highest rate at which an ideal system holds the SLO:
the limit's CPU time per request as a deterministic service (no variance,
no batching delay, no node, HTTP or client cost, and the best batch's
efficiency at any batch size), first come first served, Poisson arrivals,
the better of two ways to use the cores, each request on one core
(``cores`` servers: the M/D/c queue) or each request split perfectly
across all of them (one server ``cores`` times as fast: M/D/1), and an
ideal admission control: a request that would finish late is refused on
arrival, so it takes no server time (the SLO counts a refusal as a miss;
with a deterministic service and first come first served, a request's
finish is known when it arrives). A split waits less for the same
capacity; no real split is perfect (threads cost CPU: bench.limit
measures them), and any mix of the two lies between. Refusing the
requests that would miss anyway keeps them from delaying the rest.
Nothing real does better on these cores and inputs, so the ceiling is a
bound, and goodput is reported as a share of the limit and of the
ceiling. The waits are simulated, not taken from a closed form, because
the miss rate at the SLO is a tail quantity. All four models are
reported.

    .venv/bin/python -m bench.ceiling --cpu-ms 119 --cores 2 --slo-ms 500

With ``--routings`` it also answers two design questions about replicas
that each use one core (docs/design/scheduling.md, "Where the queue
stops goodput"): what binding a request to the replica with the fewest
outstanding at arrival (the node's router) costs against one shared
queue, and what a replica gains by taking every core while it runs alone
(``--speedup``: measured, e.g. ``examples/models/vit.py`` with one and two
BLAS threads).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections.abc import Callable
from typing import Any

#: Arrivals simulated per rate (the first 2% are the warm-up and not counted).
ARRIVALS = 200_000


def miss_rate(rate: float, service_s: float, servers: int, slo_s: float, *, arrivals: int = ARRIVALS,
              seed: int = 7, gate: bool = False) -> float:
    """Share of requests whose time in the system (wait + service) exceeds
    `slo_s` in an M/D/c queue at `rate` requests/s. With `gate`, an ideal
    admission control: a request that would finish late is refused on
    arrival (a miss that takes no server time), as the service is
    deterministic and the queue first come first served, its finish is
    known when it arrives."""
    rng = random.Random(seed)
    free = [0.0] * servers  # when each server is next free (a heap)
    t = 0.0
    warm = arrivals // 50
    late = 0
    for i in range(arrivals):
        t += rng.expovariate(rate)
        done = max(t, free[0]) + service_s
        missed = done - t > slo_s
        if not (missed and gate):
            heapq.heapreplace(free, done)
        if i >= warm and missed:
            late += 1
    return late / (arrivals - warm)


def _highest(limit: float, missed_at: Callable[[float], float], max_miss: float) -> float:
    """The highest share of `limit` at which `missed_at(rate)` (a share of
    requests late) is at most `max_miss`, to within 0.5%."""
    lo, hi = 0.0, 1.0  # fractions of the limit: lo holds, hi does not (at 100% the queue never drains)
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        if missed_at(mid * limit) <= max_miss:
            lo = mid
        else:
            hi = mid
    return lo


def _highest_md(limit: float, service_s: float, servers: int, slo_s: float, max_miss: float, arrivals: int,
                gate: bool) -> float:
    """:func:`_highest` for `servers` servers of `service_s` a request (M/D/c)."""
    if service_s > slo_s:
        return 0.0
    return _highest(limit, lambda rate: miss_rate(rate, service_s, servers, slo_s, arrivals=arrivals, gate=gate),
                    max_miss)


def ceiling(cpu_us_per_request: float, cores: int, slo_ms: float, max_miss: float,
            arrivals: int = ARRIVALS) -> dict[str, Any]:
    """The highest rate (and its share of the limit ``cores / cpu``) at which
    the ideal system misses at most `max_miss` of requests at `slo_ms`, to
    within 0.5% of the limit: the best of the ideal servers, each request
    on one core (M/D/cores) or split perfectly across all of them (M/D/1
    at cores times the speed), each with an ideal admission control
    (``gated``). All four are reported; the gated ones are the bound."""
    service_s, slo_s = cpu_us_per_request / 1e6, slo_ms / 1e3
    limit = cores / service_s
    models: dict[str, float] = {}
    for gate in (False, True):
        tag = ", gated" if gate else ""
        models[f"M/D/{cores}{tag}"] = _highest_md(limit, service_s, cores, slo_s, max_miss, arrivals, gate)
        models[f"M/D/1 at {cores}x{tag}"] = (models[f"M/D/{cores}{tag}"] if cores == 1 else
                                            _highest_md(limit, service_s / cores, 1, slo_s, max_miss, arrivals, gate))
    model = max(models, key=lambda k: (models[k], k.endswith("gated")))
    return {"rate_rps": models[model] * limit, "fraction": models[model], "limit_rps": limit, "model": model,
            "models": models}


#: How a stage's replicas share its requests, as :func:`routed_miss_rate` models it.
ROUTINGS = ("shared", "shortest", "elastic")


def routed_miss_rate(rate: float, service_s: float, servers: int, slo_s: float, routing: str, *,
                     speedup: float = 1.0, cv: float = 0.0, arrivals: int = ARRIVALS, seed: int = 7) -> float:
    """Share of requests whose time in the system exceeds `slo_s` when
    `servers` single-threaded replicas of `service_s` a request share
    Poisson arrivals at `rate` (no admission control) by `routing`:

    - ``shared``: one queue, first come first served, the first replica
      free takes the next request (the M/D/c queue of :func:`miss_rate`);
    - ``shortest``: a queue per replica, each request bound on arrival to
      the replica with the fewest requests outstanding (queued or
      running), ties at random: what the node's router does at ingress;
    - ``elastic``: one queue, and a request that starts while every other
      replica is idle runs on all the cores, `speedup` times as fast
      (intra-op threads taken when free). Optimistic: a replica starting
      meanwhile is not slowed by it.

    `cv`: the service time's coefficient of variation (normal, at least a
    fifth of the mean); 0 is deterministic."""
    rng = random.Random(seed)
    t = 0.0
    warm = arrivals // 50
    late = 0
    free = [0.0] * servers  # when each replica has finished what it was given
    ends: list[list[float]] = [[] for _ in range(servers)]  # "shortest": the finish of each request given to each
    for i in range(arrivals):
        t += rng.expovariate(rate)
        s = service_s * max(0.2, rng.gauss(1.0, cv)) if cv else service_s
        if routing == "shortest":
            for e in ends:
                while e and e[0] <= t:
                    e.pop(0)
            least = min(len(e) for e in ends)
            k = rng.choice([j for j, e in enumerate(ends) if len(e) == least])
        else:
            k = min(range(servers), key=free.__getitem__)
        start = max(t, free[k])
        if routing == "elastic" and all(free[j] <= start for j in range(servers) if j != k):
            s /= speedup
        free[k] = start + s
        if routing == "shortest":
            ends[k].append(free[k])
        if i >= warm and free[k] - t > slo_s:
            late += 1
    return late / (arrivals - warm)


def routings(cpu_us_per_request: float, cores: int, slo_ms: float, max_miss: float, *, speedup: float,
             cv: float, arrivals: int = ARRIVALS) -> dict[str, float]:
    """The highest share of the limit each of :data:`ROUTINGS` holds `slo_ms`
    at (at most `max_miss` late), to within 0.5%, with a replica a core."""
    service_s, slo_s = cpu_us_per_request / 1e6, slo_ms / 1e3
    limit = cores / service_s
    return {routing: _highest(limit, lambda rate, routing=routing: routed_miss_rate(
                rate, service_s, cores, slo_s, routing, speedup=speedup, cv=cv, arrivals=arrivals), max_miss)
            for routing in ROUTINGS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-ms", type=float, required=True, help="CPU time per request (bench.limit's)")
    ap.add_argument("--cores", type=int, required=True)
    ap.add_argument("--slo-ms", type=float, required=True)
    ap.add_argument("--max-miss", type=float, default=0.01)
    ap.add_argument("--routings", action="store_true",
                    help="also: the share of the limit each way of sharing requests among one-core replicas "
                         "holds (routed_miss_rate), with --speedup and --cv")
    ap.add_argument("--speedup", type=float, default=1.0,
                    help="how much faster a request runs on all the cores than on one (measured; for 'elastic')")
    ap.add_argument("--cv", type=float, default=0.0, help="the service time's coefficient of variation")
    a = ap.parse_args()
    out = ceiling(a.cpu_ms * 1e3, a.cores, a.slo_ms, a.max_miss)
    if a.routings:
        out["routings"] = routings(a.cpu_ms * 1e3, a.cores, a.slo_ms, a.max_miss, speedup=a.speedup, cv=a.cv)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
