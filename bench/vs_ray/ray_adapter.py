"""Run a Slipstream pipeline, unchanged, as a Ray Serve application.

This is the Ray side of ``bench/vs_ray``: it takes an app file and a
pipeline name (``examples/noop.py:noop``), reads the ``ss.Pipeline`` object
and builds the Ray Serve application a competent Ray user would write for
the same DAG, so the two systems run the *same component classes* under the
same load:

* one deployment per component, with the component's replica count
  (``num_replicas``); inside it the component class is constructed exactly
  as Slipstream's worker does (``Component.instantiate()``);
* ``@serve.batch`` in each deployment, capped at the component's
  ``max_batch_size`` and fed an ``ss.Batch`` built by concatenating the
  requests' arrays along the first dimension (requests whose trailing shapes
  differ go in separate calls, as in Slipstream); outputs are split back by
  rows;
* fan-out / fan-in through ``DeploymentHandle`` composition: every stage is
  called as soon as its parents' responses exist (parents run
  concurrently), and a join stage receives its parents' outputs and merges
  them, as Slipstream's node does;
* an HTTP ingress deployment that speaks Slipstream's JSON:
  ``POST /v1/pipelines/{name}/infer`` with ``{"inputs": {...}}`` answers
  ``{"outputs": {...}}``, so one load generator and one body file work
  against both systems. It also answers ``GET /v1/status`` (per-stage batch
  sizes, compute time and stage-to-stage handoff time measured inside the
  deployments) and ``POST /v1/admin/reset-metrics``.

Handoff time: every stage stamps its per-request output with the time its
``__call__`` returned (``time.monotonic``, one clock for all processes on a
Linux machine); the next stage reads the stamp of its last-arriving parent
when its own ``__call__`` starts, after Ray has delivered and deserialized
the arguments and before any batching wait. The difference is Ray's whole
stage-to-stage transfer: result serialization, the trip through the
ingress (or the object store), routing and argument deserialization.

The helpers at the top are plain numpy (unit-tested without Ray, see
``tests/unit/test_vs_ray_adapter.py``); Ray is imported only by
``build_app`` and ``serve_main``. It runs as a script with the Ray
virtualenv (``bench/vs_ray/setup_ray.sh``), its own directory first on the
path and on the workers' ``PYTHONPATH``, so the driver and Ray's workers
import it by one name, ``ray_adapter``; it imports nothing else of bench/::

    bench/vs_ray/.venv-ray/bin/python bench/vs_ray/ray_adapter.py serve examples/noop.py:noop --port 8001

It prints ``listening on http://127.0.0.1:PORT`` and ``ready`` on stderr,
serves until SIGINT/SIGTERM, then shuts down the Ray instance it started
(and only that one). The Ray settings it applies are documented in
``bench/vs_ray/README.md`` and in ``RAY_ENV`` below.

``--nodes K`` (K > 1) runs a K-node Ray cluster on this machine instead
(``ray.cluster_utils.Cluster``: K raylets, object stores and agent sets,
node i with the custom resource ``node_i``), with the ingress and Serve's
one proxy on node 0, the head. ``--spread`` puts replica j of each stage on
node ``(j + offset) % K`` (``plan_placement``); ``--place STAGE=I,...`` pins
whole stages. Serve cannot pin one replica of a deployment apart from the
others, so a stage spread over several nodes runs as one deployment per
node (``STAGE@nodeI``) and the ingress round-robins over its replicas
(``plan_deployments``). At start-up a line ``replica -> Ray node ...`` shows
where each deployment's replicas run::

    bench/vs_ray/.venv-ray/bin/python bench/vs_ray/ray_adapter.py serve examples/noop.py:noop --port 8001 --nodes 3 --spread
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# The key under which a stage's per-request output carries the time its
# __call__ returned; stripped before the next component or the client sees it.
T_DONE = "__vs_ray_t_done__"

# Environment for the Ray instance (driver, raylet and every worker inherit
# it). Each entry is explained in bench/vs_ray/README.md.
RAY_ENV: dict[str, str] = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",  # direct ingress, gRPC between deployments, no per-request logs
    "RAY_SERVE_ENABLE_HA_PROXY": "1",  # HAProxy in front of the ingress replicas instead of the Python proxy
    # gRPC between deployments caps messages at 4 MiB by default; a 6.4 MB tensor would fail.
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(1 << 30),
    "RAY_worker_niceness": "0",  # Ray runs workers at nice 15 by default; the load generator would starve them
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # keep Ray's internal traffic on 127.0.0.1
    # Ray's metrics pipeline (per-request Serve metrics exported to the dashboard
    # agent, ~25% of a core under load here); Slipstream keeps its own metrics on.
    "RAY_enable_metrics_collection": "0",
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage reporting (the machine has no outside network anyway)
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_DEDUP_LOGS": "0",
}


# ----------------------------------------------------------------------------
# Pure helpers: JSON <-> arrays, batching, splitting, the DAG.
# ----------------------------------------------------------------------------

def _tensor_spec(spec: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of an ``ss.Tensor``, its JSON form, or such a pair."""
    if isinstance(spec, Mapping):
        return str(spec["dtype"]), tuple(int(d) for d in spec["shape"])
    if isinstance(spec, tuple):
        return str(spec[0]), tuple(int(d) for d in spec[1])
    return str(spec.dtype), tuple(int(d) for d in spec.shape)


