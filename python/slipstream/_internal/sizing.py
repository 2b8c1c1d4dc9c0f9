"""Sizing at serve time: ``slipstream serve app.py`` runs each stage at the
replicas, threads and batch limit the planner chooses for this machine,
unless the app pins them.

A stage whose ``replicas`` or ``threads`` the app does not give is
planned (``Component.pinned`` says what was given; ``replicas=(lo, hi)``
are bounds the plan stays within and the autoscaler moves in). The plan
needs a latency profile of every stage at a few thread counts on this
machine: the first start measures it (``slipstream profile`` in a child
process, with its progress on stderr) and keeps it in a cache keyed by
the machine (CPU model, cores this process may use, memory) and by the
components' versions (their source files, options, bound arguments and
the environment variables their source names, as set),
so a second start, or another app with the same components, plans in
well under a second. ``--sizing declared`` (``SLIPSTREAM_SIZING``) serves
the declaration as written, planned parts at 1 replica and 1 thread.

The first start profiles under co-location (``slipstream profile
--colocated``: each stage measured while neighbour processes run the
pipeline's other stages on the cores it leaves), because that is how a
served stage runs at the load the plan is for: alone, multimodal's
VisionEncoder took 84 ms a batch at one thread and 72 ms at two; beside a
neighbour 91 ms and 294 ms, so a lone profile makes two threads look like
the better use of a core when they are four times slower where it counts
(docs/design/planner.md).

The profile is also the node's: routing and admission predict with it,
as they do with a profile passed by ``--profile``.

Why serve the plan by default: measured on this project's examples, a
heavy stage declared with one replica and one thread left two thirds of a
two-core machine idle (multimodal served 37% of its offline limit) until
the user found ``slipstream plan``; sizing is the runtime's job, as
batching is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream._internal.api import Component, Pipeline
from slipstream._internal.errors import ConfigError

#: Bumped when what a cached profile holds changes meaning (2: measured co-located).
CACHE_FORMAT = 2

#: Seconds at most per batch size and stage when profiling on first start
#: (``slipstream profile``'s own default is 3).
FIRST_START_BUDGET_S = 1.5

Log = Callable[[str], None]


def cache_dir() -> Path:
    """Where profiles of this machine are kept: ``$SLIPSTREAM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/slipstream``, else ``~/.cache/slipstream``."""
    if os.environ.get("SLIPSTREAM_CACHE_DIR"):
        return Path(os.environ["SLIPSTREAM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "slipstream"


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def machine() -> dict[str, Any]:
    """What a profile depends on besides the components."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        mem_gib = 0
    return {"cpu": model, "cores": usable_cores(), "memory_gib": mem_gib, "python": platform.python_version()}


#: A name in quotes in a component's source that may be an environment
#: variable it reads (``os.environ.get("RAG_LATE_BUDGET_MS")``).
_ENV_NAME = re.compile(rb"""["']([A-Z][A-Z0-9_]{2,})["']""")


def component_version(comp: Component) -> str:
    """A digest of what a component's latency depends on: its source file,
    its options, its bound arguments, and the values of the environment
    variables its source file names that are set (an app configured by
    the environment, as the examples are: rag_late's re-rank budget
    changes its Search's latency, and a profile taken at another budget
    planned the wrong batch limits)."""
    h = hashlib.sha256()
    try:
        src = inspect.getsourcefile(comp.cls)
        if src:
            text = Path(src).read_bytes()
            h.update(text)
            # (Not the runtime's own SLIPSTREAM_* variables: the node sets
            # some in workers, and they are not the component's settings.)
            names = sorted({n for n in (m.decode() for m in _ENV_NAME.findall(text))
                            if not n.startswith("SLIPSTREAM_")})
            env = [(n, os.environ[n]) for n in names if n in os.environ]
            if env:  # (none set: the key it had before the environment counted)
                h.update(repr(env).encode())
    except (TypeError, OSError):
        h.update(comp.cls.__module__.encode())
    h.update(comp.cls.__qualname__.encode())
    opts = (comp.max_batch_size, comp.tensors, comp.device, sorted(comp.needs.items()), comp.concurrency,
            repr(comp.init_args), repr(sorted(comp.init_kwargs.items())), sorted(comp.inputs), sorted(comp.outputs))
    h.update(repr(opts).encode())
    return h.hexdigest()[:16]


def thread_counts(pipe: Pipeline, cores: int) -> list[int]:
    """Thread budgets to profile: 1, 2, 4 up to the cores (at most three
    counts: each is a child process that loads every model again), and any
    count a stage pins."""
    counts = {1}
    t = 2
    while t <= cores and len(counts) < 3:
        counts.add(t)
        t *= 2
    for comp in pipe.graph.nodes.values():
        if "threads" in comp.pinned:
            counts.add(comp.threads)
    return sorted(counts)


def _version() -> str:
    try:
        return importlib.metadata.version("slipstream")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "source"


def _data_key(pipe: Pipeline, comp: Component) -> list[Any]:
    """The files the store objects `comp` needs are seeded from, as this
    pipeline declares them (``seed=``), each by path, size and modification
    time, as a part of the profile's cache key (none for a component
    without seeded needs: the key it had before data counted). A
    component's latency follows its data too: RAG's Search costs 0.6 ms a
    query on the 2,000-passage slice and 2.4 ms on the full index, and a
    profile of the slice had planned the full index's serving."""
    seeds = {s.key: s.path for s in pipe.seeds}
    files: list[list[Any]] = []
    for key in sorted(set(comp.needs.values()) & seeds.keys()):
        try:
            st = os.stat(seeds[key])
        except OSError:
            continue  # (declared in a worker, where the file need not be: the node seeded it)
        files.append([key, seeds[key], st.st_size, st.st_mtime_ns])
    return [files] if files else []


