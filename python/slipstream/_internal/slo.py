"""Latency profiles and the SLO contract.

`slipstream profile app.py` measures, for every component of every pipeline,
latency (mean, p50, p99) and memory (peak RSS) as a function of batch size,
by running the components in this process on batches built from the
pipeline's example request (or synthetic inputs of the declared types). It
writes `app.profile.json` (which `slipstream serve` loads, and which the node
keeps refining online from real batches) and draws `app.profile.png`.

`slipstream slo app.py` predicts, from that profile and a queueing model
(a discrete-event simulation of the node's own batch former, admission and
routing, with the machine's cores shared by all replicas; see
`slipstream-sched/src/sim.rs`), p50/p99 latency and the miss rate as
functions of offered load, prints the table, draws the curve, and names the
highest rate at which the SLO holds.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from slipstream._internal import admin, tensors
from slipstream._internal.api import Batch, Pipeline, completing
from slipstream._internal.client import Client
from slipstream._internal.errors import ConfigError, from_core

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _merge_inputs(pipe: Pipeline, name: str, outputs: dict[str, dict[str, np.ndarray]],
                  roots: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    parents = pipe.graph.parents(name)
    if not parents:
        return dict(roots)
    merged: dict[str, np.ndarray] = {}
    for p in parents:
        merged.update(outputs[p])
    return merged


def stage_batches(pipe: Pipeline, instances: dict[str, Any], b: int) -> Iterator[tuple[str, Batch]]:
    """Each stage's batch of `b` rows, in topological order, made from its
    parents' real outputs: each stage runs once on its batch before it is
    yielded (the outputs its children need, and a warm-up). A stage whose
    max batch size is below `b` runs on as many rows as it takes and its
    outputs are repeated to `b` rows for its children (the roots are one
    example repeated, so the rows are alike): a speech recogniser that
    takes 8 requests at most is not run on 256 to profile the search
    after it."""
    roots = pipe.example_batch(b)
    outputs: dict[str, dict[str, np.ndarray]] = {}
    for name in pipe.graph.topological_order():
        comp = pipe.stage(name)
        convert = tensors.for_component(comp.tensors, comp.device)
        inputs = _merge_inputs(pipe, name, outputs, roots)
        rows = min(b, comp.max_batch_size)
        run = inputs if rows == b else {k: v[:rows] for k, v in inputs.items()}
        batch = Batch(run if convert is None else convert(run), [1] * rows)
        result = instances[name](batch)
        outputs[name] = {k: np.asarray(tensors.as_numpy(v)) for k, v in result.items()}
        if rows < b:
            repeat = np.arange(b) % rows
            outputs[name] = {k: np.take(v, repeat, axis=0) for k, v in outputs[name].items()}
        yield name, batch


def profile_pipeline(pipe: Pipeline, batches: list[int], iters: int, budget_s: float,
                     threads: int = 1) -> dict[str, Any]:
    """Measure every stage of `pipe` at each batch size (capped by its max
    batch size). `threads` is only recorded: the thread budget is set by the
    environment this process was started with (see `cmd_profile`)."""
    order = pipe.graph.topological_order()
    instances = {}
    for name in order:
        t0 = time.perf_counter()
        instances[name] = completing(pipe.stage(name).instantiate())
        print(f"  {pipe.name}/{name}: constructed in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    stages: dict[str, Any] = {name: {"points": []} for name in order}
    plan = [(b, n) for b in batches for n in order if b <= pipe.stage(n).max_batch_size]
    total, done = len(plan), 0
    for b in batches:
        if not any(b <= pipe.stage(n).max_batch_size for n in order):
            continue
        for name, batch in stage_batches(pipe, instances, b):
            if b > pipe.stage(name).max_batch_size:
                continue
            times: list[float] = []
            deadline = time.perf_counter() + budget_s
            while len(times) < iters and (len(times) < 3 or time.perf_counter() < deadline):
                t0 = time.perf_counter()
                instances[name](batch)
                times.append((time.perf_counter() - t0) * 1e3)
            t = np.array(times)
            stages[name]["points"].append({
                "batch": b,
                "mean_ms": float(t.mean()),
                "p50_ms": float(np.percentile(t, 50)),
                "p99_ms": float(np.percentile(t, 99)),
                "samples": len(times),
                "rss_mb": round(_rss_mb(), 1),
            })
            done += 1
            _progress(done, total, f"{name} batch {b}: {t.mean():.2f} ms")
    return {"pipeline": pipe.name, "threads": threads, "stages": stages}


def merge_thread_profiles(parts: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One profile per pipeline from runs at several thread counts: each
    stage keeps ``points`` at one thread (the format every reader knows) and
    gains ``by_threads: {"2": {"points": [...]}}`` for the others."""
    base = parts[1] if 1 in parts else parts[min(parts)]
    merged = []
    for prof in base:
        out: dict[str, Any] = {"pipeline": prof["pipeline"], "stages": {}}
        near = {str(t): p["colocated"] for t, profs in sorted(parts.items())
                for p in profs if p["pipeline"] == prof["pipeline"] and "colocated" in p}
        if near:
            out["colocated"] = near  # by thread count: what ran beside each measurement
        for name, st in prof["stages"].items():
            entry: dict[str, Any] = {"points": st["points"]}
            others = {str(t): {"points": next(p for p in profs if p["pipeline"] == prof["pipeline"])
                                         ["stages"][name]["points"]}
                      for t, profs in sorted(parts.items()) if t != 1}
            if others:
                entry["by_threads"] = others
            out["stages"][name] = entry
        merged.append(out)
    return merged


