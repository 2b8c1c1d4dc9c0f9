"""Goodput at the SLO, as a share of the offline compute limit.

For each pipeline (RAG and multimodal by default), serve it in each
configuration asked for (`--configs`):

- ``out-of-box``: `slipstream serve APP` with no flags, as a new user runs
  it: the node sizes the stages the app leaves out from a profile of this
  machine (measured on its first start, then cached: `sizing.py`), with
  the default autoscaler;
- ``declared``: the app's declaration as written (`--sizing declared`,
  autoscaler off, at its starting replica counts): what serving gave before
  it planned by default;
- ``planned``: `slipstream plan APP --cores N` first, then `serve --plan`
  (autoscaler off);
- ``deadline-order``: out of the box, but batches formed in deadline order
  only (`--no-batch-by-length`): what length-aware batching adds;
- ``no-admission``: out of the box without admission control
  (`--no-admission`): what the gate's refusals cost or save;
- ``no-autoscale``: out of the box with the autoscaler off
  (`--autoscale off`): the plan's starting counts, held;
- ``max-wait-MS`` (e.g. ``max-wait-50``): out of the box with delayed
  batching, a replica waiting up to MS ms for a larger batch
  (`--max-wait-ms MS`; off by default, docs/design/scheduling.md);
- ``ray-planned``: Ray Serve (bench/vs_ray's adapter: the same component
  classes, a deployment per stage) at the counts `slipstream serve` plans
  on this machine (replicas, threads and max batch per stage, from the
  profile the ``out-of-box`` start measured), autoscaling off, measured by
  the same generator, rates and criterion as the other configurations;
  run it after ``out-of-box``. A stage receiving over 1 MB a request is
  handed its inputs through Ray's object store, the faster of Ray's two
  paths for large tensors (bench/vs_ray/compare.py measures both).

The requests are the pipeline's input mix (``bench.vs_ray.bodies.mix``:
RAG's 1,000 benchmark queries, sent in turn), the inputs bench.limit
measures the limit on, as the pipeline API's JSON (what ``curl`` sends,
and the bytes Ray Serve's adapter gets too). A Slipstream configuration
named with ``+v2`` (``out-of-box+v2``) sends the same inputs as KServe v2
binary tensors instead, what ``ss.Client`` sends (`Wire.v2`): the
node then reads an image's bytes as they are rather than parsing a number
per pixel.

At offered Poisson rates from 60% to 105% of the offline
compute limit (bench.limit), measure what is answered within the SLO.
The SLO holds at a rate when the p99 of answered requests is within the
target and misses (errors, refusals, answers later than the target) are at
most the allowed share; the headline is the goodput (answers within the
SLO per second) at the highest such rate, beside the limit and the
queueing ceiling (bench.ceiling: the share of the limit an ideal server
could hold the SLO at with Poisson arrivals; multimodal's and
audioquery's SLOs are a few requests' CPU time, which puts it far below
100%). Each rate runs at least `--min-requests` requests (a longer run
at low rates), so that one miss is not already more than the SLO allows.

    .venv/bin/python -m bench.limit            # first: the limit per pipeline
    .venv/bin/python -m bench.goodput          # -> bench/results/goodput.{json,md}

Each rate runs `--repeat` times (alternating configurations) and the
median is kept; the load average before each run is recorded. The load
generator shares the machine's cores with the node, as everywhere in
bench/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import harness
from bench.ceiling import ceiling
from bench.harness import RESULTS, ROOT
from bench.limit import limit_entry, missing_limit

APPS = {"rag": "examples/rag.py", "recsys": "examples/recsys.py", "multimodal": "examples/multimodal.py",
        "audioquery": "examples/audioquery.py", "rag_late": "examples/rag_late.py"}
#: Each configuration: the serve flags and the sizing (see the module doc).
CONFIGS = {"out-of-box": ([], "plan"), "declared": (["--autoscale", "off"], "declared"),
           "planned": (["--autoscale", "off"], "declared"),
           "deadline-order": (["--no-batch-by-length"], "plan"),
           "no-admission": (["--no-admission"], "plan"),
           "no-autoscale": (["--autoscale", "off"], "plan"),
           "ray-planned": ([], "ray")}
#: The first run's arrival seed (repeats count on from it).
SEED = 11
#: A configuration's suffix for requests as KServe v2 binary bodies.
V2 = "+v2"


def config(name: str) -> tuple[list[str], str]:
    """The serve flags and sizing of configuration `name` (see the module doc)."""
    if name.endswith(V2) and name != "ray-planned" + V2:
        name = name.removesuffix(V2)
    if name in CONFIGS:
        return CONFIGS[name]
    ms = name.removeprefix("max-wait-")
    try:
        if ms != name and float(ms) >= 0:
            return ["--max-wait-ms", ms], "plan"
    except ValueError:
        pass
    raise ValueError(f"unknown configuration {name!r}: use one of {', '.join(CONFIGS)} or max-wait-MS")


FRACTIONS = (0.6, 0.75, 0.85, 0.9, 0.95, 1.0, 1.05)


def plan_for(app: str, cores: float, out: Path) -> dict[str, Any]:
    """Profile the app (threads 1 and 2) unless it has a profile, then plan it."""
    if not (ROOT / app).with_suffix(".profile.json").is_file():
        subprocess.run([sys.executable, "-m", "slipstream._internal.cli", "profile", app, "--threads", "1,2"],
                       cwd=ROOT, check=True)
    cmd = [sys.executable, "-m", "slipstream._internal.cli", "plan", app, "--cores", f"{cores:g}", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return dict(json.loads(out.read_text()))


@dataclasses.dataclass(frozen=True)
class Wire:
    """How the requests travel: the bodies (sent in turn), the route they
    are posted to (``{p}``: the pipeline) and the headers every one
    carries. The default is the JSON of the pipeline API, what ``curl``
    or Ray Serve's adapter take; `v2` is what ``ss.Client`` sends."""

    bodies: list[bytes]
    route: str = "/v1/pipelines/{p}/infer"
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def v2(cls, bodies: list[bytes], pipe: Any) -> Wire:
        """The same requests as KServe v2 binary bodies (``bodies.as_v2``)."""
        from bench.vs_ray.bodies import as_v2

        binary, header_len = as_v2(bodies, pipe)
        return cls(binary, "/v2/models/{p}/infer", "application/octet-stream",
                   (("Inference-Header-Content-Length", str(header_len)),))

    def run(self, url: str, pipeline: str, rate: float, seconds: float, **kw: Any) -> dict[str, Any]:
        """One run of the project's generator at `rate` sending these
        requests to `pipeline` of the node at `url` (``harness.loadgen``,
        its other settings in `kw`): its report."""
        return harness.loadgen(url + self.route.format(p=pipeline), self.bodies[0], [rate], seconds,
                               bodies=self.bodies if len(self.bodies) > 1 else (), content_type=self.content_type,
                               headers=self.headers, **kw)[0]


