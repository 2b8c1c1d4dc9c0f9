"""`make bench-cluster-surge`: a load surge on a three-node cluster, and how
each way of scaling rides it.

The shape of `bench/surge.py` (Vortex's resizing experiment): open-loop
Poisson load at 40% of one replica's capacity (``--before`` s), a step to
150% (``--surge`` s), back to 40% (``--after`` s), after a warm-up at 40%.
The pipeline is `bench/apps/cluster.py:scale`, one stage whose cost is off
the CPU (it sleeps for its batch latency, as a GPU model would: 40 ms + 5 ms
per row, batches of 4, so one replica serves ~67 req/s), so that three
nodes on this 2-core machine are not capped by its cores, and whose
replicas take 4 s to construct (as loading a large model does: the lead
time an autoscaler must see past). Three real nodes, each in its own network
namespace on a bridge when the host allows (`--netns`; else on loopback),
on one real etcd; the load goes into the first node's ingress, which routes
across the cluster. Policies, each on a fresh cluster:

- **static**: one `Model` replica in the cluster (`--autoscale off`);
- **reactive**: bounds 1-3, a replica added only once requests miss
  (`slipstream deploy --autoscale reactive`), decided by the leader on the
  load every node reports;
- **anticipatory**: bounds 1-3, a warm standby placed on another node on the
  load's trend and promoted by the placement when the forecast needs it.

The nodes run with `--no-standbys`: the failover standby a singleton gets
by default would hand every policy a warm replica for its first step, and
this compares the autoscalers. The leader's `/v1/status` is polled every 250 ms: serving replicas of the
stage across the cluster (the members' records), standbys, and the
autoscaler's events. Reported per policy as in bench/surge.py: misses
(errors, refusals included, and answers later than the SLO) overall and in
the surge, p99 per window, goodput, the time from the step until two
replicas serve, until the 1-s windows are back within the SLO. Writes
bench/results/cluster_surge.{json,md,png}.

    .venv/bin/python -m bench.cluster_surge                     # ~5 min
    .venv/bin/python -m bench.cluster_surge --before 5 --surge 15 --after 10   # a smoke run

- **ray**: the same component class under Ray Serve on a 3-node Ray
  cluster on this machine (``ray.cluster_utils.Cluster`` through
  bench/vs_ray/autoscaled.py ``--nodes 3``), with Ray Serve's own
  autoscaler on ``Model`` (bounds 1-3, ``RAY_AUTOSCALING`` of
  bench/surge.py: the same upscale delay and metrics interval as there) and
  the replicas left to Ray's scheduler, offered to Ray's HTTP proxy on the
  head node. One replica holds far less there than under Slipstream (a
  3-node Ray cluster's own processes share the two cores with the
  proxy), so, as bench/surge.py does, Ray gets the trace's shape at its own
  one-replica capacity, measured first on the same Ray cluster with
  autoscaling off (``--ray-trace same``: Slipstream's trace instead).
  Needs bench/vs_ray/setup_ray.sh; skipped with a message without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.testing import CLI, Cluster, Subnet, wait_for

from bench import harness
from bench.harness import RESULTS, ROOT
from bench.surge import (
    RAY_AUTOSCALING,
    Poller,
    SurgeRay,
    Trace,
    analyse,
    capacity,
    fmt_ms,
    fmt_s,
    offer,
    plot,
    run_ray,
)
from bench.vs_ray.servers import RAY_PY

APP = ROOT / "bench" / "apps" / "cluster.py"
KEY = "scale/Model"
SLO_MS = 300.0
REPLICA_RPS = 4 / (0.040 + 4 * 0.005)  # one Model replica, full batches
LOAD_S = 4.0  # each replica's construction: a large model's load time
BODY = json.dumps({"inputs": {"x": [[0.5] * 16]}}).encode()
# policy -> (CLUSTER_MODEL_REPLICAS, --autoscale)
POLICIES = {"static": ("1", "off"), "reactive": ("1-3", "reactive"), "anticipatory": ("1-3", "anticipatory"),
            "ray": ("1", "")}
RAY_NODES = 3
RAY_TARGET = 4.0  # ongoing requests per replica: one full batch


def ray_server(config: dict[str, Any] | None, replica_log: Path) -> SurgeRay:
    """`Model` under Ray Serve on a 3-node Ray cluster (`config`: its
    autoscaling; None: one fixed replica)."""
    s = SurgeRay(config, replica_log, app=APP, pipeline="scale", stage="Model", nodes=RAY_NODES,
                 env={"CLUSTER_MODEL_REPLICAS": "1", "CLUSTER_MODEL_LOAD_S": str(LOAD_S)})
    s.log_path = RESULTS / ("cluster_surge_ray.log" if config else "cluster_surge_ray_capacity.log")
    return s


def ray_surge(trace: Trace, a: argparse.Namespace) -> tuple[Trace, dict[str, Any]]:
    """The surge on a 3-node Ray cluster, Ray Serve's autoscaler on Model:
    Slipstream's `trace`, or (``--ray-trace own``) its shape at one Ray
    replica's capacity, measured first."""
    if a.ray_trace == "own":
        server = ray_server(None, RESULTS / "cluster_surge_ray_capacity.replicas.log")
        with server:
            cap = capacity(server.infer_url, BODY, SLO_MS, "ray")
        log(f"ray: one replica holds {cap:.0f} req/s within {SLO_MS:.0f} ms on the {RAY_NODES}-node Ray cluster")
        trace = Trace(cap, a)
    loadavg = f"{os.getloadavg()[0]:.2f}"
    log(f"ray: {RAY_NODES}-node Ray cluster, Ray Serve's autoscaler on Model (1-3); load average {loadavg}")
    run = run_ray(trace, BODY, SLO_MS, a.seed, RAY_TARGET, server_for=ray_server, name="cluster_surge_ray",
                  autoscaling={**RAY_AUTOSCALING, "max_replicas": 3})
    nodes = {n for s in run["samples"] for n in s.get("running_on", {})}
    return trace, run | {"loadavg": loadavg, "ray_nodes_used": len(nodes)}