def write_profile(path: Path, profiles: list[dict[str, Any]]) -> None:
    doc = {
        "version": 1,
        "device": "cpu",
        "cores": os.cpu_count(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "pipelines": profiles,
    }
    path.write_text(json.dumps(doc, indent=2))


def plot_profile(path: Path, profiles: list[dict[str, Any]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    n = len(profiles)
    fig, axes = plt.subplots(n, 2, figsize=(11, 3.6 * n), squeeze=False)
    for row, prof in enumerate(profiles):
        for name, st in prof["stages"].items():
            b = [p["batch"] for p in st["points"]]
            axes[row][0].plot(b, [p["p99_ms"] for p in st["points"]], marker="o", label=f"{name} p99")
            axes[row][0].plot(b, [p["mean_ms"] for p in st["points"]], ls="--", alpha=0.6, label=f"{name} mean")
            axes[row][1].plot(b, [p["mean_ms"] / p["batch"] for p in st["points"]], marker="o", label=name)
        for ax, title in ((axes[row][0], "latency per batch (ms)"), (axes[row][1], "mean ms per request")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ax.set_title(f"{prof['pipeline']}: {title}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the SLO contract -------------------------------------------------------

# Used when a machine has not been calibrated (`slipstream slo --calibrate`);
# measured on this project's 2-core development machine (docs/benchmarks.md):
# hop = node -> worker -> node latency per batch beyond compute; batch_cpu =
# CPU per batch outside the component (framing, the worker's loop, wake-ups;
# 400 us is what calibrating examples/recsys.py found);
# ingress = HTTP + codec latency per request; cpu_per_request = node + load
# generator CPU per request.
DEFAULTS = {"hop_us": 300.0, "batch_cpu_us": 400.0, "ingress_us": 400.0, "cpu_per_request_us": 60.0}
# Quantiles of the latency outside the stages that a calibration measures.
EXTERNAL_QUANTILES = (0.5, 0.9, 0.99, 0.999)


def load_profile_for(pipe: Pipeline, paths: list[Path]) -> dict[str, Any]:
    for p in paths:
        doc = json.loads(p.read_text())
        for prof in doc.get("pipelines", []):
            if prof["pipeline"] == pipe.name:
                missing = set(pipe.graph.nodes) - set(prof["stages"])
                if missing:
                    raise ConfigError(f"profile {p} lacks stage(s) {sorted(missing)} of {pipe.name}: profile again")
                return dict(prof)
    raise ConfigError(f"no profile for pipeline {pipe.name!r}: run `slipstream profile` first")


def scheduler_slice_us(cores: float) -> float:
    """Linux's default time slice (EEVDF base slice, scaled as the kernel
    does by default: 0.75 ms x (1 + log2 of the CPU count, at most 8)): how
    long work waits when another thread takes its core."""
    return 750.0 * (1 + math.floor(math.log2(max(1, min(int(cores), 8)))))


def model_config(pipe: Pipeline, prof: dict[str, Any], rate: float, *, cores: float, duration_s: float,
                 policy: str = "deadline", fixed_wait_ms: float = 2.0, max_wait_ms: float = 0.0,
                 admission: bool = True, burst: int = 1, seed: int = 1, **overheads: Any) -> dict[str, Any]:
    if pipe.slo is None:
        raise ConfigError(f"pipeline {pipe.name!r} declares no SLO")
    order = list(pipe.graph.nodes)
    stages = []
    for name in order:
        comp = pipe.stage(name)
        pts = [[p["batch"], p["mean_ms"] * 1e3, p["p99_ms"] * 1e3] for p in prof["stages"][name]["points"]]
        stages.append({
            "parents": [order.index(p) for p in pipe.graph.parents(name)],
            "replicas": int(comp.replicas),
            "max_batch": int(comp.max_batch_size),
            "points": pts,
            "elastic_ms": comp.elastic_ms,
        })
    cfg = {
        "stages": stages, "slo_ms": pipe.slo.p99_ms, "rate": rate, "burst": burst,
        "duration_s": duration_s, "warmup_s": min(2.0, duration_s / 5), "cores": cores,
        "policy": policy, "fixed_wait_ms": fixed_wait_ms, "max_wait_ms": max_wait_ms,
        "admission": admission, "seed": seed, "max_miss_rate": pipe.slo.max_miss_rate,
        "preempt_slice_us": scheduler_slice_us(cores),
    }
    cfg.update(DEFAULTS)
    cfg.update({k: v for k, v in overheads.items() if v is not None})
    return cfg


# Simulated requests per load at the least: a p99 from fewer moves by 10%
# between seeds at low rates.
MIN_SIMULATED = 30_000


def predict(pipe: Pipeline, prof: dict[str, Any], rates: list[float], *, duration_s: float,
            **kw: Any) -> list[dict[str, Any]]:
    from slipstream import _core

    out = []
    for r in rates:
        secs = max(duration_s, MIN_SIMULATED / max(r, 1e-9))
        try:
            res: dict[str, Any] = json.loads(_core.simulate(json.dumps(model_config(pipe, prof, r, duration_s=secs,
                                                                                    **kw))))
        except _core.CoreError as e:
            raise from_core(e) from None
        out.append(res)
    return out


def example_body(pipe: Pipeline) -> bytes:
    """One request to `pipe` as the pipeline API's JSON: its declared example,
    else synthetic inputs of the declared types."""
    inputs = pipe._example_json() or {k: v.tolist() for k, v in pipe.example_batch(1).items()}
    return json.dumps({"inputs": inputs}).encode()


def calibration_path(target: str) -> Path:
    """Where `slipstream slo --calibrate` keeps a machine's overheads: beside the app."""
    return Path(target.split(":")[0]).with_suffix(".calibration.json")


def load_calibration(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return {k: doc[k] for k in ("hop_us", "batch_cpu_us", "ingress_us", "cpu_per_request_us", "external_us")
            if k in doc}


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def calibrate(url: str, pipe: Pipeline, prof: dict[str, Any], body: bytes, rates: tuple[float, float],
              duration_s: float, cores: float) -> dict[str, Any]:
    """Measure what the profile does not contain, by serving `pipe` on this
    machine at two light loads (the load generator runs in this process):

    - CPU outside the components, as `cpu_per_request * requests +
      batch_cpu * batches` (two loads with different batch sizes give the
      two unknowns): the node's HTTP and codecs, the workers' framing and
      wake-ups, and the load generator;
    - the hop: node -> worker -> node latency per batch beyond compute;
    - the latency outside the stages, as quantiles: measured end-to-end
      quantiles at the busier load minus the model's own quantiles there.
      This is where what the model does not know shows up.

    Linux only (reads /proc)."""
    from slipstream import _core

    with Client(url, timeout=10.0) as node:
        # The CPU the node and the idle workers use with no load at all (timers,
        # health checks), per second: taken off each run before fitting.
        st = node.status()
        pids = [st["pid"]] + [r["pid"] for p in st["pipelines"] for s in p["stages"] for r in s["replicas"]]
        t0, before = time.perf_counter(), sum(_proc_cpu_s(p) for p in pids)
        time.sleep(2.0)
        idle_per_s = max(sum(_proc_cpu_s(p) for p in pids) - before, 0.0) / (time.perf_counter() - t0)
        runs = []
        for rate in rates:
            admin.reset_metrics(url)
            st = node.status()
            pids = [st["pid"]] + [r["pid"] for p in st["pipelines"] for s in p["stages"] for r in s["replicas"]]
            before = sum(_proc_cpu_s(p) for p in pids) + sum(os.times()[:2])
            cfg = {"url": f"{url}/v1/pipelines/{pipe.name}/infer", "method": "POST", "body": list(body),
                   "content_type": "application/json", "headers": [], "rates": [rate], "duration_s": duration_s,
                   "warmup_s": 0.0, "arrival": {"kind": "poisson"}, "max_connections": 256, "timeout_s": 10.0,
                   "threads": 1, "seed": 5}
            try:
                rep = json.loads(_core.bench(json.dumps(cfg), quiet=True))[0]
            except _core.CoreError as e:
                raise from_core(e) from None
            cpu = sum(_proc_cpu_s(p) for p in pids) + sum(os.times()[:2]) - before
            pst = next(p for p in node.status()["pipelines"] if p["name"] == pipe.name)
            stages = pst["stages"]
            runs.append({
                "rate": rate, "report": rep, "stages": stages,
                "requests": max(rep["ok"] + rep["errors"], 1),
                "batches": sum(s["batches"] for s in stages),
                "outside_s": max(cpu - sum(s["compute_ms"]["mean"] * s["batches"] for s in stages) / 1e3
                                 - idle_per_s * rep["duration_s"], 0.0),
            })
    (lo, hi) = runs
    # outside = a * requests + b * batches, from the two runs.
    det = lo["requests"] * hi["batches"] - hi["requests"] * lo["batches"]
    a = b = -1.0
    if abs(det) > 1e-9:
        a = (lo["outside_s"] * hi["batches"] - hi["outside_s"] * lo["batches"]) / det
        b = (lo["requests"] * hi["outside_s"] - hi["requests"] * lo["outside_s"]) / det
    if a < 0 or b < 0:  # too close to tell apart: keep the default per-batch cost
        b = DEFAULTS["batch_cpu_us"] / 1e6
        a = max(hi["outside_s"] - b * hi["batches"], 0.0) / hi["requests"]
    cal: dict[str, Any] = {
        "cpu_per_request_us": a * 1e6, "batch_cpu_us": b * 1e6,
        "hop_us": statistics.median(s["hop_ms"]["p50"] * 1e3 for s in lo["stages"]),
        "ingress_us": 0.0,
    }
    # Latency outside the stages: at the busier load, each measured quantile
    # minus the model's own (without it) at that quantile. The model's own
    # quantiles already hold its queueing and preemption, so only what it
    # lacks is left (the lighter run's tail is dominated by wake-ups from
    # idle, which a loaded machine does not have).
    own = predict(pipe, prof, [hi["rate"]], cores=cores, duration_s=max(duration_s, 10.0), **cal)[0]
    lat = hi["report"]["latency_ms"]
    ext, floor = [], 0.0
    for q, key in zip(EXTERNAL_QUANTILES, ("p50", "p90", "p99", "p999"), strict=True):
        floor = max(floor, lat[key] - own[f"{key}_ms"])
        ext.append([q, floor * 1e3])
    ext.append([1.0, max(floor, lat["max"] - own["p999_ms"]) * 1e3])
    cal["external_us"] = ext
    cal["idle_cpu_per_s"] = idle_per_s
    cal["measured"] = [{"rate": r["rate"], "requests": r["requests"], "batches": r["batches"],
                        "cpu_outside_s": r["outside_s"], "latency_ms": r["report"]["latency_ms"]} for r in runs]
    return cal


def capacity_estimate(pipe: Pipeline, prof: dict[str, Any], cores: float,
                      cpu_per_request_us: float = DEFAULTS["cpu_per_request_us"],
                      batch_cpu_us: float = DEFAULTS["batch_cpu_us"]) -> float:
    """Requests/s the pipeline could sustain at its best batch sizes: the
    slowest stage, and the cores that all stages, the node and the load
    generator share."""
    per_stage = []
    cpu_per_req = cpu_per_request_us / 1e6
    for name, comp in pipe.graph.nodes.items():
        pts = [p for p in prof["stages"][name]["points"] if p["batch"] <= comp.max_batch_size]
        best = max(pts, key=lambda p: p["batch"] / (p["mean_ms"] + batch_cpu_us / 1e3))
        per_batch_ms = best["mean_ms"] + batch_cpu_us / 1e3
        per_stage.append(comp.replicas * best["batch"] / per_batch_ms * 1e3)
        cpu_per_req += per_batch_ms / best["batch"] / 1e3
    return min(min(per_stage), cores / cpu_per_req)


def holds(r: dict[str, Any], pipe: Pipeline) -> bool:
    assert pipe.slo is not None
    return r["answered"] > 0 and r["p99_ms"] <= pipe.slo.p99_ms and r["miss_rate"] <= pipe.slo.max_miss_rate


def plot_slo(path: Path, pipe: Pipeline, rows: list[dict[str, Any]], measured: list[dict[str, Any]] | None = None) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    assert pipe.slo is not None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["offered_rps"] for r in rows]
    a1.plot(x, [r["p50_ms"] for r in rows], marker="o", label="predicted p50")
    a1.plot(x, [r["p99_ms"] for r in rows], marker="o", label="predicted p99")
    if measured:
        a1.plot([m["offered_rps"] for m in measured], [m["p99_ms"] for m in measured], marker="x", ls="--",
                label="measured p99")
    a1.axhline(pipe.slo.p99_ms, color="red", ls=":", label=f"SLO {pipe.slo.p99_ms} ms")
    a1.set_xlabel("offered load (req/s)")
    a1.set_ylabel("latency (ms)")
    a1.legend(fontsize=8)
    a1.grid(alpha=0.3)
    a2.plot(x, [100 * r["miss_rate"] for r in rows], marker="o", label="predicted miss %")
    a2.axhline(100 * pipe.slo.max_miss_rate, color="red", ls=":", label="allowed")
    a2.set_xlabel("offered load (req/s)")
    a2.set_ylabel("misses (%): refused + dropped + late")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.suptitle(f"{pipe.name}: SLO contract")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
