"""The ``slipstream`` command line: status, scale, bench, profile, plan,
slo; ``serve`` lives in ``serve_cli``, the cluster's commands (deploy,
node) in ``cluster_cli``, the object store's (put, get, ls, versions, rm)
in ``store_cli``, the cluster CA's (tls ca, tls cert) in ``tls_cli``, and
re-signing a cluster's records after a token change in ``reseal``.

Entry points stay thin: parse arguments, call into the library, print.
Requests to a node go through ``ss.Client`` and ``admin``; their errors
are the ``ss.Error`` tree, printed on one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from slipstream._internal import admin, config
from slipstream._internal.client import Client
from slipstream._internal.cluster_cli import (
    EtcdError,
    add_cluster_args,
    add_cluster_commands,
    apply_plan,
    current_deployment,
    member_inventory,
    planned_per_node,
)
from slipstream._internal.errors import Error, RequestError, from_core
from slipstream._internal.reseal import add_reseal_command
from slipstream._internal.serve_cli import add_serve_command, model_overheads
from slipstream._internal.store_cli import add_store_commands
from slipstream._internal.store_cli import fail as _fail
from slipstream._internal.tls_cli import add_tls_commands

DEFAULT_URL = os.environ.get("SLIPSTREAM_URL", "http://127.0.0.1:8000")


def _status(url: str) -> dict[str, Any]:
    with Client(url, timeout=5.0) as c:
        return c.status()


def _per_node(assignment: dict[str, dict[str, int]]) -> str:
    """``{"p/s": {"n1": 2}}`` as ``p/s n1:2``, stage by stage."""
    return "; ".join(f"{k} " + " ".join(f"{n}:{c}" for n, c in sorted(v.items()))
                     for k, v in sorted(assignment.items())) or "-"


def _cluster_lines(c: dict[str, Any]) -> str:
    """A cluster member's part of `slipstream status`: the members, the
    placement in force and the plan it follows."""
    members = c.get("members") or {}
    names = ", ".join(f"{n} ({m.get('cores', '?')} cores{', ' + str(len(m['gpus'])) + ' GPUs' if m.get('gpus') else ''})"
                      for n, m in sorted(members.items()))
    lines = [f"cluster '{c.get('cluster')}': node {c.get('node')}, deployment {c.get('deploy')}, "
             f"{len(members)} member(s): {names or 'none'}"]
    for what in ("cordoned", "suspects"):
        if c.get(what):
            lines.append(f"  {what}: {', '.join(c[what])}")
    p = c.get("placement")
    if p:
        lines.append(f"  placement (epoch {p['epoch']}, by {p['by']}): {_per_node(p['stages'])}")
        if p.get("standby"):
            lines.append(f"  standbys: {_per_node(p['standby'])}")
    plan = c.get("plan")
    if plan:
        made = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(plan["at"])) if plan.get("at") else "?"
        lines.append(f"  plan ({plan.get('note') or 'no note'}, {made}): {_per_node(plan['planned'])}")
    else:
        lines.append("  plan: none (replica counts balanced over the members)")
    return "\n".join(lines)


def cmd_status(a: argparse.Namespace) -> int:
    st = _status(a.url)
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"node {a.url}  ready={st['ready']}  uptime={st['uptime_s']:.0f}s  in-flight={st['inflight']}"
          f"  arena={st.get('arena_used_bytes', 0) / 1e6:.1f} MB")
    listen = st.get("listen")
    if listen:
        print(f"listening: HTTP {listen['http']}  gRPC {', '.join(listen['grpc']) or 'off'}")
    c = st["copies"]
    print(f"payload copies: ingress={c['ingress']} gather={c['gather']} worker={c['worker']} egress={c['egress']}")
    if st.get("cluster"):
        print(_cluster_lines(st["cluster"]))
    store = st.get("store")
    if store:
        t = store["triggers"]
        watching = ", ".join(f"{w['prefix']} -> {w['pipeline']}" for w in t["watching"]) or "none"
        print(f"store {store['path']}: {store['seq']} changes; triggers ({watching}): fired={t['fired']} "
              f"retried={t['retried']} failed={t['failed']} pending={t['pending']}")
    for p in st["pipelines"]:
        slo = p["slo"]
        lat = p["latency_ms"]
        errs = sum(p["errors"].values())
        slo_s = f"SLO p99<={slo['p99_ms']}ms" if slo else "no SLO"
        ready = "ready" if p.get("ready", True) else "NOT READY"
        print(f"\npipeline {p['name']}  {ready}  ({slo_s})  ok={p['ok']} errors={errs}  "
              f"latency p50={lat['p50']:.2f}ms p99={lat['p99']:.2f}ms")
        for i, line in enumerate(p.get("sizing") or []):
            print(f"  {'sized:' if i == 0 else '  why:'} {line}")
        adm = p.get("admission", {})
        print(f"  admitted={p['admitted']} refused(429)={p['shed']} within SLO={p['slo_met']} late={p['slo_missed']}"
              f" cancelled={p.get('cancelled', 0)}  admission headroom={adm.get('headroom', 1.0):.2f}"
              f" in flight={adm.get('inflight', 0)}  errors by kind: {p['errors'] or '-'}")
        print(f"  {'stage':<16}{'replicas':>9}{'healthy':>8}{'queued':>7}{'batches':>9}{'batch mean':>11}"
              f"{'max':>5}{'limit':>6}{'dropped':>8}   {'ms: wait p50':>12}{'compute p50':>12}{'hop p50':>8}"
              f"{'hop p99':>8}")
        for s in p["stages"]:
            reps = s["replicas"]
            healthy = sum(1 for r in reps if r["healthy"])
            queue = sum(r["queue"] for r in reps)
            bs = s["batch_size"]
            print(f"  {s['name']:<16}{len(reps):>9}{healthy:>8}{queue:>7}{s['batches']:>9}{bs['mean']:>11.1f}"
                  f"{bs['max']:>5.0f}{s['batch_limit']:>6}{s['dropped_late']:>8}   {s['queue_wait_ms']['p50']:>12.2f}"
                  f"{s['compute_ms']['p50']:>12.2f}"
                  f"{s['hop_ms']['p50']:>8.2f}{s['hop_ms']['p99']:>8.2f}")
            others = [f"{r['id']}:{r['state']}" for r in reps if r.get("state", "ready") != "ready"]
            if others:
                print(f"  {'':<16}not serving: {' '.join(others)}")
            auto = s.get("autoscale")
            if auto:
                m = auto.get("model") or {}
                line = f"  {'':<16}autoscale {auto['policy']} ({auto['min']}..{auto['max']})"
                if m:
                    line += (f": load {m['level_rps']:.0f} req/s ({m['slope_rps_per_s']:+.0f}/s), forecast "
                             f"{m['forecast_rps']:.0f} in {m['lead_s']:.1f} s, {m['replica_capacity_rps']:.0f} req/s "
                             f"per replica -> need {m['need']}, serving {m['active']}, standby {m['standby']}")
                print(line)
                if auto.get("last"):
                    print(f"  {'':<16}last decision {auto['last']['ago_s']:.0f} s ago: {auto['last']['what']}")
    events = st.get("events", [])[-a.events:] if a.events else []
    if events:
        print("\nrecent events:")
        for ev in events:
            who = f"{ev['pipeline']}/{ev['stage']}" + (f"[{ev['replica']}]" if ev["replica"] is not None else "")
            ms = ev["unix_ms"]
            when = time.strftime("%H:%M:%S", time.localtime(ms / 1000)) + f".{ms % 1000:03d}"
            print(f"  {when}  {who:<28} {ev['what']}{': ' + ev['detail'] if ev['detail'] else ''}")
    return 0


def _stage_replicas(url: str, pipeline: str, stage: str) -> list[dict[str, Any]]:
    for p in _status(url)["pipelines"]:
        if p["name"] == pipeline:
            for s in p["stages"]:
                if s["name"] == stage:
                    return list(s["replicas"])
    return []


def cmd_scale(a: argparse.Namespace) -> int:
    try:
        out = admin.scale(a.url, a.pipeline, a.stage, a.replicas, token=a.token)
    except RequestError as e:
        if e.status is None:  # no answer: said as it is
            raise
        return _fail(f"scale refused ({e.status}): {e}")
    print(f"{a.pipeline}/{a.stage}: {out['from']} -> {out['replicas']} replicas"
          + (f"; starting {out['added']}" if out["added"] else "")
          + (f"; draining {out['draining']}" if out["draining"] else ""))
    if a.no_wait or out["from"] == out["replicas"]:
        return 0
    deadline = time.monotonic() + a.timeout
    last = ""
    while time.monotonic() < deadline:
        reps = _stage_replicas(a.url, a.pipeline, a.stage)
        states = [r["state"] for r in reps]
        line = f"  replicas: {len(reps)} ({', '.join(f'{n} {s}' for s, n in sorted(Counter(states).items()))})"
        if line != last:
            print(line, flush=True)
            last = line
        if states.count("ready") == a.replicas and len(reps) == a.replicas:
            print(f"{a.pipeline}/{a.stage}: {a.replicas} replicas ready")
            return 0
        time.sleep(0.2)
    return _fail(f"not settled within {a.timeout:.0f} s (see `slipstream status`)")


def _example_body(url: str, pipeline: str) -> bytes:
    """A one-row request built from the pipeline's declared inputs."""
    with Client(url, timeout=5.0) as c:
        desc = c.metadata(pipeline)
    if desc.get("example"):
        return json.dumps({"inputs": desc["example"]}).encode()
    inputs: dict[str, Any] = {}
    for name, spec in desc["inputs"].items():
        shape = [1] + [d if d >= 0 else 1 for d in spec["shape"][1:]]
        value: Any = True if spec["dtype"] == "bool" else 1
        for d in reversed(shape):
            value = [value] * d
        inputs[name] = value
    return json.dumps({"inputs": inputs}).encode()


