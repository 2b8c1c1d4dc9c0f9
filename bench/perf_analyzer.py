"""Triton's perf_analyzer against a node, over HTTP and gRPC in one run:
the two-stage echo chain (examples/echo.py, pipeline ``demo``) and
examples/recsys.py, concurrency 1 to 64, each protocol in turn at each
point on the same node (gRPC on the HTTP port: one node, one port).

    make bench-perf-analyzer      # installs perf_analyzer first
    python -m bench.perf_analyzer [--quick] [--repeat N]

perf_analyzer is Triton's own tool, run unchanged: it reads the pipeline's
model configuration (``/v2/models/{name}/config``), sends KServe v2
requests and reads the statistics extension (``/v2/models/{name}/stats``)
for the server-side breakdown (queue, compute input, compute infer, per
request). The node runs without admission control: perf_analyzer stops at
the first refused request. Writes bench/results/perf_analyzer.{json,md}.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import harness

PIPELINES = [
    # (app, model, shapes, input data)
    ("examples/echo.py", "demo", ["x:1,4"], "random"),
    ("examples/recsys.py", "recsys", ["user:1,1", "history:1,8"], "zero"),
]


def measure(addr: str, model: str, protocol: str, shapes: list[str], c: int, interval: int,
            data: str) -> dict[str, Any]:
    """One perf_analyzer point; when its windows do not agree, once more with
    windows twice as long (perf_analyzer's own advice). The row says which
    window it took; a point that never settles has no figures (``stable``
    False) and is left out of the medians."""
    for window in (interval, 2 * interval):
        try:
            r = harness.perf_analyzer(addr, model, protocol=protocol, shapes=shapes, concurrency=c,
                                      interval_ms=window, input_data=data)
            return {**r, "window_ms": window, "stable": True}
        except RuntimeError as e:
            if "stable measurement" not in str(e):
                raise
            print(f"{model} {protocol} c={c}: no stable measurement in {window} ms windows", flush=True)
    return {"concurrency": c, "stable": False, "rps": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="concurrency 1, 8, 64 and 1 s windows")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each point, protocols alternating (medians)")
    ap.add_argument("--out", default=str(harness.RESULTS / "perf_analyzer"))
    a = ap.parse_args()
    machine = harness.machine()
    levels = [1, 8, 64] if a.quick else [1, 2, 4, 8, 16, 32, 64]
    interval = 1000 if a.quick else 2000
    runs: list[dict[str, Any]] = []
    for app, model, shapes, data in PIPELINES:
        # Admission off: perf_analyzer stops at its first failed request, and
        # a closed loop of at most 64 requests offers no more than it is sent
        # back; Triton, whose shape it expects, has no admission control.
        with harness.node(str(harness.ROOT / app), "--no-admission") as n:
            addr = n.url.removeprefix("http://")
            for c in levels:
                for run in range(a.repeat):
                    for protocol in ("http", "grpc"):
                        t0 = time.time()
                        r = measure(addr, model, protocol, shapes, c, interval, data)
                        r.update(pipeline=model, protocol=protocol, run=run)
                        runs.append(r)
                        print(f"{model:<7} {protocol:<4} c={c:<3} {r['rps']:>8.0f} infer/s  p50 {r['p50_ms']:6.2f} ms"
                              f"  p99 {r['p99_ms']:6.2f} ms  server queue {r.get('server_queue_ms', 0):.2f} ms"
                              f"  compute {r.get('server_compute_infer_ms', 0):.2f} ms  ({time.time() - t0:.0f} s)",
                              flush=True)
    # One row per point: the median of its runs, figure by figure.
    rows: list[dict[str, Any]] = []
    for _, model, _, _ in PIPELINES:
        for c in levels:
            for protocol in ("http", "grpc"):
                same = [r for r in runs if (r["pipeline"], r["concurrency"], r["protocol"]) == (model, c, protocol)
                        and r["stable"]]
                figures = {k for r in same for k, v in r.items() if isinstance(v, float)}
                rows.append({"pipeline": model, "concurrency": c, "protocol": protocol, "runs": len(same),
                             **{k: harness.percentile([r[k] for r in same if k in r], 50) for k in figures}})
    md = ["# perf_analyzer over HTTP and gRPC", "",
          "Triton's perf_analyzer (tritonclient 2.41.0's binary), unchanged, against one node; both protocols "
          f"at each point, admission off; medians of {a.repeat} runs per point, the protocols alternating. "
          "Latencies are perf_analyzer's (client side); the server columns come from the statistics extension, "
          "per request.", "",
          "| pipeline | concurrency | HTTP infer/s (runs) | gRPC infer/s (runs) | gRPC/HTTP | HTTP p50 ms | gRPC p50 ms | "
          "HTTP p99 ms | gRPC p99 ms | server queue ms (gRPC) | server compute ms (gRPC) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, model, _, _ in PIPELINES:
        for c in levels:
            h = next(r for r in rows if r["pipeline"] == model and r["concurrency"] == c and r["protocol"] == "http")
            g = next(r for r in rows if r["pipeline"] == model and r["concurrency"] == c and r["protocol"] == "grpc")
            f = lambda x, k: x.get(k, float("nan"))  # noqa: E731 (a point with no stable run has no figures)
            md.append(f"| {model} | {c} | {f(h, 'rps'):.0f} ({h['runs']}) | {f(g, 'rps'):.0f} ({g['runs']}) | "
                      f"{f(g, 'rps') / max(f(h, 'rps'), 1e-9):.2f} | "
                      f"{f(h, 'p50_ms'):.2f} | {f(g, 'p50_ms'):.2f} | {f(h, 'p99_ms'):.2f} | {f(g, 'p99_ms'):.2f} | "
                      f"{f(g, 'server_queue_ms'):.2f} | {f(g, 'server_compute_infer_ms'):.2f} |")
    paths = harness.write_results(a.out, {"rows": rows, "runs": runs, "levels": levels, "interval_ms": interval,
                                          "repeat": a.repeat},
                                  "\n".join(md), machine)
    print("\n".join(md))
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
