"""Late admits above capacity: `examples/recsys.py` (SLO p99 50 ms) offered
1.3x what it can answer, open loop; the requests the admission gate lets
in must still meet the SLO (issue 22, finding 4: the admitted requests'
p99 was 59.5 ms at 9,000 req/s offered).

    make bench-late-admits
    python -m bench.late_admits [--factor 1.3] [--seconds 10] [--repeat 3]

Capacity is measured first, in the same run: the answers per second while
3x an estimate is offered (the gate refuses the rest, so the answered rate
is what the pipeline sustains at its SLO here). Then `--factor` x capacity
is offered `--repeat` times (Poisson arrivals, the project's generator;
latency from each request's scheduled send, answered requests only).
Pass: the admitted requests' p99 at the client (median over the runs in
which the generator kept up) within the SLO. A run in which more than 1%
of the generator's sends left over 1 ms late measured the generator's
own queue, not the node (its latency counts from the scheduled send), and
is shown but not judged; the node's own p99 is given beside each run.
Writes bench/results/late_admits.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from bench import harness

APP = harness.ROOT / "examples" / "recsys.py"
BODY = json.dumps({"inputs": {"user": [[4242]], "history": [[17, 99, 3, 123456, 4567, -1, -1, -1]]}}).encode()
SLO_MS = 50.0
#: Enough that admitted requests (p50 ~30 ms at 15,000/s) never wait for a
#: free connection in the generator.
MAX_CONNECTIONS = 2048
#: The generator's threads: one on a small machine (it shares the cores
#: with the node and the workers), a quarter of the cores on a larger one
#: (one thread fell behind at 15,000/s on 16 cores).
GENERATOR_THREADS = max(1, (os.cpu_count() or 2) // 4)
#: A run whose late sends exceed this share of its requests is generator-bound.
LATE_SHARE = 0.01


def offer(rate: float, seconds: float) -> dict[str, Any]:
    """One run on a node of its own, so that the node's own figures (its
    latency histogram counts from when it read each request) are this run's."""
    with harness.node(APP) as node:
        r = harness.loadgen(f"{node.url}/v1/pipelines/recsys/infer", BODY, [rate], seconds, warmup_s=2.0, seed=11,
                            slo_ms=SLO_MS, max_connections=MAX_CONNECTIONS, threads=GENERATOR_THREADS)[0]
        pipe = node.status()["pipelines"][0]
    sent = max(r["ok"] + r["errors"], 1)
    refused = r["errors_by_kind"].get("status_429", 0)
    return {"offered_rps": rate, "answered_rps": r["ok"] / seconds, "p50_ms": r["latency_ms"]["p50"],
            "p99_ms": r["latency_ms"]["p99"], "refused_share": refused / sent, "errors": r["errors"],
            "errors_by_kind": r["errors_by_kind"], "slower_than_slo": r.get("slower_than_slo"),
            "late_sends": r.get("late_sends"), "late_share": r.get("late_sends", 0) / sent,
            "node_p99_ms": pipe["latency_ms"]["p99"],
            "node_headroom": pipe.get("admission_headroom"),
            "queue_wait_p99_ms": {s["name"]: s["queue_wait_ms"]["p99"] for s in pipe["stages"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factor", type=float, default=1.3)
    ap.add_argument("--estimate", type=float, default=6000.0, help="a rough capacity, req/s (3x it is offered)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(harness.RESULTS / "late_admits"))
    a = ap.parse_args()
    machine = harness.machine()
    probe = offer(3 * a.estimate, a.seconds)
    capacity = probe["answered_rps"]
    print(f"capacity: {capacity:,.0f} answered/s while {3 * a.estimate:,.0f}/s was offered", flush=True)
    runs = []
    for i in range(a.repeat):
        r = offer(a.factor * capacity, a.seconds)
        runs.append(r)
        print(f"run {i + 1}/{a.repeat}: {r['answered_rps']:,.0f} answered/s of {r['offered_rps']:,.0f}, "
              f"admitted p99 {r['p99_ms']:.1f} ms (the node's own {r['node_p99_ms']:.1f} ms), "
              f"refused {100 * r['refused_share']:.1f}%, late sends {r['late_sends']}", flush=True)
    keys = ("answered_rps", "p50_ms", "p99_ms", "node_p99_ms", "refused_share")
    med = harness.medians(runs, keys)
    valid = [r for r in runs if r["late_share"] <= LATE_SHARE]
    judged = statistics.median(r["p99_ms"] for r in valid) if valid else None
    ok = judged is not None and judged <= SLO_MS
    md = [f"# Late admits: recsys at {a.factor:g}x capacity (SLO p99 {SLO_MS:g} ms)", "",
          f"Capacity {capacity:,.0f} answered/s (measured while {3 * a.estimate:,.0f}/s was offered); then "
          f"{a.factor * capacity:,.0f}/s offered, Poisson, {a.seconds:g} s per run, {a.repeat} runs.", "",
          "Admitted p99: at the client (from each request's scheduled send) and the node's own (from when it "
          "read the request).", "",
          "| run | answered/s | admitted p50 ms | admitted p99 ms | node's p99 ms | refused | late sends |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(runs, 1):
        md.append(f"| {i} | {r['answered_rps']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                  f"{r['node_p99_ms']:.1f} | {100 * r['refused_share']:.1f}% | {100 * r['late_share']:.1f}% |")
    md.append(f"| median | {med['answered_rps']:,.0f} | {med['p50_ms']:.1f} | {med['p99_ms']:.1f} | "
              f"{med['node_p99_ms']:.1f} | {100 * med['refused_share']:.1f}% | |")
    if judged is None:
        md += ["", f"Every run was generator-bound (late sends over {100 * LATE_SHARE:g}%): **not judged** "
               "(the node's own p99 is in the table)"]
    else:
        md += ["", f"Admitted p99 {judged:.1f} ms over the {len(valid)} run(s) the generator kept up with "
               f"(pass: <= {SLO_MS:g}): **{'pass' if ok else 'fail'}**"]
    print("\n".join(md))
    result = {"factor": a.factor, "capacity_rps": capacity, "probe": probe, "runs": runs, "median": med,
              "judged_p99_ms": judged, "pass": ok}
    paths = harness.write_results(a.out, result, "\n".join(md), machine)
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
