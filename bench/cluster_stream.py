"""`python -m bench.cluster_stream`: the chunks of a streaming stage on
another node, against the same stage on the client's own ingress.

Two nodes (``near``, ``far``) on one real etcd, both on this machine; the
app is ``bench/apps/cluster_stream.py``, whose ``Chunks`` yields five
chunks 20 ms apart (its cost off the CPU), placed on ``far`` only by a
plan (``slipstream deploy --plan``). Each stream is one request
(``ss.Client.stream``, closed loop, one at a time: service times, not
queueing), sent in turn to ``far``'s ingress (the stage is local there)
and to ``near``'s (the stage is on the other node: each chunk crosses the
data plane as a partial reply of the batch's call, the answer after it).
Per stream: ``first`` (sent -> first chunk decoded), ``gap`` (between
consecutive chunks, median of the four), ``done`` (sent -> final answer
decoded); chunks of 1 KB and 1 MB. Medians and p90 of ``-n`` streams per
point. Writes bench/results/cluster_stream.{json,md}.

    .venv/bin/python -m bench.cluster_stream            # ~1 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import slipstream as ss
from slipstream.testing import Etcd, deploy, start_node, stop_all, wait_for

from bench import harness
from bench.harness import RESULTS, ROOT, percentile

APP = ROOT / "bench" / "apps" / "cluster_stream.py"
SIZES = {"1 KB": 256, "1 MB": 262144}  # float32 elements per chunk


def log(msg: str) -> None:
    print(f"[cluster_stream] {msg}", file=sys.stderr, flush=True)


def plan_file(path: Path) -> Path:
    """The stage on `far` only."""
    stage = {"replicas": 1, "max_replicas": 1, "threads": 1, "max_batch_size": 1, "throughput_rps": 10.0,
             "nodes": {"far": 1}}
    doc = {"version": 1, "app": APP.name, "inventory": {"cores": 2.0, "nodes": {"near": 1.0, "far": 1.0}},
           "pipelines": {"chunks": {"capacity_rps": 10.0, "target_rps": 9.0, "stages": {"Chunks": stage}}},
           "solve_ms": 1.0}
    path.write_text(json.dumps(doc))
    return path


def one_stream(client: ss.Client, n: int) -> dict[str, float]:
    t0 = time.perf_counter()
    at = []
    with client.stream("chunks", {"n": np.array([[n]], dtype=np.int64)}) as s:
        for chunk in s:
            at.append(time.perf_counter() - t0)
            if chunk["c"].shape != (1, n):
                raise RuntimeError(f"a chunk of shape {chunk['c'].shape}, not (1, {n})")
    done = time.perf_counter() - t0
    if len(at) != 5 or s.final is None:
        raise RuntimeError(f"{len(at)} chunks and final {s.final is not None}, not 5 and a final answer")
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    return {"first_ms": at[0] * 1e3, "gap_ms": statistics.median(gaps) * 1e3, "done_ms": done * 1e3}


def summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(runs)}
    for k in ("first_ms", "gap_ms", "done_ms"):
        xs = [r[k] for r in runs]
        out[k] = {"p50": statistics.median(xs), "p90": percentile(xs, 90)}
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = ["# A streaming stage's chunks across nodes", "",
             f"`python -m bench.cluster_stream -n {res['n']}`: two nodes and etcd on this machine ({res['cores']} "
             "cores); `Chunks` yields 5 chunks 20 ms apart (off the CPU), placed on `far`; each stream one "
             "request, closed loop, alternating between `far`'s ingress (the stage local) and `near`'s (the "
             "stage on the other node). Median / p90 of the streams, ms.", "",
             "| chunk | ingress | streams | first chunk | gap between chunks | done |", "|---|---|---:|---:|---:|---:|"]
    for size, per in res["points"].items():
        for where, s in per.items():
            lines.append(f"| {size} | {where} | {s['n']} | {s['first_ms']['p50']:.1f} / {s['first_ms']['p90']:.1f} | "
                         f"{s['gap_ms']['p50']:.1f} / {s['gap_ms']['p90']:.1f} | "
                         f"{s['done_ms']['p50']:.1f} / {s['done_ms']['p90']:.1f} |")
    lines += ["", "The gap is the component's 20 ms plus what a chunk costs on its way; the stage on the other node "
              "adds one data-plane crossing per chunk, not a round trip per stream."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=40, help="streams per point")
    ap.add_argument("--out", type=Path, default=RESULTS / "cluster_stream")
    a = ap.parse_args()
    machine = harness.machine()
    log(f"load average {machine['loadavg_before']}")
    etcd = Etcd(1)
    ns: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = deploy(etcd, APP, "--plan", str(plan_file(Path(tmp) / "p.plan.json")), wait=0)
            if out.returncode != 0:
                raise RuntimeError(out.stdout + out.stderr)
        ns = {name: start_node(etcd, name, "--no-standbys") for name in ("near", "far")}
        for node in ns.values():
            def joined(node: Any = node) -> bool:
                return bool(node.is_ready() and len(node.status()["cluster"]["members"]) == 2)
            wait_for(joined, timeout=180)
        wait_for(lambda: ((ns["near"].status()["cluster"]["placement"] or {}).get("stages", {})
                          .get("chunks/Chunks") == {"far": 1}), timeout=60)
        clients = {"local (far)": ns["far"].client(), "another node (near)": ns["near"].client()}
        for c in clients.values():  # warm-up: connections, the chunk tensors made
            for n in SIZES.values():
                for _ in range(3):
                    one_stream(c, n)
        points: dict[str, dict[str, Any]] = {}
        for size, n in SIZES.items():
            runs: dict[str, list[dict[str, float]]] = {k: [] for k in clients}
            for _ in range(a.n):
                for where, c in clients.items():
                    runs[where].append(one_stream(c, n))
            points[size] = {where: summary(r) for where, r in runs.items()}
            log(f"{size}: " + "; ".join(f"{w} first {s['first_ms']['p50']:.1f} ms, gap {s['gap_ms']['p50']:.1f} ms, "
                                        f"done {s['done_ms']['p50']:.1f} ms" for w, s in points[size].items()))
        served = ns["far"].status()["cluster"]["counters"]["served_batches"]
        log(f"far served {served} batches for near")
    finally:
        stop_all(list(ns.values()))
        etcd.stop()
    res = {"n": a.n, "cores": machine.get("cores"), "points": points, "far_served_batches": served}
    harness.write_results(a.out, res, markdown(res), machine)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
