"""Every example pipeline in one run, as a new user serves it: the offline
limit, the goodput at the SLO out of the box (`slipstream serve APP`, no
flags), its share of the limit and of the queueing ceiling, and Ray Serve
at the same counts, measured the same way.

    .venv/bin/python -m bench.examples                          # all five (~90 min on 2 cores)
    .venv/bin/python -m bench.examples --pipelines rag,multimodal
    .venv/bin/python -m bench.examples --fresh-profiles         # as on a fresh machine

1. `bench.limit --force` for the pipelines asked (bench/results/limit.json):
   the limit is measured in the same run as the goodput, on the same
   inputs (``bench.vs_ray.bodies.mix``), because this machine's speed
   drifts from day to day (multimodal's limit read 21.7 req/s one day and
   28.2 the next).
2. Per pipeline, `bench.goodput`'s ``out-of-box`` then ``ray-planned``
   configurations: open-loop Poisson rates, each run `--repeat` times and
   the median kept, the SLO held when the p99 of answers is within it and
   misses (errors, refusals and late answers) within its miss budget. Ray
   Serve gets the counts the out-of-box start planned (replicas, threads,
   batch limit per stage) and is measured by the same generator, rates
   and criterion. Each side's rates start at the fractions of the limit
   below (where the earlier runs put its knee: a prior for where to look,
   not a cap) and are searched from there (`bench.goodput.search`:
   halving while nothing holds, then `--refine` geometric steps).
3. The queueing ceiling (`bench.ceiling`): the share of the limit no
   server on these cores can hold the SLO beyond under Poisson arrivals.

With ``--fresh-profiles`` the node's profile cache is a new, empty
directory, so that each pipeline's first start profiles it on this
machine, as on a fresh install (and Ray's counts come from that profile).

Writes bench/results/examples.{json,md}; each pipeline's runs also go to
bench/results/examples_NAME.{json,md}. Benchmark on a quiet machine: the
load average before each run is recorded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import goodput, harness
from bench.harness import RESULTS, ROOT
from bench.limit import limit_entry

#: Per pipeline: the out-of-box and Ray Serve starting rates (fractions of
#: the limit) and the fewest requests a rate runs (bench.goodput's
#: --min-requests; audioquery's requests take 1.8 s of CPU each).
SETTINGS: dict[str, dict[str, Any]] = {
    "rag": {"fractions": [0.7, 0.8, 0.85, 0.9], "ray": [0.15, 0.25, 0.35], "min_requests": 300},
    "recsys": {"fractions": [0.4, 0.5, 0.55, 0.6], "ray": [0.003, 0.005, 0.008], "min_requests": 300},
    "multimodal": {"fractions": [0.5, 0.6, 0.65, 0.7], "ray": [0.2, 0.27, 0.35], "min_requests": 300},
    "rag_late": {"fractions": [0.3, 0.4, 0.5], "ray": [0.08, 0.12, 0.16], "min_requests": 300},
    "audioquery": {"fractions": [0.45, 0.5], "ray": [0.3, 0.4], "min_requests": 50},
}


def num(x: float) -> str:
    """A rate as the tables print it: whole with separators from 100 up, else three figures."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def pct(x: float) -> str:
    """A share as a percentage: whole from 10%, else two figures."""
    return f"{100 * x:.0f}%" if x >= 0.1 else f"{100 * x:.2g}%"


