"""`make bench-grpc`: the Open Inference Protocol over gRPC against the same
protocol over HTTP, on the two-stage no-op chain (examples/noop.py), so the
difference is the edge: HTTP/2 + protobuf vs HTTP/1.1 + JSON or binary.

Each side is driven closed-loop by a generator written for its protocol,
at the same load shape (concurrency and duration):

- gRPC: `ghz` (`ModelInfer` with `raw_input_contents`, as tritonclient sends
  it), one connection per concurrent worker unless --grpc-connections;
- HTTP: `oha` POSTing to `/v2/models/noop/infer`, once with a JSON body and
  once with the binary-tensor extension (the same bytes as gRPC's raw
  contents, after a JSON header).

Both generators share the machine's cores with the node; quote medians of
repeated runs (--repeat) on a noisy machine. ghz builds its messages
dynamically from the .proto and costs more CPU per call than oha, which
on a small machine shows up as gRPC latency: read the two as "the same
protocol through two stacks, generator included". The pipeline's 10 ms SLO
stays on, so past saturation the node sheds (RESOURCE_EXHAUSTED / 429,
answered at once): "answered/s" counts only successful calls, and the
latency percentiles include the fast refusals (neither generator splits
them); --no-admission makes the node queue instead of refusing.
Prints throughput and p50/p99 per side and writes
bench/results/grpc.{json,md} (or --out).

    GOFLAGS=-mod=mod go install github.com/bojand/ghz/cmd/ghz@v0.120.0   # -> ~/go/bin/ghz
    cargo install oha --locked                                            # -> ~/.cargo/bin/oha
    .venv/bin/python -m bench.grpc_vs_http [--duration 15] [--repeat 3]
"""

from __future__ import annotations

import argparse
import base64
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.harness import EXAMPLES, RESULTS, ROOT, cpu_seconds, percentile

PROTO = ROOT / "crates" / "slipstream-kserve" / "proto" / "grpc_predict_v2.proto"
SIDES = ("grpc", "http v2 json", "http v2 binary")


def log(msg: str) -> None:
    print(f"[bench-grpc] {msg}", file=sys.stderr, flush=True)


def payloads(dim: int, workdir: Path) -> dict[str, Any]:
    """The same 1 x dim FP32 tensor in each side's wire form: ghz's request
    file, the JSON body, and the binary body with its header's length."""
    x = np.arange(dim, dtype=np.float32).reshape(1, dim)
    grpc_req = {"model_name": "noop", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, dim]}],
                "raw_input_contents": [base64.b64encode(x.tobytes()).decode()]}
    (workdir / "grpc.json").write_text(json.dumps(grpc_req))
    json_body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, dim],
                                        "data": x.ravel().tolist()}]}).encode()
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, dim],
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    return {"grpc": workdir / "grpc.json", "http v2 json": json_body,
            "http v2 binary": (header + x.tobytes(), len(header))}


