"""A cluster on one machine: scaling, cross-node handoff, node kill, merged frames.

Every node is a real `slipstream node` process joined through a real etcd
(``slipstream.testing.Cluster`` starts both); the load generator is the
project's open-loop one (Poisson arrivals, latency from the scheduled send),
sending to the first node's ingress, which routes across the cluster.

1. **Scaling** (`bench/apps/cluster.py:scale`): one stage whose cost is off
   the CPU (it sleeps for its batch latency, as a GPU model would), one
   replica per node, SLO p99 <= 300 ms with at most 1% misses. Goodput at
   the SLO = answers within the SLO per second at the highest offered rate
   (fractions of the compute limit) where the SLO holds; 1, 2 and 3 nodes;
   the ratio to linear. With `--ray`, the same app under Ray Serve as a 1-
   and 3-node Ray cluster on this machine (`bench/vs_ray/ray_adapter.py
   --nodes K --spread`, started by ``bench.vs_ray.servers.RayServer``), side by side.
2. **Handoff** (`handoff`): a stage's output of 1 KB or 6.4 MB consumed by
   the next stage, on one node and with the two stages on two nodes
   (request latency p50/p99, 1 request in flight); with `--ray`, the same
   under Ray (one node; two Ray nodes with the stages pinned apart).
3. **Node kill** (`scale` on 3 nodes at 70% of their capacity, more than two serve): one node is
   killed with SIGKILL; requests lost, and the time until goodput is full
   again (250 ms buckets). **Singleton kill**: `scale` with one replica in
   the cluster, the node holding it killed, with the warm standby the
   placement keeps elsewhere and without (`--no-standbys`), alternating.
4. **Merged frames**: `cargo run --release -p slipstream-peer --example
   merge` (many small tensors per request, merged vs unmerged vs one
   message per tensor).

    .venv/bin/python -m bench.cluster [--ray] [--quick]   # -> bench/results/cluster.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from slipstream.testing import Cluster, wait_for

from bench import harness
from bench.goodput import holds, repeated, run_rate
from bench.harness import RESULTS, ROOT, percentile
from bench.vs_ray.servers import RayServer

APP = str(ROOT / "bench" / "apps" / "cluster.py")

SLO_MS = 300.0
MAX_MISS = 0.01
# One replica of `Model`: batches of 4 rows in 40 + 4 x 5 ms.
REPLICA_RPS = 4 / (0.040 + 4 * 0.005)
BODY_SCALE = json.dumps({"inputs": {"x": [[0.5] * 16]}}).encode()


def log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


def cluster(k: int, replicas: int) -> Cluster:
    """etcd + `k` nodes running `bench/apps/cluster.py`, `replicas` Model replicas in all."""
    c = Cluster(APP, k, env={"CLUSTER_MODEL_REPLICAS": str(replicas)})
    time.sleep(1.0)
    return c


def goodput_at_slo(url: str, capacity: float, fractions: list[float], seconds: float, repeat: int,
                   pipeline: str = "scale") -> dict[str, Any]:
    """Goodput at the highest offered rate (a fraction of the compute limit)
    where the SLO holds; when it holds at none of `fractions`, lower ones
    are tried (down to 10%) until it does."""
    rows = []

    def point(f: float) -> dict[str, Any]:
        # (Seeds from 7: the cluster's published runs drew these arrivals.)
        med = repeated(lambda seed: run_rate(url, pipeline, [BODY_SCALE], f * capacity, seconds, SLO_MS,
                                             warmup_s=2.0, seed=seed), repeat, first_seed=7)
        row = {"fraction": f, **med, "offered_rps": f * capacity,
               "holds": holds(med | {"ok": 1}, SLO_MS, MAX_MISS)}
        log(f"  {f:.2f} x {capacity:.0f} req/s: goodput {row['goodput_rps']:.1f}, p99 {row['p99_ms']:.0f} ms, "
            f"misses {row['miss_rate']:.2%} ({'holds' if row['holds'] else 'fails'})")
        rows.append(row)
        return row

    for f in fractions:
        point(f)
    lower = [0.5, 0.35, 0.25, 0.15, 0.1]
    while not any(r["holds"] for r in rows) and lower:
        point(lower.pop(0))
    held = [r for r in rows if r["holds"]]
    return {"capacity_rps": capacity, "rates": rows,
            "goodput_rps": max((r["goodput_rps"] for r in held), default=0.0)}


def scaling_slipstream(a: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k in a.nodes:
        log(f"scaling: Slipstream, {k} node(s)")
        with cluster(k, k) as c:
            out[str(k)] = goodput_at_slo(c.url, k * REPLICA_RPS, a.fractions, a.seconds, a.repeat)
    return out


def ray_serve(pipeline: str, k: int, extra: list[str], env: dict[str, str] | None = None) -> RayServer:
    """Ray Serve as a k-node Ray cluster on this machine, serving `pipeline`
    of `bench/apps/cluster.py` (a context manager: started on entry)."""
    server = RayServer(APP, pipeline, RESULTS, [*(["--nodes", str(k)] if k > 1 else []), *extra], env=env)
    server.log_path = RESULTS / f"cluster_ray_{pipeline}_{k}.log"
    return server


def scaling_ray(a: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k in a.nodes:
        log(f"scaling: Ray Serve, {k} Ray node(s)")
        with ray_serve("scale", k, ["--spread"] if k > 1 else [], {"CLUSTER_MODEL_REPLICAS": str(k)}) as ray:
            out[str(k)] = goodput_at_slo(ray.base, k * REPLICA_RPS, a.fractions, a.seconds, a.repeat)
    return out


def latency_run(url: str, pipeline: str, body: bytes, seconds: float) -> dict[str, Any]:
    """Closed loop, one request in flight: latency p50/p99 (ms)."""
    lat = []
    end = time.monotonic() + seconds
    target = f"{url}/v1/pipelines/{pipeline}/infer"
    for _ in range(20):  # warm-up
        urllib.request.urlopen(urllib.request.Request(target, data=body, method="POST"), timeout=10).read()
    while time.monotonic() < end:
        t0 = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(target, data=body, method="POST"), timeout=10) as r:
            r.read()
        lat.append((time.perf_counter() - t0) * 1e3)
    return {"n": len(lat), "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "load_avg": os.getloadavg()[0]}


SIZES = {"1KB": 256, "6.4MB": 1_600_000}


def handoff_bodies() -> dict[str, bytes]:
    return {name: json.dumps({"inputs": {"n": [[n]]}}).encode() for name, n in SIZES.items()}


def median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"p50_ms": statistics.median(r["p50_ms"] for r in runs), "p99_ms": statistics.median(r["p99_ms"] for r in runs),
            "runs": runs}


def handoff_slipstream(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, where in ((1, "one_node"), (2, "two_nodes")):
        log(f"handoff: Slipstream, {where}")
        with cluster(k, 1) as c:
            placement = c.nodes[0].status()["cluster"]["placement"]["stages"]
            apart = k == 1 or placement["handoff/Produce"] != placement["handoff/Consume"]
            out[where] = {"placement": {s: placement[s] for s in ("handoff/Produce", "handoff/Consume")},
                          "stages_apart": apart}
            for name, body in handoff_bodies().items():
                out[where][name] = median_runs([latency_run(c.url, "handoff", body, a.seconds / 2)
                                                for _ in range(a.repeat)])
                log(f"  {name}: p50 {out[where][name]['p50_ms']:.2f} ms, p99 {out[where][name]['p99_ms']:.2f} ms")
    return out


def handoff_ray(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, where, extra in ((1, "one_node", []), (3, "two_nodes", ["--place", "Consume=0,Produce=1"])):
        log(f"handoff: Ray Serve, {where}")
        with ray_serve("handoff", k, extra) as ray:
            out[where] = {}
            for name, body in handoff_bodies().items():
                out[where][name] = median_runs([latency_run(ray.base, "handoff", body, a.seconds / 2)
                                                for _ in range(a.repeat)])
                log(f"  {name}: p50 {out[where][name]['p50_ms']:.2f} ms, p99 {out[where][name]['p99_ms']:.2f} ms")
    return out


def kill_under_load(c: Cluster, victim: int, url: str, rate: float, duration: float) -> dict[str, Any]:
    """Open-loop load at `rate` to `url`; node `victim` SIGKILLed 6 s in.
    Requests lost and refused, and when goodput was full again (the first
    250 ms bucket from which on every bucket answers >= 99% of what was
    sent in it within the SLO)."""
    bucket_ms, kill_at = 250.0, 6.0
    killed: dict[str, float] = {}

    def kill() -> None:
        time.sleep(kill_at)
        killed["t"] = time.monotonic()
        c.nodes[victim].stop(signal.SIGKILL)

    t0 = time.monotonic()
    threading.Thread(target=kill, daemon=True).start()
    report = harness.loadgen(f"{url}/v1/pipelines/scale/infer", BODY_SCALE, [rate], duration, warmup_s=0.0,
                             seed=3, slo_ms=SLO_MS, timeline_ms=bucket_ms)[0]
    observer = next(n for i, n in enumerate(c.nodes) if i != victim)
    events = [e for e in observer.status()["events"] if e["what"] in ("node_suspected", "placed", "ready",
                                                                         "promoted")]
    kill_s = killed["t"] - t0 - 0.02
    good = []
    for b in report["timeline"]:
        sent = b["ok"] + sum(b["errors_by_kind"].values())
        good.append((b["t_s"], (b["ok"] - b["slower_than_slo"]) / sent if sent else 1.0, sent))
    recovered = None
    for i, (t, _share, _) in enumerate(good):
        if t >= kill_s and all(s >= 0.99 for _, s, _ in good[i:]):
            recovered = max(0.0, t - kill_s)
            break
    errors = dict(report["errors_by_kind"])
    refused = errors.get("status_429", 0)
    return {"rate_rps": rate, "kill_at_s": kill_s, "sent": report["sent"], "ok": report["ok"],
            "late": report["slower_than_slo"], "errors_by_kind": errors, "refused": refused,
            "lost": sum(errors.values()) - refused, "p99_ms": report["latency_ms"]["p99"],
            "recovered_after_s": recovered,
            # From the bucket the kill fell in on.
            "worst_bucket_share": min(s for t, s, _ in good if t >= kill_s - bucket_ms / 1e3),
            "timeline": [{"t_s": t, "good_share": s, "sent": n} for t, s, n in good], "events": events[-20:],
            "load_avg": os.getloadavg()[0]}


def node_kill(a: argparse.Namespace) -> dict[str, Any]:
    """3 nodes at 70% of their capacity (more than two can serve); n3 killed 6 s in; 250 ms buckets."""
    log("node kill: 3 nodes at 70% of their capacity, n3 killed with SIGKILL")
    rate = 0.7 * 3 * REPLICA_RPS  # more than two nodes can serve: the lost replica must come back
    with cluster(3, 3) as c:
        return kill_under_load(c, 2, c.url, rate, a.kill_seconds)


def placed(n: Any) -> dict[str, dict[str, int]]:
    """The placement's replicas per stage per node, as node `n` knows it."""
    p = n.status()["cluster"]["placement"]
    return p["stages"] if p else {}


