"""CPU time the node and its workers spend per request, at fixed loads
below capacity: the runtime's own overhead, measured in a way that a noisy
shared machine disturbs far less than tail latency.

    .venv/bin/python -m bench.cpu_per_request [--rates 2000,5000] [--repeat 3]
    .venv/bin/python -m bench.cpu_per_request --baseline /path/to/other/python

Serves the two-stage no-op chain (examples/noop.py) with admission off,
offers each rate for 10 s (open loop, Poisson), and reads the node's and
the workers' CPU time from /proc before and after. The load generator runs
in this process and is not counted.

The floor: each repeat also offers the same rates, with the same
generator and body, to a bare Go HTTP echo server (bench/echo), whose CPU
per request is what one HTTP request and answer cost on this machine
before any serving work (on a small VM most of it is the kernel's TCP
path, which the loopback charges to both ends).

`--baseline DIR` compares two builds: DIR is another checkout's `python/`
directory with its compiled `_core` beside it (its workers run its Python
too); each repeat serves the baseline and then this build, back to back,
so that a noisy minute hits both. Medians over the repeats. Writes
bench/results/cpu_per_request.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bench import harness
from bench.harness import RESULTS, ROOT, group_cpu_seconds
from bench.run import start_echo

BODY = json.dumps({"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}).encode()


def _offer(url: str, rate: float, duration: float, groups: dict[str, list[int]]) -> tuple[dict[str, float], Any]:
    """Microseconds of CPU per request sent, per group of processes, while
    `rate` is offered; and the generator's report."""
    before = group_cpu_seconds(groups)
    rep = harness.loadgen(url, BODY, [rate], duration, warmup_s=2.0, seed=7)[0]
    # Warm-up requests ran too: charge the CPU to every request sent.
    sent = (rep["ok"] + rep["errors"]) * (duration + 2.0) / duration
    return {g: (cpu - before[g]) / sent * 1e6 for g, cpu in group_cpu_seconds(groups).items()}, rep


def serve(rates: list[float], duration: float, pythonpath: str | None) -> dict[float, dict[str, float]]:
    out = {}
    env = {"PYTHONPATH": pythonpath} if pythonpath else None
    with harness.node(ROOT / "examples" / "noop.py", "--no-admission", env=env) as node:
        st = node.status()
        workers = [r["pid"] for s in st["pipelines"][0]["stages"] for r in s["replicas"]]
        for rate in rates:
            us, rep = _offer(node.url + "/v1/pipelines/noop/infer", rate, duration,
                             {"node": [st["pid"]], "workers": workers})
            out[rate] = {"node_us": us["node"], "workers_us": us["workers"], "total_us": us["node"] + us["workers"],
                         "p50_ms": rep["latency_ms"]["p50"], "p99_ms": rep["latency_ms"]["p99"],
                         "errors": rep["errors"]}
    return out


def echo_floor(rates: list[float], duration: float) -> dict[float, dict[str, float]]:
    echo = start_echo()
    if echo is None:
        return {}
    proc, url = echo
    try:
        out = {}
        for rate in rates:
            us, rep = _offer(url, rate, duration, {"echo": [proc.pid]})
            out[rate] = {"echo_us": us["echo"], "p50_ms": rep["latency_ms"]["p50"], "p99_ms": rep["latency_ms"]["p99"]}
        return out
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="2000,5000")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", help="another build's python/ directory, served in alternation with this one")
    ap.add_argument("--no-floor", action="store_true", help="skip the bare Go echo server")
    ap.add_argument("--out", default=str(RESULTS / "cpu_per_request.json"))
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    machine = harness.machine()
    builds = (["baseline"] if a.baseline else []) + ["this build"]
    runs: dict[str, list[dict[float, dict[str, float]]]] = {b: [] for b in builds}
    floor: list[dict[float, dict[str, float]]] = []
    for i in range(a.repeat):
        print(f"repeat {i + 1}/{a.repeat}", file=sys.stderr, flush=True)
        for b in builds:
            runs[b].append(serve(rates, a.duration, a.baseline if b == "baseline" else None))
        if not a.no_floor:
            f = echo_floor(rates, a.duration)
            if f:
                floor.append(f)
    med = {b: {str(r): harness.medians([run[r] for run in runs[b]]) for r in rates} for b in builds}
    floor_med = {str(r): harness.medians([f[r] for f in floor]) for r in rates} if floor else {}
    md = ["# CPU per request: the two-stage no-op chain, admission off", "",
          f"Median of {a.repeat} run(s) of {a.duration:g} s per rate"
          + (f"; baseline from `{a.baseline}`, served in alternation with this build" if a.baseline else "")
          + ". CPU per request sent (warm-up included); the generator is not counted.", "",
          "| build | rate/s | node us/request | workers us/request | total | p50 ms | p99 ms |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for b in builds:
        for r in rates:
            m = med[b][str(r)]
            md.append(f"| {b} | {r:.0f} | {m['node_us']:.1f} | {m['workers_us']:.1f} | {m['total_us']:.1f} | "
                      f"{m['p50_ms']:.2f} | {m['p99_ms']:.2f} |")
    if floor_med:
        md += ["", "The floor: a bare Go HTTP echo server (bench/echo) under the same generator and body, "
               "in the same repeats.", "", "| rate/s | echo us/request | node / echo |", "|---:|---:|---:|"]
        for r in rates:
            e = floor_med[str(r)]["echo_us"]
            md.append(f"| {r:.0f} | {e:.1f} | {med['this build'][str(r)]['node_us'] / e:.2f} |")
    if a.baseline:
        md += ["", "| rate/s | node after/before | workers after/before | total after/before |", "|---:|---:|---:|---:|"]
        for r in rates:
            x, y = med["this build"][str(r)], med["baseline"][str(r)]
            md.append(f"| {r:.0f} | {x['node_us'] / y['node_us']:.2f} | {x['workers_us'] / y['workers_us']:.2f} | "
                      f"{x['total_us'] / y['total_us']:.2f} |")
    print("\n".join(md))
    result = {"repeat": a.repeat, "duration_s": a.duration, "baseline": a.baseline, "median": med,
              "floor_median": floor_med,
              "runs": {b: [{str(k): v for k, v in r.items()} for r in runs[b]] for b in builds},
              "floor_runs": [{str(k): v for k, v in f.items()} for f in floor]}
    json_path, md_path = harness.write_results(a.out, result, "\n".join(md), machine)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