def _parse_rates(a: argparse.Namespace) -> list[float]:
    if a.sweep:
        return [float(x) for x in a.sweep.split(",") if x.strip()]
    return [float(a.rate)]


def _compare_slo(a: argparse.Namespace, reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Predicted vs measured p99 at each offered rate."""
    from slipstream._internal import slo
    from slipstream._internal.app import default_profile_path, load_pipelines

    _, pipelines = load_pipelines(a.compare_slo)
    pipe = next((p for p in pipelines if p.name == a.pipeline), None)
    if pipe is None:
        raise SystemExit(f"slipstream: error: {a.compare_slo} has no pipeline {a.pipeline!r}")
    prof = slo.load_profile_for(pipe, [default_profile_path(a.compare_slo)])
    if a.arrival != "bursty":
        a.burst = 1  # the model's arrivals match the generator's
    predicted = _slo_table(a, pipe, prof, [r["offered_rps"] for r in reports], _overheads(a, a.compare_slo))
    rows = []
    print(f"\n{'offered/s':>10}{'measured p99':>14}{'predicted p99':>15}{'error':>8}{'measured miss%':>16}{'predicted miss%':>17}")
    for m, p in zip(reports, predicted, strict=True):
        mp99 = m["latency_ms"]["p99"]
        err = (p["p99_ms"] - mp99) / mp99 if mp99 else float("nan")
        sent = max(m["sent"], 1)
        assert pipe.slo is not None
        late = 0  # the generator does not know deadlines: count errors (429/504) as misses
        mmiss = (m["errors"] + late) / sent
        print(f"{m['offered_rps']:>10.0f}{mp99:>14.2f}{p['p99_ms']:>15.2f}{100 * err:>7.0f}%{100 * mmiss:>16.2f}"
              f"{100 * p['miss_rate']:>17.2f}")
        rows.append({"offered_rps": m["offered_rps"], "measured_p99_ms": mp99, "predicted_p99_ms": p["p99_ms"],
                     "relative_error": err, "measured_error_rate": mmiss, "predicted_miss_rate": p["miss_rate"]})
    return rows


def cmd_bench(a: argparse.Namespace) -> int:
    from slipstream import _core

    base = a.url.rstrip("/")
    if a.target:
        target = a.target
    elif a.pipeline:
        target = f"{base}/v1/pipelines/{a.pipeline}/infer"
    else:
        return _fail("give --pipeline NAME (a Slipstream pipeline) or --target URL (any HTTP endpoint)")
    if a.body_file:
        body = Path(a.body_file).read_bytes()
    elif a.body is not None:
        body = a.body.encode()
    elif a.pipeline:
        try:
            body = _example_body(base, a.pipeline)
        except RequestError as e:
            return _fail(f"cannot describe pipeline {a.pipeline!r} at {base} ({e})")
    else:
        body = b"{}"
    rates = _parse_rates(a)
    cfg = {
        "url": target,
        "method": "POST",
        "body": list(body),
        "content_type": "application/json",
        "headers": [],
        "rates": rates,
        "duration_s": a.duration,
        "warmup_s": a.warmup,
        "arrival": {"kind": a.arrival, "burst": a.burst} if a.arrival == "bursty" else {"kind": a.arrival},
        "max_connections": a.connections,
        "timeout_s": a.timeout,
        "threads": a.threads,
        "seed": a.seed,
    }
    is_node = a.pipeline is not None
    if is_node:
        try:
            admin.reset_metrics(base)
        except RequestError:
            is_node = False
    try:
        reports = json.loads(_core.bench(json.dumps(cfg), quiet=a.quiet))
    except _core.CoreError as e:
        raise from_core(e) from None
    node_status = None
    if is_node:
        try:
            node_status = _status(base)
        except RequestError:
            node_status = None
    print(f"\n{'offered/s':>10}{'achieved/s':>11}{'ok':>9}{'errors':>8}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}{'max ms':>9}{'late':>7}")
    for r in reports:
        lat = r["latency_ms"]
        print(f"{r['offered_rps']:>10.0f}{r['achieved_rps']:>11.0f}{r['ok']:>9}{r['errors']:>8}{lat['p50']:>9.2f}"
              f"{lat['p99']:>9.2f}{lat['p999']:>10.2f}{lat['max']:>9.2f}{r['late_sends']:>7}")
        if r["errors_by_kind"]:
            print(f"{'':>10} errors: {r['errors_by_kind']}")
    result: dict[str, Any] = {
        "target": target,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {k: v for k, v in cfg.items() if k != "body"},
        "runs": reports,
    }
    if node_status is not None:
        stages = {}
        for p in node_status["pipelines"]:
            if p["name"] == a.pipeline:
                for s in p["stages"]:
                    stages[s["name"]] = {"hop_ms": s["hop_ms"], "batch_size": s["batch_size"],
                                         "compute_ms": s["compute_ms"], "queue_wait_ms": s["queue_wait_ms"]}
        result["node"] = {"stages": stages, "copies": node_status["copies"]}
        for name, s in stages.items():
            print(f"stage {name}: mean batch {s['batch_size']['mean']:.1f}, hop (node->worker->node) "
                  f"p50 {s['hop_ms']['p50'] * 1000:.0f}us p99 {s['hop_ms']['p99'] * 1000:.0f}us")
    if a.compare_slo:
        result["slo_check"] = _compare_slo(a, reports)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def _thread_counts(spec: str) -> list[int]:
    try:
        counts = sorted({1, *(int(t) for t in spec.split(",") if t.strip())})
    except ValueError:
        raise SystemExit(f"slipstream: error: --threads takes comma-separated integers, got {spec!r}") from None
    if counts[0] < 1:
        raise SystemExit("slipstream: error: --threads must be >= 1")
    return counts


def _request_pipelines(pipelines: list[Any], what: str) -> list[Any]:
    """The pipelines that requests invoke; those that store puts invoke
    (a root that watches a prefix) have no request rate to profile or plan."""
    for p in pipelines:
        if p.watch is not None:
            print(f"slipstream: {what} skips pipeline {p.name}: store puts under {p.watch} invoke it, "
                  "not requests (it keeps its declaration and shares the cores)", file=sys.stderr)
    return [p for p in pipelines if p.watch is None]


def cmd_profile(a: argparse.Namespace) -> int:
    if os.environ.get("SLIPSTREAM_PROFILE_CHILD") != "1":
        return _profile_parent(a)
    from slipstream._internal import slo
    from slipstream._internal.app import load_pipelines

    # A child: measure at the thread budget its environment was started with
    # and write the raw profile to --out for the parent to merge.
    _, pipelines = load_pipelines(a.app)
    if a.pipeline:
        pipelines = [p for p in pipelines if p.name == a.pipeline]
        if not pipelines:
            return _fail(f"no pipeline named {a.pipeline!r} in {a.app}")
    pipelines = _request_pipelines(pipelines, "profile")
    if a.neighbour:
        from slipstream._internal import colocate

        return colocate.run_neighbour(pipelines[0])
    batches = [int(b) for b in a.batches.split(",")] if a.batches else list(slo.DEFAULT_BATCHES)
    threads = int(os.environ.get("SLIPSTREAM_THREADS", "1"))
    profiles = []
    for p in pipelines:
        print(f"profiling {p.name} on cpu ({os.cpu_count()} cores), {threads} thread(s), batch sizes {batches}",
              file=sys.stderr)
        if a.colocated:
            from slipstream._internal import colocate
            from slipstream._internal.sizing import usable_cores

            with colocate.neighbours(a.app, p.name, colocate.neighbour_count(usable_cores(), threads)) as near:
                prof = slo.profile_pipeline(p, batches, a.iters, a.budget, threads=threads)
            prof["colocated"] = near.record()
        else:
            prof = slo.profile_pipeline(p, batches, a.iters, a.budget, threads=threads)
        profiles.append(prof)
    slo.write_profile(Path(a.out), profiles)
    return 0


def _profile_parent(a: argparse.Namespace) -> int:
    """Measure under the conditions workers run in: a thread budget of t
    (OMP_NUM_THREADS and the other numeric libraries' variables, and
    SLIPSTREAM_THREADS). Libraries read these only when they load, so each
    thread count is measured by a child process of its own; the parent merges
    them (`slo.merge_thread_profiles`), writes the file and prints."""
    import subprocess
    import tempfile

    from slipstream._internal import slo
    from slipstream._internal.app import THREAD_VARS, default_profile_path

    counts = _thread_counts(a.threads)
    mine = [v for v in THREAD_VARS if v in os.environ]
    if len(counts) > 1 and mine:
        print(f"slipstream: note: {', '.join(mine)} set here win over --threads (as they do in served workers)",
              file=sys.stderr)
    out = Path(a.out) if a.out else default_profile_path(a.app)
    args = ["profile", a.app, "--iters", str(a.iters), "--budget", str(a.budget)]
    args += ["--pipeline", a.pipeline] if a.pipeline else []
    args += ["--batches", a.batches] if a.batches else []
    args += ["--colocated"] if a.colocated else []
    parts: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t in counts:
            part = Path(tmp) / f"t{t}.json"
            env = dict(os.environ, SLIPSTREAM_PROFILE_CHILD="1", SLIPSTREAM_THREADS=str(t))
            for var in THREAD_VARS:
                env.setdefault(var, str(t))
            rc = subprocess.run([sys.executable, "-m", "slipstream._internal.cli", *args, "--out", str(part)],
                                env=env).returncode
            if rc != 0:
                return rc
            parts[t] = json.loads(part.read_text())["pipelines"]
    profiles = slo.merge_thread_profiles(parts)
    slo.write_profile(out, profiles)
    print(f"wrote {out}")
    png = None if a.no_plot else slo.plot_profile(out.with_suffix(".png"), profiles)
    if png:
        print(f"wrote {png}")
    for prof in profiles:
        print(f"\n{prof['pipeline']}: ms per batch (mean / p99)")
        for name, st in prof["stages"].items():
            runs = [("", st["points"])] + [(f" t={t}", v["points"]) for t, v in st.get("by_threads", {}).items()]
            for tag, pts in runs:
                cells = "  ".join(f"b{pt['batch']}: {pt['mean_ms']:.2f}/{pt['p99_ms']:.2f}" for pt in pts)
                print(f"  {name + tag:<16} {cells}")
    return 0


def _overheads(a: argparse.Namespace, app: str) -> dict[str, Any]:
    """The machine's overheads for the model: flags, else the app's calibration file, else the defaults."""
    out = model_overheads(app)
    for k in ("hop_us", "batch_cpu_us", "ingress_us", "cpu_per_request_us"):
        if getattr(a, k, None) is not None:
            out[k] = getattr(a, k)
    return out


def _slo_table(a: argparse.Namespace, pipe: Any, prof: dict[str, Any], rates: list[float],
               overheads: dict[str, Any]) -> list[dict[str, Any]]:
    from slipstream._internal import slo

    return slo.predict(pipe, prof, rates, cores=a.cores, duration_s=a.sim_duration, policy=a.batching,
                       burst=a.burst, **overheads)


def _calibrate(a: argparse.Namespace, pipe: Any, prof: dict[str, Any]) -> None:
    """Serve the app here briefly at two light loads and save the machine's overheads."""
    from slipstream._internal import slo
    from slipstream._internal.launch import launch

    cap = slo.capacity_estimate(pipe, prof, a.cores)
    rates = tuple(float(r) for r in a.calibration_rates.split(",")) if a.calibration_rates else \
        (max(round(cap * 0.03), 20), max(round(cap * 0.15), 60))
    if len(rates) != 2:
        raise SystemExit("slipstream: error: --calibration-rates takes two rates, e.g. 100,500")
    body = slo.example_body(pipe)
    print(f"calibrating {pipe.name} on this machine at {rates[0]:g} and {rates[1]:g} req/s "
          f"({a.calibration_duration:g} s each) ...", file=sys.stderr)
    with launch(a.app) as node:
        cal = slo.calibrate(node.url, pipe, prof, body, (rates[0], rates[1]), a.calibration_duration, a.cores)
    path = slo.calibration_path(a.app)
    path.write_text(json.dumps({"pipeline": pipe.name, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **cal},
                               indent=2))
    print(f"  CPU outside components {cal['cpu_per_request_us']:.0f} us/request + {cal['batch_cpu_us']:.0f} us/batch;"
          f" hop {cal['hop_us']:.0f} us; wrote {path}", file=sys.stderr)


def cmd_slo(a: argparse.Namespace) -> int:
    from slipstream._internal import slo
    from slipstream._internal.app import default_profile_path, load_pipelines

    _, pipelines = load_pipelines(a.app)
    paths = [Path(p) for p in a.profile] or [default_profile_path(a.app)]
    report = {}
    for pipe in pipelines:
        if a.pipeline and pipe.name != a.pipeline:
            continue
        if pipe.slo is None:
            print(f"{pipe.name}: no SLO declared, skipped", file=sys.stderr)
            continue
        prof = slo.load_profile_for(pipe, paths)
        if a.calibrate:
            _calibrate(a, pipe, prof)
        overheads = _overheads(a, a.app)
        cap = slo.capacity_estimate(pipe, prof, a.cores, overheads["cpu_per_request_us"], overheads["batch_cpu_us"])
        rates = [float(r) for r in a.rates.split(",")] if a.rates else \
            [round(cap * f, 1) for f in (0.1, 0.25, 0.4, 0.55, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)]
        rows = _slo_table(a, pipe, prof, rates, overheads)
        best = max((r["offered_rps"] for r in rows if slo.holds(r, pipe)), default=0.0)
        print(f"\n{pipe.name}: SLO p99 <= {pipe.slo.p99_ms} ms, misses <= {pipe.slo.max_miss_rate:.1%}; "
              f"{a.cores:g} cores; capacity estimate {cap:.0f} req/s")
        print(f"{'offered/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'refused':>9}{'dropped':>9}{'late':>7}{'miss %':>8}"
              f"{'goodput/s':>11}  SLO")
        for r in rows:
            ok = "holds" if slo.holds(r, pipe) else "MISSED"
            print(f"{r['offered_rps']:>10.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['refused']:>9}{r['dropped']:>9}"
                  f"{r['late']:>7}{100 * r['miss_rate']:>8.2f}{r['goodput_rps']:>11.0f}  {ok}")
        print(f"highest offered rate at which the SLO holds: {best:.0f} req/s")
        report[pipe.name] = {"slo": {"p99_ms": pipe.slo.p99_ms, "max_miss_rate": pipe.slo.max_miss_rate},
                             "capacity_estimate_rps": cap, "highest_rate_slo_holds": best, "curve": rows}
        png = slo.plot_slo(Path(a.app.split(":")[0]).with_suffix(f".{pipe.name}.slo.png"), pipe, rows)
        if png:
            print(f"wrote {png}")
    out = Path(a.out) if a.out else Path(a.app.split(":")[0]).with_suffix(".slo.json")
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


_MIB = {"M": 1.0, "MI": 1.0, "MIB": 1.0, "G": 1024.0, "GI": 1024.0, "GIB": 1024.0, "T": 1024.0**2, "TI": 1024.0**2,
        "TIB": 1024.0**2}


def _mib(text: str) -> float:
    """``16G``, ``512MiB``, ``1.5Ti``: MiB."""
    t = text.strip().upper()
    unit = t.lstrip("0123456789.")
    if unit not in _MIB:
        raise ValueError(text)
    return float(t[: len(t) - len(unit)]) * _MIB[unit]


def _node_inventory(text: str) -> dict[str, tuple[float, float, str]]:
    """``--nodes``: ``NAME=CORES[:MEMORY][/GPUS],...`` or
    ``COUNTxCORES[:MEMORY][/GPUS],...`` (named n0, n1, ...), GPUS as
    ``4xA100+2xA30:nomig``: name -> (cores, MiB (0: memory not given),
    GPUs ("": none))."""
    from slipstream._internal.planner import parse_inventory

    out: dict[str, tuple[float, float, str]] = {}
    for whole in (p.strip() for p in text.split(",")):
        part, _, gpus = whole.partition("/")
        label, eq, given = part.partition("=")
        count, x, each = part.partition("x")
        try:
            size, _, mem = (given if eq else each).partition(":")
            one = (float(size), _mib(mem) if mem else 0.0, gpus.strip())
            if eq:
                items = [(label.strip(), one)]
            elif x:
                items = [(f"n{len(out) + i}", one) for i in range(int(count))]
            else:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"{whole!r}: expected NAME=CORES[:MEMORY][/GPUS] or "
                                             "COUNTxCORES[:MEMORY][/GPUS] (e.g. n0=8, n0=8:32G, 3x4:16G or "
                                             "g0=32:256G/4xA100+2xA30:nomig)") from None
        if gpus.strip():
            try:
                parse_inventory(gpus.strip().replace("+", ","))
            except Error as e:
                raise argparse.ArgumentTypeError(f"{whole!r}: {e}") from None
        for name, (cores, mib, _) in items:
            if not name or not (cores > 0 and math.isfinite(cores)) or not (mib >= 0 and math.isfinite(mib)):
                raise argparse.ArgumentTypeError(f"{part!r}: a node needs a name and cores > 0")
            if name in out:
                raise argparse.ArgumentTypeError(f"node {name!r} is named twice")
            out[name] = (cores, mib, gpus.strip())
    if not out:
        raise argparse.ArgumentTypeError("no nodes given")
    return out