def singleton_kill(a: argparse.Namespace) -> dict[str, Any]:
    """`scale` with one Model replica in a 3-node cluster, at 70% of what it
    serves; the node holding it SIGKILLed, load sent to another node; with
    the warm standby the placement keeps on a third node, and without
    (`--no-standbys`), alternating runs."""
    out: dict[str, Any] = {}
    for r in range(a.repeat):
        for mode, args in (("standby", ()), ("no_standby", ("--no-standbys",))):
            log(f"singleton kill, {mode.replace('_', ' ')}, run {r + 1}/{a.repeat}")
            with Cluster(APP, 3, *args, env={"CLUSTER_MODEL_REPLICAS": "1"}) as c:
                holder = wait_for(lambda c=c: next(iter(placed(c.nodes[0]).get("scale/Model", {})), None), 60)
                if mode == "standby":
                    wait_for(lambda c=c: any(m.get("standby", {}).get("scale/Model")
                                             for m in c.nodes[0].status()["cluster"]["members"].values()), 120)
                victim = int(holder.lstrip("n")) - 1
                ingress = next(n for i, n in enumerate(c.nodes) if i != victim)
                time.sleep(1.0)
                run = kill_under_load(c, victim, ingress.url, 0.7 * REPLICA_RPS, a.kill_seconds)
            out.setdefault(mode, []).append(run)
            log(f"  lost {run['lost']}, refused {run['refused']}, full goodput again after "
                f"{run['recovered_after_s']} s")
    return {mode: {"runs": runs,
                   "median": {k: statistics.median(x[k] if x[k] is not None else float("inf") for x in runs)
                              for k in ("lost", "refused", "recovered_after_s", "p99_ms", "worst_bucket_share")}}
            for mode, runs in out.items()}


