"""The ``slipstream`` command line: serve, status, bench.

Entry points stay thin: parse arguments, call into the library, print.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from slipstream._internal.errors import Error, ServeError

DEFAULT_URL = os.environ.get("SLIPSTREAM_URL", "http://127.0.0.1:8000")


def _fail(msg: str, code: int = 1) -> int:
    print(f"slipstream: error: {msg}", file=sys.stderr)
    return code


def cmd_serve(a: argparse.Namespace) -> int:
    from slipstream import _core
    from slipstream._internal.app import app_spec, default_profile_path, load_pipelines, load_profiles

    _, pipelines = load_pipelines(a.app)
    profile_paths = [Path(p) for p in a.profile]
    if not profile_paths and default_profile_path(a.app).is_file():
        profile_paths = [default_profile_path(a.app)]
    for p in profile_paths:
        print(f"slipstream: latency profile {p}", file=sys.stderr)
    batching = {"policy": a.batching, "fixed_wait_ms": a.fixed_wait_ms, "max_wait_ms": a.max_wait_ms,
                "admission": not a.no_admission}
    spec = app_spec(a.app, pipelines, batching=batching, profiles=load_profiles(profile_paths))
    for p in pipelines:
        stages = ", ".join(
            s["name"] + (f" <- {' + '.join(s['parents'])}" if s["parents"] else " <- inputs")
            for s in p.to_spec()["stages"]
        )
        print(f"slipstream: pipeline {p.name}: {stages}", file=sys.stderr)
    try:
        _core.serve(
            json.dumps(spec),
            host=a.host,
            port=a.port,
            threads=a.threads,
            max_body_bytes=int(a.max_body_mb * (1 << 20)),
            request_timeout_s=a.request_timeout,
            drain_timeout_s=a.drain_timeout,
            worker_start_timeout_s=a.worker_start_timeout,
            pool_mb=a.pool_mb,
        )
    except _core.CoreError as e:
        kind, message = e.args
        raise ServeError(kind, message) from None
    return 0


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def cmd_status(a: argparse.Namespace) -> int:
    try:
        st = _get(a.url.rstrip("/") + "/v1/status")
    except (urllib.error.URLError, OSError) as e:
        return _fail(f"no node answers at {a.url} ({e}); is `slipstream serve` running?")
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"node {a.url}  ready={st['ready']}  uptime={st['uptime_s']:.0f}s  in-flight={st['inflight']}")
    c = st["copies"]
    print(f"payload copies: ingress={c['ingress']} gather={c['gather']} worker={c['worker']} egress={c['egress']}")
    for p in st["pipelines"]:
        slo = p["slo"]
        lat = p["latency_ms"]
        errs = sum(p["errors"].values())
        slo_s = f"SLO p99<={slo['p99_ms']}ms" if slo else "no SLO"
        print(f"\npipeline {p['name']}  ({slo_s})  ok={p['ok']} errors={errs}  "
              f"latency p50={lat['p50']:.2f}ms p99={lat['p99']:.2f}ms")
        print(f"  {'stage':<16}{'replicas':>9}{'healthy':>8}{'queued':>7}{'batches':>9}{'batch mean':>11}"
              f"{'max':>5}   {'ms: wait p50':>12}{'compute p50':>12}{'hop p50':>8}{'hop p99':>8}")
        for s in p["stages"]:
            reps = s["replicas"]
            healthy = sum(1 for r in reps if r["healthy"])
            queue = sum(r["queue"] for r in reps)
            bs = s["batch_size"]
            print(f"  {s['name']:<16}{len(reps):>9}{healthy:>8}{queue:>7}{s['batches']:>9}{bs['mean']:>11.1f}"
                  f"{bs['max']:>5.0f}   {s['queue_wait_ms']['p50']:>12.2f}{s['compute_ms']['p50']:>12.2f}"
                  f"{s['hop_ms']['p50']:>8.2f}{s['hop_ms']['p99']:>8.2f}")
    return 0


def _example_body(url: str, pipeline: str) -> bytes:
    """A one-row request built from the pipeline's declared inputs."""
    desc = _get(f"{url}/v1/pipelines/{pipeline}")
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
        except (urllib.error.URLError, OSError) as e:
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
            urllib.request.urlopen(urllib.request.Request(base + "/v1/admin/reset-metrics", method="POST"), timeout=5)
        except (urllib.error.URLError, OSError):
            is_node = False
    reports = json.loads(_core.bench(json.dumps(cfg), quiet=a.quiet))
    node_status = None
    if is_node:
        try:
            node_status = _get(base + "/v1/status")
        except (urllib.error.URLError, OSError):
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
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="slipstream", description="Serve multi-stage ML pipelines under a latency SLO.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="serve the pipelines of an app file")
    s.add_argument("app", help="app file, optionally file.py:pipeline_variable")
    s.add_argument("--host", default=os.environ.get("SLIPSTREAM_HOST", "127.0.0.1"))
    s.add_argument("--port", type=int, default=int(os.environ.get("SLIPSTREAM_PORT", "8000")))
    s.add_argument("--threads", type=int, default=0, help="node threads (default: min(cores, 4))")
    s.add_argument("--max-body-mb", type=float, default=64.0)
    s.add_argument("--request-timeout", type=float, default=30.0, help="seconds before a request is answered 504")
    s.add_argument("--drain-timeout", type=float, default=30.0)
    s.add_argument("--worker-start-timeout", type=float, default=300.0)
    s.add_argument("--pool-mb", type=int, default=0, help="shared-memory pool size per replica (MiB)")
    s.add_argument("--profile", action="append", default=[],
                   help="latency profile from `slipstream profile` (default: APP.profile.json beside the app, if any)")
    s.add_argument("--batching", choices=["deadline", "fixed"], default="deadline",
                   help="deadline-aware batch former (default), or fixed max-batch + wait (the Triton/Ray policy)")
    s.add_argument("--fixed-wait-ms", type=float, default=2.0, help="the fixed policy's wait for a full batch")
    s.add_argument("--max-wait-ms", type=float, default=2.0, help="the deadline policy's longest delayed-batching wait")
    s.add_argument("--no-admission", action="store_true", help="do not refuse requests predicted to miss the SLO")
    s.set_defaults(fn=cmd_serve)

    st = sub.add_parser("status", help="stages, replicas, queue depths, batch sizes of a running node")
    st.add_argument("--url", default=DEFAULT_URL)
    st.add_argument("--json", action="store_true", help="print the raw status JSON")
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
    b.set_defaults(fn=cmd_bench)
    return ap


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
