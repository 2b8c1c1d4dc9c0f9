"""`make bench-surge`: a load surge, and how each way of scaling rides it.

The shape of the resizing experiment in the Vortex paper: the RAG pipeline
(examples/rag.py) under open-loop Poisson load at 40% of one Embed replica's
capacity (``--before``, 20 s), a step to 150% of it (``--surge``, 60 s), then
back to 40% (``--after``, 30 s), after a short warm-up at 40%. One replica
cannot hold the surge; two can. The same trace (one load-generator run with
a piecewise-constant rate, ``BenchConfig.schedule``) is offered to:

- **static**: one Embed replica (``RAG_EMBED_REPLICAS=1 --autoscale off``);
- **reactive**: bounds 1-4 (the node caps a stage at its cores), a replica
  started only once requests already miss (``--autoscale reactive``);
- **anticipatory**: bounds 1-4, a warm standby kept on the load trend and
  promoted when the forecast needs it (``--autoscale anticipatory``);
- **ray**: the same component classes under Ray Serve through the
  bench/vs_ray adapter, with Ray Serve's own autoscaler on the Embed
  deployment (``autoscaling_config``: min 1, max 2 replicas (the cores),
  decisions on the last 2 s of queue lengths pushed every 0.25 s, up after
  0.5 s, down after 10 s, ``target_ongoing_requests`` 4 (``--ray-target``);
  ``RAY_AUTOSCALING`` below), in Ray's own virtualenv
  (bench/vs_ray/setup_ray.sh; skipped with a message when it is missing,
  or with ``--no-ray``).

Each runs on a fresh server. Ray Serve's single-replica capacity on this
pipeline is well below Slipstream's (bench/results/vs_ray.md), so by default
Ray gets the same trace *shape* at its own measured capacity (40% -> 150%
of one Ray replica), which compares the autoscalers rather than the
systems; ``--ray-trace same`` offers it Slipstream's trace instead.

Capacity of one replica: the highest Poisson rate whose p99 is within the
SLO with < 1% errors, on one replica with scaling off (a short sweep from
50 req/s in steps of x1.25, then two bisections; 1 s warm-up and 4 s per
rate; a failing rate is tried twice); ``--capacity R`` (and
``--ray-capacity R``) skip it.

During each run Slipstream's ``/v1/status`` is polled every 250 ms
(replicas by state with their queues, the autoscaler's model, and its
decisions from the event log); under Ray, the driver asks the Serve
controller every 250 ms for the Embed deployment's replicas by state and
its target replica count.

Reported per policy: requests; SLO misses (errors, refusals included, plus
answers later than the SLO) overall and during the surge; p99 of the
answers per window (before / surge / after); goodput (answers within the
SLO per second, and as a share of the offered load); the time from the step
until the serving Embed replicas reach the number the surge needs
(ceil(150%) = 2), and until the 1-s windows are back within the SLO (the
start of the first 5 consecutive windows with <= 1% misses, counted from
the first window that missed; 0 if none missed); and for Slipstream the
autoscaler's decisions, timed from the step. Writes
bench/results/surge.{json,md} and surge.png (latency p99 per 1-s window,
misses per window and replica counts over time, per policy).

The machine is shared: the 1-min load average is printed before each run
(and recorded), and a run waits up to 2 min for it to fall to 1.0; if it
does not, the benchmark refuses to start unless ``--force`` (past the
first run, it warns and goes on).

    .venv/bin/python -m bench.surge                                  # everything, ~15 min
    .venv/bin/python -m bench.surge --before 5 --surge 15 --after 10 --no-ray --force  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.testing import Node

from bench import harness
from bench.harness import RESULTS, free_port
from bench.vs_ray.servers import HERE as VS_RAY
from bench.vs_ray.servers import RAY_PY, RayServer

APP = harness.EXAMPLES / "rag.py"
PIPELINE = "rag"
STAGE = "Embed"
BUCKET_MS = 1000.0
POLL_S = 0.25
MAX_MISS = 0.01  # a 1-s window "within the SLO": at most 1% of its requests missed
RECOVERED_AFTER = 5  # consecutive good windows that count as recovered
LOADAVG_MAX = 1.0
POLICIES = ("static", "reactive", "anticipatory", "ray")
# policy -> (RAG_EMBED_REPLICAS, --autoscale)
SLIPSTREAM_POLICIES = {"static": ("1", "off"), "reactive": ("1-4", "reactive"),
                       "anticipatory": ("1-4", "anticipatory")}
# Ray Serve's autoscaler, tuned for a step on two cores: decide on the last
# 2 s of metrics pushed every 0.25 s, scale up after 0.5 s of need, down
# after 10 s (the defaults, 30 s / 10 s / 30 s / 600 s, are for clusters).
# target_ongoing_requests comes from --ray-target.
RAY_AUTOSCALING: dict[str, Any] = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
                                   "metrics_interval_s": 0.25, "look_back_period_s": 2.0,
                                   "upscale_delay_s": 0.5, "downscale_delay_s": 10.0}
# metrics_interval_s is deprecated but, in Ray 2.60, still how often the
# handles push their queue lengths; these are its successors (default 10 s),
# read by Ray at import (ray.serve._private.constants).
RAY_AUTOSCALING_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.25",
                       "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.25"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


# --------------------------------------------------------------------------
# The trace and the load


class Trace:
    """40% -> 150% -> 40% of `capacity`, in seconds of the measured window."""

    def __init__(self, capacity: float, a: argparse.Namespace) -> None:
        self.capacity = capacity
        self.base, self.peak = a.base * capacity, a.peak * capacity
        self.before, self.surge, self.after, self.warmup = a.before, a.surge, a.after, a.warmup
        self.step, self.end_surge = a.before, a.before + a.surge
        self.duration = a.before + a.surge + a.after
        # Replicas the surge needs at one replica's capacity each.
        self.need = max(1, math.ceil(a.peak - 1e-9))

    def schedule(self) -> list[tuple[float, float]]:
        return [(0.0, self.base), (self.step, self.peak), (self.end_surge, self.base)]

    def windows(self) -> dict[str, tuple[float, float]]:
        return {"before": (0.0, self.step), "surge": (self.step, self.end_surge),
                "after": (self.end_surge, self.duration)}

    def to_json(self) -> dict[str, Any]:
        return {"capacity_rps": self.capacity, "base_rps": self.base, "peak_rps": self.peak,
                "before_s": self.before, "surge_s": self.surge, "after_s": self.after,
                "warmup_s": self.warmup, "replicas_needed": self.need, "schedule": self.schedule()}


def offer(url: str, body: bytes, slo_ms: float, *, rate: float = 0.0, duration: float = 4.0, warmup: float = 1.0,
          schedule: list[tuple[float, float]] | None = None, timeline: bool = False, seed: int = 1) -> dict[str, Any]:
    """One open-loop Poisson run of the project's generator: a constant
    `rate`, or the piecewise-constant `schedule` (then `rate` is ignored)."""
    return harness.loadgen(url, body, [rate or 1.0], duration, warmup_s=warmup, schedule=schedule or (),
                           max_connections=1024, timeout_s=5.0, seed=seed, slo_ms=slo_ms,
                           timeline_ms=BUCKET_MS if timeline else 0.0, timeline_latencies=timeline)[0]


def passes(r: dict[str, Any], slo_ms: float) -> bool:
    return r["sent"] > 0 and r["errors"] / r["sent"] < MAX_MISS and r["latency_ms"]["p99"] <= slo_ms


def capacity(url: str, body: bytes, slo_ms: float, label: str) -> float:
    """The highest Poisson rate one replica holds within the SLO: from 50
    req/s up (or down) by x1.25 until the first rate that fails twice (or
    the first that passes), then two geometric bisections."""
    def ok(rate: float) -> bool:
        for attempt in (1, 2):
            r = offer(url, body, slo_ms, rate=rate)
            good = passes(r, slo_ms)
            log(f"  capacity {label}: {rate:.1f}/s -> p99 {r['latency_ms']['p99']:.1f} ms, "
                f"errors {r['errors']}/{r['sent']} {'ok' if good else 'FAIL'}{' (again)' if attempt == 2 else ''}")
            if good:
                return True
        return False

    offer(url, body, slo_ms, rate=10.0, duration=3.0)  # warm-up: first requests, lazy imports, caches
    lo, hi = 50.0, 62.5
    if ok(lo):
        while ok(hi):
            lo, hi = hi, hi * 1.25
            if hi > 20_000:
                return lo
    else:
        lo, hi = 40.0, 50.0
        while not ok(lo):
            lo, hi = lo / 1.25, lo
            if lo < 2.0:
                raise RuntimeError(f"{label}: not even 2 req/s within the SLO")
    for _ in range(2):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


# --------------------------------------------------------------------------
# Watching the servers


def embed_stage(status: dict[str, Any]) -> dict[str, Any]:
    """The Embed stage of `status` (empty if absent)."""
    for p in status.get("pipelines", []):
        if p["name"] == PIPELINE:
            for s in p["stages"]:
                if s["name"] == STAGE:
                    return dict(s)
    return {}


def replica_counts(stage: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in stage.get("replicas", []):
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    return counts


def embed_sample(st: dict[str, Any]) -> dict[str, Any]:
    """One poll's sample of a node's /v1/status: the Embed replicas by state
    (with each one's queue) and the autoscaler's model."""
    stage = embed_stage(st)
    model = (stage.get("autoscale") or {}).get("model") or {}
    # Per replica: [id, state, queued, outstanding, batch limit].
    each = [[r["id"], r["state"], r["queue"], r["outstanding"], r["batch_limit"]] for r in stage.get("replicas", [])]
    return {"replicas": replica_counts(stage), "each": each, **{k: model[k] for k in (
        "level_rps", "slope_rps_per_s", "forecast_rps", "need", "replica_capacity_rps") if k in model}}


class Poller:
    """Polls a node's /v1/status every POLL_S in a thread: a sample of it
    (`sample`, by default the Embed stage's replicas and autoscaler model)
    and every event (by sequence number)."""

    def __init__(self, base: str, sample: Callable[[dict[str, Any]], dict[str, Any]] = embed_sample) -> None:
        self.base = base
        self.sample = sample
        self.samples: list[dict[str, Any]] = []
        self.events: dict[int, dict[str, Any]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while True:
            t = time.time()
            try:
                st = get(self.base + "/v1/status")
            except OSError:
                st = None
            if st is not None:
                self.samples.append({"t": t, **self.sample(st)})
                for e in st.get("events", []):
                    self.events[int(e["seq"])] = e
            if self.stop.wait(max(0.0, POLL_S - (time.time() - t))):
                return

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def load_ok(force: bool, label: str, first: bool = False) -> str:
    """Waits up to 2 min for the 1-min load average to fall to LOADAVG_MAX.
    If it does not: before the first run, refuses (SystemExit) unless
    `force`; later (results already measured), warns and goes on."""
    deadline = time.monotonic() + 120.0
    while True:
        la = os.getloadavg()
        text = f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f}"
        if la[0] <= LOADAVG_MAX or force or time.monotonic() >= deadline:
            break
        log(f"{label}: load average {text}, waiting for <= {LOADAVG_MAX}")
        time.sleep(10.0)
    log(f"{label}: load average before: {text}")
    if la[0] > LOADAVG_MAX:
        if first and not force:
            raise SystemExit(f"{label}: the load average is {la[0]:.2f} (> {LOADAVG_MAX}): other work is running. "
                             "Measure on an idle machine, or pass --force for a noisy run.")
        log(f"{label}: WARNING: load average {la[0]:.2f} > {LOADAVG_MAX}; the numbers will be noisy")
    return text


# --------------------------------------------------------------------------
# Slipstream


def slipstream_node(replicas: str, autoscale: str) -> Node:
    return harness.node(APP, "--autoscale", autoscale, env={"RAG_EMBED_REPLICAS": replicas})


def run_slipstream(policy: str, trace: Trace, body: bytes, slo_ms: float, seed: int) -> dict[str, Any]:
    replicas, autoscale = SLIPSTREAM_POLICIES[policy]
    node = slipstream_node(replicas, autoscale)
    try:
        with node:
            url = f"{node.url}/v1/pipelines/{PIPELINE}/infer"
            log(f"{policy}: serving on {node.url} (RAG_EMBED_REPLICAS={replicas}, --autoscale {autoscale}); "
                f"trace {trace.base:.0f} -> {trace.peak:.0f} -> {trace.base:.0f} req/s")
            with Poller(node.url) as poller:
                report = offer(url, body, slo_ms, duration=trace.duration, warmup=trace.warmup,
                               schedule=trace.schedule(), timeline=True, seed=seed)
            final = get(node.url + "/v1/status")
    finally:
        (RESULTS / f"surge_{policy}.log").write_text(node.log())
    for e in final.get("events", []):
        poller.events[int(e["seq"])] = e
    t0 = report["wall_start"]
    samples = [{**s, "t": s["t"] - t0, "serving": s["replicas"].get("ready", 0),
                "standby": s["replicas"].get("standby", 0), "starting": s["replicas"].get("starting", 0)}
               for s in poller.samples]
    events = [{"t": e["unix_ms"] / 1e3 - t0, "replica": e.get("replica"), "what": e["what"], "detail": e["detail"]}
              for _, e in sorted(poller.events.items())
              if e.get("pipeline") == PIPELINE and e.get("stage") == STAGE]
    return {"report": report, "samples": samples, "events": events,
            "autoscale_final": embed_stage(final).get("autoscale")}


# --------------------------------------------------------------------------
# Ray Serve


class SurgeRay(RayServer):
    """A pipeline under Ray Serve through ``bench/vs_ray/autoscaled.py``
    (by default RAG, whose Embed is autoscaled): `stage` autoscaled by Ray
    Serve (``autoscaling``; None: its fixed replica count), its replica
    states logged to `replica_log`; on a Ray cluster of `nodes` nodes on
    this machine when `nodes` > 1 (the stage's replicas left to Ray's
    scheduler)."""

    def __init__(self, autoscaling: dict[str, Any] | None, replica_log: Path, *, app: Path = APP,
                 pipeline: str = PIPELINE, stage: str = STAGE, env: dict[str, str] | None = None,
                 nodes: int = 1) -> None:
        env = {"RAG_EMBED_REPLICAS": "1"} if env is None else env
        super().__init__(str(app), pipeline, RESULTS, [], env={**env, **RAY_AUTOSCALING_ENV})
        self.autoscaling, self.replica_log, self.stage, self.nodes = autoscaling, replica_log, stage, nodes

    def command(self) -> list[str]:
        cmd = [str(RAY_PY), str(VS_RAY / "autoscaled.py"), f"{self.app}:{self.pipeline}", "--port", str(free_port()),
               "--stage", self.stage, "--poll-s", str(POLL_S), "--replica-log", str(self.replica_log)]
        if self.nodes > 1:
            cmd += ["--nodes", str(self.nodes)]
        return cmd + (["--autoscaling", json.dumps(self.autoscaling)] if self.autoscaling else [])


def ray_server(autoscaling: dict[str, Any] | None, replica_log: Path) -> SurgeRay:
    server = SurgeRay(autoscaling, replica_log)
    server.log_path = RESULTS / ("surge_ray.log" if autoscaling else "surge_ray_capacity.log")
    return server


def ray_capacity(body: bytes, slo_ms: float) -> float:
    server = ray_server(None, RESULTS / "surge_ray_capacity.replicas.log")
    with server:
        return capacity(server.infer_url, body, slo_ms, "ray")


def run_ray(trace: Trace, body: bytes, slo_ms: float, seed: int, target: float,
            server_for: Callable[[dict[str, Any], Path], SurgeRay] = ray_server, name: str = "surge_ray",
            autoscaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace offered to Ray Serve with its autoscaler on (`autoscaling`,
    default ``RAY_AUTOSCALING``, with `target` ongoing requests per
    replica); the controller's view of the replicas logged beside."""
    replica_log = RESULTS / f"{name}.replicas.log"
    replica_log.unlink(missing_ok=True)
    config = {**(autoscaling or RAY_AUTOSCALING), "target_ongoing_requests": target}
    server = server_for(config, replica_log)
    with server:
        log(f"ray: serving on {server.base} (autoscaling_config {json.dumps(config)}); "
            f"trace {trace.base:.0f} -> {trace.peak:.0f} -> {trace.base:.0f} req/s")
        report = offer(server.infer_url, body, slo_ms, duration=trace.duration, warmup=trace.warmup,
                       schedule=trace.schedule(), timeline=True, seed=seed)
        time.sleep(2 * POLL_S)
    t0 = report["wall_start"]
    samples: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for line in replica_log.read_text().splitlines() if replica_log.exists() else []:
        s = json.loads(line)
        if "replicas" not in s:
            continue
        sample = {"t": s["t"] - t0, "replicas": s["replicas"], "target": s.get("target"),
                  "running_on": s.get("running_on", {}),
                  "serving": s["replicas"].get("RUNNING", 0), "standby": 0,
                  "starting": s["replicas"].get("STARTING", 0)}
        # The controller's decisions (when it reports them), else changes of its target and replicas.
        for d in s.get("decisions", []):
            events.append({"t": d["timestamp_s"] - t0, "replica": None, "what": "autoscale",
                           "detail": f"{d['prev_num_replicas']} -> {d['curr_num_replicas']}: {d['reason']}"})
        last = samples[-1] if samples else None
        if last is not None and last["target"] != sample["target"]:
            events.append({"t": sample["t"], "replica": None, "what": "target",
                           "detail": f"target_num_replicas {last['target']} -> {sample['target']}"})
        if last is not None and last["replicas"] != sample["replicas"]:
            events.append({"t": sample["t"], "replica": None, "what": "replicas",
                           "detail": ", ".join(f"{k} {v}" for k, v in sorted(sample["replicas"].items()))})
        samples.append(sample)
    return {"report": report, "samples": samples, "events": events, "autoscaling_config": config}


# --------------------------------------------------------------------------
# Analysis


def in_window(report: dict[str, Any], t0: float, t1: float) -> list[dict[str, Any]]:
    return [b for b in report["timeline"] if t0 - 1e-6 <= b["t_s"] and b["t_s"] + BUCKET_MS / 1e3 <= t1 + 1e-6]


def sent(bs: list[dict[str, Any]]) -> int:
    return sum(b["ok"] + sum(b["errors_by_kind"].values()) for b in bs)


def missed(bs: list[dict[str, Any]]) -> int:
    return sum(b["slower_than_slo"] + sum(b["errors_by_kind"].values()) for b in bs)


def p99(bs: list[dict[str, Any]]) -> float | None:
    lat = [x for b in bs for x in b.get("latencies_ms", [])]
    return harness.percentile(lat, 99) if lat else None


def recovery(trace: Trace, report: dict[str, Any]) -> tuple[float | None, int]:
    """(seconds from the step until the 1-s windows are back within the SLO,
    windows of the surge that missed): see the module doc."""
    surge = in_window(report, trace.step, trace.end_surge)
    good = [sent([b]) > 0 and missed([b]) <= MAX_MISS * sent([b]) for b in surge]
    bad = good.count(False)
    if bad == 0:
        return 0.0, 0
    first_bad = good.index(False)
    for i in range(first_bad, len(good) - RECOVERED_AFTER + 1):
        if all(good[i:i + RECOVERED_AFTER]):
            return surge[i]["t_s"] - trace.step, bad
    return None, bad


def full_capacity(trace: Trace, samples: list[dict[str, Any]]) -> float | None:
    """Seconds from the step until the serving Embed replicas reach the
    number the surge needs (0 if they already had; None: never in the surge)."""
    at_step = [s for s in samples if s["t"] <= trace.step]
    if at_step and at_step[-1]["serving"] >= trace.need:
        return 0.0
    for s in samples:
        if trace.step < s["t"] <= trace.end_surge and s["serving"] >= trace.need:
            return float(s["t"] - trace.step)
    return None


def analyse(policy: str, trace: Trace, run: dict[str, Any], slo_ms: float) -> dict[str, Any]:
    r = run["report"]
    windows = {}
    for name, (t0, t1) in trace.windows().items():
        bs = in_window(r, t0, t1)
        n = sent(bs)
        windows[name] = {"sent": n, "missed": missed(bs), "miss_rate": missed(bs) / n if n else 0.0,
                         "p99_ms": p99(bs), "goodput_rps": (n - missed(bs)) / (t1 - t0)}
    recovered, bad_windows = recovery(trace, r)
    total_missed = r["errors"] + r["slower_than_slo"]
    return {
        "policy": policy, "trace": trace.to_json(), "sent": r["sent"], "ok": r["ok"],
        "errors_by_kind": r["errors_by_kind"], "slower_than_slo": r["slower_than_slo"], "missed": total_missed,
        "miss_rate": total_missed / r["sent"] if r["sent"] else 0.0,
        "goodput_rps": (r["sent"] - total_missed) / r["duration_s"],
        "goodput_share": (r["sent"] - total_missed) / r["sent"] if r["sent"] else 0.0,
        "p99_ms": r["latency_ms"]["p99"], "windows": windows,
        "to_full_capacity_s": full_capacity(trace, run["samples"]),
        "to_slo_s": recovered, "surge_windows_missed": bad_windows,
        "max_serving": max((s["serving"] for s in run["samples"]), default=None),
        "events": run["events"], "autoscale_final": run.get("autoscale_final"),
        "autoscaling_config": run.get("autoscaling_config"),
        "samples": run["samples"],
        "timeline": [{k: v for k, v in b.items() if k != "latencies_ms"} for b in r["timeline"]],
        "report": {k: v for k, v in r.items() if k != "timeline"},
    }


# --------------------------------------------------------------------------
# Output


def fmt_s(v: float | None) -> str:
    return "never" if v is None else f"{v:.1f} s"


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def markdown(res: dict[str, Any]) -> str:
    t = res["trace"]
    lines = [f"# Load surge: RAG, {t['before_s']:.0f} s at {res['base']:.0%} -> {t['surge_s']:.0f} s at "
             f"{res['peak']:.0%} -> {t['after_s']:.0f} s at {res['base']:.0%} of one Embed replica", "",
             f"The load generator shares the machine's cores; SLO p99 "
             f"{res['slo_ms']:.0f} ms; Poisson arrivals, {t['warmup_s']:.0f} s warm-up at the base rate; "
             "1-s windows.", "",
             f"One Embed replica holds {t['capacity_rps']:.0f} req/s within the SLO"
             f"{' (measured)' if res['capacity_measured'] else ' (given)'}: the trace offers "
             f"{t['base_rps']:.0f} -> {t['peak_rps']:.0f} -> {t['base_rps']:.0f} req/s and the surge needs "
             f"{t['replicas_needed']} replicas."]
    if "ray" in res["policies"]:
        rt = res["policies"]["ray"]["trace"]
        lines.append(f"Ray Serve: one replica holds {rt['capacity_rps']:.0f} req/s; it was offered "
                     f"{rt['base_rps']:.0f} -> {rt['peak_rps']:.0f} -> {rt['base_rps']:.0f} req/s "
                     f"({res['ray_trace']} trace); `autoscaling_config` "
                     f"`{json.dumps(res['policies']['ray']['autoscaling_config'])}`.")
    elif res.get("ray_skipped"):
        lines.append(f"Ray Serve: not run ({res['ray_skipped']}).")
    lines += ["", "| policy | load avg | requests | missed | missed in surge | p99 before / surge / after ms | "
              "goodput | serving replicas reach need after | windows back within SLO after |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in res["policies"].items():
        w = p["windows"]
        lines.append(
            f"| {name} | {p['loadavg'].split()[0]} | {p['sent']:,} | {p['missed']:,} ({p['miss_rate']:.1%}) | "
            f"{w['surge']['missed']:,} ({w['surge']['miss_rate']:.1%}) | "
            f"{fmt_ms(w['before']['p99_ms'])} / {fmt_ms(w['surge']['p99_ms'])} / {fmt_ms(w['after']['p99_ms'])} | "
            f"{p['goodput_rps']:.0f}/s ({p['goodput_share']:.1%}) | {fmt_s(p['to_full_capacity_s'])} | "
            f"{fmt_s(p['to_slo_s'])} ({p['surge_windows_missed']} missed) |")
    lines += ["", "Missed: errors (refusals included) plus answers later than the SLO. p99 of the answers "
              "(refused requests have no latency). A window is within the SLO when <= 1% of its requests "
              "missed; \"back within SLO\" is the start of the first 5 such windows in a row after the first "
              "that missed. Replicas: serving Embed replicas (Slipstream `ready`, Ray `RUNNING`) from "
              "/v1/status or Ray Serve's controller every 250 ms."]
    for name, p in res["policies"].items():
        if not p["events"]:
            continue
        lines += ["", f"## {name}: Embed events (seconds from the step)", ""]
        step = p["trace"]["before_s"]
        for e in p["events"]:
            who = f"[{e['replica']}] " if e.get("replica") is not None else ""
            lines.append(f"- {e['t'] - step:+.2f} s {who}{e['what']}: {e['detail']}")
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path, title: str = "RAG load surge", what: str = "Embed") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"static": "tab:gray", "reactive": "tab:orange", "anticipatory": "tab:blue", "ray": "tab:red"}
    styles = {"reactive": "--", "ray": "-."}
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 9), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 2, 1.5]})
    for i, (name, p) in enumerate(res["policies"].items()):
        c, ls = colors.get(name), styles.get(name, "-")
        step, end = p["trace"]["before_s"], p["trace"]["before_s"] + p["trace"]["surge_s"]
        tl = p["timeline"]
        xs = [b["t_s"] + BUCKET_MS / 2e3 for b in tl]
        ax1.plot([x for x, b in zip(xs, tl, strict=True) if b["ok"]], [b["p99_ms"] for b in tl if b["ok"]],
                 color=c, ls=ls, label=name, lw=1.4)
        ax2.plot(xs, [100.0 * missed([b]) / max(1, sent([b])) for b in tl], color=c, ls=ls, lw=1.2, label=name)
        ss = p["samples"]
        dy = 0.03 * i  # keep equal counts of different policies apart
        ax3.step([s["t"] for s in ss], [s["serving"] + dy for s in ss], where="post", color=c, ls=ls, lw=1.4,
                 label=name)
        if any(s["standby"] for s in ss):
            ax3.step([s["t"] for s in ss], [s["serving"] + s["standby"] + dy for s in ss], where="post", color=c,
                     lw=1.0, ls=":", label=f"{name} + standby")
    for ax in (ax1, ax2, ax3):
        ax.axvspan(step, end, color="tab:orange", alpha=0.08, lw=0)
        ax.grid(alpha=0.3)
    ax1.axhline(res["slo_ms"], color="black", ls="--", lw=1, label=f"SLO {res['slo_ms']:.0f} ms")
    ax1.set_yscale("log")
    ax1.set_ylabel("p99 of the answers\nper 1-s window (ms)")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(f"{title}: {res['base']:.0%} -> {res['peak']:.0%} -> {res['base']:.0%} of one {what} "
                  f"replica (shaded: the surge)")
    ax2.set_ylabel("missed per 1-s window\n(% of its requests)")
    ax3.set_ylabel(f"{what} replicas\nserving")
    ax3.set_xlabel("seconds from the start of the measured window")
    ax3.set_ylim(0, max(3, 1 + max((s["serving"] + s["standby"] for p in res["policies"].values()
                                    for s in p["samples"]), default=2)))
    ax3.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------


