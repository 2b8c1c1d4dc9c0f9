"""Loading a user's app file and describing it to the node.

``slipstream serve examples/echo.py`` imports the file, collects the
``Pipeline`` objects defined at its top level (or the one named after a
colon: ``examples/echo.py:app``), and builds the JSON spec the node reads.
Each worker imports the same file again to construct its component. An app
ending in ``.pkl`` is a bundle of Pipeline objects (``bundle.py``), which is
how ``ss.launch(pipeline)`` reaches the workers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from slipstream._internal import bundle
from slipstream._internal.api import Pipeline, Pool
from slipstream._internal.errors import ConfigError
from slipstream._internal.seeds import Seed


def split_target(target: str) -> tuple[Path, str | None]:
    path, _, attr = target.partition(":")
    p = Path(path).expanduser().resolve()
    if not p.is_file():
        raise ConfigError(f"no such app file: {path}")
    return p, (attr or None)


def load_module(path: Path) -> ModuleType:
    """Import a file as a module (its directory goes on sys.path, so sibling
    modules import as they would when the file is run as a script)."""
    name = "slipstream_app_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent = str(path.parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    spec.loader.exec_module(module)
    return module


def load_pipelines(target: str) -> tuple[Path, list[Pipeline]]:
    path, attr = split_target(target)
    if path.suffix == bundle.SUFFIX:  # Pipeline objects from ss.launch / ss.serve (see bundle.py)
        pipelines = bundle.load(path)
        if attr is not None:
            pipelines = [p for p in pipelines if p.name == attr]
            if not pipelines:
                raise ConfigError(f"{path.name} has no pipeline named {attr!r}")
        return path, pipelines
    module = load_module(path)
    if attr is not None:
        obj = getattr(module, attr, None)
        if not isinstance(obj, Pipeline):
            raise ConfigError(f"{path.name} has no Pipeline named {attr!r}")
        return path, [obj]
    found: list[Pipeline] = []
    for v in vars(module).values():
        if isinstance(v, Pipeline) and all(v is not p for p in found):
            found.append(v)
    if not found:
        raise ConfigError(f"{path.name} defines no slipstream.Pipeline at its top level")
    names = [p.name for p in found]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ConfigError(f"{path.name} defines several pipelines named {', '.join(sorted(dup))}")
    return path, found


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def default_profile_path(target: str) -> Path:
    """Where `slipstream profile app.py` writes, and `serve` looks: app.profile.json beside the app."""
    path, _ = split_target(target)
    return path.with_suffix(".profile.json")


def load_profiles(paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read profile {p}: {e}") from None
        for prof in doc.get("pipelines", []):
            out.append({
                "pipeline": prof["pipeline"],
                "stages": {
                    name: {"points": [{"batch": pt["batch"], "mean_ms": pt["mean_ms"], "p99_ms": pt["p99_ms"]}
                                      for pt in st["points"]]}
                    for name, st in prof["stages"].items()
                },
            })
    return out


def stage_env(threads: int) -> dict[str, str]:
    """A stage's worker environment beyond the node-wide one: its thread
    budget. One replica = ``threads`` cores' worth of work: numeric libraries
    default to a thread per core, and N replicas x N threads thrash a small
    machine (measured: recsys p99 159 ms with default BLAS threads, 27 ms
    with one). A user's own setting of a library's variable wins."""
    env = {var: os.environ.get(var, str(threads)) for var in THREAD_VARS}
    env["SLIPSTREAM_THREADS"] = str(threads)
    return env


def store_pools(pipelines: list[Pipeline]) -> list[Pool]:
    """The pools the pipelines declare, each prefix once: a prefix declared
    by several pipelines must have the same settings everywhere."""
    pools: dict[str, tuple[Pool, str]] = {}
    for p in pipelines:
        for pool in p.pools:
            have = pools.get(pool.prefix)
            if have is not None and have[0] != pool:
                raise ConfigError(f"pool {pool.prefix} is declared differently by pipelines {have[1]!r} and "
                                  f"{p.name!r}: {have[0]} vs {pool}")
            pools.setdefault(pool.prefix, (pool, p.name))
    return [pool for pool, _ in pools.values()]


def store_seeds(pipelines: list[Pipeline]) -> list[Seed]:
    """The seeds the pipelines declare, each key once (the same file and
    content type wherever a key is seeded twice)."""
    seeds: dict[str, tuple[Seed, str]] = {}
    for p in pipelines:
        for seed in p.seeds:
            have = seeds.get(seed.key)
            if have is not None and have[0] != seed:
                raise ConfigError(f"store key {seed.key} is seeded differently by pipelines {have[1]!r} "
                                  f"({have[0].path}, {have[0].content_type}) and {p.name!r} "
                                  f"({seed.path}, {seed.content_type})")
            seeds.setdefault(seed.key, (seed, p.name))
    return [seed for seed, _ in seeds.values()]


def app_spec(
    target: str,
    pipelines: list[Pipeline],
    batching: dict[str, Any] | None = None,
    profiles: list[dict[str, Any]] | None = None,
    autoscale: dict[str, Any] | None = None,
) -> dict[str, Any]:
    path, attr = split_target(target)
    env = {"PYTHONUNBUFFERED": "1", "SLIPSTREAM_WORKER": "1"}
    # Optionally run workers below the node's priority (e.g. 5): the node's
    # work per request is small and on every request's path (admission,
    # deadline timers, answers), the workers' is bulk compute. Measured on
    # 2 cores (docs/benchmarks.md): under 3x bursts the slowest refusal came
    # 13 ms after the send instead of 55 ms, but the node spent ~6% more CPU
    # per request at moderate load (more preemptions), so it is off by default.
    env["SLIPSTREAM_WORKER_NICE"] = os.environ.get("SLIPSTREAM_WORKER_NICE", "0")
    specs = [p.to_spec() for p in pipelines]
    for spec in specs:
        for st in spec["stages"]:
            st["env"] = stage_env(st["threads"])
    return {
        "pipelines": specs,
        "store": {"pools": [pool.to_json() for pool in store_pools(pipelines)],
                  "seed": [seed.to_json() for seed in store_seeds(pipelines)]},
        "batching": batching or {},
        "profiles": profiles or [],
        "autoscale": autoscale,
        "worker_argv": [sys.executable, "-m", "slipstream._internal.worker", "--app", str(path) + (f":{attr}" if attr else "")],
        "worker_env": env | {k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
    }