def json_to_array(value: Any, dtype: str) -> np.ndarray:
    """One JSON input as Slipstream's worker would see it: numeric dtypes as
    numpy arrays of that dtype, ``string`` as an object array of ``str``,
    ``bytes`` as an object array of ``bytes`` (JSON carries base64)."""
    if dtype == "string":
        arr = np.array(value, dtype=object)
        if arr.ndim == 0:
            raise ValueError("a string tensor needs at least one dimension")
        for s in arr.flat:
            if not isinstance(s, str):
                raise ValueError(f"string tensor holds a non-string element {s!r}")
        return arr
    if dtype == "bytes":
        arr = np.array(value, dtype=object)
        if arr.ndim == 0:
            raise ValueError("a bytes tensor needs at least one dimension")
        out = np.empty(arr.shape, dtype=object)
        for i, s in enumerate(arr.flat):
            if not isinstance(s, str):
                raise ValueError(f"bytes tensor element must be a base64 string, got {s!r}")
            out.flat[i] = base64.b64decode(s)
        return out
    arr = np.asarray(value, dtype=np.dtype(dtype))
    if arr.ndim == 0:
        raise ValueError("a tensor needs at least one dimension (the row dimension)")
    return arr


def inputs_from_json(data: Mapping[str, Any], specs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The pipeline inputs of one request body ``{"inputs": {...}}``."""
    if not isinstance(data, Mapping) or not isinstance(data.get("inputs"), Mapping):
        raise ValueError('the body must be a JSON object {"inputs": {name: array, ...}}')
    given = data["inputs"]
    missing = [k for k in specs if k not in given]
    if missing:
        raise ValueError(f"missing input(s): {', '.join(missing)}")
    out: dict[str, np.ndarray] = {}
    rows = None
    for name, spec in specs.items():
        dtype, shape = _tensor_spec(spec)
        arr = json_to_array(given[name], dtype)
        if arr.ndim != len(shape) or any(d >= 0 and d != a for d, a in zip(shape, arr.shape, strict=True)):
            raise ValueError(f"input {name!r}: shape {list(arr.shape)} does not match {list(shape)}")
        if rows is not None and arr.shape[0] != rows:
            raise ValueError(f"input {name!r} has {arr.shape[0]} rows, the others {rows}")
        rows = arr.shape[0]
        out[name] = arr
    if not rows:
        raise ValueError("a request needs at least one row")
    return out


def array_to_json(arr: Any) -> Any:
    """An output array as JSON-ready data (numeric arrays are left to the
    encoder when it understands numpy; strings stay strings, bytes become
    base64 strings)."""
    arr = np.asarray(arr)
    if arr.dtype.kind == "O":
        def conv(x: Any) -> Any:
            if isinstance(x, list):
                return [conv(y) for y in x]
            if isinstance(x, (bytes, bytearray, memoryview)):
                return base64.b64encode(bytes(x)).decode()
            if isinstance(x, np.generic):
                return x.item()
            return x
        return conv(arr.tolist())
    if arr.dtype.kind == "S":
        return array_to_json(arr.astype(object))
    if arr.dtype.kind == "U":
        return arr.tolist()
    return arr


def merge_parts(parts: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], float | None]:
    """The union of a stage's parents' outputs (root stages: the pipeline
    inputs), and the latest parent "done" stamp (None for a root stage)."""
    merged: dict[str, Any] = {}
    t_done: float | None = None
    for p in parts:
        for k, v in p.items():
            if k == T_DONE:
                t_done = v if t_done is None else max(t_done, v)
            else:
                merged[k] = v
    return merged, t_done


def _shape_key(req: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    return tuple((k, v.shape[1:], v.dtype.str) for k, v in sorted(req.items()))


def group_by_shape(reqs: Sequence[Mapping[str, np.ndarray]]) -> list[list[int]]:
    """Indices of requests that can share one batch: same names, trailing
    shapes and dtypes (first come first, order kept within a group)."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault(_shape_key(r), []).append(i)
    return list(groups.values())


def concat_requests(reqs: Sequence[Mapping[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Concatenate requests' arrays along the first dimension (what
    ``ss.Batch`` holds) and return the row count of each request. Arrays are
    made read-only, like Slipstream's shared-memory views."""
    if not reqs:
        raise ValueError("empty batch")
    names = list(reqs[0])
    sizes = [int(next(iter(r.values())).shape[0]) for r in reqs]
    tensors: dict[str, np.ndarray] = {}
    for n in names:
        if len(reqs) == 1:
            a = np.asarray(reqs[0][n])
            if a.flags.writeable:
                a = a.view()
        else:
            a = np.concatenate([r[n] for r in reqs], axis=0)
        a.flags.writeable = False
        tensors[n] = a
    return tensors, sizes


def split_rows(outputs: Mapping[str, Any], sizes: Sequence[int], component: str = "component") -> list[dict[str, Any]]:
    """Split a component's outputs back to its requests by row counts."""
    if not isinstance(outputs, Mapping):
        raise TypeError(f"{component} returned {type(outputs).__name__}, expected a dict of arrays")
    rows = int(sum(sizes))
    arrays: dict[str, np.ndarray] = {}
    for k, v in outputs.items():
        a = np.asarray(v)
        if a.ndim == 0 or a.shape[0] != rows:
            raise ValueError(f"{component}: output {k!r} has shape {list(a.shape)}; its first dim must be {rows}")
        arrays[k] = a
    out: list[dict[str, Any]] = []
    start = 0
    for n in sizes:
        out.append({k: a[start:start + n] for k, a in arrays.items()})
        start += n
    return out


def run_component(component: Any, batch: Any) -> Any:
    """One call of `component` on `batch`, as a Slipstream worker makes it: a
    streaming component (a generator) runs to its end and its result is its
    return value (else its last chunk), what a plain call of the pipeline
    answers; there is no stream to pass its chunks to here."""
    from slipstream._internal.api import complete

    return complete(component(batch))


def topo_order(stages: Mapping[str, Sequence[str]]) -> list[str]:
    """Stage names so that every stage comes after its parents
    (``stages``: name -> parent names)."""
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise ValueError(f"cycle through {n!r}")
        state[n] = 1
        for p in stages[n]:
            visit(p)
        state[n] = 2
        order.append(n)

    for n in stages:
        visit(n)
    return order


def sinks(stages: Mapping[str, Sequence[str]]) -> list[str]:
    parents = {p for ps in stages.values() for p in ps}
    return [n for n in stages if n not in parents]


def percentiles(xs: Sequence[float]) -> dict[str, float]:
    """Slipstream's summary shape: count, mean, p50, p90, p99, p999, max;
    percentiles by bench.harness's convention (linear interpolation between
    the closest ranks), which this file, run apart from bench/, repeats."""
    if not xs:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "p999": 0.0, "max": 0.0}
    a = np.asarray(xs, dtype=np.float64)
    q = np.percentile(a, [50, 90, 99, 99.9], method="linear")
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(q[0]), "p90": float(q[1]),
            "p99": float(q[2]), "p999": float(q[3]), "max": float(a.max())}


def load_pipeline(target: str) -> Any:
    """The ``ss.Pipeline`` named by ``file.py:name`` (a pipeline's name or the
    variable holding it; without ``:name`` the file must define exactly one)."""
    from slipstream._internal.app import load_pipelines

    path, _, name = target.partition(":")
    _, found = load_pipelines(path)
    if not name:
        if len(found) != 1:
            raise ValueError(f"{path} defines {len(found)} pipelines; name one: {path}:NAME")
        return found[0]
    for p in found:
        if p.name == name:
            return p
    _, by_var = load_pipelines(target)
    return by_var[0]


class _Stats:
    """Bounded per-replica samples for /v1/status."""

    LIMIT = 200_000

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hop_ms: list[float] = []
        self.batch_size: list[float] = []
        self.compute_ms: list[float] = []
        self.in_bytes: list[float] = []
        self.batches = 0
        self.requests = 0

    def add(self, xs: list[float], v: float) -> None:
        if len(xs) < self.LIMIT:
            xs.append(v)

    def summary(self) -> dict[str, Any]:
        return {"batches": self.batches, "requests": self.requests, "hop_ms": percentiles(self.hop_ms),
                "batch_size": percentiles(self.batch_size), "compute_ms": percentiles(self.compute_ms),
                "in_bytes": percentiles(self.in_bytes)}

    SERIES = ("hop_ms", "batch_size", "compute_ms", "in_bytes")

    def samples(self) -> dict[str, Any]:
        """The raw samples, to be merged with other replicas' (``merge_samples``)."""
        return {"batches": self.batches, "requests": self.requests, **{k: getattr(self, k) for k in self.SERIES}}


def merge_samples(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One stage's ``/v1/status`` summary from the raw samples of several
    deployments (a stage split into per-node deployments, ``--spread``)."""
    s = _Stats()
    for p in parts:
        s.batches += int(p["batches"])
        s.requests += int(p["requests"])
        for k in s.SERIES:
            getattr(s, k).extend(p[k])
    return s.summary()


# ----------------------------------------------------------------------------
# Placement on a multi-node Ray cluster (--nodes K, --spread, --place).
# ----------------------------------------------------------------------------

def node_resource(i: int) -> str:
    """The custom resource that only Ray node ``i`` of the cluster has."""
    return f"node_{i}"


# What a pinned replica asks of its node's resource (each node has 100).
NODE_SHARE = 0.01


def plan_placement(replicas: Mapping[str, int], nodes: int = 1, spread: bool = False,
                   place: Mapping[str, int] | None = None) -> dict[str, list[int | None]]:
    """The Ray node of every replica of every stage (``None``: Ray's
    scheduler decides). ``replicas``: stage -> replica count, parents first.

    ``place`` pins whole stages to a node. With ``spread``, every other
    stage's replica j goes to node ``(j + offset) % nodes``, where ``offset``
    counts the replicas spread before this stage, so the round-robin goes on
    from stage to stage: nodes' totals differ by at most one, and a chain
    of one-replica stages crosses a node boundary at every hop. The ingress
    is not counted: it always runs on node 0 (the head)."""
    place = dict(place or {})
    unknown = sorted(set(place) - set(replicas))
    if unknown:
        raise ValueError(f"--place names unknown stage(s) {', '.join(unknown)}; stages: {', '.join(replicas)}")
    bad = {s: n for s, n in place.items() if not 0 <= n < nodes}
    if bad:
        raise ValueError(f"--place: node index out of range 0..{nodes - 1}: {bad}")
    out: dict[str, list[int | None]] = {}
    offset = 0
    for stage, n in replicas.items():
        if stage in place:
            out[stage] = [place[stage]] * n
        elif spread and nodes > 1:
            out[stage] = [(j + offset) % nodes for j in range(n)]
            offset += n
        else:
            out[stage] = [None] * n
    return out


def plan_deployments(placement: Mapping[str, Sequence[int | None]]
                     ) -> tuple[dict[str, tuple[str, int | None, int]], dict[str, list[str]]]:
    """Ray Serve deployments for a placement (``plan_placement``).

    All replicas of one Serve deployment share its ``ray_actor_options``, so
    Serve cannot put replica j of a deployment on a chosen node. A stage
    whose replicas go to several nodes becomes one deployment per node,
    ``STAGE@nodeI``, each pinned there with that node's resource and holding
    that node's share of the replicas; a stage on one node (or left to Ray)
    keeps its own name. Returns (deployment -> (stage, node or None,
    num_replicas), stage -> route), where a stage's route names the
    deployment of each of its replicas, in replica order: the ingress sends
    request i of the stage to ``route[i % len(route)]``, so every replica
    gets the same share of the requests."""
    deployments: dict[str, tuple[str, int | None, int]] = {}
    routes: dict[str, list[str]] = {}
    for stage, where in placement.items():
        if len(set(where)) <= 1:
            deployments[stage] = (stage, where[0] if where else None, len(where))
            routes[stage] = [stage]
            continue
        route = []
        for node in where:
            name = f"{stage}@node{node}"
            _, _, count = deployments.get(name, (stage, node, 0))
            deployments[name] = (stage, node, count + 1)
            route.append(name)
        routes[stage] = route
    return deployments, routes


def format_placement(actual: Mapping[str, Sequence[int]], expected: Mapping[str, int | None],
                     nodes: int) -> tuple[str, list[str]]:
    """The one-line replica -> node summary printed at start-up, and the
    deployments whose replicas are not where they were meant to be
    (``expected``: deployment -> node, or None where Ray decides; node -1 in
    ``actual``: a node that is not one of the cluster's)."""
    parts = [f"{d}=[{','.join(str(n) for n in sorted(ns))}]" for d, ns in actual.items()]
    problems = []
    for d, want in expected.items():
        got = actual.get(d, [])
        if not got:
            problems.append(f"{d}: no running replica")
        elif want is not None and any(n != want for n in got):
            problems.append(f"{d}: replicas on node(s) {sorted(set(got))}, meant for node {want}")
    used = sorted({n for ns in actual.values() for n in ns})
    line = f"replica -> Ray node ({nodes} nodes, {len(used)} used): " + " ".join(parts)
    return line, problems


# ----------------------------------------------------------------------------
# The Ray Serve application.
# ----------------------------------------------------------------------------

class StageImpl:
    """The body of one stage deployment (Ray wraps it with ``serve.deployment``
    in ``build_app``). Constructs the component like a Slipstream worker."""

    def __init__(self, target: str, stage: str, max_batch_size: int, batch_wait_s: float,
                 compute_thread: bool = False) -> None:
        from ray import serve

        pipeline = load_pipeline(target)
        comp = pipeline.stage(stage)
        self.name = stage
        self.component = comp.instantiate()
        self.stats = _Stats()
        self._pool: Any = None
        if compute_thread:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"compute-{stage}")
        self._batched = serve.batch(max_batch_size=int(max_batch_size),
                                    batch_wait_timeout_s=float(batch_wait_s))(self._run_batch)

    async def __call__(self, *parts: Mapping[str, Any]) -> dict[str, Any]:
        t_enter = time.monotonic()
        inputs, t_parent = merge_parts(parts)
        if t_parent is not None:
            self.stats.add(self.stats.hop_ms, (t_enter - t_parent) * 1000.0)
        self.stats.add(self.stats.in_bytes, float(sum(getattr(v, "nbytes", 0) for v in inputs.values())))
        out: dict[str, Any] = await self._batched(inputs)
        out[T_DONE] = time.monotonic()
        return out

    async def _run_batch(self, reqs: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        if self._pool is None:
            return self._run(reqs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._run, reqs)

    def _run(self, reqs: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        import slipstream as ss

        results: list[dict[str, Any]] = [{} for _ in reqs]
        for group in group_by_shape(reqs):
            tensors, sizes = concat_requests([reqs[i] for i in group])
            t0 = time.perf_counter()
            outputs = run_component(self.component, ss.Batch(tensors, sizes))
            self.stats.add(self.stats.compute_ms, (time.perf_counter() - t0) * 1000.0)
            self.stats.add(self.stats.batch_size, float(len(group)))
            self.stats.batches += 1
            self.stats.requests += len(group)
            for i, part in zip(group, split_rows(outputs, sizes, self.name), strict=True):
                results[i] = part
        return results

    def get_stats(self) -> dict[str, Any]:
        return self.stats.summary()

    def get_samples(self) -> dict[str, Any]:
        return self.stats.samples()

    def reset_stats(self) -> bool:
        self.stats.reset()
        return True


class IngressImpl:
    """The HTTP ingress: Slipstream's JSON API in front of the stage deployments."""

    def __init__(self, target: str, handles: dict[str, Any], routes: dict[str, list[str]] | None = None) -> None:
        """``handles``: deployment name -> handle. ``routes``: stage -> the
        deployment of each of its replicas (``plan_deployments``); without
        it every stage is the one deployment of its own name."""
        pipeline = load_pipeline(target)
        self.name = pipeline.name
        self.specs = {k: _tensor_spec(v) for k, v in pipeline.inputs.items()}
        self.parents = {n: list(pipeline.graph.parents(n)) for n in pipeline.graph.nodes}
        self.order = topo_order(self.parents)
        self.sinks = sinks(self.parents)
        self.handles = handles
        routes = routes or {n: [n] for n in self.parents}
        # A stage split over nodes: its deployments, round-robin per replica.
        self.routes = {n: [handles[d] for d in routes[n]] for n in self.parents}
        self.stage_deployments = {n: list(dict.fromkeys(routes[n])) for n in self.parents}
        self._next = dict.fromkeys(self.parents, 0)
        self.infer_path = f"/v1/pipelines/{self.name}/infer"
        try:
            import orjson

            self._dumps = lambda o: orjson.dumps(o, option=orjson.OPT_SERIALIZE_NUMPY)
            self._loads = orjson.loads
        except ImportError:  # pragma: no cover - setup_ray.sh installs orjson
            import json

            self._dumps = lambda o: json.dumps(o, default=lambda a: a.tolist()).encode()
            self._loads = json.loads

    def _json(self, obj: Any, status: int = 200) -> Any:
        from starlette.responses import Response

        return Response(self._dumps(obj), status_code=status, media_type="application/json")

    def _error(self, status: int, kind: str, message: str) -> Any:
        return self._json({"error": {"kind": kind, "message": message}}, status)

    def _handle(self, stage: str) -> Any:
        route = self.routes[stage]
        if len(route) == 1:
            return route[0]
        i = self._next[stage]
        self._next[stage] = i + 1
        return route[i % len(route)]

    async def _stage_stats(self, stage: str) -> dict[str, Any]:
        deps = self.stage_deployments[stage]
        if len(deps) == 1:
            stats: dict[str, Any] = await self.handles[deps[0]].get_stats.remote()
            return stats
        return merge_samples(await asyncio.gather(*(self.handles[d].get_samples.remote() for d in deps)))

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        responses: dict[str, Any] = {}
        for n in self.order:
            args = [responses[p] for p in self.parents[n]] if self.parents[n] else [inputs]
            responses[n] = self._handle(n).remote(*args)
        done = await asyncio.gather(*(responses[s] for s in self.sinks))
        merged, _ = merge_parts(done)
        return merged

    async def __call__(self, request: Any) -> Any:
        path, method = request.url.path, request.method
        if path == self.infer_path and method == "POST":
            try:
                inputs = inputs_from_json(self._loads(await request.body()), dict(self.specs))
            except (ValueError, TypeError) as e:
                return self._error(400, "invalid_input", str(e))
            try:
                outputs = await self.run(inputs)
            except Exception as e:  # noqa: BLE001 - a component failed: answer like Slipstream does
                return self._error(500, "component_error", f"{type(e).__name__}: {e}")
            body = {k: array_to_json(v) for k, v in outputs.items()}
            for k, v in body.items():
                if isinstance(v, np.ndarray) and not v.flags.c_contiguous:
                    body[k] = np.ascontiguousarray(v)
            return self._json({"outputs": body})
        if path == "/v1/status" and method == "GET":
            names = list(self.parents)
            stats = await asyncio.gather(*(self._stage_stats(n) for n in names))
            stages = [{"name": n, "parents": self.parents[n], **s} for n, s in zip(names, stats, strict=True)]
            return self._json({"pipelines": [{"name": self.name, "stages": stages}]})
        if path == "/v1/admin/reset-metrics" and method == "POST":
            await asyncio.gather(*(h.reset_stats.remote() for h in self.handles.values()))
            return self._json({"ok": True})
        if path == "/healthz":
            return self._json({"ok": True})
        return self._error(404, "not_found", f"no route for {method} {path}")


def pipeline_placement(pipeline: Any, nodes: int = 1, spread: bool = False,
                       place: Mapping[str, int] | None = None) -> dict[str, list[int | None]]:
    """``plan_placement`` for an ``ss.Pipeline`` (stages parents first)."""
    parents = {n: list(pipeline.graph.parents(n)) for n in pipeline.graph.nodes}
    replicas = {n: int(pipeline.graph.nodes[n].replicas) for n in topo_order(parents)}
    return plan_placement(replicas, nodes, spread, place)


def build_app(target: str, *, batch_wait_s: float = 0.0, ingress_replicas: int = 1,
              max_ongoing: int = 1024, compute_thread: bool = False, nodes: int = 1,
              spread: bool = False, place: Mapping[str, int] | None = None) -> Any:
    """The Ray Serve application for one pipeline (see the module docstring).

    ``batch_wait_s``: ``@serve.batch``'s ``batch_wait_timeout_s`` for every
    stage. ``max_ongoing``: ``max_ongoing_requests`` of the ingress (stages
    get at least ``2 * max_batch_size``, so a batch can fill while the
    previous one runs; Ray's default of 5 would cap batches at 5).
    ``compute_thread``: run the component in a worker thread instead of on
    the replica's event loop. Whether stage outputs travel by value (gRPC)
    or through the object store is Ray's ``RAY_SERVE_USE_GRPC_BY_DEFAULT``.

    ``nodes`` > 1 (a cluster whose node i has the resource ``node_i``): the
    ingress is pinned to node 0, the head; ``spread`` and ``place`` pin the
    stages' replicas (``plan_placement``, ``plan_deployments``); stages
    neither spread nor placed are left to Ray's scheduler. With ``nodes`` =
    1 the app is the same as without these arguments.
    """
    from ray import serve

    pipeline = load_pipeline(target)
    no_cpu = {"num_cpus": 0}  # logical CPUs only: every deployment fits on a 2-core machine

    def on(node: int | None) -> dict[str, Any]:
        if nodes <= 1 or node is None:
            return dict(no_cpu)
        return {**no_cpu, "resources": {node_resource(node): NODE_SHARE}}

    def threads_of(comp: Any) -> dict[str, Any]:
        # A stage's thread budget, as Slipstream gives each replica (app.stage_env);
        # one thread is what every Ray worker has already (serve_main's environment).
        if int(comp.threads) <= 1:
            return {}
        from slipstream._internal.app import stage_env

        return {"runtime_env": {"env_vars": stage_env(int(comp.threads))}}

    deployments, routes = plan_deployments(pipeline_placement(pipeline, nodes, spread, place))
    handles: dict[str, Any] = {}
    for name, (stage, node, count) in deployments.items():
        comp = pipeline.graph.nodes[stage]
        dep = serve.deployment(
            StageImpl,
            name=name,
            num_replicas=count,
            max_ongoing_requests=max(64, 2 * int(comp.max_batch_size)),
            ray_actor_options={**on(node), **threads_of(comp)},
        )
        handles[name] = dep.bind(target, stage, int(comp.max_batch_size), batch_wait_s, compute_thread)
    ingress = serve.deployment(
        IngressImpl, name="Ingress", num_replicas=int(ingress_replicas),
        max_ongoing_requests=int(max_ongoing), ray_actor_options=on(0),
    )
    if nodes <= 1:
        return ingress.bind(target, handles)
    return ingress.bind(target, handles, routes)


# ----------------------------------------------------------------------------
# serve: start a private Ray instance, run the app, wait for a signal.
# ----------------------------------------------------------------------------

def serve_main(a: argparse.Namespace) -> int:
    here = str(Path(__file__).resolve().parent)
    path, sep, name = a.app.partition(":")
    target = str(Path(path).resolve()) + sep + name
    # Import the app before Ray starts, as `slipstream serve` does before it
    # starts its workers: settings an app makes at import time (e.g.
    # OPENBLAS_NUM_THREADS) reach every Ray worker through the environment.
    pipeline = load_pipeline(target)
    try:
        pipeline_placement(pipeline, a.nodes, a.spread, a.place)  # --place names real stages and nodes
    except ValueError as e:
        print(f"ray_adapter: error: {e}", file=sys.stderr, flush=True)
        return 2
    env = dict(RAY_ENV)
    if not a.ha_proxy:
        env["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    if not a.throughput_optimized:
        env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "0"
    if a.by_reference:
        env["RAY_SERVE_USE_GRPC_BY_DEFAULT"] = "0"
    tmp = Path(tempfile.mkdtemp(prefix="vsray-", dir="/tmp"))
    hap = tmp / "haproxy"
    hap.mkdir()
    if a.nodes > 1:
        # ray.cluster_utils.Cluster records its address in $RAY_TMPDIR/ray/ray_current_cluster
        # (default /tmp/ray/...), where a bare ray.init() anywhere on the machine would find and
        # join it, and deletes that file on shutdown (another Ray's, if it had overwritten it).
        (tmp / "ray").mkdir()
        env["RAY_TMPDIR"] = str(tmp)
        # The ingress replica waits 30 s on shutdown (by default) for external load balancers to
        # drop it; HAProxy here is Serve's own and goes at the same time, so this only delays the
        # stop (serve.shutdown gives up after 30 s). Shutdown-only: no effect while serving.
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = "1"
    env |= {
        # HAProxy's files default to /tmp/haproxy-serve, shared with any other Ray on the machine.
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(hap / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(hap / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(hap),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(hap / "server-state"),
        # Fixed default ports (8500, 9500, 8404, 9101) would collide with any other Ray on the machine.
        **dict(zip(("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
                    "RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"),
                   (str(p) for p in _free_ports(4, exclude={a.port})), strict=True)),
        # The thread settings Slipstream gives its workers (one BLAS/OpenMP thread
        # unless the user set one; see slipstream._internal.app.app_spec).
        **{v: os.environ.get(v, "1") for v in _thread_vars()},
        "PYTHONPATH": os.pathsep.join(p for p in [here, os.environ.get("PYTHONPATH", "")] if p),
    }
    for k, v in env.items():
        if k in a.keep_env and k in os.environ:
            continue
        os.environ[k] = v
    os.environ.pop("RAY_ADDRESS", None)

    import logging

    import ray
    import ray_adapter  # this file, imported by name so Ray workers resolve the classes the same way
    from ray import serve
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import LoggingConfig

    stop = {"now": False}

    def on_signal(signum: int, frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t_start = time.monotonic()
    cluster: Any = None
    if a.nodes > 1:
        cluster = _start_cluster(a.nodes, tmp)
        # Each of Cluster's nodes registers a SIGTERM handler that kills that node only and
        # exits; ours stops serving, then shuts everything down in order (finally below).
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    try:
        if cluster is None:
            ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False,
                     _temp_dir=str(tmp), logging_level=logging.WARNING, log_to_driver=a.verbose,
                     configure_logging=True)
        else:
            ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=a.verbose,
                     configure_logging=True)
            # ray.init's core worker installs a fatal-signal handler for SIGTERM that prints a
            # stack and kills the driver: take SIGTERM back so it shuts the cluster down in order.
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            print(f"ray_adapter: Ray cluster of {a.nodes} nodes on this machine up in "
                  f"{time.monotonic() - t_start:.1f}s (address {cluster.address})", file=sys.stderr, flush=True)
        try:
            quiet = LoggingConfig(enable_access_log=False, log_level="WARNING")
            # One proxy, on the head node: every node is 127.0.0.1 here, so proxies on the other
            # nodes would all try to bind the same port (Serve's default is one per node).
            where = {} if cluster is None else {"proxy_location": "HeadOnly"}
            serve.start(http_options=HTTPOptions(host="127.0.0.1", port=a.port), logging_config=quiet, **where)
            app = ray_adapter.build_app(target, batch_wait_s=a.batch_wait_ms / 1000.0,
                                        ingress_replicas=a.ingress_replicas, max_ongoing=a.max_ongoing,
                                        compute_thread=a.compute_thread, nodes=a.nodes, spread=a.spread,
                                        place=a.place)
            serve.run(app, name="vs_ray", route_prefix="/", logging_config=quiet)
            url = f"http://127.0.0.1:{a.port}"
            print(f"ray_adapter: listening on {url}", file=sys.stderr, flush=True)
            _wait_http(url + "/healthz", 120.0)
            if cluster is not None:
                _report_placement(target, a)
            print(f"ray_adapter: ready, serving {a.app} on {url}", file=sys.stderr, flush=True)
            if cluster is not None:
                print(f"ray_adapter: start-up took {time.monotonic() - t_start:.1f}s", file=sys.stderr, flush=True)
            while not stop["now"]:
                time.sleep(0.2)
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
    finally:
        if cluster is not None:
            _stop_cluster(cluster)
    return 0


def _object_store_bytes() -> int:
    """Ray's default object store size for this machine when it is one node
    (30% of the memory, at most 95% of /dev/shm)."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    size = int(0.3 * mem)
    try:
        st = os.statvfs("/dev/shm")
        size = min(size, int(0.95 * st.f_frsize * st.f_blocks))
    except OSError:
        pass
    return size


def _start_cluster(nodes: int, tmp: Path) -> Any:
    """A Ray cluster of ``nodes`` nodes on this machine
    (``ray.cluster_utils.Cluster``): the head and ``nodes - 1`` more, each
    its own raylet, object store and agents, node i with the resource
    ``node_i: 100``. The machine's logical CPUs and object store of the
    one-node setup are shared out among the nodes (replicas ask for no CPU;
    Cluster's own default object store is a test-sized 150 MiB)."""
    from ray.cluster_utils import Cluster

    common = {
        "num_cpus": -(-max(8, os.cpu_count() or 1) // nodes),
        "object_store_memory": _object_store_bytes() // nodes,
        "temp_dir": str(tmp),
        "node_ip_address": "127.0.0.1",
    }
    # shutdown_at_exit: each node's processes die with this process (atexit, and the
    # kernel's parent-death signal where Linux offers it), whatever happens to it.
    cluster = Cluster(initialize_head=True, shutdown_at_exit=True,
                      head_node_args={**common, "include_dashboard": False,
                                      "resources": {node_resource(0): 100}})
    try:
        for i in range(1, nodes):
            cluster.add_node(**common, resources={node_resource(i): 100})
        cluster.wait_for_nodes()
    except BaseException:
        _stop_cluster(cluster)
        raise
    return cluster


def _stop_cluster(cluster: Any) -> None:
    """Kill every process of every node (the others first, then the head)
    and wait for them."""
    try:
        cluster.shutdown()
    except Exception as e:  # noqa: BLE001 - still try the rest, and say so
        print(f"ray_adapter: cluster shutdown: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        for node in [*cluster.worker_nodes, *([cluster.head_node] if cluster.head_node else [])]:
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


def _report_placement(target: str, a: argparse.Namespace) -> None:
    """Print where Ray placed each replica (from the Serve controller's own
    record, as ``serve status`` shows it) and warn where that is not the
    plan."""
    import ray
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    index: dict[str, int] = {}
    for n in ray.nodes():
        for res in n.get("Resources", {}):
            if n.get("Alive") and res.startswith("node_") and res[5:].isdigit():
                index[n["NodeID"]] = int(res[5:])
    details = ServeInstanceDetails(**_get_global_client().get_serve_details())
    app = details.applications["vs_ray"]
    actual = {name: [index.get(r.node_id or "", -1) for r in d.replicas if str(r.state.value) == "RUNNING"]
              for name, d in app.deployments.items()}
    deployments, _ = plan_deployments(pipeline_placement(load_pipeline(target), a.nodes, a.spread, a.place))
    expected: dict[str, int | None] = {"Ingress": 0, **{d: node for d, (_, node, _) in deployments.items()}}
    order = ["Ingress", *deployments]
    line, problems = format_placement({d: actual.get(d, []) for d in order}, expected, a.nodes)
    print(f"ray_adapter: {line}", file=sys.stderr, flush=True)
    for p in problems:
        print(f"ray_adapter: WARNING: placement: {p}", file=sys.stderr, flush=True)


def _thread_vars() -> tuple[str, ...]:
    try:
        from slipstream._internal.app import THREAD_VARS

        return tuple(THREAD_VARS)
    except ImportError:  # an older slipstream: the same list
        return ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def _free_ports(n: int, exclude: set[int]) -> list[int]:
    """``n`` distinct free ports (all held open while choosing, so none repeats)."""
    import socket

    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)
            s.bind(("0.0.0.0", 0))
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def _wait_http(url: str, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.2)
    raise RuntimeError(f"the Ray app did not answer {url} within {timeout:.0f}s ({last})")


def _parse_place(text: str) -> dict[str, int]:
    """``STAGE=NODE,...`` -> {stage: node index}."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        stage, sep, node = item.partition("=")
        if not sep or not stage.strip() or not node.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected STAGE=NODE_INDEX, got {item!r}")
        out[stage.strip()] = int(node)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve one pipeline with Ray Serve")
    s.add_argument("app", help="app file and pipeline, e.g. examples/noop.py:noop")
    s.add_argument("--port", type=int, default=8001)
    s.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="@serve.batch batch_wait_timeout_s, in ms (0: batch whatever is queued)")
    s.add_argument("--ingress-replicas", type=int, default=1)
    s.add_argument("--max-ongoing", type=int, default=1024, help="ingress max_ongoing_requests")
    s.add_argument("--by-reference", action="store_true",
                   help="pass stage outputs through the object store (turns off gRPC between deployments)")
    s.add_argument("--compute-thread", action="store_true",
                   help="run components in a thread, off the replica's event loop")
    s.add_argument("--no-ha-proxy", dest="ha_proxy", action="store_false")
    s.add_argument("--no-throughput-optimized", dest="throughput_optimized", action="store_false")
    s.add_argument("--keep-env", action="append", default=[],
                   help="a RAY_ENV variable to take from the environment when set there (repeatable)")
    s.add_argument("--verbose", action="store_true", help="forward worker logs to stderr")
    s.add_argument("--nodes", type=int, default=1,
                   help="Ray nodes: K > 1 runs a K-node Ray cluster on this machine (ray.cluster_utils.Cluster); "
                        "the ingress stays on node 0, the head")
    s.add_argument("--spread", action="store_true",
                   help="with --nodes K: replica j of each stage on node (j + offset) %% K, round-robin "
                        "continuing from stage to stage (a stage over several nodes becomes one deployment per node)")
    s.add_argument("--place", type=_parse_place, default={}, metavar="STAGE=NODE,...",
                   help="with --nodes K: pin whole stages to nodes (0 is the head), e.g. Produce=0,Consume=1")
    a = ap.parse_args(argv)
    if a.nodes < 1:
        ap.error("--nodes must be at least 1")
    if a.nodes == 1 and (a.spread or a.place):
        ap.error("--spread and --place need --nodes K with K > 1")
    return serve_main(a)


if __name__ == "__main__":
    sys.exit(main())