def run_rate(url: str, pipeline: str, bodies: list[bytes] | Wire, rate: float, seconds: float, slo_ms: float,
             warmup_s: float = 2.0, seed: int = SEED) -> dict[str, Any]:
    """One open-loop Poisson run at `rate` with the project's generator: what
    was answered, within the SLO or not (goodput), and the load average.
    `bodies` are sent in turn (the input mix), as JSON unless a `Wire`
    says otherwise."""
    wire = bodies if isinstance(bodies, Wire) else Wire(bodies)
    urllib.request.urlopen(urllib.request.Request(url + "/v1/admin/reset-metrics", method="POST"), timeout=5).read()
    r = wire.run(url, pipeline, rate, seconds, warmup_s=warmup_s, max_connections=1024, timeout_s=10.0, seed=seed,
                 slo_ms=slo_ms)
    sent = max(int(r["sent"]), 1)
    good = int(r["ok"]) - int(r["slower_than_slo"])
    return {"offered_rps": rate, "arrived_rps": sent / r["duration_s"], "sent": sent, "ok": r["ok"],
            "errors": r["errors"], "errors_by_kind": r["errors_by_kind"], "late": r["slower_than_slo"],
            "p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"],
            "miss_rate": (sent - good) / sent, "goodput_rps": good / r["duration_s"],
            "load_avg": os.getloadavg()[0]}


