"""What every benchmark in bench/ shares, so their figures mean the same
thing and their result files have the same shape.

- **The machine record** (``machine()``): cores (all and usable), CPU model,
  memory, GPUs (``nvidia-smi``; none is an empty list), platform, Python,
  the git commit (and whether the tree had uncommitted changes), the load
  average before the run, the time and the command. Take it when the run
  starts (the load average is the one *before*) and hand it to
  ``write_results``, which puts it under ``"machine"`` in the JSON and as
  the last line of the Markdown of every result.
- **One percentile convention** (``percentile()``): linear interpolation
  between the closest ranks, numpy's default (Hyndman and Fan's type 7):
  for n sorted values and q in [0, 100], rank h = (n - 1) q / 100 and the
  percentile is v[floor h] + (h - floor h)(v[floor h + 1] - v[floor h]);
  NaN for no values. Every percentile bench/ computes from raw samples goes
  through it; figures a load generator reports (oha, ghz, the project's
  generator) are that generator's own.
- **One runner per load generator**, each returning parsed figures: the
  project's open-loop generator in this process (``loadgen``, through
  ``slipstream._core.bench``), ``oha`` (HTTP), ``ghz`` (gRPC) and
  ``redis-benchmark``; the parsers are separate functions, tested on
  captured output.
- **Nodes started one way** (``node()``): ``slipstream serve APP --port 0
  ...`` through ``slipstream.testing.Node`` (its URL from the node's
  ``listening on http://HOST:PORT`` line, ready at ``ready, serving``), as a
  context manager that stops it.
- **One results writer** (``write_results``): ``STEM.json`` and ``STEM.md``,
  by default under bench/results/.
- ``example_module``: the example apps' own modules (``models``, the
  ``*_client.py`` files), imported under the names the apps use.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from slipstream.testing import Node, free_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
EXAMPLES = ROOT / "examples"

__all__ = ["EXAMPLES", "GHZ", "OHA", "PERF_ANALYZER", "REDIS_BENCHMARK", "RESULTS", "ROOT", "cpu_seconds", "describe_machine",
           "example_module", "free_port", "ghz", "loadgen", "machine", "node", "oha", "parse_ghz", "parse_nvidia_smi",
           "parse_oha", "parse_perf_analyzer", "parse_redis_benchmark", "perf_analyzer", "percentile", "redis_benchmark", "tool", "write_results"]


# --------------------------------------------------------------------------
# The machine record


def machine() -> dict[str, Any]:
    """This machine and this run, as recorded in every result file."""
    return {
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "git_sha": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": _command(),
    }


def describe_machine(m: dict[str, Any]) -> str:
    """The machine record in one line of prose (the Markdown's last line)."""
    gpus = ", ".join(f"{g['name']} ({g['memory_mib'] / 1024:.0f} GiB)" for g in m["gpus"]) or "no GPU"
    sha = (m["git_sha"] or "unknown")[:10] + (" with uncommitted changes" if m["git_dirty"] else "")
    cores = f"{m['cores']} cores" + (f" ({m['usable_cores']} usable)" if m["usable_cores"] != m["cores"] else "")
    return (f"{cores}, {m['cpu_model']}, {m['memory_gib']:.0f} GiB RAM, {gpus}; {m['platform']}, "
            f"Python {m['python']}; git {sha}; load average before "
            f"{' '.join(f'{x:.2f}' for x in m['loadavg_before'])}; {m['time']}; `{m['command']}`")


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=name,memory.total,driver_version
    --format=csv,noheader,nounits`` output, one GPU a line."""
    gpus = []
    for line in text.strip().splitlines():
        name, memory, driver = (f.strip() for f in line.split(","))
        gpus.append({"name": name, "memory_mib": int(float(memory)), "driver": driver})
    return gpus


def _gpus() -> list[dict[str, Any]]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else []


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _command() -> str:
    """How this run was started: ``python -m bench.NAME ARGS`` for a module."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


# --------------------------------------------------------------------------
# Percentiles


def percentile(values: Iterable[float] | np.ndarray, q: float) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation between
    the closest ranks (see the module doc); NaN for no values."""
    a = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
    return float(np.percentile(a, q, method="linear")) if a.size else float("nan")


# --------------------------------------------------------------------------
# Nodes


def medians(runs: Sequence[dict[str, Any]], keys: Iterable[str] | None = None) -> dict[str, float]:
    """Each of `keys` (default: every key of the first run) as its median
    over `runs`, the repeats of one point."""
    return {k: statistics.median(r[k] for r in runs) for k in (keys if keys is not None else runs[0])}


def node(app: Any, *flags: str, env: dict[str, str] | None = None, echo: bool = False,
         ready_timeout: float = 600.0, sizing: str = "declared") -> Node:
    """``slipstream serve APP --port 0 FLAGS`` from the repository root, with
    `env` over this environment; use it as a context manager: ready on
    entry, stopped on exit. `app`: a file or ``Pipeline`` objects; `echo`:
    copy the node's output to stderr. `sizing`: the benchmarks serve the
    counts they declare (``"declared"``, so that a comparison gives both
    systems the same replicas), unless one measures the out-of-the-box
    plan (``"plan"``)."""
    return Node(app, *flags, env={"SLIPSTREAM_SIZING": sizing, **(env or {})}, cwd=ROOT, echo=echo,
                ready_timeout=ready_timeout)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds so far of each named group of processes (their sum)."""
    return {g: sum(cpu_seconds(p) for p in pids) for g, pids in groups.items()}


# --------------------------------------------------------------------------
# Load generators


def loadgen(url: str, body: bytes, rates: Sequence[float], duration_s: float, *, warmup_s: float = 2.0,
            arrival: str = "poisson", burst: int = 1, schedule: Sequence[tuple[float, float]] = (),
            max_connections: int = 512, timeout_s: float = 10.0, seed: int = 1, slo_ms: float = 0.0,
            timeline_ms: float = 0.0, timeline_latencies: bool = False, content_type: str = "application/json",
            retry: dict[str, Any] | None = None, threads: int = 1,
            bodies: Sequence[bytes] = (), headers: Sequence[tuple[str, str]] = ()) -> list[dict[str, Any]]:
    """The project's open-loop generator (``slipstream._core.bench``, in this
    process): POST `body` to `url` at each of `rates` in turn (or one run on
    the piecewise-constant `schedule` of (from_s, rate)), `duration_s`
    measured seconds each after `warmup_s`. Latency counts from each
    request's scheduled send. One report per run, as the generator gives
    it: offered_rps, achieved_rps, duration_s, sent, ok, errors,
    errors_by_kind, latency_ms (p50, p90, p99, p999, max, mean), late_sends,
    slower_than_slo (with `slo_ms`), timeline (with `timeline_ms`), retries
    (sends beyond the first, with `retry`: ``{"mode": "now" | "honor",
    "attempts": ..., ...}``, see ``slipstream-loadgen``'s ``RetryConfig``). `threads`: the
    generator's own (1 by default: on a small machine it shares the cores).
    `bodies`: a mix sent in turn instead of `body` (arrival i sends
    ``bodies[i % len]``, the same sequence at every rate). `headers`:
    extra request headers, the same on every request. The first report
    also has ``wall_start``: the wall-clock time its measured window began
    (the generator starts 20 ms after the call, then warms up).
    """
    from slipstream import _core

    cfg = {"url": url, "method": "POST", "body": list(body), "bodies": [list(b) for b in bodies],
           "content_type": content_type, "headers": [list(h) for h in headers],
           "rates": list(rates) or [1.0], "schedule": [list(s) for s in schedule], "duration_s": duration_s,
           "warmup_s": warmup_s, "arrival": {"kind": arrival, "burst": burst} if arrival == "bursty"
           else {"kind": arrival}, "max_connections": max_connections, "timeout_s": timeout_s, "threads": threads,
           "seed": seed, "slo_ms": slo_ms, "timeline_ms": timeline_ms, "timeline_latencies": timeline_latencies,
           "retry": retry or {"mode": "none"}}
    called = time.time()
    reports: list[dict[str, Any]] = json.loads(_core.bench(json.dumps(cfg), quiet=True))
    reports[0]["wall_start"] = called + 0.02 + warmup_s
    return reports


def tool(name: str, *fallbacks: Path) -> str | None:
    """The path of the program `name`: $NAME (upper case) if set, else on
    PATH, else the first of `fallbacks` that exists (None: not installed)."""
    found = os.environ.get(name.upper().replace("-", "_")) or shutil.which(name)
    if found:
        return found
    return next((str(p) for p in fallbacks if p.exists()), None)


OHA = tool("oha", Path.home() / ".cargo" / "bin" / "oha")
GHZ = tool("ghz", Path.home() / "go" / "bin" / "ghz")
REDIS_BENCHMARK = tool("redis-benchmark", Path("/usr/bin/redis-benchmark"))
PERF_ANALYZER = tool("perf_analyzer", ROOT / ".venv" / "opt" / "perf_analyzer" / "perf_analyzer")


def _need(path: str | None, name: str, install: str) -> str:
    if path is None:
        raise RuntimeError(f"{name} not found: {install}")
    return path


def parse_oha(text: str) -> dict[str, Any]:
    """oha's ``--output-format json`` report: requests/s (``rps``), responses
    (``requests``: every status received), 2xx answers (``ok``, and
    ``ok_rps``), latency percentiles in ms over every response, the status
    counts (``status``) and the failures (``errors``: non-2xx statuses and
    connection errors)."""
    d = json.loads(text)
    status = {str(k): int(v) for k, v in (d.get("statusCodeDistribution") or {}).items()}
    responses = sum(status.values())
    ok = sum(v for k, v in status.items() if k.startswith("2"))
    rps = float(d["summary"]["requestsPerSec"])
    lat = d.get("latencyPercentiles") or {}
    return {"rps": rps, "ok_rps": rps * ok / max(responses, 1), "requests": responses, "ok": ok,
            **{f"{p}_ms": float(lat.get(k, float("nan"))) * 1e3 for p, k in (("p50", "p50"), ("p90", "p90"),
                                                                              ("p99", "p99"), ("p999", "p99.9"))},
            "status": status,
            "errors": {k: v for k, v in status.items() if not k.startswith("2")} | dict(d.get("errorDistribution") or {})}


def oha(url: str, *, seconds: float, concurrency: int, method: str = "POST", body: bytes | None = None,
        headers: Sequence[str] = (), rate: float | None = None) -> dict[str, Any]:
    """One oha run against `url` for `seconds` with `concurrency` connections
    (closed loop; with `rate`, that many requests/s with latency correction,
    i.e. from the scheduled send), parsed by ``parse_oha``."""
    exe = _need(OHA, "oha", "cargo install oha --locked (or set OHA=path)")
    cmd = [exe, "-z", f"{seconds:g}s", "-c", str(concurrency), "--no-tui", "--output-format", "json", "-m", method]
    if rate is not None:
        cmd += ["-q", f"{rate:g}", "--latency-correction"]
    for h in headers:
        cmd += ["-H", h]
    with tempfile.NamedTemporaryFile(prefix="bench-oha-") as f:
        if body is not None:
            f.write(body)
            f.flush()
            cmd += ["-D", f.name]
        out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True)
    return parse_oha(out.stdout)


