"""Finding 1 of the robustness work, reproduced with an independent load
generator (``oha``: ``cargo install oha --locked``): spikes far past
capacity whose clients drop the connections still in flight when each run
ends, then a steady load well within capacity. A node whose admission gate
leaks abandoned requests refuses most of the steady load for good.

    .venv/bin/python -m bench.spike_then_steady [--spikes 4] [--steady 3000]

Serves ``examples/echo.py``; each spike is ``oha -z 8s -q 30000 -c 256
--latency-correction``, each steady run 10 s at ``--steady`` req/s over 64
connections (twice). Prints oha's status counts per run and, after each
steady run, the admission gate's books; writes
bench/results/spike_then_steady.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import EXAMPLES, RESULTS

BODY = json.dumps({"inputs": {"x": [[3, 4]]}}).encode()


def run(url: str, seconds: float, rate: float, connections: int) -> dict[str, Any]:
    r = harness.oha(url, seconds=seconds, concurrency=connections, rate=rate, body=BODY,
                    headers=["Content-Type: application/json"])
    print(f"  {r['rps']:.0f} req/s, statuses {r['status']}, failed {r['errors']}, p99 {r['p99_ms']:.1f} ms",
          flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spikes", type=int, default=4)
    ap.add_argument("--steady", type=float, default=3000.0, help="req/s of the steady runs")
    ap.add_argument("--out", type=Path, default=RESULTS / "spike_then_steady", help="results path without suffix")
    a = ap.parse_args()
    if harness.OHA is None:
        print("needs oha: cargo install oha --locked", file=sys.stderr)
        return 1
    machine = harness.machine()
    res: dict[str, Any] = {"spikes": [], "steady": []}
    with harness.node(EXAMPLES / "echo.py") as node:
        url = f"{node.url}/v1/pipelines/demo/infer"
        for i in range(a.spikes):
            print(f"spike {i + 1}/{a.spikes}: 8 s at 30,000 req/s over 256 connections", flush=True)
            res["spikes"].append(run(url, 8, 30_000, 256))
            time.sleep(1)
        for i in range(2):
            print(f"steady {a.steady:.0f} req/s for 10 s ({i + 1}/2)", flush=True)
            steady = run(url, 10, a.steady, 64)
            p = node.status()["pipelines"][0]
            steady["gate"] = {"admission": p.get("admission"), "cancelled": p.get("cancelled")}
            print(f"  gate: {steady['gate']['admission']}, cancelled: {steady['gate']['cancelled']}", flush=True)
            res["steady"].append(steady)
    md = ["# Load spikes, then a steady load (oha)", "",
          f"`examples/echo.py`; {a.spikes} spike(s) of 8 s at 30,000 req/s over 256 connections, then 10 s at "
          f"{a.steady:.0f} req/s over 64 connections, twice.", "",
          "| run | req/s | statuses | failed | p99 ms | gate in flight |", "|---|---:|---|---|---:|---:|"]
    for name, runs in (("spike", res["spikes"]), ("steady", res["steady"])):
        for i, r in enumerate(runs):
            gate = ((r.get("gate") or {}).get("admission") or {}).get("inflight", "")
            md.append(f"| {name} {i + 1} | {r['rps']:.0f} | {r['status']} | {r['errors'] or ''} | {r['p99_ms']:.1f} "
                      f"| {gate} |")
    json_path, md_path = harness.write_results(a.out, res, "\n".join(md), machine)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
