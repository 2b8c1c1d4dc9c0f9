"""Every example pipeline in one run, as a new user serves it: the offline
limit, the goodput at the SLO out of the box (`slipstream serve APP`, no
flags), its share of the limit and of the queueing ceiling, and Ray Serve
at the same counts, measured the same way.

    .venv/bin/python -m bench.examples --ray-min-requests 60    # all five (~90 min on 2 cores)
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

Ray Serve's rates often fall to a few requests a second (multimodal) or
below one (audioquery), where 300 requests a rate take minutes each run:
``--ray-min-requests 60`` bounds that (what ``make bench-examples`` uses).

With ``--fresh-profiles`` the node's profile cache is a new, empty
directory, so that each pipeline's first start profiles it on this
machine, as on a fresh install (and Ray's counts come from that profile).

Writes bench/results/examples.{json,md}; each pipeline's runs also go to
bench/results/examples_NAME.{json,md}. Benchmark on a quiet machine: the
load average before each run is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import goodput, harness
from bench.ceiling import ceiling
from bench.harness import RESULTS, ROOT
from bench.limit import limit_entry, missing_limit

#: Per pipeline: the out-of-box and Ray Serve starting rates (fractions of
#: the limit) and the fewest requests a rate runs (bench.goodput's
#: --min-requests; audioquery's requests take 1.8 s of CPU each).
SETTINGS: dict[str, dict[str, Any]] = {
    "rag": {"fractions": [0.7, 0.8, 0.85, 0.9], "ray": [0.15, 0.25, 0.35], "min_requests": 300},
    "recsys": {"fractions": [0.4, 0.5, 0.55, 0.6], "ray": [0.003, 0.005, 0.008], "min_requests": 300},
    "multimodal": {"fractions": [0.5, 0.6, 0.65, 0.7], "ray": [0.2, 0.27, 0.35], "min_requests": 300},
    # Its Search is elastic (re-ranks until its batch's time runs out): the
    # goodput and the limit are at less re-rank than a lone query gets.
    "rag_late": {"fractions": [0.4, 0.5, 0.55, 0.6], "ray": [0.08, 0.12, 0.16], "min_requests": 300,
                 "note": "elastic Search: the share of the re-rank falls with the load, see bench.late_served"},
    "audioquery": {"fractions": [0.5, 0.6], "ray": [0.3, 0.4], "min_requests": 200},
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
    arrived = f"arrived {num(b['arrived_rps'])}, " if b and "arrived_rps" in b else ""
    held = (f"{num(b['offered_rps'])} ({arrived}p99 {b['p99_ms']:.0f} ms, {100 * b['miss_rate']:.2f}% missed)" if b
            else "none tried")
    frac = ours["goodput_fraction"]
    served = ", ".join(f"{k} {v}" for k, v in ours["served_as"].items())
    if SETTINGS.get(name, {}).get("note"):
        served += f" ({SETTINGS[name]['note']})"
    if ray is None:
        vs = "-"
    else:
        rb = ray["best"]
        vs = f"{num(rb['goodput_rps'])} req/s ({pct(ray['goodput_fraction'])})" if rb else "none held"
        if rb and b:
            vs += f"; **{b['goodput_rps'] / rb['goodput_rps']:.1f}x**"
    # (A limit measured cores short is low: the shares below read high.)
    short = " (measured cores short: low)" if (res.get("limit") or {}).get("cores_short") else ""
    return (f"| {name} ({res['slo_ms']:g} ms) | {num(res['limit_rps'])}{short} | {num(ceil['rate_rps'])} "
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
    ap.add_argument("--ray-min-requests", type=int,
                    help="Ray Serve's rates run at least this many requests (default: as Slipstream's); "
                         "Ray's low rates otherwise take minutes each")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other pipelines' results already in OUT.json (rerun some of them)")
    ap.add_argument("--ceilings", action="store_true",
                    help="measure nothing: compute the queueing ceilings in OUT.json again and rewrite OUT.md")
    a = ap.parse_args()
    if a.ceilings:
        doc = json.loads(a.out.with_suffix(".json").read_text())
        write(a.out, with_ceilings(doc), doc["machine"], int(doc.get("repeat", a.repeat)))
        return 0
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
    out: dict[str, Any] = {"pipelines": {}, "repeat": a.repeat, "command": "python -m bench.examples " + " ".join(sys.argv[1:])}
    for name in names:
        lim = limit_entry(name)
        if lim is None:
            print(missing_limit(name), file=sys.stderr)
            return 1
        s = SETTINGS[name]
        ns = argparse.Namespace(duration=a.duration, min_requests=s["min_requests"], repeat=a.repeat,
                                fractions=s["fractions"], ray_fractions=s["ray"], refine=a.refine,
                                ray_min_requests=a.ray_min_requests)
        res = goodput.measure(name, goodput.APPS[name], lim, configs, ns)
        res["limit"] = lim
        res["measured"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        res["command"] = machine["command"]
        out["pipelines"][name] = res
        harness.write_results(a.out.with_name(f"{a.out.name}_{name}"), res, row(name, res), machine)
    if a.merge:
        out = merged(a.out, out)
    write(a.out, out, machine, a.repeat)
    return 0


def merged(path: Path, out: dict[str, Any]) -> dict[str, Any]:
    """`out` with the results of the other pipelines already written under
    `path`: each pipeline's own file (``OUT_NAME.json``, written as soon
    as it is measured, so also those of a run cut short)."""
    pipelines: dict[str, Any] = {}
    for name in SETTINGS:
        part = path.with_name(f"{path.name}_{name}.json")
        if name in out["pipelines"]:
            pipelines[name] = out["pipelines"][name]
        elif part.is_file():
            pipelines[name] = {k: v for k, v in json.loads(part.read_text()).items() if k != "machine"}
            pipelines[name]["command"] = json.loads(part.read_text())["machine"].get("command")
    return {**out, "pipelines": pipelines}


def with_ceilings(out: dict[str, Any]) -> dict[str, Any]:
    """Each pipeline's queueing ceiling computed again (bench.ceiling: a
    simulation, nothing measured) from its limit in the same file."""
    from slipstream._internal.app import load_pipelines

    for name, res in out["pipelines"].items():
        lim = res.get("limit") or limit_entry(name)  # (files from before the limit was kept in them)
        assert lim is not None, f"{name}: no limit"
        _, pipes = load_pipelines(str(ROOT / res["app"]))
        slo = next(p for p in pipes if p.name == name).slo
        res["ceiling"] = ceiling(float(lim["cpu_us_per_request"]), int(lim["cores"]), res["slo_ms"],
                                 slo.max_miss_rate if slo else 0.01)
    return out


def write(path: Path, out: dict[str, Any], machine: dict[str, Any], repeat: int) -> None:
    """bench/results/examples.{json,md}: the summary table of `out`."""
    runs: dict[str, list[str]] = {}
    for name, res in out["pipelines"].items():
        runs.setdefault(res.get("command") or out["command"], []).append(name)
    said = "; ".join(f"`{c}` ({', '.join(n)})" for c, n in runs.items())
    lines = ["# Every example out of the box, against its limit, its queueing ceiling and Ray Serve", "",
             f"Runs: {said}. Limit: bench.limit, measured first in the same run. Goodput: the "
             f"median of {repeat} open-loop Poisson runs per rate (each with its own arrival seed), the answers "
             "within the SLO per second at the highest offered rate at which the p99 of answers is within the SLO "
             "and misses (errors, refusals, late answers) within its budget; `arrived`: the rate the runs' Poisson "
             "draws actually sent (median), which the goodput follows. Ray Serve: the same "
             "components at the counts the out-of-box start planned, the same generator, rates and criterion. "
             "Queueing ceiling: bench.ceiling (the limit's CPU a request as a deterministic service, Poisson "
             "arrivals, a core per request or each split over the cores, an ideal admission control).", "",
             "| pipeline (SLO) | limit req/s | queueing ceiling | served out of the box | highest rate holding "
             "| goodput | of the limit | of the ceiling | Ray Serve at the same counts; ratio |",
             "|---|---:|---:|---|---|---:|---:|---:|---|"]
    lines += [row(n, r) for n, r in out["pipelines"].items()]
    harness.write_results(path, out, "\n".join(lines), machine)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
