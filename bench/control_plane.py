"""`make bench-control-plane`: the cluster's control plane at 10, 50 and
100 members, against one real etcd.

Each member is simulated by `crates/slipstream-cluster/examples/control_plane.rs`
doing what a node's agent does (a 2 s lease renewed every third of it, a
signed member record under it, re-put about every 10 s as its ready
replicas change, one watch on the whole cluster prefix); the leader
computes the placement of 50 stages over all members with the cluster's
own `placement::place` and writes it, then puts a probe every 200 ms whose
arrival at every member's watch is the watch latency. Measured per size:

- etcd requests per second per member, counted by the members, and by
  etcd itself (the difference of its `grpc_server_handled_total` and
  `etcd_http_*` counters scraped from its `/metrics` before and after:
  an independent count, which includes the watches' and the probes');
- watch latency p50/p99 (a probe put until every member saw it);
- placement solve time (a first placement and 40 re-placements as a
  member leaves and comes back) and the record's size.

All members run in one process on this machine beside etcd, so the
figures are an upper bound on what etcd and the placement cost at that
size, not a measure of 100 machines' network. Writes
bench/results/control_plane.{json,md}; the load average at the start is
recorded (run it on an idle machine).

    .venv/bin/python -m bench.control_plane [--seconds 20] [--members 10,50,100]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import urllib.request

from slipstream.testing import Etcd

from bench.harness import RESULTS, ROOT

EXAMPLE = ROOT / "target" / "release" / "examples" / "control_plane"


def etcd_requests(etcd: Etcd) -> float:
    """Requests etcd has handled (gRPC and the HTTP gateway), from its own /metrics."""
    host, port = etcd.host, etcd.client[0]
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if re.match(r"^grpc_server_handled_total\{", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(members: int, seconds: int) -> dict:
    etcd = Etcd(1)
    try:
        before = etcd_requests(etcd)
        out = subprocess.run([str(EXAMPLE), etcd.url, str(members), str(seconds)], capture_output=True,
                             text=True, timeout=seconds + 120)
        if out.returncode != 0:
            raise RuntimeError(f"control_plane {members} failed:\n{out.stderr}")
        res: dict = json.loads(out.stdout.strip().splitlines()[-1])
        after = etcd_requests(etcd)
        res["etcd_handled_per_s"] = (after - before) / (seconds + res["join_s"])
        res["etcd_handled_per_s_per_member"] = res["etcd_handled_per_s"] / members
        return res
    finally:
        etcd.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--members", default="10,50,100")
    ap.add_argument("--repeats", type=int, default=3, help="runs per size, interleaved; medians reported")
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"load average at start: {load}", file=sys.stderr)
    print("building the simulator (cargo build --release --example control_plane)...", file=sys.stderr)
    subprocess.run(["cargo", "build", "--release", "--locked", "-q", "-p", "slipstream-cluster", "--example",
                    "control_plane"], cwd=ROOT, check=True)
    sizes = [int(x) for x in args.members.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for k in range(args.repeats):
        for n in sizes:
            print(f"repeat {k + 1}/{args.repeats}: {n} members for {args.seconds} s...", file=sys.stderr)
            runs[n].append(run(n, args.seconds))
            print(json.dumps(runs[n][-1]), file=sys.stderr)
    # The median of each figure over the repeats.
    rows = [{f: statistics.median(r[f] for r in runs[n]) for f in runs[n][0]} for n in sizes]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "control_plane.json").write_text(
        json.dumps({"load_average": load, "repeats": args.repeats, "medians": rows, "runs": runs}, indent=2))
    lines = ["# The control plane at N members (bench/control_plane.py)", "",
             f"load average at start: {[round(x, 2) for x in load]}; one etcd and all members on this machine; "
             f"{args.seconds} s per size; medians of {args.repeats} interleaved repeats.", "",
             "| members | member requests/s (per member) | etcd handled/s (per member) | watch p50 / p99 / max ms "
             "| placement solve p50 / max ms (stages, replicas) | placement record | join s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['members']:.0f} | {r['member_ops_per_s']:.0f} ({r['ops_per_s_per_member']:.2f}) "
            f"| {r['etcd_handled_per_s']:.0f} ({r['etcd_handled_per_s_per_member']:.2f}) "
            f"| {r['watch_latency_ms_p50']:.1f} / {r['watch_latency_ms_p99']:.1f} / {r['watch_latency_ms_max']:.1f} "
            f"| {r['placement_solve_ms_p50']:.2f} / {r['placement_solve_ms_max']:.2f} "
            f"({r['placement_stages']}, {r['placement_replicas']}) "
            f"| {r['placement_record_bytes'] / 1024:.1f} KiB | {r['join_s']:.2f} |")
    (RESULTS / "control_plane.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