def oha_check(a: argparse.Namespace) -> dict[str, Any]:
    """The 3-node headline with an independent generator: `oha` at a fixed
    rate (with latency correction) against the first node's ingress."""
    out: dict[str, Any] = {}
    with cluster(3, 3) as c:
        for f in (0.85, 0.95):
            rate = f * 3 * REPLICA_RPS
            runs = []
            for _ in range(a.repeat):
                r = harness.oha(f"{c.url}/v1/pipelines/scale/infer", seconds=round(a.seconds + 4), concurrency=64,
                                rate=round(rate), body=BODY_SCALE, headers=["content-type: application/json"])
                runs.append({"rps": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "status": r["status"],
                             "load_avg": os.getloadavg()[0]})
            out[f"{rate:.0f}"] = {"offered_rps": rate, "p50_ms": statistics.median(x["p50_ms"] for x in runs),
                                  "p99_ms": statistics.median(x["p99_ms"] for x in runs), "runs": runs}
            log(f"  oha at {rate:.0f} req/s: p50 {out[f'{rate:.0f}']['p50_ms']:.0f} ms, "
                f"p99 {out[f'{rate:.0f}']['p99_ms']:.0f} ms, {runs[-1]['status']}")
    return out


def merged_frames(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    log("merged frames: cargo run --release -p slipstream-peer --example merge")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cargo", "run", "--release", "--locked", "-q", "-p", "slipstream-peer", "--example", "merge",
                    "--", "--json", str(out), "--secs", str(max(1.0, a.seconds / 3))], cwd=ROOT, check=True)
    return dict(json.loads(out.read_text()))


