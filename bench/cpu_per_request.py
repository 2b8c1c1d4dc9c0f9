"""CPU time the node and its workers spend per request, at fixed loads
below capacity: the runtime's own overhead, measured in a way that a noisy
shared machine disturbs far less than tail latency.

    python bench/cpu_per_request.py [--rates 2000,5000] [--repeat 3]

Serves the two-stage no-op chain (examples/noop.py) with admission off,
offers each rate for 10 s (open loop, Poisson), and reads the node's and
the workers' CPU time from /proc before and after. The load generator runs
in this process and is not counted. To compare two builds with the same
load generator, point `--node-pythonpath` at the other build's `python/`
directory (its compiled `_core` beside it) and alternate runs on an idle
machine; compare medians. Writes bench/results/cpu_per_request.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import urllib.request
from pathlib import Path
from typing import Any

import slipstream as ss
from slipstream import _core

ROOT = Path(__file__).resolve().parent.parent


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(rates: list[float], duration: float) -> dict[float, dict[str, float]]:
    out = {}
    with ss.launch(ROOT / "examples" / "noop.py", "--no-admission", cwd=ROOT) as node:
        with urllib.request.urlopen(node.url + "/v1/status") as r:
            st = json.loads(r.read())
        node_pid = st["pid"]
        workers = [r["pid"] for s in st["pipelines"][0]["stages"] for r in s["replicas"]]
        body = json.dumps({"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}).encode()
        for rate in rates:
            cfg = {"url": node.url + "/v1/pipelines/noop/infer", "method": "POST", "body": list(body),
                   "content_type": "application/json", "headers": [], "rates": [rate], "duration_s": duration,
                   "warmup_s": 2.0, "arrival": {"kind": "poisson"}, "max_connections": 512, "timeout_s": 10.0,
                   "threads": 1, "seed": 7}
            n0, w0 = cpu_s(node_pid), sum(cpu_s(p) for p in workers)
            rep = json.loads(_core.bench(json.dumps(cfg), quiet=True))[0]
            n1, w1 = cpu_s(node_pid), sum(cpu_s(p) for p in workers)
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
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_per_request.json"))
    a = ap.parse_args()
    if a.node_pythonpath:
        os.environ["PYTHONPATH"] = a.node_pythonpath  # the node's; this process keeps its own generator
    rates = [float(r) for r in a.rates.split(",")]
    load = os.getloadavg()[0]
    runs = [measure(rates, a.duration) for _ in range(a.repeat)]
    med: dict[str, Any] = {}
    print(f"load average before: {load:.2f}\n{'rate/s':>8}{'node us/req':>13}{'workers us/req':>16}{'p50 ms':>8}"
          f"{'p99 ms':>8}")
    for rate in rates:
        m = {k: statistics.median(r[rate][k] for r in runs) for k in runs[0][rate]}
        med[str(rate)] = m
        print(f"{rate:>8.0f}{m['node_us']:>13.1f}{m['workers_us']:>16.1f}{m['p50_ms']:>8.2f}{m['p99_ms']:>8.2f}")
    Path(a.out).write_text(json.dumps({"loadavg_before": load, "repeat": a.repeat, "median": med,
                                       "runs": [{str(k): v for k, v in r.items()} for r in runs]}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