def log(msg: str) -> None:
    print(f"[cluster_surge] {msg}", file=sys.stderr, flush=True)


def cluster_sample(st: dict[str, Any]) -> dict[str, Any]:
    """One poll of the leader: the stage's replicas serving and standing by
    across the cluster (the members' records), and its autoscaler model."""
    members = st["cluster"]["members"].values()
    block = st["cluster"].get("autoscale", {}).get("stages", {}).get(KEY, {})
    return {"serving": sum(m["ready"].get(KEY, 0) for m in members),
            "standby": sum(m.get("standby", {}).get(KEY, 0) for m in members),
            **{k: v for k, v in (block.get("model") or {}).items() if k in ("level_rps", "forecast_rps", "need")}}


def profile(out: Path) -> Path:
    """The stage's latency profile (`slipstream profile`, batches 1-4), as
    a user gives one to `slipstream deploy --profile`: the autoscaler plans
    with it from the first tick instead of learning batch costs from the
    small batches a light load forms."""
    path = out.with_name(out.name + ".profile.json")
    log(f"profiling {APP}:scale -> {path}")
    cmd = [*CLI, "profile", f"{APP}", "--pipeline", "scale", "--batches", "1,2,4",
           "--iters", "10", "--out", str(path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return path


def netns_usable() -> bool:
    """Whether this host makes network namespaces (root, CAP_NET_ADMIN)."""
    try:
        Subnet(["probe"]).close()
    except Exception as e:  # noqa: BLE001 (any failure means: not here)
        log(f"no network namespaces here ({e}): the nodes share this machine's loopback")
        return False
    return True


def run(policy: str, trace: Trace, seed: int, profile_path: Path, netns: bool) -> dict[str, Any]:
    replicas, autoscale = POLICIES[policy]
    loadavg = f"{os.getloadavg()[0]:.2f}"  # before the run
    where = "each in its own network namespace" if netns else "on loopback"
    log(f"{policy}: 3 nodes {where}, CLUSTER_MODEL_REPLICAS={replicas}, --autoscale {autoscale}; "
        f"load average {loadavg}")
    subnet = Subnet(["n1", "n2", "n3"]) if netns else None
    try:
        return run_on(policy, trace, seed, profile_path, subnet) | {"loadavg": loadavg}
    finally:
        if subnet is not None:
            subnet.close()


def run_on(policy: str, trace: Trace, seed: int, profile_path: Path, subnet: Subnet | None) -> dict[str, Any]:
    replicas, autoscale = POLICIES[policy]
    # --no-standbys: no failover standby for the singleton (it would give
    # every policy a warm replica to promote at its first step).
    with Cluster(APP, 3, "--no-standbys", env={"CLUSTER_MODEL_REPLICAS": replicas, "CLUSTER_MODEL_LOAD_S": str(LOAD_S)},
                 deploy_args=("--autoscale", autoscale, "--profile", str(profile_path)), subnet=subnet) as c:
        leader = c.nodes[0]
        wait_for(lambda: (leader.status()["cluster"]["placement"] or {}).get("stages", {}).get(KEY), 60)
        time.sleep(1.0)
        with Poller(leader.url, cluster_sample) as poller:
            report = offer(f"{c.url}/v1/pipelines/scale/infer", BODY, SLO_MS, duration=trace.duration,
                           warmup=trace.warmup, schedule=trace.schedule(), timeline=True, seed=seed)
        final = leader.status()
    for e in final.get("events", []):
        poller.events[int(e["seq"])] = e
    t0 = report["wall_start"]
    samples = [{**s, "t": s["t"] - t0} for s in poller.samples]
    events = [{"t": e["unix_ms"] / 1e3 - t0, "replica": e.get("replica"), "what": e["what"], "detail": e["detail"]}
              for _, e in sorted(poller.events.items())
              if (e["what"] == "autoscale" and (e.get("pipeline"), e.get("stage")) == ("scale", "Model"))
              or (e["what"] == "placed" and not e.get("pipeline"))]
    return {"report": report, "samples": samples, "events": events,
            "autoscale_final": final["cluster"].get("autoscale", {}).get("stages", {}).get(KEY)}


def markdown(res: dict[str, Any]) -> str:
    t = res["trace"]
    lines = [f"# Load surge on a 3-node cluster: {t['before_s']:.0f} s at {res['base']:.0%} -> {t['surge_s']:.0f} s "
             f"at {res['peak']:.0%} -> {t['after_s']:.0f} s at {res['base']:.0%} of one `Model` replica", "",
             f"`python -m bench.cluster_surge` on one machine ({res['cores']} cores): three nodes "
             + ("(each in its own network namespace, on a bridge) " if res.get("netns") else "(on loopback) ")
             + "and etcd; "
             f"SLO p99 {SLO_MS:.0f} ms; Poisson arrivals; 1-s windows; nodes with `--no-standbys` (only the "
             f"autoscaler's own standbys). One replica serves "
             f"{t['capacity_rps']:.0f} req/s (40 ms + 5 ms/row, batches of 4, off the CPU) and takes "
             f"{LOAD_S:.0f} s to construct: the trace offers "
             f"{t['base_rps']:.0f} -> {t['peak_rps']:.0f} -> {t['base_rps']:.0f} req/s and the surge needs "
             f"{t['replicas_needed']} replicas.", "",
             "| policy | load avg before | requests | missed | missed in surge | p99 before / surge / after ms | goodput | "
             "two serve after | windows back within SLO after |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, p in res["policies"].items():
        w = p["windows"]
        lines.append(
            f"| {name} | {p['loadavg']} | {p['sent']:,} | {p['missed']:,} ({p['miss_rate']:.1%}) | "
            f"{w['surge']['missed']:,} ({w['surge']['miss_rate']:.1%}) | "
            f"{fmt_ms(w['before']['p99_ms'])} / {fmt_ms(w['surge']['p99_ms'])} / {fmt_ms(w['after']['p99_ms'])} | "
            f"{p['goodput_rps']:.0f}/s ({p['goodput_share']:.1%}) | {fmt_s(p['to_full_capacity_s'])} | "
            f"{fmt_s(p['to_slo_s'])} ({p['surge_windows_missed']} missed) |")
    lines += ["", "Missed: errors (refusals included) plus answers later than the SLO. Serving replicas: the "
              "members' records of ready replicas, read from the leader every 250 ms."]
    if "ray" in res["policies"]:
        p = res["policies"]["ray"]
        rt = p["trace"]
        whose = ("the same trace" if rt["capacity_rps"] == t["capacity_rps"] else
                 f"the trace's shape at one Ray replica's capacity within the SLO there, {rt['capacity_rps']:.0f} "
                 f"req/s, measured first ({rt['base_rps']:.0f} -> {rt['peak_rps']:.0f} -> {rt['base_rps']:.0f} "
                 f"req/s)")
        lines += ["", f"Ray Serve: a {RAY_NODES}-node Ray cluster on this machine, {whose} offered to its "
                  f"HTTP proxy; its replicas ran on {p.get('ray_nodes_used', '?')} of the {RAY_NODES} nodes; "
                  f"serving replicas are the controller's RUNNING ones, polled every 250 ms; `autoscaling_config` "
                  f"`{json.dumps(p['autoscaling_config'])}`."]
    elif res.get("ray_skipped"):
        lines += ["", f"Ray Serve: not run ({res['ray_skipped']})."]
    for name, p in res["policies"].items():
        if p["events"]:
            whose = "Ray Serve's controller" if name == "ray" else "the leader"
            lines += ["", f"## {name}: {whose}'s events (seconds from the step)", ""]
            for e in p["events"]:
                lines.append(f"- {e['t'] - p['trace']['before_s']:+.2f} s {e['what']}: {e['detail']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=float, default=20.0)
    ap.add_argument("--surge", type=float, default=40.0)
    ap.add_argument("--after", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--base", type=float, default=0.4)
    ap.add_argument("--peak", type=float, default=1.5)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--ray-trace", choices=["own", "same"], default="own",
                    help="Ray's trace: the shape at its own one-replica capacity (measured), or Slipstream's")
    ap.add_argument("--netns", choices=["auto", "on", "off"], default="auto",
                    help="each node in its own network namespace (needs root; auto: when the host allows)")
    ap.add_argument("--out", default=str(RESULTS / "cluster_surge"))
    a = ap.parse_args()
    netns = a.netns == "on" or (a.netns == "auto" and netns_usable())
    machine = harness.machine()
    log(f"load average {machine['loadavg_before']}")
    trace = Trace(REPLICA_RPS, a)
    res: dict[str, Any] = {"trace": trace.to_json(), "base": a.base, "peak": a.peak, "slo_ms": SLO_MS,
                           "cores": os.cpu_count(), "netns": netns, "policies": {}}
    out = Path(a.out)
    profile_path = profile(out)
    for policy in a.policies.split(","):
        if policy == "ray" and not RAY_PY.exists():
            log(f"ray: skipped ({RAY_PY} is missing: run bench/vs_ray/setup_ray.sh)")
            res["ray_skipped"] = "bench/vs_ray/setup_ray.sh not run"
            continue
        used = trace
        if policy == "ray":
            used, r = ray_surge(trace, a)
        else:
            r = run(policy, trace, a.seed, profile_path, netns)
        res["policies"][policy] = analyse(policy, used, r, SLO_MS) | {
            k: r[k] for k in ("loadavg", "ray_nodes_used") if k in r}
        p = res["policies"][policy]
        log(f"  {policy}: missed {p['missed']} ({p['miss_rate']:.1%}), in the surge "
            f"{p['windows']['surge']['miss_rate']:.1%}; two serve after {fmt_s(p['to_full_capacity_s'])}")
    harness.write_results(out, res, markdown(res), machine)
    plot(res, out.with_suffix(".png"), title="Load surge on a 3-node cluster", what="Model")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
