"""A torch stage on a GPU: the offline compute limit against served goodput.

    .venv/bin/python -m bench.gpu                 # needs a CUDA GPU and oha
    .venv/bin/python -m bench.gpu --replicas 2    # two replicas on the one GPU

The stage is an MLP in fp16 (``--width`` wide, ``--layers`` deep, weights
from a fixed seed: it stands for a model's compute, not its accuracy),
declared with ``tensors="torch", device="cuda"``: its replica's worker is
bound to one GPU through ``CUDA_VISIBLE_DEVICES`` and gets each batch as
torch tensors over the node's shared memory, moved to the GPU once per
batch; its output comes back to host memory once.

1. **Offline limit**: the same module run in this process on the same GPU,
   batch after batch of ``max_batch_size`` rows with the host<->device
   copies included: rows/s no server can beat.
2. **Served**: ``oha`` drives ``/v2/models/gpu_mlp/infer`` with KServe v2
   binary bodies (one row each) at several concurrencies; answered/s within
   the SLO (goodput), p50/p99, and the node's batch sizes.

Prints a table and writes ``bench/results/gpu.json`` and ``gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import slipstream as ss

from bench import harness
from bench.harness import RESULTS


def log(msg: str) -> None:
    print(f"[bench-gpu] {msg}", file=sys.stderr, flush=True)


def build_mlp(width: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).half().eval()


def pipeline(width: int, layers: int, max_batch: int, replicas: int, slo_ms: float) -> ss.Pipeline:
    class MLP:
        def __init__(self) -> None:
            import torch

            self.torch = torch
            self.net = build_mlp(width, layers).cuda()

        def __call__(self, batch: ss.Batch) -> dict:
            with self.torch.inference_mode():
                y = self.net(batch["x"].half()).float()
            return {"y": y}

    comp = ss.component(MLP, name="MLP", max_batch_size=max_batch, replicas=replicas, tensors="torch",
                        device="cuda", inputs={"x": ss.Tensor("float32", (-1, width))})
    # The example warms each replica (CUDA context, cuBLAS handles: hundreds of
    # ms on the first batch) before it reports ready.
    return ss.Pipeline("gpu_mlp", comp, slo=ss.SLO(p99_ms=slo_ms), example={"x": [[0.0] * width]})


def offline_limit(width: int, layers: int, batch: int, seconds: float) -> dict[str, float]:
    import torch

    net = build_mlp(width, layers).cuda()
    x = np.random.default_rng(0).standard_normal((batch, width), dtype=np.float32)
    with torch.inference_mode():
        for _ in range(10):
            net(torch.from_numpy(x).cuda().half()).float().cpu()
        torch.cuda.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            net(torch.from_numpy(x).cuda().half()).float().cpu().numpy()
            n += 1
        dt = time.perf_counter() - t0
    return {"batch": batch, "rows_per_s": n * batch / dt, "batch_ms": dt / n * 1e3}


def mlp_stage(status: dict[str, Any]) -> dict[str, Any]:
    p = next(p for p in status["pipelines"] if p["name"] == "gpu_mlp")
    return next(s for s in p["stages"] if s["name"] == "MLP")


def run_oha(url: str, body: bytes, header_len: int, concurrency: int, seconds: float) -> dict[str, Any]:
    """oha POSTing KServe v2 binary bodies (a JSON header of `header_len` bytes, then the tensor)."""
    return harness.oha(url, seconds=seconds, concurrency=concurrency, body=body,
                       headers=["Content-Type: application/octet-stream",
                                f"Inference-Header-Content-Length: {header_len}"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        log("no CUDA GPU: this benchmark needs one")
        return 2
    if harness.OHA is None:
        log("oha not found: cargo install oha --locked (or set OHA=path)")
        return 2
    gpu = torch.cuda.get_device_name(0)
    machine = harness.machine()
    offline = [offline_limit(a.width, a.layers, b, 3.0) for b in sorted({1, a.max_batch // 4, a.max_batch})]
    for o in offline:
        log(f"offline batch {o['batch']}: {o['rows_per_s']:,.0f} rows/s ({o['batch_ms']:.2f} ms/batch)")
    x = np.random.default_rng(1).standard_normal((1, a.width), dtype=np.float32)
    header = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, a.width],
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    served: dict[int, list[dict[str, Any]]] = {c: [] for c in a.concurrency}
    body = header + x.tobytes()
    with harness.node(pipeline(a.width, a.layers, a.max_batch, a.replicas, a.slo_ms), "--autoscale", "off",
                      echo=True) as node:
        url = f"{node.url}/v2/models/gpu_mlp/infer"
        with ss.Client(node.url) as c:
            out = c.infer("gpu_mlp", {"x": x}, deadline_ms=60_000)
            with torch.inference_mode():
                want = build_mlp(a.width, a.layers).cuda()(torch.from_numpy(x).cuda().half()).float().cpu().numpy()
            err = float(np.abs(np.asarray(out["y"]) - want).max())
            log(f"served answer matches the offline module: max abs diff {err:.2e}")
            replicas = mlp_stage(c.status())["replicas"]
        devices = [(r.get("device"), (r.get("gpu") or {}).get("name")) for r in replicas]
        log(f"replicas: {devices}")
        run_oha(url, body, len(header), max(a.concurrency), 3.0)
        for rep in range(a.repeat):
            for conc in a.concurrency:
                r = run_oha(url, body, len(header), conc, a.duration)
                served[conc].append(r)
                log(f"run {rep + 1}/{a.repeat} c={conc}: {r['ok_rps']:,.0f} answered/s, p50 {r['p50_ms']:.2f} ms, "
                    f"p99 {r['p99_ms']:.2f} ms, {r['ok']}/{r['requests']} ok")
        with ss.Client(node.url) as c:
            stage = mlp_stage(c.status())
    res = {
        "gpu": gpu,
        "config": vars(a) | {"out": str(a.out)},
        "answer_max_abs_diff": err,
        "replica_devices": devices,
        "offline": offline,
        "served": {c: {m: statistics.median(r[m] for r in rs) for m in ("ok_rps", "p50_ms", "p99_ms")} | {"runs": rs}
                   for c, rs in served.items()},
        "batch_size": stage.get("batch_size"),
    }
    limit = max(o["rows_per_s"] for o in offline)
    lines = [f"# A torch stage on {gpu}", "",
             f"`python -m bench.gpu` on {gpu}, {os.cpu_count()} CPU cores. MLP {a.layers} x {a.width} fp16, max batch {a.max_batch}, {a.replicas} "
             f"replica(s), SLO p99 {a.slo_ms:g} ms; one row per request (KServe v2 binary, `oha`), "
             f"medians of {a.repeat} runs of {a.duration:g} s.", "",
             "| offline batch | rows/s | ms/batch |", "|---:|---:|---:|"]
    lines += [f"| {o['batch']} | {o['rows_per_s']:,.0f} | {o['batch_ms']:.2f} |" for o in offline]
    lines += ["", "| clients | answered/s | of offline limit | p50 ms | p99 ms |", "|---:|---:|---:|---:|---:|"]
    for conc, s in res["served"].items():
        lines.append(f"| {conc} | {s['ok_rps']:,.0f} | {s['ok_rps'] / limit:.0%} | {s['p50_ms']:.2f} | "
                     f"{s['p99_ms']:.2f} |")
    bs = res["batch_size"] or {}
    lines += ["", f"Requests per batch over the whole run: mean {bs.get('mean', float('nan')):.1f}, "
              f"p99 {bs.get('p99', float('nan')):.0f}."]
    md = "\n".join(lines) + "\n"
    print(md)
    harness.write_results(a.out, res, md, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
