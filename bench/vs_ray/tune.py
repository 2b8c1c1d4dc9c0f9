"""Pick the Ray adapter's knobs in good faith: serve a pipeline with Ray
under each candidate setting and sweep a few rates with the same generator.

    .venv/bin/python -m bench.vs_ray.tune examples/recsys.py:recsys --rates 100,200,250,300 \\
        --config "" --config "--batch-wait-ms=2" --config "--compute-thread"

Each ``--config`` is a space-separated list of ``ray_adapter.py serve``
options ("" = the defaults). Prints a table (p50 / p99 per rate and config)
and appends it, with the machine record (``bench.harness.machine``), to
``bench/results/vs_ray_tuning.json`` (a history: one entry per run). The settings chosen
from it, and the runs behind them, are in bench/vs_ray/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from bench import harness
from bench.harness import RESULTS
from bench.vs_ray import bodies
from bench.vs_ray.compare import load_target, summarize
from bench.vs_ray.servers import RayServer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="app.py:pipeline")
    ap.add_argument("--rates", required=True)
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=1, help="alternate the configs this many rounds")
    a = ap.parse_args()
    app, pipe, _ = load_target(a.target)
    body, _ = bodies.body(app, pipe)
    rates = [float(r) for r in a.rates.split(",")]
    machine = harness.machine()
    rows: list[dict[str, Any]] = []
    for rnd in range(a.repeat):
        for cfg in a.config:
            server = RayServer(str(app), pipe.name, RESULTS, cfg.split())
            with server:
                for _ in range(5):
                    server.infer(body)
                for rate in rates:
                    r = summarize(harness.loadgen(server.infer_url, body, [rate], a.duration, warmup_s=a.warmup,
                                                  timeout_s=10.0)[0])
                    r |= {"config": cfg or "(defaults)", "round": rnd, "stages": server.stage_stats()}
                    rows.append(r)
                    batch = {n: round(s["batch_size"]["mean"], 1) for n, s in r["stages"].items()}
                    print(f"{cfg or '(defaults)':<28} {rate:>7.0f} req/s  p50 {r['p50_ms']:8.2f}  "
                          f"p99 {r['p99_ms']:8.2f} ms  errors {r['errors']}  batch {batch}", flush=True)
                    server.reset_metrics()
                    time.sleep(1)
    out = RESULTS / "vs_ray_tuning.json"
    hist = json.loads(out.read_text()) if out.exists() else []
    hist.append({"machine": machine, "target": a.target, "rates": rates, "runs": rows})
    out.write_text(json.dumps(hist, indent=1))
    print(f"appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
