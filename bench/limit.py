"""The offline compute limit: the highest request rate this machine's cores
could sustain on each example pipeline if serving cost nothing.

For each pipeline and each of its stages, the stage's component runs in a
tight loop on ready-made batches (no node, no HTTP, no load generator):

1. Best batch size: one process with one thread runs batches of
   1, 2, 4, ... up to the stage's ``max_batch_size`` requests, briefly each;
   the best is the smallest whose requests/s is within 2% of the highest.
2. Threads: for each thread count t (1, 2, 4, ... up to the cores, and the
   cores themselves), k = cores // t worker processes, each started with
   OMP_NUM_THREADS (and the other numeric libraries' variables) and
   SLIPSTREAM_THREADS set to t, as the node starts a replica of
   ``threads=t``, run the stage at its best batch over the same wall-clock
   window, after a warm-up. T_s(t) = the k processes' requests/s together;
   T_s = the best over t.

A request costs each stage 1 / T_s of the whole machine's time (every stage
runs once per request, also in a fan-out / fan-in DAG, and all stages share
the cores), so the pipeline's limit is ``1 / sum_s(1 / T_s)`` requests/s.
Also reported: the stage-level bound ``min_s T_s`` (what the slowest stage
alone could do with the whole machine) and each stage's CPU microseconds per
request (``cores / T_s``).

The requests are the ones the goodput benchmarks send
(``bench.vs_ray.bodies.mix``: the same bytes for Slipstream and Ray Serve):
the pipeline's real input mix where it ships one (RAG: its benchmark
queries, the first 256), else one request repeated; decoded to arrays as
the node decodes them. A non-root stage gets its parents' outputs for each
request, computed once. Batches are cut from the mix ordered by length (the
longest string element), as the best offline batcher would form them, so
that a batch pads little; each process cycles through up to 64 of them.
What the limit leaves
out: HTTP and the codecs, the node, the hand-offs between processes, the
load generator, and any idle time a latency SLO forces on batching.

    .venv/bin/python -m bench.limit                       # every example (several minutes)
    .venv/bin/python -m bench.limit --pipelines rag,recsys --quick
    .venv/bin/python -m bench.limit --pipelines examples/echo.py:demo --threads 1

Each measuring process reports the CPU it used in the window: when one
single-threaded process per core keeps less than 90% of the cores busy,
other work took part of the machine, and the run says so ("cores short").

Without ``--force`` a result less than an hour old, from this machine with
the same cores, thread counts and ``--quick`` setting and not cores short,
is reused (``make bench`` runs it this way); ``make bench-limit`` always
measures. Results are merged into
``bench/results/limit.json`` (one entry per pipeline) and rendered to
``bench/results/limit.md``. Other benchmarks read it with
``load_limit(pipeline)``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from bench import harness
from bench.harness import RESULTS, ROOT

DEFAULT_OUT = RESULTS / "limit.json"

# name -> app target. noop is the runtime-overhead baseline of bench.run:
# its limit is the components' own (near-zero) cost.
PIPELINES = {
    "rag": "examples/rag.py:rag",
    "recsys": "examples/recsys.py:recsys",
    "multimodal": "examples/multimodal.py:multimodal",
    "audioquery": "examples/audioquery.py:audioquery",
    "rag_late": "examples/rag_late.py:rag_late",
    "noop": "examples/noop.py:noop",
}
# The variables the node sets per replica (slipstream._internal.app), set
# here in each measuring process before any numeric library is imported.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")
FRESH_S = 3600.0
BEST_WITHIN = 0.98  # the best batch: the smallest within 2% of the highest throughput
READY_TIMEOUT_S = 900.0
CONTENDED = 0.9  # warn when 1-thread processes, one per core, keep fewer than 90% of the cores busy


def _stored(pipeline: str, path: Path | str) -> dict[str, Any] | None:
    """`pipeline`'s entry in `path` as written, or None if there is none."""
    try:
        entry = json.loads(Path(path).read_text())["pipelines"][pipeline]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entry if isinstance(entry, dict) else None