def one_side(side: str, node: Any, data: Any, a: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """One measured run, with the CPU the node and the generator spent per
    answered call: on a 2-core machine the generators compete with the node,
    and a heavier generator shows up as protocol cost unless it is split out."""
    node0, gen0 = cpu_seconds(node.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _one_side(side, node, data, a, seconds)
    gen1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    calls = max(r["requests"], 1)
    r["node_cpu_us_per_call"] = (cpu_seconds(node.pid) - node0) / calls * 1e6
    r["generator_cpu_us_per_call"] = (gen1.ru_utime + gen1.ru_stime - gen0.ru_utime - gen0.ru_stime) / calls * 1e6
    return r


def _one_side(side: str, node: Any, data: Any, a: argparse.Namespace, seconds: float) -> dict[str, Any]:
    if side == "grpc":
        return harness.ghz(node.grpc_url, proto=PROTO, call="inference.GRPCInferenceService/ModelInfer", data=data,
                           seconds=seconds, concurrency=a.concurrency,
                           connections=a.grpc_connections or a.concurrency)
    url = f"{node.url}/v2/models/noop/infer"
    if side == "http v2 json":
        return harness.oha(url, seconds=seconds, concurrency=a.concurrency, body=data,
                           headers=["Content-Type: application/json"])
    body, header_len = data
    return harness.oha(url, seconds=seconds, concurrency=a.concurrency, body=body,
                       headers=["Content-Type: application/octet-stream",
                                f"Inference-Header-Content-Length: {header_len}"])


def one_client(node: Any, dim: int, n: int) -> dict[str, Any]:
    """One client, one call at a time, with Triton's own Python clients for
    both protocols (tritonclient.grpc over gRPC's C core, tritonclient.http
    with binary tensors): the protocols' latency through the node without a
    load generator competing for the cores."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    x = np.arange(dim, dtype=np.float32).reshape(1, dim)
    out: dict[str, Any] = {"calls": n}
    for name, mod, client in (("grpc", tg, tg.InferenceServerClient(node.grpc_url)),
                              ("http", th, th.InferenceServerClient(node.url.removeprefix("http://")))):
        inp = mod.InferInput("x", [1, dim], "FP32")
        if name == "http":
            inp.set_data_from_numpy(x, binary_data=True)
        else:
            inp.set_data_from_numpy(x)
        took = []
        for i in range(n + 100):
            t0 = time.perf_counter()
            client.infer("noop", [inp])
            if i >= 100:  # the first 100 warm up
                took.append((time.perf_counter() - t0) * 1e3)
        out[name] = {"p50_ms": percentile(took, 50), "p99_ms": percentile(took, 99)}
        client.close()
        log(f"one client, {n} sequential calls, {name}: p50 {out[name]['p50_ms']:.3f} ms, "
            f"p99 {out[name]['p99_ms']:.3f} ms")
    return out


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        "# gRPC vs HTTP: the Open Inference Protocol on the two-stage no-op chain", "",
        f"`bench/grpc_vs_http.py`: examples/noop.py, a 1x{cfg['dim']} FP32 tensor, {cfg['concurrency']} concurrent "
        f"clients for {cfg['duration_s']:g} s per side (after {cfg['warmup_s']:g} s of warm-up), median of "
        f"{cfg['repeat']} interleaved run(s). gRPC: `ghz` with raw contents over {cfg['grpc_connections']} "
        f"connection(s); HTTP: `oha`, one connection per client. The generators share the machine "
        f"with the node; admission control "
        f"{'off' if cfg['no_admission'] else 'on (the pipeline sheds past saturation)'}.", "",
        "| side | answered/s | calls/s | p50 ms | p99 ms | node CPU µs/call | generator CPU µs/call "
        "| not answered (all runs) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, r in res["sides"].items():
        failed = sum(x["requests"] - x["ok"] for x in r["runs"])
        lines.append(f"| {side} | {r['ok_rps']:,.0f} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
                     f"| {r['node_cpu_us_per_call']:.0f} | {r['generator_cpu_us_per_call']:.0f} | {failed} |")
    lines += ["", "Latency percentiles include refused and dropped calls (answered at once); the kinds of "
              "failure are in grpc.json."]
    sq = res.get("sequential")
    if sq:
        lines += ["", f"One client, {sq['calls']} sequential calls with Triton's Python clients "
                  "(`tritonclient.grpc`, `tritonclient.http` with binary tensors):", "",
                  "| protocol | p50 ms | p99 ms |", "|---|---:|---:|",
                  f"| gRPC | {sq['grpc']['p50_ms']:.3f} | {sq['grpc']['p99_ms']:.3f} |",
                  f"| HTTP | {sq['http']['p50_ms']:.3f} | {sq['http']['p99_ms']:.3f} |"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=15.0, help="measured seconds per side and run")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds per side before the first run")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs per side (medians reported)")
    ap.add_argument("--dim", type=int, default=16, help="the tensor's width (1 x dim FP32)")
    ap.add_argument("--grpc-connections", type=int, default=0, help="ghz connections (default: one per client)")
    ap.add_argument("--no-admission", action="store_true", help="the node queues instead of refusing")
    ap.add_argument("--sequential", type=int, default=2000, help="calls of the one-client comparison")
    ap.add_argument("--out", type=Path, default=RESULTS / "grpc.json")
    a = ap.parse_args()
    for name, path, hint in (("ghz", harness.GHZ, "GOFLAGS=-mod=mod go install github.com/bojand/ghz/cmd/ghz@v0.120.0"),
                             ("oha", harness.OHA, "cargo install oha --locked")):
        if path is None:
            log(f"{name} not found: {hint}")
            return 2
    machine = harness.machine()
    flags = ["--autoscale", "off", *(["--no-admission"] if a.no_admission else [])]
    with tempfile.TemporaryDirectory(prefix="bench-grpc-") as tmp, harness.node(EXAMPLES / "noop.py", *flags) as node:
        if node.grpc_url is None:
            log("the node has no gRPC listener")
            return 1
        data = payloads(a.dim, Path(tmp))
        log(f"node {node.url}, gRPC {node.grpc_url}; warming up {a.warmup:g} s per side")
        for side in SIDES:
            one_side(side, node, data[side], a, a.warmup)
        sequential = one_client(node, a.dim, a.sequential)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
        for rep in range(a.repeat):
            for side in SIDES:
                r = one_side(side, node, data[side], a, a.duration)
                runs[side].append(r)
                log(f"run {rep + 1}/{a.repeat} {side}: {r['ok_rps']:,.0f} answered/s, {r['rps']:,.0f} calls/s, p50 {r['p50_ms']:.2f} ms, "
                    f"p99 {r['p99_ms']:.2f} ms, {r['ok']}/{r['requests']} ok, CPU per call: node "
                    f"{r['node_cpu_us_per_call']:.0f} µs, generator {r['generator_cpu_us_per_call']:.0f} µs")
    res = {
        "sequential": sequential,
        "config": {"concurrency": a.concurrency, "duration_s": a.duration, "warmup_s": a.warmup, "repeat": a.repeat,
                   "dim": a.dim, "grpc_connections": a.grpc_connections or a.concurrency,
                   "no_admission": a.no_admission},
        "sides": {s: {m: statistics.median(r[m] for r in rs) for m in ("ok_rps", "rps", "p50_ms", "p99_ms",
                                                                  "node_cpu_us_per_call", "generator_cpu_us_per_call")}
                  | {"runs": rs}
                  for s, rs in runs.items()},
    }
    md = markdown(res)
    print(md)
    json_path, md_path = harness.write_results(a.out, res, md, machine)
    log(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