def parse_ghz(text: str) -> dict[str, Any]:
    """ghz's ``--format json`` report, in the same shape as ``parse_oha``'s:
    calls/s, calls, OK calls, latency percentiles in ms (ghz's
    ``latencyDistribution``, in ns), status counts and failures."""
    d = json.loads(text)
    pct = {float(p["percentage"]): float(p["latency"]) / 1e6 for p in d.get("latencyDistribution") or []}
    status = {str(k): int(v) for k, v in (d.get("statusCodeDistribution") or {}).items()}
    count, ok, rps = int(d["count"]), status.get("OK", 0), float(d["rps"])
    return {"rps": rps, "ok_rps": rps * ok / max(count, 1), "requests": count, "ok": ok,
            **{f"{p}_ms": pct.get(q, float("nan")) for p, q in (("p50", 50.0), ("p90", 90.0), ("p99", 99.0),
                                                              ("p999", 99.9))},
            "status": status, "errors": dict(d.get("errorDistribution") or {})}


def ghz(addr: str, *, proto: Path, call: str, data: Path, seconds: float, concurrency: int,
        connections: int, timeout_s: float = 10.0) -> dict[str, Any]:
    """One ghz run of `call` (from `proto`) with the request in the JSON file
    `data`, against `addr` (HOST:PORT, plaintext), parsed by ``parse_ghz``."""
    exe = _need(GHZ, "ghz", "GOFLAGS=-mod=mod go install github.com/bojand/ghz/cmd/ghz@v0.120.0")
    cmd = [exe, "--insecure", "--proto", str(proto), "--import-paths", str(proto.parent), "--call", call,
           "--data-file", str(data), "--concurrency", str(concurrency), "--connections", str(connections),
           "--duration", f"{seconds:g}s", "--timeout", f"{timeout_s:g}s", "--format", "json", addr]
    # ghz exits non-zero when some calls failed; its report says which.
    out = subprocess.run(cmd, capture_output=True, text=True)
    if not out.stdout.strip():
        raise RuntimeError(f"ghz failed: {out.stderr.strip()}")
    return parse_ghz(out.stdout)