def limit_entry(pipeline: str, path: Path | str = DEFAULT_OUT) -> dict[str, Any] | None:
    """`pipeline`'s measurement from `path` (``bench/results/limit.json``:
    limit_rps, cpu_us_per_request, cores, stages, ...), or None if it has not
    been measured (no positive limit) or was measured while other work took
    cores from it ("cores short"): such a limit is low, and every share of
    it a benchmark reports would read high (rag_late's read 167 req/s where
    a quiet machine gives 238). :func:`missing_limit` says which."""
    entry = _stored(pipeline, path)
    if entry is None or entry.get("cores_short"):
        return None
    value = entry.get("limit_rps")
    return dict(entry) if isinstance(value, (int, float)) and value > 0 else None


def missing_limit(pipeline: str, path: Path | str = DEFAULT_OUT) -> str:
    """Why :func:`limit_entry` has no limit for `pipeline`, and what to run."""
    short = (_stored(pipeline, path) or {}).get("cores_short")
    why = (f"its offline limit in {path} was measured cores short (other work took the cores from {', '.join(short)})"
           if short else f"no offline limit in {path}")
    return f"{pipeline}: {why}: run `python -m bench.limit --force --pipelines {pipeline}` on a quiet machine"


def load_limit(pipeline: str, path: Path | str = DEFAULT_OUT) -> float | None:
    """The offline compute limit of `pipeline` in requests/s, or None if it
    has not been measured."""
    entry = limit_entry(pipeline, path)
    return float(entry["limit_rps"]) if entry else None


# --------------------------------------------------------------------------
# Measuring processes (this module run with --child; the spec on stdin)


