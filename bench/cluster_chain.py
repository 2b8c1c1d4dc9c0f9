"""`python -m bench.cluster_chain`: a chain of three stages on three
nodes, each request handed from node to node (direct, the default) against
every stage's answer brought back to the ingress (hub and spoke,
``slipstream node --via-ingress``).

Five nodes and one real etcd on this machine: ``a``, ``b`` and ``c`` run
``First``, ``Second`` and ``Third`` of ``bench/apps/cluster_chain.py``
(each passes its input on, so the figures are how the tensor travels, not
compute), placed by a plan; ``i`` and ``j`` hold no replica and are the
ingresses, ``i`` direct (i -> a -> b -> c -> i: four crossings of the
tensor) and ``j`` via the ingress (i -> a -> i -> b -> i -> c -> i: six).
Requests one at a time (service times, not queueing), alternating between
the two ingresses, with tensors of 1 KB and 6.4 MB; per point the median
and p99 latency as the client sees it, and the bytes the data plane
carried per request, summed over every node. With ``--curl``, the same
points are timed again by an independent client: `curl` posting the
tensor in the binary form of the KServe v2 protocol (and asking for the
answer as binary), one process a request, its own ``time_total``. Writes
bench/results/cluster_chain.{json,md}.

    .venv/bin/python -m bench.cluster_chain            # ~2 min
    .venv/bin/python -m bench.cluster_chain --curl     # and curl's timing (~3 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from slipstream.testing import Etcd, deploy, start_node, stop_all, wait_for

from bench import harness
from bench.harness import RESULTS, ROOT, percentile

APP = ROOT / "bench" / "apps" / "cluster_chain.py"
SIZES = {"1 KB": 256, "6.4 MB": 1_600_000}  # float32 elements a request
PLACED = {"First": "a", "Second": "b", "Third": "c"}
INGRESSES = {"direct (i)": "i", "via the ingress (j)": "j"}


def log(msg: str) -> None:
    print(f"[cluster_chain] {msg}", file=sys.stderr, flush=True)


def plan_file(path: Path) -> Path:
    """Each stage on its node, one replica."""
    stages = {s: {"replicas": 1, "max_replicas": 1, "threads": 1, "max_batch_size": 1, "throughput_rps": 50.0,
                  "nodes": {n: 1}} for s, n in PLACED.items()}
    doc = {"version": 1, "app": APP.name,
           "inventory": {"cores": 10.0, "nodes": {n: 2.0 for n in ("i", "j", "a", "b", "c")}},
           "pipelines": {"chain3": {"capacity_rps": 50.0, "target_rps": 45.0, "stages": stages}}, "solve_ms": 1.0}
    path.write_text(json.dumps(doc))
    return path


def data_plane_bytes(nodes: dict[str, Any]) -> int:
    """Bytes every node's data plane has written (its calls and its replies)."""
    total = 0
    for n in nodes.values():
        c = n.status()["cluster"]
        total += c["data_plane"]["bytes_sent"] + (c["data_plane_served"] or {}).get("bytes_sent", 0)
    return int(total)


def v2_body(x: np.ndarray, path: Path) -> str:
    """Write `x` as a binary v2 request for ``chain3`` (output asked as
    binary too) to `path`; the header length curl must send."""
    head = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    path.write_bytes(head + x.tobytes())
    return str(len(head))


