"""The ``slipstream serve`` command: its flags, the app's spec built from
them, and the node run in this process.

``cli`` registers it beside the other commands; ``ss.launch`` and
``ss.serve`` (launch.py) parse their options with the same parser and serve
through the same function; the cluster commands (``deploy``, ``node``)
share its flags and its spec. It lives apart from ``cli`` so that none of
those imports the whole command line, which itself starts nodes through
``launch`` (``slipstream slo --calibrate``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from slipstream._internal import config, sizing
from slipstream._internal.errors import from_core


def build_spec(a: argparse.Namespace, size_here: bool = True) -> dict[str, Any]:
    """The app's spec for the node, from the app file and the spec flags (serve and deploy share them).
    With `size_here`, stages the app leaves unsized are planned for this machine (`sizing`); a
    deployment to a cluster keeps the declaration (the cluster places replicas by counts)."""
    from slipstream._internal.app import app_spec, default_profile_path, load_pipelines, load_profiles
    from slipstream._internal.planner import profiles_for_threads

    _, pipelines = load_pipelines(a.app)
    cfg = config.resolve(a)
    profile_paths = [Path(p) for p in a.profile]
    if not profile_paths and default_profile_path(a.app).is_file():
        profile_paths = [default_profile_path(a.app)]
    notes: dict[str, list[str]] = {}
    if a.plan:
        pipelines = apply_plan_file(pipelines, Path(a.plan))
        notes = {p.name: [f"from the plan {a.plan}"] for p in pipelines}
    elif cfg["sizing"] == "plan" and size_here:
        sized = sizing.size(a.app, pipelines, cores=cfg["cores"], overheads=model_overheads(a.app),
                            log=lambda m: log(cfg["log_format"], m))
        pipelines, notes = sized.pipelines, sized.notes
        profile_paths += [p for p in sized.profiles if p not in profile_paths]
    for path in profile_paths:
        log(cfg["log_format"], f"latency profile {path}")
    sections = cfg.spec_sections()
    profiles = profiles_for_threads(load_profiles(profile_paths), profile_paths, pipelines)
    spec = app_spec(a.app, pipelines, batching=sections["batching"], profiles=profiles,
                    autoscale=sections["autoscale"])
    for p in spec["pipelines"]:
        p["sizing"] = notes.get(p["name"], ["as declared" + (" (--sizing declared)" if size_here else "")])
    for p in pipelines:
        stages = ", ".join(
            s["name"] + (f" <- {' + '.join(s['parents'])}" if s["parents"] else " <- inputs")
            for s in p.to_spec()["stages"]
        )
        log(cfg["log_format"], f"pipeline {p.name}: {stages}")
    return spec


def model_overheads(app: str) -> dict[str, Any]:
    """The SLO model's overheads for this machine: the app's calibration file
    (`slipstream slo --calibrate`), else the defaults."""
    from slipstream._internal import slo

    out: dict[str, Any] = dict(slo.DEFAULTS)
    out.update(slo.load_calibration(slo.calibration_path(app)) or {})
    return out


def log(fmt: str, message: str) -> None:
    """One line of the node's log on stderr, in the node's format (`log_format`:
    `slipstream: ...` lines, or one JSON object per line as the node writes them)."""
    if fmt == "json":
        now = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
        line = json.dumps({"timestamp": now, "level": "INFO", "message": message, "target": "slipstream::cli"})
    else:
        line = f"slipstream: {message}"
    print(line, file=sys.stderr)


def node_options(a: argparse.Namespace) -> str:
    """`_core.serve`'s node configuration (JSON) from the file, environment and flags (serve and node)."""
    return config.resolve(a).node_json()


def cmd_serve(a: argparse.Namespace) -> int:
    from slipstream import _core

    spec = build_spec(a)
    try:
        _core.serve(json.dumps(spec), node_options(a))
    except _core.CoreError as e:
        raise from_core(e) from None
    except KeyboardInterrupt:
        # The node already drained and stopped on this SIGINT; Python only
        # sees it once the node has returned.
        pass
    return 0


def apply_plan_file(pipelines: list[Any], path: Path) -> list[Any]:
    """`serve --plan FILE`: the app's pipelines with the plan's replicas,
    threads and batch limits, and a GPU plan's stages bound to the GPUs
    and MIG slices it chose on this machine."""
    from slipstream._internal.planner import Plan, apply_plan
    from slipstream._internal.planner.gpu import gpu_binding, local_smi_lines

    plan = Plan.load(path)
    placed = {(p, s): sp.placement for p, pp in plan.pipelines.items() for s, sp in pp.stages.items() if sp.placement}
    devices = None
    # One machine's GPU plan (a cluster's names nodes: each binds its own, not yet).
    if placed and plan.inventory.get("gpus") and not {"nodes", "gpu_nodes"} & set(plan.inventory):
        devices = gpu_binding(plan.inventory, placed, local_smi_lines())
    out = apply_plan(pipelines, plan, devices)
    for p in out:
        pp = plan.pipelines.get(p.name)
        if pp is not None:
            cells = ", ".join(f"{n} {c.replicas}" + (f"..{c.max_replicas}" if c.autoscaled else "")
                              + f"x{c.threads}t b{c.max_batch_size}"
                              + (" on " + ",".join(f"cuda:{d}" for d in c.devices) if c.devices else "")
                              for n, c in p.graph.nodes.items())
            print(f"slipstream: plan {path}: {p.name}: {cells} (target {pp.target_rps:,.0f} req/s)", file=sys.stderr)
    return out


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """The flags that shape an app's spec (serve and deploy)."""
    p.add_argument("app", help="app file, optionally file.py:pipeline_variable")
    p.add_argument("--profile", action="append", default=[],
                   help="latency profile from `slipstream profile` (default: APP.profile.json beside the app, if any)")
    p.add_argument("--plan", metavar="FILE",
                   help="run with a plan from `slipstream plan` (its replicas, threads and batch limits per stage)")
    config.add_flags(p, "spec")


def add_node_args(p: argparse.ArgumentParser) -> None:
    """The flags of a node (serve and node): one per node setting (see config.py)."""
    config.add_flags(p, "node")


def add_serve_command(sub: Any) -> None:
    """Register ``serve`` on a command line's subparsers."""
    s = sub.add_parser("serve", help="serve the pipelines of an app file")
    add_spec_args(s)
    add_node_args(s)
    s.set_defaults(fn=cmd_serve)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """``slipstream serve ARGV...``'s arguments, parsed (and refused) as the command line does."""
    ap = argparse.ArgumentParser(prog="slipstream")
    add_serve_command(ap.add_subparsers(dest="cmd", required=True))
    return ap.parse_args(["serve", *argv])