def _child() -> int:
    # The protocol goes over the original stdout; whatever the components
    # print goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    spec = json.loads(sys.stdin.readline())
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])

    def send(obj: Any) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        if spec["mode"] == "prep":
            send(_prep(spec))
        elif spec["mode"] == "sweep":
            send(_sweep(spec))
        else:
            _run(spec, send)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which names the stage
        import traceback

        traceback.print_exc()
        send({"error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


def _pipeline(target: str) -> Any:
    from slipstream._internal.app import load_pipelines

    _, pipes = load_pipelines(target)
    if len(pipes) != 1:
        raise ValueError(f"{target} defines several pipelines ({', '.join(p.name for p in pipes)}): "
                         "name one as path.py:NAME")
    return pipes[0]


def _decode(pipe: Any, raw: bytes) -> dict[str, Any]:
    """One request body's inputs as arrays, decoded as the node decodes the
    pipeline API's JSON."""
    import base64

    import numpy as np

    inputs = json.loads(raw)["inputs"]

    def unb64(x: Any) -> Any:
        return [unb64(v) for v in x] if isinstance(x, list) else base64.b64decode(x)

    out: dict[str, Any] = {}
    for name, spec in pipe.inputs.items():
        v = inputs[name]
        if spec.dtype == "string":
            out[name] = np.array(v, dtype=object)
        elif spec.dtype == "bytes":
            out[name] = np.array(unb64(v), dtype=object)
        else:
            out[name] = np.asarray(v, dtype=spec.dtype)
    return out


#: Requests of an input mix the limit runs on (the first ones of the mix).
MIX_REQUESTS = 256


def _request_mix(pipe: Any, target: str) -> tuple[list[dict[str, Any]], str]:
    """The requests' inputs as arrays: the goodput benchmarks' input mix (or
    their one body), else the pipeline's example."""
    try:
        from bench.vs_ray import bodies

        raws, origin = bodies.mix(Path(target.split(":")[0]), pipe)
        return [_decode(pipe, raw) for raw in raws[:MIX_REQUESTS]], origin
    except Exception as e:  # noqa: BLE001 - no body builder for this app: the declared example
        print(f"limit: no benchmark body ({e}); using the pipeline's example batch", file=sys.stderr)
        return [pipe.example_batch(1)], "pipeline.example_batch"


def _prep(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the app (building its data, as `slipstream serve` does), run
    every stage on each request of the mix, and save each stage's inputs
    per request."""
    import pickle

    import numpy as np
    from slipstream._internal.api import Batch, completing

    pipe = _pipeline(spec["target"])
    order = pipe.graph.topological_order()
    mix, origin = _request_mix(pipe, spec["target"])
    rows = int(next(iter(mix[0].values())).shape[0])
    outputs: list[dict[str, dict[str, Any]]] = [{} for _ in mix]
    stage_inputs: dict[str, list[dict[str, Any]]] = {}
    stages = []
    for name in order:
        comp = pipe.stage(name)
        parents = pipe.graph.parents(name)
        t0 = time.perf_counter()
        inst = completing(comp.instantiate())
        built = time.perf_counter() - t0
        print(f"  {pipe.name}/{name}: constructed in {built:.1f} s", file=sys.stderr, flush=True)
        per_request = []
        for roots, outs in zip(mix, outputs, strict=True):
            inputs: dict[str, Any] = dict(roots) if not parents else {}
            for p in parents:
                inputs.update(outs[p])
            per_request.append(inputs)
            n = int(next(iter(inputs.values())).shape[0])
            outs[name] = {k: np.asarray(v) for k, v in inst(Batch(inputs, [n])).items()}
        stage_inputs[name] = per_request
        del inst
        stages.append({"name": name, "parents": parents, "max_batch_size": int(comp.max_batch_size),
                       "declared_threads": int(getattr(comp, "threads", 1)), "construct_s": round(built, 2)})
    with open(spec["inputs_file"], "wb") as f:
        pickle.dump(stage_inputs, f)
    return {"pipeline": pipe.name, "order": order, "stages": stages, "rows_per_request": rows, "body": origin,
            "mix_requests": len(mix)}


def _length(inputs: dict[str, Any]) -> int:
    """A request's length for grouping: its longest string or bytes element
    (0 for fixed-size inputs, whose batches pad nothing)."""
    longest = 0
    for v in inputs.values():
        if getattr(v, "dtype", None) is not None and v.dtype.kind == "O":
            longest = max([longest] + [len(x.encode() if isinstance(x, str) else x) for x in v.ravel()])
    return longest


#: Distinct batches a measuring process cycles through.
MAX_BATCHES = 64


def _stage_batches(spec: dict[str, Any], requests: int) -> list[Any]:
    """Batches of `requests` requests each from the mix, as the best offline
    batcher would form them: the mix ordered by length (so that a batch
    pads little), cut into consecutive groups, wrapping around; one batch
    repeating the single request when the mix is one request. At most
    MAX_BATCHES, their starts spread over the ordered mix."""
    import pickle

    import numpy as np
    from slipstream._internal.api import Batch

    with open(spec["inputs_file"], "rb") as f:
        mix = pickle.load(f)[spec["stage"]]
    mix = sorted(mix, key=_length)
    count = max(1, min(MAX_BATCHES, -(-len(mix) // requests)))
    batches = []
    for b in range(count):
        start = b * len(mix) // count  # spread over the whole mix
        members = [mix[(start + i) % len(mix)] for i in range(requests)]
        tensors = {}
        for k in members[0]:
            a = np.ascontiguousarray(np.concatenate([m[k] for m in members], axis=0))
            a.flags.writeable = False  # as served: read-only views over shared memory
            tensors[k] = a
        batches.append(Batch(tensors, [int(next(iter(m.values())).shape[0]) for m in members]))
    return batches


def _construct(spec: dict[str, Any]) -> Any:
    """The stage's component as a function of a batch, run to completion
    (a streaming stage's whole work: `api.completing`)."""
    from slipstream._internal.api import completing

    pipe = _pipeline(spec["target"])
    return completing(pipe.stage(spec["stage"]).instantiate())


def _sweep(spec: dict[str, Any]) -> dict[str, Any]:
    """Requests/s at each batch size, one process (this one)."""
    inst = _construct(spec)
    points = []
    for b in spec["batches"]:
        batches = _stage_batches(spec, b)
        for batch in batches:
            inst(batch)  # warm-up: first call at each shape
        calls, t0 = 0, time.perf_counter()
        while True:
            inst(batches[calls % len(batches)])
            calls += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= spec["budget_s"]:
                break
        points.append({"batch": b, "calls": calls, "ms_per_batch": elapsed / calls * 1e3,
                       "requests_per_s": calls * b / elapsed})
    return {"points": points}


def _run(spec: dict[str, Any], send: Any) -> None:
    """Construct, warm up once, say ready, then run from the parent's start
    time to its end time; credit each call with the part of it that lies in
    the window (so all processes are measured over the same interval).
    Also reports the cores this process (and the processes it waited for,
    e.g. a TTS binary) used from the first call ending in the window to the
    last: about `threads` when nothing else competes for the machine."""
    inst = _construct(spec)
    b = int(spec["batch"])
    batches = _stage_batches(spec, b)
    for batch in batches:
        inst(batch)
    send({"ready": True})
    start, end = (float(x) for x in sys.stdin.readline().split())
    credit, calls, turn = 0.0, 0, 0
    mark: tuple[float, float] | None = None
    while True:
        t0 = time.monotonic()
        inst(batches[turn % len(batches)])
        turn += 1
        t1 = time.monotonic()
        inside = min(t1, end) - max(t0, start)
        if inside > 0:
            credit += b * inside / (t1 - t0)
            calls += 1
        if mark is None and t1 >= start:
            mark = (t1, sum(os.times()[:4]))
        if t1 >= end:
            break
    assert mark is not None
    cpu, wall = sum(os.times()[:4]) - mark[1], t1 - mark[0]
    send({"requests_per_s": credit / (end - start), "calls": calls, "cores_used": cpu / wall if wall > 0 else None})


# --------------------------------------------------------------------------
# The parent


class Child:
    """One measuring process: this module with --child, its thread budget in
    the environment before anything is imported."""

    def __init__(self, spec: dict[str, Any], threads: int, log: IO[str] | None):
        env = dict(os.environ)
        env.update({v: str(threads) for v in THREAD_VARS})
        env["SLIPSTREAM_THREADS"] = str(threads)
        env["PYTHONUNBUFFERED"] = "1"
        if spec["mode"] == "prep":
            env.pop("SLIPSTREAM_WORKER", None)  # build the app's data here, once, as `serve` does
        else:
            env["SLIPSTREAM_WORKER"] = "1"
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.limit", "--child"], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.send(json.dumps(spec))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise RuntimeError(f"no answer within {timeout:.0f} s{self.tail()}") from None
        if not line:
            self.proc.wait()
            raise RuntimeError(f"exited with status {self.proc.returncode}{self.tail()}")
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            self.proc.wait()
            raise RuntimeError(f"{msg['error']}{self.tail()}")
        return msg

    def tail(self) -> str:
        if self.log is None:
            return ""  # its stderr is ours
        self.log.flush()
        try:
            text = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return ("; its log ends:\n    " + "\n    ".join(text[-15:])) if text else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def finish(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def batch_sizes(max_batch: int, rows_per_request: int) -> list[int]:
    top = max(1, max_batch // max(rows_per_request, 1))
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    return out + [top]


def thread_counts(cores: int) -> list[int]:
    out, t = [], 1
    while t <= cores:
        out.append(t)
        t *= 2
    return out if out[-1] == cores else out + [cores]


def measure_pipeline(target: str, a: argparse.Namespace, cpus: list[int], work: Path) -> dict[str, Any]:
    cores = len(cpus)
    pinned = cpus if a.cores else None
    started = time.time()
    machine = harness.machine()
    loadavg_before = list(os.getloadavg())
    inputs_file = str(work / "inputs.pkl")
    progress(f"[{_short(target)}] loading the app (building its data if missing) and running each stage once ...")
    # Its stderr is ours: building an app's data (the RAG slice) takes a while and says how far it got.
    child = Child({"mode": "prep", "target": target, "inputs_file": inputs_file, "cpus": pinned}, cores, None)
    try:
        prep = child.recv(READY_TIMEOUT_S)
    finally:
        child.finish()
    name, rows = prep["pipeline"], int(prep["rows_per_request"])
    progress(f"[{name}] stages {describe_graph(prep['stages'])}; request body: {prep['body']}")
    threads = a.threads or thread_counts(cores)
    stages: dict[str, Any] = {}
    for st in prep["stages"]:
        sname = st["name"]
        base = {"target": target, "stage": sname, "inputs_file": inputs_file, "cpus": pinned}
        # 1. the best batch size, one process, one thread
        with open(work / f"{sname}.sweep.log", "w") as log:
            child = Child({**base, "mode": "sweep", "batches": batch_sizes(st["max_batch_size"], rows),
                           "budget_s": a.batch_seconds}, 1, log)
            try:
                sweep = child.recv(READY_TIMEOUT_S)["points"]
            finally:
                child.finish()
        top = max(p["requests_per_s"] for p in sweep)
        best = next(p for p in sweep if p["requests_per_s"] >= BEST_WITHIN * top)
        progress(f"[{name}] {sname}: batch sweep (1 process, 1 thread): "
                 + ", ".join(f"{p['batch']}: {_num(p['requests_per_s'])}/s" for p in sweep)
                 + f" -> batch {best['batch']}")
        # 2. every thread count, cores // t processes over one window
        per_t: dict[str, Any] = {}
        call_s = best["ms_per_batch"] / 1e3
        window = max(a.seconds, 3 * call_s)
        warmup = max(a.warmup, call_s)
        for t in threads:
            k = max(1, cores // t)
            logs = [open(work / f"{sname}.t{t}.{i}.log", "w") for i in range(k)]  # noqa: SIM115 - closed below
            children: list[Child] = []
            try:
                children = [Child({**base, "mode": "run", "batch": best["batch"]}, t, log) for log in logs]
                for c in children:
                    c.recv(READY_TIMEOUT_S)
                start = time.monotonic() + warmup
                for c in children:
                    c.send(f"{start!r} {start + window!r}")
                results = [c.recv(window + warmup + 60 + 10 * call_s) for c in children]
                for c in children:
                    c.finish()
            finally:
                for c in children:
                    c.kill()  # the others, if one failed
                for log in logs:
                    log.close()
            total = sum(r["requests_per_s"] for r in results)
            used = [r["cores_used"] for r in results if r.get("cores_used") is not None]
            per_t[str(t)] = {"processes": k, "requests_per_s": total,
                             "per_process": [round(r["requests_per_s"], 3) for r in results],
                             "cores_used": round(sum(used), 2) if used else None}
            progress(f"[{name}] {sname}: {k} process(es) x {t} thread(s), batch {best['batch']}, "
                     f"{window:.1f} s: {_num(total)} req/s"
                     + (f", {sum(used):.2f} of {cores} cores busy" if used else ""))
        t_best = max(per_t, key=lambda t: per_t[t]["requests_per_s"])
        rps = per_t[t_best]["requests_per_s"]
        stages[sname] = {
            "best_batch": best["batch"],
            "threads": int(t_best),
            "processes": per_t[t_best]["processes"],
            "requests_per_s": rps,
            "rows_per_s": rps * rows,
            "cpu_us_per_request": cores / rps * 1e6,
            "by_threads": per_t,
            "batch_sweep": [{"batch": p["batch"], "requests_per_s": p["requests_per_s"],
                             "ms_per_batch": p["ms_per_batch"]} for p in sweep],
            "max_batch_size": st["max_batch_size"],
            "declared_threads": st["declared_threads"],
        }
    limit = 1.0 / sum(1.0 / s["requests_per_s"] for s in stages.values())
    slowest = min(stages, key=lambda s: stages[s]["requests_per_s"])
    # One single-threaded process per core should keep every core busy; less
    # means other work took cores from the measurement (or the stage waits).
    short = [s for s, st in stages.items()
             if (st["by_threads"].get("1") or {}).get("cores_used") is not None
             and st["by_threads"]["1"]["cores_used"] < CONTENDED * st["by_threads"]["1"]["processes"]]
    if short:
        progress(f"[{name}] WARNING: with one single-threaded process per core, {', '.join(short)} kept less than "
                 f"{CONTENDED:.0%} of the cores busy: other work is running (load average "
                 f"{os.getloadavg()[0]:.2f}); the limit is low. Measure on an idle machine.")
    return {
        "pipeline": name,
        "target": _short(target),
        "limit_rps": limit,
        "stage_bound_rps": stages[slowest]["requests_per_s"],
        "slowest_stage": slowest,
        "cpu_us_per_request": sum(s["cpu_us_per_request"] for s in stages.values()),
        "stages": stages,
        "rows_per_request": rows,
        "body": prep["body"],
        "cores": cores,
        "machine": machine,
        "threads_tried": threads,
        "quick": bool(a.quick),
        "settings": {"batch_seconds": a.batch_seconds, "seconds": a.seconds, "warmup": a.warmup},
        "cores_short": short,
        "loadavg_before": loadavg_before,
        "loadavg_after": list(os.getloadavg()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "measured_at": started,
        "wall_s": round(time.time() - started, 1),
    }


def _short(target: str) -> str:
    """An app target relative to the repository when it lies inside it."""
    path, sep, attr = target.partition(":")
    p = Path(path).resolve()
    return (str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else path) + sep + attr


def describe_graph(stages: list[dict[str, Any]]) -> str:
    """``A -> B -> C`` for a chain, else each stage with its parents."""
    names = [s["name"] for s in stages]
    if all(s["parents"] == names[i - 1: i] for i, s in enumerate(stages)):
        return " -> ".join(names)
    return ", ".join(s["name"] + (f" (after {' + '.join(s['parents'])})" if s["parents"] else "") for s in stages)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def table(doc: dict[str, Any], names: list[str]) -> list[str]:
    """Markdown rows: one per pipeline, then one per stage."""
    lines = [
        "| pipeline / stage | limit req/s | stage bound req/s | best batch | threads x processes | "
        "stage req/s | CPU us / request |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        p = doc["pipelines"].get(n)
        if p is None:
            continue
        lines.append(f"| **{n}** | **{_num(p['limit_rps'])}** | {_num(p['stage_bound_rps'])} "
                     f"({p['slowest_stage']}) | | | | {_num(p['cpu_us_per_request'])} |")
        for s, st in p["stages"].items():
            lines.append(f"| {n} / {s} | | | {st['best_batch']} | {st['threads']} x {st['processes']} | "
                         f"{_num(st['requests_per_s'])} | {_num(st['cpu_us_per_request'])} |")
    return lines


def markdown(doc: dict[str, Any]) -> str:
    names = list(doc["pipelines"])
    out = [
        "# Offline compute limit",
        "",
        "Each stage's component in a tight loop at its best batch size, no serving; `cores // t` processes",
        "of `t` threads for each thread count t, the best kept. limit = 1 / sum over stages of 1 / (stage",
        "req/s): every stage runs once per request on the same cores. Stage bound: the slowest stage with",
        "the whole machine. Method: `python -m bench.limit`, docs/benchmarks.md.",
        "",
        *table(doc, names),
        "",
    ]
    for n in names:
        p = doc["pipelines"][n]
        la = ", ".join(f"{x:.2f}" for x in p["loadavg_before"])
        lb = ", ".join(f"{x:.2f}" for x in p["loadavg_after"])
        out.append(f"- {n}: {p['time']}, {p['cores']} cores, "
                   f"{'quick' if p['quick'] else 'full'} run, {p['wall_s']:.0f} s; load average {la} before, "
                   f"{lb} after; body: {p['body']}."
                   + (f" **Cores short** (other work was running) in {', '.join(p['cores_short'])}."
                      if p.get("cores_short") else ""))
    return "\n".join(out) + "\n"


def fresh(doc: dict[str, Any], names: list[str], cores: int, quick: bool, threads: list[int]) -> bool:
    """Whether every pipeline asked for has a result < FRESH_S old, measured
    on this machine with the same cores, thread counts and --quick."""
    now = time.time()
    cpu_model = harness.machine()["cpu_model"]
    for n in names:
        p = doc.get("pipelines", {}).get(n)
        m = p.get("machine") if p is not None else None
        if (p is None or now - float(p.get("measured_at", 0)) > FRESH_S or p.get("cores") != cores
                or not isinstance(m, dict) or m.get("cpu_model") != cpu_model or bool(p.get("quick")) != quick
                or p.get("threads_tried") != threads or p.get("cores_short")):
            return False
    return True


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return _child()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", default=",".join(PIPELINES),
                    help=f"comma-separated: names ({', '.join(PIPELINES)}) or app targets path.py:PIPELINE")
    ap.add_argument("--quick", action="store_true", help="short measurements (a smoke run; noisier)")
    ap.add_argument("--threads", help="thread counts to try, e.g. 1,2 (default: 1, 2, 4, ... up to the cores)")
    ap.add_argument("--cores", type=int, help="use only this many of the cores this process may run on "
                    "(the measuring processes are pinned to them)")
    ap.add_argument("--seconds", type=float, help="measured window per thread count (default 5; --quick 1)")
    ap.add_argument("--warmup", type=float, help="warm-up before the window (default 2; --quick 0.3)")
    ap.add_argument("--batch-seconds", type=float,
                    help="time per batch size when finding the best batch (default 1; --quick 0.2)")
    ap.add_argument("--force", action="store_true", help=f"measure even if a result < {FRESH_S / 3600:g} h old exists")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args()
    a.seconds = a.seconds or (1.0 if a.quick else 5.0)
    a.warmup = a.warmup if a.warmup is not None else (0.3 if a.quick else 2.0)
    a.batch_seconds = a.batch_seconds or (0.2 if a.quick else 1.0)
    avail = sorted(os.sched_getaffinity(0))
    if a.cores is not None and not 1 <= a.cores <= len(avail):
        ap.error(f"--cores must be between 1 and {len(avail)}")
    cpus = avail[: a.cores] if a.cores else avail
    a.threads = [int(t) for t in a.threads.split(",")] if a.threads else None
    if a.threads and any(not 1 <= t <= len(cpus) for t in a.threads):
        ap.error(f"--threads must be between 1 and the cores ({len(cpus)})")
    targets = [PIPELINES.get(p.strip(), p.strip()) for p in a.pipelines.split(",") if p.strip()]
    # A target's pipeline name: the part after the colon, else the file's stem.
    names = [t.split(":")[1] if ":" in t else Path(t).stem for t in targets]

    out = Path(a.out)
    try:
        doc: dict[str, Any] = json.loads(out.read_text())
    except (OSError, ValueError):
        doc = {}
    doc.setdefault("pipelines", {})
    if not a.force and fresh(doc, names, len(cpus), bool(a.quick), a.threads or thread_counts(len(cpus))):
        print(f"{out} holds a limit < {FRESH_S / 3600:g} h old for {', '.join(names)} from this machine: "
              "reusing it (--force to measure again)")
        print("\n".join(table(doc, names)))
        return 0

    machine = harness.machine()
    progress(f"offline compute limit: {', '.join(names)} on {len(cpus)} cores ({machine['cpu_model']}); "
             f"load average {', '.join(f'{x:.2f}' for x in machine['loadavg_before'])}")
    failed = []
    for target in targets:
        tgt = target
        path, _, attr = target.partition(":")
        if not Path(path).is_absolute():
            tgt = str((Path.cwd() / path).resolve()) + (f":{attr}" if attr else "")
        with tempfile.TemporaryDirectory(prefix="slipstream-limit-") as tmp:
            try:
                res = measure_pipeline(tgt, a, cpus, Path(tmp))
            except (RuntimeError, OSError, ValueError, KeyError) as e:
                progress(f"[{target}] FAILED: {e}")
                failed.append(target)
                continue
        doc["pipelines"][res["pipeline"]] = res
        progress(f"[{res['pipeline']}] limit {_num(res['limit_rps'])} req/s (stage bound "
                 f"{_num(res['stage_bound_rps'])}, {res['slowest_stage']}) in {res['wall_s']:.0f} s")
        doc.update({"cores": len(cpus), "updated": res["time"]})
        harness.write_results(out, doc, markdown(doc), machine)
    measured = [n for n in names if n in doc["pipelines"]]
    if measured:
        print()
        print("\n".join(table(doc, measured)))
    if failed:
        print(f"\nnot measured: {', '.join(failed)}")
    if len(failed) < len(targets):
        print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 1 if failed and len(failed) == len(targets) else 0


if __name__ == "__main__":
    sys.exit(main())