def served_as(status: dict[str, Any], pipeline: str) -> dict[str, str]:
    """Each stage of `pipeline` as the node serves it (``/v1/status``):
    replicas x threads and the batch limit, e.g. ``2x1t b8``."""
    return {s["name"]: f"{len(s['replicas'])}x{s['threads']}t b{s['max_batch_size']}"
            for p in status["pipelines"] if p["name"] == pipeline for s in p["stages"]}


@contextlib.contextmanager
def serving(app: str, pipe: Any, flags: list[str], sizing: str, probe: bytes
            ) -> Iterator[tuple[str, dict[str, str]]]:
    """Serve `pipe` of `app` in one configuration (see the module doc):
    yields its base URL and each stage as served (``2x1t b8``). `probe`:
    a request (Ray's warm-up, which also shows how large its stages'
    inputs are)."""
    if sizing != "ray":
        with harness.node(ROOT / app, *flags, sizing=sizing) as node:
            time.sleep(1.0)
            yield node.url, served_as(node.status(), pipe.name)
        return
    from bench.vs_ray.compare import load_target, planned_sizes, wrapper
    from bench.vs_ray.servers import RayServer

    path, _, target = load_target(f"{app}:{pipe.name}")
    counts = planned_sizes(path, pipe)
    wrapped, _ = wrapper(path, target.rpartition(":")[2], None, counts)
    server = RayServer(str(wrapped), pipe.name, RESULTS, [])
    server.start()
    try:
        for _ in range(3):  # a cold first call may miss; then see how large the stages' inputs are
            server.infer(probe)
        server.by_reference_if_large(lambda msg: print(msg, file=sys.stderr))
        yield server.base, {n: f"{r}x{t}t b{b}" for n, (r, t, b) in counts.items()}
    finally:
        server.stop()


def search(rates: list[float], limit: float, point: Callable[[float], bool], refine: int) -> list[float]:
    """Which rates to measure, in order: `rates` rising until one above 90%
    of the limit misses; if none held (Ray Serve, often), the lowest
    halved until one holds (down to 1/256 of the limit); if the highest
    held, 1.5 times it until one misses (up to the limit); then up to
    `refine` rates between the highest that held and the lowest above it
    that missed (geometric means, while they are more than 4% apart).
    `point(rate)` measures a rate and says whether it held. Returns the
    rates measured."""
    done: dict[float, bool] = {}

    def at(rate: float) -> bool:
        done[rate] = point(rate)
        return done[rate]

    for rate in rates:
        if not at(rate) and rate > limit * 0.9:
            break  # past the knee
    low = min(rates)
    while not any(done.values()) and low > limit / 256:
        low = nice(low / 2)
        at(low)
    high = max(done)
    while done[high] and high < limit:  # the highest held: look above it (Ray Serve beyond its prior)
        high = nice(min(high * 1.5, limit))
        if high in done:
            break
        at(high)
    for _ in range(refine):
        held = max((r for r, ok in done.items() if ok), default=None)
        above = [r for r, ok in done.items() if not ok and held is not None and r > held]
        if held is None or not above:
            break
        mid = nice((held * min(above)) ** 0.5)
        if mid <= held * 1.04 or mid >= min(above):
            break  # no rate between worth a run
        at(mid)
    return list(done)


def nice(rate: float) -> float:
    """A rate rounded to three significant figures (whole above 20 req/s)."""
    return float(round(rate)) if rate >= 20 else float(f"{rate:.3g}")


def holds(row: dict[str, Any], slo_ms: float, max_miss: float) -> bool:
    return bool(row["ok"] > 0 and row["p99_ms"] <= slo_ms and row["miss_rate"] <= max_miss)


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rows[0])
    for k in ("arrived_rps", "goodput_rps", "p50_ms", "p99_ms", "miss_rate", "load_avg"):
        out[k] = statistics.median(r[k] for r in rows)
    out["runs"] = [{k: r[k] for k in ("arrived_rps", "goodput_rps", "p99_ms", "miss_rate", "load_avg")}
                   for r in rows]
    return out