def profile_path(pipe: Pipeline, threads: Sequence[int]) -> Path:
    """The cache file of `pipe`'s profile on this machine at `threads`: keyed
    by the runtime's version, the machine, the thread counts, each stage's
    component version (`component_version`) and the data its store needs
    are seeded from (`_data_key`), and the graph's edges."""
    key = {"format": CACHE_FORMAT, "slipstream": _version(), "machine": machine(), "threads": list(threads),
           "stages": {n: [c.name, component_version(c), *_data_key(pipe, c)] for n, c in pipe.graph.nodes.items()},
           "edges": {n: pipe.graph.parents(n) for n in pipe.graph.nodes}}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "profiles" / f"{pipe.name}-{digest}.json"


def needs_plan(pipe: Pipeline) -> bool:
    """Whether any stage of `pipe` leaves its replicas or threads to the planner."""
    return any(not {"replicas", "threads"} <= c.pinned for c in pipe.graph.nodes.values())


def _profile(app: str, pipe: Pipeline, threads: Sequence[int], out: Path, log: Log) -> None:
    """Measure `pipe` with `slipstream profile` in a child process (its progress goes to stderr)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"profiling pipeline {pipe.name} on this machine at {', '.join(map(str, threads))} thread(s), "
        f"beside neighbours running its stages (first start; cached in {out.parent} for the next)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        cmd = [sys.executable, "-m", "slipstream._internal.cli", "profile", app, "--pipeline", pipe.name,
               "--threads", ",".join(map(str, threads)), "--budget", str(FIRST_START_BUDGET_S), "--colocated",
               "--no-plot", "--out", str(part)]
        env = {k: v for k, v in os.environ.items() if k != "SLIPSTREAM_PROFILE_CHILD"}
        rc = subprocess.run(cmd, env=env, stdout=sys.stderr).returncode
        if rc != 0:
            raise ConfigError(f"profiling pipeline {pipe.name} failed (exit {rc}; its errors are above)")
        os.replace(part, out)  # whole or not at all: an interrupted profile is measured again
    log(f"profiled {pipe.name} in {time.monotonic() - t0:.0f} s")


def machine_profile(app: str, pipe: Pipeline, cores: int, log: Log) -> tuple[Path, dict[str, Any]]:
    """`pipe`'s profile on this machine: from the cache, or measured now."""
    from slipstream._internal import slo

    threads = thread_counts(pipe, cores)
    path = profile_path(pipe, threads)
    if path.is_file():
        log(f"pipeline {pipe.name}: profile of this machine from {path}")
    else:
        _profile(app, pipe, threads, path, log)
    return path, slo.load_profile_for(pipe, [path])


def _describe(pipe: Pipeline, declared: Pipeline) -> str:
    cells = []
    for n, c in pipe.graph.nodes.items():
        reps = f"{c.min_replicas}..{c.max_replicas} from {c.replicas}" if c.autoscaled else str(c.replicas)
        pinned = declared.stage(n).pinned
        mark = "" if not pinned else " (" + ", ".join(sorted(pinned)) + " pinned)"
        cells.append(f"{n} {reps} x {c.threads} thread(s), batch <= {c.max_batch_size}{mark}")
    return "; ".join(cells)


@dataclass
class Sized:
    """What `size` chose: the pipelines, the profiles it planned from, and
    per pipeline the choice and its reasons in words (``status`` shows them)."""

    pipelines: list[Pipeline]
    profiles: list[Path] = field(default_factory=list)
    notes: dict[str, list[str]] = field(default_factory=dict)


def size(app: str, pipelines: list[Pipeline], *, cores: float | None, overheads: dict[str, Any],
         log: Log) -> Sized:
    """The pipelines sized by the plan for this machine.

    Pipelines whose stages are all pinned, that store puts invoke, or that
    run on GPUs (planned with ``slipstream plan --gpus``) keep their
    declaration."""
    from slipstream._internal import planner

    n_cores = usable_cores()
    plan_cores = float(cores) if cores is not None else float(n_cores)
    todo, out = [], Sized(pipelines)
    for p in pipelines:
        why = None
        if not needs_plan(p):
            why = "as declared: every stage pins its replicas and threads"
        elif p.watch is not None:
            why = "as declared: store puts invoke it, so it has no request rate to plan for"
        elif any(c.device != "cpu" for c in p.graph.nodes.values()):
            why = "as declared: GPU stages are planned by `slipstream plan --gpus`"
        else:
            todo.append(p)
            continue
        out.notes[p.name] = [f"{why}: {_describe(p, p)}"]
        log(f"pipeline {p.name}: {out.notes[p.name][0]}")
    if not todo:
        return out
    profiles = {}
    for p in todo:
        path, profiles[p.name] = machine_profile(app, p, n_cores, log)
        out.profiles.append(path)
    plan = planner.plan_cpu(todo, profiles, cores=plan_cores, overheads=overheads, app=app)
    out.pipelines = planner.apply_plan(pipelines, plan)
    by_name = {p.name: p for p in pipelines}
    for p, path in zip(todo, out.profiles, strict=True):
        sized, pp = next(s for s in out.pipelines if s.name == p.name), plan.pipelines[p.name]
        out.notes[p.name] = [
            f"planned for {plan_cores:g} cores from the profile {path} (solved in {plan.solve_ms:.0f} ms): "
            f"{_describe(sized, by_name[p.name])}; capacity {pp.capacity_rps:,.0f} req/s",
            *pp.why,
        ]
        log(f"pipeline {p.name} {out.notes[p.name][0]}")
        for line in pp.why:
            log(f"  why: {line}")
    return out
