"""`make bench`: the runtime's own overhead on this machine, in one run.

1. The bare HTTP limit: a Go echo server (bench/echo) driven by the same
   open-loop generator (skipped if Go is missing).
2. Slipstream: the two-stage no-op chain (examples/noop.py: an ingress
   stage and a child stage, both Python components) at the same rates.

Prints a table and writes bench/results/runtime.{json,md}. The generator
shares the machine's cores with the server, as the issue prescribes; quote
medians of repeated runs (--repeat) on a noisy machine.

    .venv/bin/python -m bench.run [--repeat 3] [--duration 10]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from bench import harness
from bench.harness import RESULTS, ROOT, free_port
from bench.limit import load_limit


def load(url: str, body: bytes, rates: list[float], duration: float, warmup: float) -> list[dict[str, Any]]:
    return harness.loadgen(url, body, rates, duration, warmup_s=warmup, seed=7)


def start_echo() -> tuple[subprocess.Popen[bytes], str] | None:
    go = shutil.which("go")
    if go is None:
        print("go not found: skipping the bare HTTP echo baseline", file=sys.stderr)
        return None
    exe = ROOT / "target" / "bench-echo"
    subprocess.run([go, "build", "-o", str(exe), "."], cwd=ROOT / "bench" / "echo", check=True)
    port = free_port()
    proc = subprocess.Popen([str(exe), "-addr", f"127.0.0.1:{port}"])
    url = f"http://127.0.0.1:{port}/echo"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("echo server did not start")


def summarise(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Median over repeats, per rate."""
    out = []
    for per_rate in zip(*runs, strict=True):
        def med(f: Any, per_rate: tuple[dict[str, Any], ...] = per_rate) -> float:
            return statistics.median(f(r) for r in per_rate)
        out.append({
            "offered_rps": per_rate[0]["offered_rps"],
            "achieved_rps": med(lambda r: r["achieved_rps"]),
            "p50_ms": med(lambda r: r["latency_ms"]["p50"]),
            "p99_ms": med(lambda r: r["latency_ms"]["p99"]),
            "p999_ms": med(lambda r: r["latency_ms"]["p999"]),
            "errors": med(lambda r: r["errors"]),
            "late_sends": med(lambda r: r["late_sends"]),
            "repeats": len(per_rate),
        })
    return out


def table(name: str, rows: list[dict[str, Any]]) -> list[str]:
    """Markdown: a heading and one row per offered rate."""
    lines = [f"## {name}", "", "| offered/s | achieved/s | p50 ms | p99 ms | p99.9 ms | errors | late sends |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['offered_rps']:.0f} | {r['achieved_rps']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
              f"{r['p999_ms']:.2f} | {r['errors']:.0f} | {r['late_sends']:.0f} |" for r in rows]
    return lines + [""]


def highest_within(rows: list[dict[str, Any]], p99_ms: float) -> float:
    ok = [r["offered_rps"] for r in rows
          if r["p99_ms"] <= p99_ms and r["errors"] == 0 and r["achieved_rps"] >= 0.98 * r["offered_rps"]]
    return max(ok, default=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="5000,10000,15000,20000,25000")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-echo", action="store_true")
    ap.add_argument("--serve-flag", action="append", default=[],
                    help="extra `slipstream serve` flag for the noop node, e.g. --serve-flag=--no-admission")
    ap.add_argument("--out", default=str(RESULTS / "runtime.json"))
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    body = json.dumps({"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}).encode()
    machine = harness.machine()
    result: dict[str, Any] = {"rates": rates, "duration_s": a.duration, "serve_flags": a.serve_flag}
    md = ["# Runtime overhead: the two-stage no-op chain against a bare HTTP echo", "",
          f"The project's open-loop generator (Poisson), {a.duration:g} s per rate after {a.warmup:g} s of "
          f"warm-up, medians of {a.repeat} run(s); the generator shares the cores with the server.", ""]

    if not a.no_echo:
        echo = start_echo()
        if echo is not None:
            proc, url = echo
            try:
                runs = []
                for i in range(a.repeat):
                    print(f"bare HTTP echo, run {i + 1}/{a.repeat} ...", file=sys.stderr, flush=True)
                    runs.append(load(url, body, rates, a.duration, a.warmup))
                result["echo"] = summarise(runs)
            finally:
                proc.kill()
                proc.wait()
            md += table("bare HTTP echo (Go net/http), same load generator", result["echo"])

    with harness.node(ROOT / "examples" / "noop.py", *a.serve_flag) as node:
        runs = []
        stages = []
        for i in range(a.repeat):
            print(f"slipstream noop chain, run {i + 1}/{a.repeat} ...", file=sys.stderr, flush=True)
            node.request("POST", "/v1/admin/reset-metrics")
            runs.append(load(node.url + "/v1/pipelines/noop/infer", body, rates, a.duration, a.warmup))
            stages.append({s["name"]: {"hop_ms": s["hop_ms"], "batch_size": s["batch_size"]}
                           for s in node.status()["pipelines"][0]["stages"]})
    result["slipstream"] = summarise(runs)
    result["hop"] = {
        name: {
            "p50_us": statistics.median(s[name]["hop_ms"]["p50"] * 1000 for s in stages),
            "p99_us": statistics.median(s[name]["hop_ms"]["p99"] * 1000 for s in stages),
            "mean_batch": statistics.median(s[name]["batch_size"]["mean"] for s in stages),
        }
        for name in stages[0]
    }
    md += table("slipstream: two-stage no-op chain (First -> Second, Python workers)", result["slipstream"])
    md += ["Per-hop overhead node -> worker -> node (all rates of the sweep):", ""]
    md += [f"- {name}: p50 {h['p50_us']:.0f} us, p99 {h['p99_us']:.0f} us, mean batch {h['mean_batch']:.1f}"
           for name, h in result["hop"].items()]
    result["highest_rate_p99_under_10ms"] = {
        "slipstream": highest_within(result["slipstream"], 10.0),
        **({"echo": highest_within(result["echo"], 10.0)} if "echo" in result else {}),
    }
    md += ["", f"Highest offered rate with p99 <= 10 ms: {result['highest_rate_p99_under_10ms']}."]
    limit = load_limit("noop")
    if limit is not None:
        result["offline_limit_rps"] = limit
        best = result["highest_rate_p99_under_10ms"]["slipstream"]
        md.append(f"Offline compute limit of the noop components (bench.limit): {limit:,.0f} req/s; "
                  f"slipstream reached {best / limit:.2%} of it (the rest is HTTP, the node and the generator).")
    else:
        md.append("No offline compute limit for noop in bench/results/limit.json: run `python -m bench.limit` first.")
    print("\n".join(md))
    json_path, md_path = harness.write_results(a.out, result, "\n".join(md), machine)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