def markdown(res: dict[str, Any]) -> str:
    lines = ["# A cluster on one machine", "",
             f"Medians of {res['repeat']} runs per point. Each section's command, time and load average are in "
             "cluster.json (`run`); the last run's machine is below.", ""]
    sc = res.get("scaling", {})
    if sc:
        lines += ["## Scaling: goodput at the SLO (p99 <= 300 ms, <= 1% misses), off-CPU stage", "",
                  "| nodes | compute limit req/s | " + " | ".join(f"{s} goodput | {s} vs linear" for s in sc) + " |",
                  "|---|---|" + "---|---|" * len(sc)]
        for k in res["nodes"]:
            row = [str(k), f"{k * REPLICA_RPS:.0f}"]
            for s in sc.values():
                g1 = s.get("1", {}).get("goodput_rps", 0.0)
                gk = s.get(str(k), {}).get("goodput_rps", 0.0)
                row += [f"{gk:.1f}", f"{gk / (k * g1):.2f}x" if g1 else "-"]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    ho = res.get("handoff", {})
    if ho:
        lines += ["## Handoff: one stage's output to the next (request latency, 1 in flight)", "",
                  "| system | tensor | one node p50 / p99 ms | two nodes p50 / p99 ms | added by the network p50 |",
                  "|---|---|---|---|---|"]
        for sysname, h in ho.items():
            for size in SIZES:
                one, two = h["one_node"][size], h["two_nodes"][size]
                lines.append(f"| {sysname} | {size} | {one['p50_ms']:.2f} / {one['p99_ms']:.2f} | "
                             f"{two['p50_ms']:.2f} / {two['p99_ms']:.2f} | {two['p50_ms'] - one['p50_ms']:+.2f} ms |")
        lines.append("")
    k = res.get("kill")
    if k:
        rec = f"{k['recovered_after_s']:.2f} s" if k["recovered_after_s"] is not None else "not within the run"
        lines += ["## Node kill under load (3 nodes at 70% of their capacity, one SIGKILLed)", "",
                  f"{k['sent']} requests sent at {k['rate_rps']:.0f} req/s; answered {k['ok']} "
                  f"({k['late']} later than the SLO); refused by admission (429, predicted to miss while "
                  f"capacity was short): {k['refused']}; lost (failed after admission): {k['lost']} "
                  f"{k['errors_by_kind']}; "
                  f"full goodput again {rec} after the kill (every 250 ms bucket >= 99% within the SLO); "
                  f"worst bucket from the kill on: {k['worst_bucket_share']:.0%} within the SLO.", ""]
    sk = res.get("singleton")
    if sk:
        lines += ["## The node holding a stage's only replica killed under load (3 nodes, one `Model` replica at 70%)",
                  "", "Medians of the runs (alternating); lost = failed after admission (503/504); refused = 429; "
                  "full goodput again = every 250 ms bucket from then on >= 99% within the SLO (0.02 s: the "
                  "first bucket after the kill already was); worst bucket: from the kill on.", "",
                  "| cluster | lost | refused | full goodput again after | p99 ms | worst bucket |",
                  "|---|---:|---:|---:|---:|---:|"]
        for mode, label in (("standby", "warm standby on another node"), ("no_standby", "`--no-standbys`")):
            if mode in sk:
                m = sk[mode]["median"]
                lines.append(f"| {label} | {m['lost']:.0f} | {m['refused']:.0f} | {m['recovered_after_s']:.2f} s | "
                             f"{m['p99_ms']:.0f} | {m['worst_bucket_share']:.0%} |")
        lines.append("")
    o = res.get("oha")
    if o:
        lines += ["## The 3-node point with an independent generator (oha, fixed rate, latency correction)", "",
                  "| offered req/s | p50 ms | p99 ms | statuses (last run) |", "|---|---|---|---|"]
        for v in o.values():
            lines.append(f"| {v['offered_rps']:.0f} | {v['p50_ms']:.0f} | {v['p99_ms']:.0f} | {v['runs'][-1]['status']} |")
        lines.append("")
    m = res.get("merge")
    if m:
        c = m["measure_costs"]
        lines += ["## Merged frames: 128 sparse features of 64 B + 13 dense floats per request, echoed "
                  "(`cargo run --release -p slipstream-peer --example merge`)", "",
                  f"Measured at start-up: {c['per_segment_ns']:.1f} ns per extra iovec, {c['per_byte_ns']:.3f} ns "
                  f"per copied byte: merge threshold {c['merge_threshold']} B.", "",
                  "| mode | frames per request | p50 us (1 in flight) | p99 us | req/s (16 in flight) |",
                  "|---|---|---|---|---|"]
        for name, mode in m["modes"].items():
            lat, thr = mode["latency"]["median"], mode["throughput"]["median"]
            lines.append(f"| {name} | {mode['frames_per_request']} | {lat['p50_us']:.0f} | {lat['p99_us']:.0f} | "
                         f"{thr['rps']:.0f} |")
        r = m["ratios"]
        lines += ["", f"Merged vs one message per tensor: {r['merged_vs_one_by_one']['throughput_merged_over_other']:.1f}x "
                  f"the throughput, {r['merged_vs_one_by_one']['p50_other_over_merged']:.1f}x lower p50; merged vs "
                  f"one frame with an iovec per tensor: {r['merged_vs_unmerged']['throughput_merged_over_other']:.2f}x "
                  f"the throughput, {r['merged_vs_unmerged']['p50_other_over_merged']:.2f}x lower p50.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ray", action="store_true", help="also run Ray Serve as a multi-node Ray cluster")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter points (a smoke run)")
    ap.add_argument("--only", choices=["scaling", "handoff", "kill", "singleton", "merge", "oha"], action="append")
    ap.add_argument("--fractions", default="", help="offered rates for the scaling points, as fractions of the "
                    "compute limit (default 0.7,0.85,0.95; lower ones follow where none holds)")
    ap.add_argument("--systems", default="slipstream,ray", help="with --ray: which systems to run (e.g. ray)")
    ap.add_argument("--out", type=Path, default=RESULTS / "cluster", help="results path without suffix")
    a = ap.parse_args()
    a.nodes = [1, 2, 3]
    a.fractions = [float(f) for f in a.fractions.split(",") if f] or ([0.7, 0.85, 0.95] if not a.quick else [0.8])
    a.seconds = 8.0 if not a.quick else 4.0
    a.repeat = 3 if not a.quick else 1
    a.kill_seconds = 20.0 if not a.quick else 12.0
    only = set(a.only or ["scaling", "handoff", "kill", "singleton", "merge", "oha"])
    machine = harness.machine()
    res: dict[str, Any] = {"repeat": a.repeat, "nodes": a.nodes}
    log(f"load average {machine['loadavg_before']}")
    systems = set(a.systems.split(",")) if a.ray else {"slipstream"}
    # Sections can be rerun one at a time (--only): each records its own run.
    stamp = {k: machine[k] for k in ("command", "time", "loadavg_before", "git_sha")}
    if "scaling" in only:
        res["scaling"] = {}
        if "slipstream" in systems:
            res["scaling"]["slipstream"] = scaling_slipstream(a) | {"run": stamp}
        if "ray" in systems:
            res["scaling"]["ray"] = scaling_ray(a) | {"run": stamp}
    if "handoff" in only:
        res["handoff"] = {}
        if "slipstream" in systems:
            res["handoff"]["slipstream"] = handoff_slipstream(a) | {"run": stamp}
        if "ray" in systems:
            res["handoff"]["ray"] = handoff_ray(a) | {"run": stamp}
    if "kill" in only:
        res["kill"] = node_kill(a)
    if "singleton" in only:
        res["singleton"] = singleton_kill(a) | {"run": stamp}
    if "merge" in only:
        res["merge"] = merged_frames(a, a.out.parent / "cluster_merge.json")
    if "oha" in only:
        log("independent generator: oha against 3 nodes")
        res["oha"] = oha_check(a)
    path = a.out.with_suffix(".json")
    if a.only and path.exists():
        # A partial rerun updates what it measured and keeps the rest (each
        # section records its own command, time and load average).
        old = json.loads(path.read_text())
        for section in ("scaling", "handoff"):
            if section in res:
                old.setdefault(section, {}).update(res[section])
                res[section] = old[section]
        res = old | res
    harness.write_results(a.out, res, markdown(res), machine)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