def parse_perf_analyzer(csv_text: str) -> list[dict[str, Any]]:
    """perf_analyzer's ``-f`` CSV, one row per concurrency: ``concurrency``,
    ``rps`` (inferences/s), latency percentiles in ms (``p50_ms`` ...
    ``p99_ms``: its own, from the client's side) and the
    server-side breakdown it derives from the statistics extension
    (``server_queue_ms``, ``server_compute_input_ms``,
    ``server_compute_infer_ms``, ``server_compute_output_ms``), per request."""
    import csv
    import io

    rows = []
    for r in csv.DictReader(io.StringIO(csv_text)):
        us = {k.strip(): float(v) for k, v in r.items() if k and v not in (None, "")}
        rows.append({"concurrency": int(us["Concurrency"]), "rps": us["Inferences/Second"],
                     **{f"{p}_ms": us[f"{p} latency"] / 1e3 for p in ("p50", "p90", "p95", "p99")},
                     **{f"server_{k.lower().replace(' ', '_')}_ms": us[f"Server {k}"] / 1e3
                        for k in ("Queue", "Compute Input", "Compute Infer", "Compute Output")
                        if f"Server {k}" in us}})
    return rows


def perf_analyzer(addr: str, model: str, *, protocol: str, shapes: Sequence[str], concurrency: int,
                  interval_ms: int = 2000, input_data: str = "random", stability_percent: float = 10.0,
                  max_trials: int = 10) -> dict[str, Any]:
    """One perf_analyzer run (Triton's tool, unchanged) against `addr`
    (HOST:PORT) over `protocol` (http or grpc) at `concurrency`, inputs of
    `shapes` (``x:1,2``) filled with `input_data` (``random`` or ``zero``),
    until three windows of `interval_ms` agree within `stability_percent`
    (perf_analyzer's default, 10), trying at most `max_trials` windows (its
    default, 10); its row as ``parse_perf_analyzer`` gives it."""
    exe = _need(PERF_ANALYZER, "perf_analyzer", "scripts/install_perf_analyzer.sh (or set PERF_ANALYZER=path)")
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(exe).parent / "lib")}
    with tempfile.TemporaryDirectory(prefix="bench-pa-") as d:
        out = Path(d) / "pa.csv"
        cmd = [exe, "-m", model, "-u", addr, "-i", protocol, "--concurrency-range", f"{concurrency}:{concurrency}",
               "--measurement-interval", str(interval_ms), "--input-data", input_data, "-f", str(out),
               "--stability-percentage", f"{stability_percent:g}", "--max-trials", str(max_trials)]
        for shape in shapes:
            cmd += ["--shape", shape]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0 or not out.exists():
            raise RuntimeError(f"perf_analyzer failed ({run.returncode}): {run.stdout[-2000:]}{run.stderr[-2000:]}")
        return parse_perf_analyzer(out.read_text())[0]