def cmd_plan(a: argparse.Namespace) -> int:
    from slipstream._internal import planner, slo
    from slipstream._internal.app import default_profile_path, load_pipelines, split_target

    _, pipelines = load_pipelines(a.app)
    if a.pipeline:
        pipelines = [p for p in pipelines if p.name == a.pipeline]
        if not pipelines:
            return _fail(f"no pipeline named {a.pipeline!r} in {a.app}")
    paths = [Path(p) for p in a.profile] or [default_profile_path(a.app)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        return _fail(f"no profile {', '.join(missing)}: run `slipstream profile {a.app}` first")
    pipelines = _request_pipelines(pipelines, "plan")
    profiles = {p.name: slo.load_profile_for(p, paths) for p in pipelines}
    if a.nodes and a.cluster:
        return _fail("--nodes or --cluster: the nodes are given, or read from the cluster, not both")
    if a.watch is not None:
        a.apply = True
        if not a.watch > 0:
            return _fail(f"--watch: seconds between looks at the members, more than 0 (got {a.watch:g})")
    if a.apply and not a.cluster:
        return _fail("--apply and --watch write the plan into a cluster: give --cluster too")
    if a.gpus and (a.nodes or a.cluster):
        return _fail("--gpus is one machine's GPUs: give a cluster's GPU nodes in --nodes (g0=32/4xA100+2xA30:nomig)")
    if a.network_ms is not None and not (a.nodes or a.cluster):
        return _fail("--network-ms is for a cluster plan: give --nodes or --cluster too")
    out = Path(a.out) if a.out else split_target(a.app)[0].with_suffix(".plan.json")
    if a.watch is not None:
        return _watch_plan(a, pipelines, profiles, out)
    if a.cluster:
        try:
            a.nodes = member_inventory(a)
        except EtcdError as e:
            return _fail(str(e))
        print(f"planning for cluster '{a.cluster_name}': {_members_line(a.nodes)}", file=sys.stderr)
    plan = _make_plan(a, pipelines, profiles)
    out.write_text(json.dumps(plan.to_json(), indent=2))
    if a.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(planner.format_plan(plan))
        if not a.apply:
            print(f"\nwrote {out}; run it with: slipstream serve {a.app} --plan {out}")
    if a.apply:
        try:
            deployment = apply_plan(a, current_deployment(a), plan,
                                    f"slipstream plan --apply ({_members_line(a.nodes)})")
        except EtcdError as e:
            return _fail(str(e))
        print(f"\nwrote {out}; cluster '{a.cluster_name}' places deployment {deployment} by it now")
    return 0


def _members_line(nodes: dict[str, tuple[float, float, str]]) -> str:
    return ", ".join(f"{n} ({c:g} cores, {m / 1024:.1f} GiB{', ' + g if g else ''})"
                     for n, (c, m, g) in sorted(nodes.items()))


def _make_plan(a: argparse.Namespace, pipelines: list[Any], profiles: dict[str, Any]) -> Any:
    """The plan for `a`'s machine, GPUs or nodes (``a.nodes``)."""
    from slipstream._internal import planner

    if a.gpus:
        return planner.plan_gpu(pipelines, profiles, a.gpus, rate=a.rate, app=a.app, cores=a.cores,
                                overheads=_overheads(a, a.app))
    inv: dict[str, tuple[float, float, str]] = a.nodes or {}
    network_ms = planner.NETWORK_MS if a.network_ms is None else a.network_ms
    gpu_nodes = {n: g for n, (_, _, g) in inv.items() if g}
    if gpu_nodes:
        # Stages profiled on a GPU go on the GPU nodes' GPUs; the others on
        # every node's cores.
        return planner.plan_gpu(pipelines, profiles, "", rate=a.rate, app=a.app, nodes=gpu_nodes,
                                network_ms=network_ms, cpu_nodes={n: c for n, (c, _, _) in inv.items()},
                                overheads=_overheads(a, a.app))
    return planner.plan_cpu(pipelines, profiles, cores=a.cores, overheads=_overheads(a, a.app), rate=a.rate,
                            app=a.app, check_slo=not a.no_check, sim_duration_s=a.sim_duration,
                            nodes={n: c for n, (c, _, _) in inv.items()} or None,
                            node_memory_mb={n: m for n, (_, m, _) in inv.items() if m} or None,
                            network_ms=network_ms)


def _watch_plan(a: argparse.Namespace, pipelines: list[Any], profiles: dict[str, Any], out: Path) -> int:
    """``slipstream plan --cluster ... --watch S``: plan again from the
    members' inventory whenever it changes (a node joins, leaves or is
    replaced by a bigger one) or another deployment replaces this one, and
    write each plan for the cluster's leader to follow, until interrupted.
    Errors (etcd away, no deployment yet, a plan that cannot be made) are
    said and tried again at the next look."""
    done: tuple[Any, str] | None = None
    said = ""
    warned: set[str] = set()

    def say(msg: str) -> None:
        nonlocal said
        if msg != said:  # the same trouble is said once, not every look
            print(f"plan --watch: {msg}", file=sys.stderr, flush=True)
            said = msg

    def warn(msg: str) -> None:
        if msg not in warned:
            warned.add(msg)
            print(f"plan --watch: {msg}", file=sys.stderr, flush=True)

    try:
        while True:
            try:
                members = member_inventory(a, warn)
                d = current_deployment(a)
                deployment = str(d["id"])
                if done != (members, deployment):
                    a.nodes = members
                    say(f"deployment {deployment} on {_members_line(members)}: planning")
                    t0 = time.monotonic()
                    plan = _make_plan(a, pipelines, profiles)
                    planned = planned_per_node(plan)
                    apply_plan(a, d, plan, f"slipstream plan --watch ({_members_line(members)})")
                    out.write_text(json.dumps(plan.to_json(), indent=2))
                    done = (members, deployment)
                    say(f"applied to deployment {deployment} in {time.monotonic() - t0:.1f} s: {_per_node(planned)}")
            except (EtcdError, Error) as e:
                say(f"{e}; looking again in {a.watch:g} s")
            time.sleep(a.watch)
    except KeyboardInterrupt:
        return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="slipstream", description="Serve multi-stage ML pipelines under a latency SLO.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    add_serve_command(sub)
    add_cluster_commands(sub)
    add_reseal_command(sub)
    add_tls_commands(sub)
    config.add_command(sub)

    st = sub.add_parser("status", help="stages, replicas, queue depths, batch sizes of a running node")
    st.add_argument("--url", default=DEFAULT_URL)
    st.add_argument("--json", action="store_true", help="print the raw status JSON")
    st.add_argument("--events", type=int, default=10, help="recent replica events to show (0: none)")

    sc = sub.add_parser("scale", help="set the number of replicas of a stage on a running node")
    sc.add_argument("pipeline")
    sc.add_argument("stage")
    sc.add_argument("replicas", type=int)
    sc.add_argument("--url", default=DEFAULT_URL)
    sc.add_argument("--token", default=os.environ.get("SLIPSTREAM_ADMIN_TOKEN"),
                    help="admin token (default: $SLIPSTREAM_ADMIN_TOKEN)")
    sc.add_argument("--no-wait", action="store_true", help="return once the node accepted the change")
    sc.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the replicas to settle")
    sc.set_defaults(fn=cmd_scale)
    st.set_defaults(fn=cmd_status)

    b = sub.add_parser("bench", help="open-loop load test (Poisson arrivals) of a pipeline or any URL")
    b.add_argument("--url", default=DEFAULT_URL, help="node base URL")
    b.add_argument("--pipeline", help="pipeline to load (body built from its inputs unless --body)")
    b.add_argument("--target", help="full URL to POST to instead of a pipeline")
    b.add_argument("--body", help="request body (JSON text)")
    b.add_argument("--body-file")
    b.add_argument("--rate", type=float, default=1000.0, help="offered requests/s")
    b.add_argument("--sweep", help="comma-separated rates, one run each")
    b.add_argument("--duration", type=float, default=10.0, help="measured seconds per rate")
    b.add_argument("--warmup", type=float, default=2.0)
    b.add_argument("--arrival", choices=["poisson", "uniform", "bursty"], default="poisson")
    b.add_argument("--burst", type=int, default=10)
    b.add_argument("--connections", type=int, default=512)
    b.add_argument("--timeout", type=float, default=10.0)
    b.add_argument("--threads", type=int, default=1, help="load generator threads")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--out", default="bench/results/bench.json")
    b.add_argument("--quiet", action="store_true")
    b.add_argument("--compare-slo", metavar="APP",
                   help="also predict each rate with the SLO model from APP's profile and report the error")
    add_model_args(b)
    b.set_defaults(fn=cmd_bench)

    add_store_commands(sub, DEFAULT_URL)

    pr = sub.add_parser("profile", help="measure each component's latency and memory by batch size")
    pr.add_argument("app")
    pr.add_argument("--pipeline", help="only this pipeline")
    pr.add_argument("--batches", help="comma-separated batch sizes (default 1,2,4,...,256, capped per component)")
    pr.add_argument("--iters", type=int, default=30, help="timed calls per batch size")
    pr.add_argument("--budget", type=float, default=3.0, help="seconds at most per batch size and stage")
    pr.add_argument("--out", help="profile file (default: APP.profile.json beside the app)")
    pr.add_argument("--threads", default="1",
                    help="comma-separated thread budgets per replica to measure, e.g. 1,2 (default 1)")
    pr.add_argument("--no-plot", action="store_true", help="write no PNG beside the profile")
    pr.add_argument("--colocated", action="store_true",
                    help="measure each stage while single-threaded neighbours run the pipeline's stages on the "
                         "cores it leaves (at least one): the contention a loaded deployment has")
    pr.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    pr.set_defaults(fn=cmd_profile)

    pl = sub.add_parser("plan", help="choose replicas, threads and batch limits per stage for this machine or GPUs")
    pl.add_argument("app")
    pl.add_argument("--rate", type=float, help="plan the cheapest configuration holding this many req/s "
                                                 "(and the machine's max as the autoscaler's bound)")
    pl.add_argument("--cores", type=float, default=float(os.cpu_count() or 1), help="cores to plan for")
    pl.add_argument("--gpus", metavar="SPEC", help="plan on GPUs instead: e.g. 12xA30, 4xA100-80GB:nomig, "
                                                    "or a JSON inventory")
    pl.add_argument("--nodes", metavar="SPEC", type=_node_inventory,
                    help="plan across a cluster's nodes instead of this machine: NAME=CORES[:MEMORY][/GPUS],... "
                         "(e.g. n0=8,n1=8:32G,g0=32/4xA100+2xA30:nomig) or COUNTxCORES,... (e.g. 2x8,1x4: "
                         "nodes n0, n1, n2); the plan gives each stage's replicas per node (with GPU nodes: "
                         "on their GPUs and MIG slices, stages profiled with a gpu section)")
    add_cluster_args(pl, required=False, what="plan across the members of this cluster now (their cores, from "
                                              "their records in etcd) instead of this machine")
    pl.add_argument("--network-ms", type=float, default=None, metavar="MS",
                    help="with --nodes: what a hop between nodes adds to each stage on a path (default 1.0)")
    pl.add_argument("--profile", action="append", default=[], help="profile file(s) (default: APP.profile.json)")
    pl.add_argument("--out", help="plan file (default: APP.plan.json beside the app)")
    pl.add_argument("--pipeline", help="only this pipeline")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--sim-duration", type=float, default=3.0, help="simulated seconds per SLO check")
    pl.add_argument("--no-check", action="store_true", help="skip the SLO model's check of the plan")
    pl.add_argument("--apply", action="store_true",
                    help="with --cluster: write the plan for the cluster's deployment; its leader places by it "
                         "(replicas move without restarting the nodes)")
    pl.add_argument("--watch", type=float, metavar="SECONDS",
                    help="with --cluster: plan again and apply whenever the members change (looked at every "
                         "SECONDS), until interrupted")
    pl.set_defaults(fn=cmd_plan)

    so = sub.add_parser("slo", help="predict latency and misses against load from the profile (the SLO contract)")
    so.add_argument("app")
    so.add_argument("--pipeline")
    so.add_argument("--profile", action="append", default=[])
    so.add_argument("--rates", help="comma-separated offered loads (default: 10%%..150%% of estimated capacity)")
    so.add_argument("--out")
    so.add_argument("--calibrate", action="store_true",
                    help="first serve the app here at two light loads and save the machine's overheads "
                         "to APP.calibration.json (used by later runs)")
    so.add_argument("--calibration-rates", help="the two light loads, req/s (default 3%% and 15%% of capacity)")
    so.add_argument("--calibration-duration", type=float, default=5.0, help="seconds per calibration load")
    add_model_args(so)
    so.set_defaults(fn=cmd_slo)
    return ap


def add_model_args(p: argparse.ArgumentParser) -> None:
    from slipstream._internal.slo import DEFAULTS

    g = p.add_argument_group("SLO model", "Overheads not given come from APP.calibration.json "
                                          "(slipstream slo --calibrate), else from defaults.")
    g.add_argument("--cores", type=float, default=float(os.cpu_count() or 1), help="cores the replicas share")
    g.add_argument("--sim-duration", type=float, default=20.0, help="simulated seconds per load")
    if "--burst" not in p._option_string_actions:
        g.add_argument("--burst", type=int, default=1, help="arrivals per burst (1 = Poisson)")
    g.add_argument("--hop-us", type=float, help=f"node-worker-node overhead per batch (default {DEFAULTS['hop_us']:g})")
    g.add_argument("--batch-cpu-us", type=float,
                   help=f"CPU per batch outside the component (default {DEFAULTS['batch_cpu_us']:g})")
    g.add_argument("--ingress-us", type=float,
                   help=f"HTTP + codec latency per request (default {DEFAULTS['ingress_us']:g})")
    g.add_argument("--cpu-per-request-us", type=float,
                   help=f"CPU the node and load generator spend per request (default {DEFAULTS['cpu_per_request_us']:g})")
    if "--batching" not in p._option_string_actions:
        g.add_argument("--batching", choices=["deadline", "fixed"], default="deadline")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        rc: int = a.fn(a)
        return rc
    except Error as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