def repeated(run: Callable[[int], dict[str, Any]], repeat: int, first_seed: int = SEED) -> dict[str, Any]:
    """`repeat` runs of one rate, each with its own arrival seed (from
    `first_seed` up), as their median row. A few hundred Poisson arrivals
    run 5-10% off the rate (one seed's draw put 274 arrivals where 300 were
    due), so runs that all drew the same arrivals would share that draw's
    luck, good or bad."""
    return median_row([run(first_seed + i) for i in range(repeat)])


def measure(name: str, app: str, lim: dict[str, Any], configs: dict[str, tuple[list[str], str]], a: argparse.Namespace
            ) -> dict[str, Any]:
    from slipstream._internal.api import Pipeline
    from slipstream._internal.app import load_pipelines

    from bench.vs_ray.bodies import mix

    limit = float(lim["limit_rps"])
    _, pipes = load_pipelines(str(ROOT / app))
    pipe: Pipeline = next(p for p in pipes if p.name == name)
    assert pipe.slo is not None
    slo_ms, max_miss = pipe.slo.p99_ms, pipe.slo.max_miss_rate
    # The requests bench.limit measured the components with.
    bodies, source = mix(ROOT / app, pipe)
    print(f"{name}: requests from {source}", file=sys.stderr)
    def rates_at(fractions: list[float]) -> list[float]:
        return sorted({nice(limit * f) for f in fractions})
    results: dict[str, Any] = {}
    for label, (flags, sizing) in configs.items():
        what = (f"Ray Serve at the plan's counts, {app}" if sizing == "ray"
                else f"slipstream serve {app} {' '.join(flags)} (sizing {sizing})")
        print(f"\n{name} [{label}]: {what}", file=sys.stderr)
        rows: list[dict[str, Any]] = []
        with serving(app, pipe, flags, sizing, bodies[0]) as (url, sizes):
            print(f"  served as: {sizes}", file=sys.stderr)

            least = (a.ray_min_requests or a.min_requests) if sizing == "ray" else a.min_requests
            wire = Wire.v2(bodies, pipe) if label.endswith(V2) else Wire(bodies)

            def point(rate: float, rows: list[dict[str, Any]] = rows, url: str = url, least: int = least,
                      wire: Wire = wire) -> bool:
                m = repeated(lambda seed: run_rate(url, name, wire, rate, max(a.duration, least / max(rate, 1e-9)),
                                                   slo_ms, seed=seed), a.repeat)
                rows.append(m)
                ok = holds(m, slo_ms, max_miss)
                print(f"  {rate:>7g} req/s offered: goodput {m['goodput_rps']:>7.0f}/s p99 {m['p99_ms']:>7.1f} ms "
                      f"misses {100 * m['miss_rate']:.2f}%  [{'holds' if ok else 'missed'}]  load "
                      f"{m['load_avg']:.2f}", file=sys.stderr)
                return ok

            search(rates_at(a.ray_fractions if sizing == "ray" and a.ray_fractions else a.fractions), limit, point,
                   a.refine)
        best = max((r for r in rows if holds(r, slo_ms, max_miss)), key=lambda r: r["goodput_rps"], default=None)
        results[label] = {"rows": rows, "best": best, "served_as": sizes, "wire": wire.route,
                          "goodput_fraction": (best["goodput_rps"] / limit) if best else 0.0}
    ceil = ceiling(float(lim["cpu_us_per_request"]), int(lim["cores"]), slo_ms, max_miss)
    print(f"{name}: queueing ceiling {ceil['rate_rps']:.1f} req/s = {100 * ceil['fraction']:.0f}% of the limit "
          f"({ceil['model']}, {lim['cpu_us_per_request'] / 1e3:.1f} ms a request, SLO {slo_ms:g} ms)", file=sys.stderr)
    return {"pipeline": name, "app": app, "limit_rps": limit, "slo_ms": slo_ms, "body": source, "configs": results,
            "ceiling": ceil}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", default="rag,multimodal")
    ap.add_argument("--configs", default="out-of-box,declared",
                    help=f"comma-separated, of {', '.join(CONFIGS)} (see the module doc)")
    ap.add_argument("--cores", type=float, default=float(os.cpu_count() or 2))
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per run")
    ap.add_argument("--min-requests", type=int, default=300,
                    help="run each rate at least this many requests (longer than --duration at low rates)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ray-fractions", type=lambda s: [float(x) for x in s.split(",")],
                    help="ray-planned's offered rates as fractions of the limit (default: --fractions)")
    ap.add_argument("--ray-min-requests", type=int,
                    help="ray-planned's rates run at least this many requests (default: --min-requests)")
    ap.add_argument("--refine", type=int, default=0,
                    help="after the fractions, up to this many rates between the highest that held and the "
                         "lowest above it that missed (geometric means)")
    ap.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=list(FRACTIONS),
                    help="offered rates as fractions of the limit")
    ap.add_argument("--out", type=Path, default=RESULTS / "goodput",
                    help="results path without suffix (the plans go beside it)")
    a = ap.parse_args()
    machine = harness.machine()
    print(f"load average before: {machine['loadavg_before']}", file=sys.stderr)
    out: dict[str, Any] = {"cores": a.cores, "pipelines": {}}
    for name in a.pipelines.split(","):
        app = APPS[name]
        lim = limit_entry(name)
        if lim is None:
            print(missing_limit(name), file=sys.stderr)
            return 1
        a.out.parent.mkdir(parents=True, exist_ok=True)
        try:
            configs = {c: config(c) for c in a.configs.split(",")}
        except ValueError as e:
            print(str(e), file=sys.stderr)
            return 2
        plan = None
        if "planned" in configs:
            plan_path = a.out.parent / f"goodput_{name}.plan.json"
            plan = plan_for(app, a.cores, plan_path)
            configs["planned"] = (configs["planned"][0] + ["--plan", str(plan_path)], configs["planned"][1])
        res = measure(name, app, lim, configs, a)
        if plan is not None:
            res["plan"] = plan["pipelines"].get(name)
        out["pipelines"][name] = res
    lines = ["# Goodput at the SLO vs the offline compute limit", "",
             f"{a.cores:g} cores; median of {a.repeat} runs of {a.duration:g} s (at least {a.min_requests} requests) "
             "per rate, each with its own arrival seed; goodput: answers within the SLO per second, which follows "
             "the rate the runs' arrivals drew (`arrived_rps` in the JSON); queueing ceiling: bench.ceiling (the better of M/D/cores and M/D/1 at cores x the speed, at the limit's CPU a request and the SLO's "
             f"miss budget); `python -m bench.goodput --pipelines {a.pipelines} --configs {a.configs}`.", "",
             "| pipeline | config | served as | limit (req/s) | queueing ceiling (req/s) | best rate holding the SLO "
             "| goodput (req/s) | share of limit | share of ceiling | p99 (ms) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in out["pipelines"].items():
        for label, c in res["configs"].items():
            b = c["best"]
            served = ", ".join(f"{k} {v}" for k, v in c["served_as"].items())
            ceil = res["ceiling"]
            of_ceiling = c["goodput_fraction"] / ceil["fraction"] if ceil["fraction"] else 0.0
            lines.append(f"| {name} | {label} | {served} | {res['limit_rps']:.1f} | {ceil['rate_rps']:.1f} "
                         f"({100 * ceil['fraction']:.0f}%) | {b['offered_rps'] if b else '-'} | "
                         f"{b['goodput_rps'] if b else 0:.1f} | {100 * c['goodput_fraction']:.0f}% | "
                         f"{100 * of_ceiling:.0f}% | {b['p99_ms'] if b else float('nan'):.1f} |")
    for name, res in out["pipelines"].items():
        ours, ray = (res["configs"].get(c) for c in ("out-of-box", "ray-planned"))
        if ours and ray:
            g, r = (c["best"]["goodput_rps"] if c["best"] else 0.0 for c in (ours, ray))
            res["vs_ray"] = g / r if r else None
            lines.append(f"\n{name}: out of the box {g:.1f} req/s, Ray Serve at the plan's counts {r:.1f} req/s: "
                         + (f"{g / r:.1f}x" if r else "Ray held no rate tried"))
    harness.write_results(a.out, out, "\n".join(lines), machine)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