def parse_redis_benchmark(text: str) -> dict[str, dict[str, float]]:
    """``redis-benchmark --csv`` output: per test (lower case, e.g. "set"),
    its ops/s and latency p50 and p99 in ms."""
    rows = [[c.strip('"') for c in line.split(",")] for line in text.strip().splitlines()]
    head = rows[0]
    out = {}
    for row in rows[1:]:
        col = dict(zip(head, row, strict=True))
        out[col["test"].lower()] = {"ops_s": float(col["rps"]), "p50_ms": float(col["p50_latency_ms"]),
                                    "p99_ms": float(col["p99_latency_ms"])}
    return out


def redis_benchmark(host: str, port: int, *, tests: str, clients: int, requests: int,
                    value_bytes: int) -> dict[str, dict[str, float]]:
    """One ``redis-benchmark`` run of `tests` (e.g. "set,get"), parsed by
    ``parse_redis_benchmark``."""
    exe = _need(REDIS_BENCHMARK, "redis-benchmark", "apt-get install redis-tools")
    out = subprocess.run([exe, "-h", host, "-p", str(port), "-t", tests, "-c", str(clients), "-n", str(requests),
                          "-d", str(value_bytes), "--csv"], capture_output=True, text=True, check=True)
    return parse_redis_benchmark(out.stdout)


# --------------------------------------------------------------------------
# Results


def write_results(out: Path | str, result: dict[str, Any], markdown: str, machine: dict[str, Any]
                  ) -> tuple[Path, Path]:
    """Write `result` with the `machine` record (``machine()`` at the run's
    start) first, to ``OUT.json``, and `markdown` with the machine's line
    last, to ``OUT.md`` (`out`: a path with or without the suffix); returns
    both paths."""
    out = Path(out)
    json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine, **{k: v for k, v in result.items() if k != "machine"}}
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md_path.write_text(markdown.rstrip("\n") + f"\n\nMachine: {describe_machine(machine)}.\n")
    return json_path, md_path


# --------------------------------------------------------------------------
# The examples' own modules


def example_module(name: str, directory: Path = EXAMPLES) -> ModuleType:
    """A module beside the example apps (``models.corpus``,
    ``clipper_client``; `directory`: examples/) under the name the apps
    import it by. The apps import their sibling modules by top-level name
    (``from models import ...``), as the node loads an app beside them; the
    top-level package or file is loaded from `directory` once and
    registered under that name."""
    top = name.split(".")[0]
    if top not in sys.modules:
        path = directory / top
        if path.is_dir():
            spec = importlib.util.spec_from_file_location(top, path / "__init__.py",
                                                          submodule_search_locations=[str(path)])
        else:
            spec = importlib.util.spec_from_file_location(top, path.with_suffix(".py"))
        if spec is None or spec.loader is None:
            raise ImportError(f"no module {top} in {directory}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[top] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[top]
            raise
    return importlib.import_module(name)