def request_body() -> tuple[bytes, float]:
    """The request body (bench/vs_ray's, the same bytes for both systems)
    and the pipeline's SLO (p99, ms)."""
    from slipstream._internal.app import load_pipelines

    from bench.vs_ray import bodies

    _, pipes = load_pipelines(f"{APP}:{PIPELINE}")
    if pipes[0].slo is None:
        raise RuntimeError(f"{PIPELINE} declares no SLO")
    body, origin = bodies.body(APP, pipes[0])
    log(f"body: {len(body)} bytes from {origin}")
    return bytes(body), float(pipes[0].slo.p99_ms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=float, default=20.0, help="seconds at the base rate before the step")
    ap.add_argument("--surge", type=float, default=60.0, help="seconds of the surge")
    ap.add_argument("--after", type=float, default=30.0, help="seconds at the base rate after it")
    ap.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds at the base rate first")
    ap.add_argument("--base", type=float, default=0.4, help="base rate, share of one replica's capacity")
    ap.add_argument("--peak", type=float, default=1.5, help="surge rate, share of one replica's capacity")
    ap.add_argument("--capacity", type=float, help="one Embed replica's capacity (req/s): skip the sweep")
    ap.add_argument("--ray-capacity", type=float, help="the same under Ray Serve (req/s)")
    ap.add_argument("--ray-trace", choices=["own", "same"], default="own",
                    help="Ray's trace at its own one-replica capacity (default) or Slipstream's")
    ap.add_argument("--ray-target", type=float, default=4.0,
                    help="Ray Serve's target_ongoing_requests for Embed")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    ap.add_argument("--no-ray", action="store_true", help="skip Ray Serve")
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--force", action="store_true", help="run even if the load average is above 1.0")
    ap.add_argument("--out", default=str(RESULTS / "surge.json"))
    a = ap.parse_args()
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    ray_skipped = None
    if "ray" in policies and a.no_ray:
        policies.remove("ray")
        ray_skipped = "--no-ray"
    if "ray" in policies and not RAY_PY.exists():
        policies.remove("ray")
        ray_skipped = f"{RAY_PY} is missing: run bench/vs_ray/setup_ray.sh"
        log(f"ray: skipped ({ray_skipped})")
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = harness.machine()
    body, slo_ms = request_body()

    cap = a.capacity
    if cap is None:  # one replica, scaling off
        la = load_ok(a.force, "capacity", first=True)
        with slipstream_node("1", "off") as node:
            cap = capacity(f"{node.url}/v1/pipelines/{PIPELINE}/infer", body, slo_ms, "slipstream")
        log(f"capacity: one Embed replica holds {cap:.0f} req/s within {slo_ms:.0f} ms (load average {la})")
    trace = Trace(cap, a)
    results: dict[str, Any] = {}
    for i, policy in enumerate(policies):
        la = load_ok(a.force, policy, first=i == 0 and a.capacity is not None)
        if policy == "ray":
            if a.ray_trace == "same":
                ray_trace = trace
            else:
                if a.ray_capacity is None:
                    ray_trace = Trace(ray_capacity(body, slo_ms), a)
                    log(f"ray: one replica holds {ray_trace.capacity:.0f} req/s")
                    la = load_ok(a.force, policy)
                else:
                    ray_trace = Trace(a.ray_capacity, a)
            run = run_ray(ray_trace, body, slo_ms, a.seed, a.ray_target)
            res = analyse(policy, ray_trace, run, slo_ms)
        else:
            run = run_slipstream(policy, trace, body, slo_ms, a.seed)
            res = analyse(policy, trace, run, slo_ms)
        res["loadavg"] = la
        results[policy] = res
        log(f"{policy}: {res['sent']} requests, {res['missed']} missed ({res['miss_rate']:.1%}), "
            f"in the surge {res['windows']['surge']['missed']} ({res['windows']['surge']['miss_rate']:.1%}); "
            f"serving replicas reach {trace.need} after {fmt_s(res['to_full_capacity_s'])}, "
            f"windows within the SLO after {fmt_s(res['to_slo_s'])}")
    out = Path(a.out)
    doc = {"slo_ms": slo_ms, "base": a.base, "peak": a.peak, "capacity_measured": a.capacity is None,
           "trace": trace.to_json(), "ray_trace": a.ray_trace, "ray_skipped": ray_skipped, "seed": a.seed,
           "policies": results}
    md = markdown(doc)
    json_path, md_path = harness.write_results(out, doc, md, machine)
    if results:
        plot(doc, out.with_suffix(".png"))
    print("\n" + md)
    log(f"wrote {json_path}, {md_path} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
