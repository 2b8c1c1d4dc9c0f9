"""CPU time the node and its workers spend per request, at fixed loads
below capacity: the runtime's own overhead, measured in a way that a noisy
shared machine disturbs far less than tail latency.

    .venv/bin/python -m bench.cpu_per_request [--rates 2000,5000] [--repeat 3]

Serves the two-stage no-op chain (examples/noop.py) with admission off,
offers each rate for 10 s (open loop, Poisson), and reads the node's and
the workers' CPU time from /proc before and after. The load generator runs
in this process and is not counted. To compare two builds with the same
load generator, point `--node-pythonpath` at the other build's `python/`
directory (its compiled `_core` beside it) and alternate runs on an idle
machine; compare medians. Writes bench/results/cpu_per_request.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from bench import harness
from bench.harness import RESULTS, ROOT, cpu_seconds


def measure(rates: list[float], duration: float) -> dict[float, dict[str, float]]:
    out = {}
    with harness.node(ROOT / "examples" / "noop.py", "--no-admission") as node:
        st = node.status()
        node_pid = st["pid"]
        workers = [r["pid"] for s in st["pipelines"][0]["stages"] for r in s["replicas"]]
        body = json.dumps({"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}).encode()
        for rate in rates:
            n0, w0 = cpu_seconds(node_pid), sum(cpu_seconds(p) for p in workers)
            rep = harness.loadgen(node.url + "/v1/pipelines/noop/infer", body, [rate], duration, warmup_s=2.0,
                                  seed=7)[0]
            n1, w1 = cpu_seconds(node_pid), sum(cpu_seconds(p) for p in workers)
            # Warm-up requests ran too: charge the CPU to every request sent.
            done = (rep["ok"] + rep["errors"]) * (duration + 2.0) / duration
            out[rate] = {"node_us": (n1 - n0) / done * 1e6, "workers_us": (w1 - w0) / done * 1e6,
                         "p50_ms": rep["latency_ms"]["p50"], "p99_ms": rep["latency_ms"]["p99"],
                         "errors": rep["errors"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="2000,5000")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--node-pythonpath", help="serve with the slipstream package found here (another build)")
    ap.add_argument("--out", default=str(RESULTS / "cpu_per_request.json"))
    a = ap.parse_args()
    if a.node_pythonpath:
        os.environ["PYTHONPATH"] = a.node_pythonpath  # the node's; this process keeps its own generator
    rates = [float(r) for r in a.rates.split(",")]
    machine = harness.machine()
    runs = [measure(rates, a.duration) for _ in range(a.repeat)]
    med: dict[str, Any] = {}
    md = ["# CPU per request: the two-stage no-op chain, admission off", "",
          f"Median of {a.repeat} run(s) of {a.duration:g} s per rate"
          + (f"; node from `{a.node_pythonpath}`" if a.node_pythonpath else "") + ".", "",
          "| rate/s | node us/request | workers us/request | p50 ms | p99 ms |", "|---:|---:|---:|---:|---:|"]
    for rate in rates:
        m = {k: statistics.median(r[rate][k] for r in runs) for k in runs[0][rate]}
        med[str(rate)] = m
        md.append(f"| {rate:.0f} | {m['node_us']:.1f} | {m['workers_us']:.1f} | {m['p50_ms']:.2f} | "
                  f"{m['p99_ms']:.2f} |")
    print("\n".join(md))
    result = {"repeat": a.repeat, "node_pythonpath": a.node_pythonpath, "median": med,
              "runs": [{str(k): v for k, v in r.items()} for r in runs]}
    json_path, md_path = harness.write_results(a.out, result, "\n".join(md), machine)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