def curl_ms(url: str, body: Path, head_len: str) -> float:
    """One request by curl; its own total time, ms. Raises unless 200."""
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code} %{time_total}",
                          "-H", "Content-Type: application/octet-stream",
                          "-H", f"Inference-Header-Content-Length: {head_len}",
                          "--data-binary", f"@{body}", f"{url}/v2/models/chain3/infer"],
                         capture_output=True, text=True, timeout=60, check=True)
    code, secs = out.stdout.split()
    if code != "200":
        raise RuntimeError(f"curl: HTTP {code}")
    return float(secs) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200, help="requests per point and ingress (1 KB; a tenth of it at 6.4 MB "
                    "and at least 40)")
    ap.add_argument("--out", type=Path, default=RESULTS / "cluster_chain")
    ap.add_argument("--curl", action="store_true", help="time each point with curl too (an independent client)")
    a = ap.parse_args()
    machine = harness.machine()
    log(f"load average {machine['loadavg_before']}")
    etcd = Etcd(1)
    ns: dict[str, Any] = {}
    points: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = deploy(etcd, APP, "--plan", str(plan_file(Path(tmp) / "p.plan.json")), wait=0)
            if out.returncode != 0:
                raise RuntimeError(out.stdout + out.stderr)
        for name in ("a", "b", "c", "i", "j"):
            ns[name] = start_node(etcd, name, "--no-standbys", *(["--via-ingress"] if name == "j" else []))
        for node in ns.values():
            def joined(node: Any = node) -> bool:
                return bool(node.is_ready() and len(node.status()["cluster"]["members"]) == 5)
            wait_for(joined, timeout=240)
        want = {f"chain3/{s}": {n: 1} for s, n in PLACED.items()}
        wait_for(lambda: (ns["i"].status()["cluster"]["placement"] or {}).get("stages", {}) == want, timeout=60)
        clients = {label: ns[name].client() for label, name in INGRESSES.items()}
        for size, elems in SIZES.items():
            x = np.arange(elems, dtype=np.float32).reshape(1, elems)
            for c in clients.values():  # warm-up: connections, arenas
                for _ in range(5):
                    y = c.infer("chain3", {"x": x})["y"]
                    if not np.array_equal(y, x):
                        raise RuntimeError("the chain did not pass the tensor on intact")
            n = a.n if elems < 10_000 else max(40, a.n // 10)
            lat: dict[str, list[float]] = {k: [] for k in clients}
            moved: dict[str, int] = {k: 0 for k in clients}
            for _ in range(n):
                for label, c in clients.items():
                    before = data_plane_bytes(ns)
                    t0 = time.perf_counter()
                    c.infer("chain3", {"x": x})
                    lat[label].append((time.perf_counter() - t0) * 1e3)
                    moved[label] += data_plane_bytes(ns) - before
            points[size] = {label: {"n": n, "p50_ms": statistics.median(v), "p99_ms": percentile(v, 99),
                                    "data_plane_bytes_per_request": moved[label] / n} for label, v in lat.items()}
            if a.curl:
                with tempfile.TemporaryDirectory() as tmp:
                    body = Path(tmp) / "body.bin"
                    head_len = v2_body(x, body)
                    by_curl: dict[str, list[float]] = {k: [] for k in clients}
                    for _ in range(n):
                        for label, name in INGRESSES.items():
                            by_curl[label].append(curl_ms(ns[name].url, body, head_len))
                for label, v in by_curl.items():
                    points[size][label]["curl_p50_ms"] = statistics.median(v)
                    points[size][label]["curl_p99_ms"] = percentile(v, 99)
            log(f"{size}: " + "; ".join(f"{k} p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, "
                                        f"{s['data_plane_bytes_per_request'] / 1e6:.2f} MB a request"
                                        + (f", curl p50 {s['curl_p50_ms']:.2f} ms" if "curl_p50_ms" in s else "")
                                        for k, s in points[size].items()))
        chains = ns["i"].status()["cluster"]["counters"]
    finally:
        stop_all(list(ns.values()))
        etcd.stop()
    res = {"cores": machine.get("cores"), "points": points, "ingress_i_counters": chains}
    harness.write_results(a.out, res, markdown(res), machine)
    print(markdown(res))
    return 0


def markdown(res: dict[str, Any]) -> str:
    lines = ["# A chain across three nodes: handed node to node, or back to the ingress after every stage", "",
             f"`python -m bench.cluster_chain`: five nodes and etcd on this machine ({res['cores']} cores); "
             "First, Second and Third on nodes a, b and c, each passing its input on; ingress i hands each "
             "request from node to node (the default), ingress j brings every stage's answer back "
             "(`--via-ingress`). One request at a time, alternating between the ingresses; latency as the "
             "client sees it, and the bytes every node's data plane wrote per request.", "",
             "| tensor | ingress | requests | p50 ms | p99 ms | data plane MB a request | curl p50 / p99 ms |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for size, per in res["points"].items():
        for label, s in per.items():
            by_curl = f"{s['curl_p50_ms']:.2f} / {s['curl_p99_ms']:.2f}" if "curl_p50_ms" in s else "-"
            lines.append(f"| {size} | {label} | {s['n']} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | "
                         f"{s['data_plane_bytes_per_request'] / 1e6:.3f} | {by_curl} |")
    for size, per in res["points"].items():
        d, h = per["direct (i)"], per["via the ingress (j)"]
        lines.append(f"\n{size}: direct takes {d['p50_ms'] / h['p50_ms']:.2f}x the median latency of hub and "
                     f"spoke, and moves {d['data_plane_bytes_per_request'] / h['data_plane_bytes_per_request']:.2f}x "
                     "its bytes." + (f" By curl: {d['curl_p50_ms'] / h['curl_p50_ms']:.2f}x the median." if
                                     "curl_p50_ms" in d else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