def row(name: str, res: dict[str, Any]) -> str:
    """One pipeline's line of the summary table."""
    ours, ray = res["configs"]["out-of-box"], res["configs"].get("ray-planned")
    ceil = res["ceiling"]
    b = ours["best"]
    held = (f"{num(b['offered_rps'])} (p99 {b['p99_ms']:.0f} ms, {100 * b['miss_rate']:.2f}% missed)" if b
            else "none tried")
    frac = ours["goodput_fraction"]
    served = ", ".join(f"{k} {v}" for k, v in ours["served_as"].items())
    if ray is None:
        vs = "-"
    else:
        rb = ray["best"]
        vs = f"{num(rb['goodput_rps'])} req/s ({pct(ray['goodput_fraction'])})" if rb else "none held"
        if rb and b:
            vs += f"; **{b['goodput_rps'] / rb['goodput_rps']:.1f}x**"
    return (f"| {name} ({res['slo_ms']:g} ms) | {num(res['limit_rps'])} | {num(ceil['rate_rps'])} "
            f"({pct(ceil['fraction'])}) | {served} | {held} | {num(b['goodput_rps'] if b else 0)} | "
            f"**{pct(frac)}** | {pct(frac / ceil['fraction'] if ceil['fraction'] else 0)} | {vs} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", default=",".join(SETTINGS))
    ap.add_argument("--repeat", type=int, default=3, help="runs per rate (the median is kept)")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per run, at least")
    ap.add_argument("--refine", type=int, default=2, help="geometric steps past the fractions (bench.goodput)")
    ap.add_argument("--no-ray", action="store_true", help="out of the box only")
    ap.add_argument("--no-limit", action="store_true", help="reuse bench/results/limit.json (not the same run)")
    ap.add_argument("--fresh-profiles", action="store_true",
                    help="an empty profile cache: every first start profiles, as on a fresh machine")
    ap.add_argument("--out", type=Path, default=RESULTS / "examples")
    a = ap.parse_args()
    names = a.pipelines.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        print(f"unknown pipeline(s) {', '.join(unknown)}: use {', '.join(SETTINGS)}", file=sys.stderr)
        return 2
    machine = harness.machine()
    print(f"load average before: {machine['loadavg_before']}", file=sys.stderr)
    if a.fresh_profiles:
        os.environ["SLIPSTREAM_CACHE_DIR"] = tempfile.mkdtemp(prefix="slipstream-profiles-")
        print(f"profile cache: {os.environ['SLIPSTREAM_CACHE_DIR']} (empty)", file=sys.stderr)
    if not a.no_ray:
        subprocess.run(["bash", str(ROOT / "bench/vs_ray/setup_ray.sh")], cwd=ROOT, check=True)
    if not a.no_limit:
        subprocess.run([sys.executable, "-m", "bench.limit", "--force", "--pipelines", ",".join(names)], cwd=ROOT,
                       check=True)
    configs = {"out-of-box": goodput.config("out-of-box")}
    if not a.no_ray:
        configs["ray-planned"] = goodput.config("ray-planned")
    out: dict[str, Any] = {"pipelines": {}, "command": " ".join(sys.argv)}
    for name in names:
        lim = limit_entry(name)
        if lim is None:
            print(f"{name}: no offline limit in bench/results/limit.json", file=sys.stderr)
            return 1
        s = SETTINGS[name]
        ns = argparse.Namespace(duration=a.duration, min_requests=s["min_requests"], repeat=a.repeat,
                                fractions=s["fractions"], ray_fractions=s["ray"], refine=a.refine)
        res = goodput.measure(name, goodput.APPS[name], lim, configs, ns)
        out["pipelines"][name] = res
        harness.write_results(a.out.with_name(f"{a.out.name}_{name}"), res, row(name, res), machine)
    lines = ["# Every example out of the box, against its limit, its queueing ceiling and Ray Serve", "",
             f"One run: `python -m {__spec__.name if __spec__ else 'bench.examples'} {' '.join(sys.argv[1:])}`. "
             f"Limit: bench.limit, measured first in the same run. Goodput: the median of {a.repeat} open-loop "
             "Poisson runs per rate, the highest rate at which the p99 of answers is within the SLO and misses "
             "(errors, refusals, late answers) within its budget. Ray Serve: the same components at the counts "
             "the out-of-box start planned, the same generator, rates and criterion.", "",
             "| pipeline (SLO) | limit req/s | queueing ceiling | served out of the box | highest rate holding "
             "| goodput | of the limit | of the ceiling | Ray Serve at the same counts; ratio |",
             "|---|---:|---:|---|---|---:|---:|---:|---|"]
    lines += [row(n, r) for n, r in out["pipelines"].items()]
    harness.write_results(a.out, out, "\n".join(lines), machine)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
