"""A worker process: runs one replica of one component.

Started by the node as ``python -m slipstream._internal.worker --app FILE
--pipeline P --stage S ...``. It imports the app file, constructs the
component (models load here, before the worker reports ready; store
objects the component ``needs`` are fetched first, see ``needs.py``),
connects to the node's socket, and then loops: read a batch descriptor,
build numpy views over shared memory (no copy; torch tensors over the same
memory for a ``tensors="torch"`` component, see ``tensors.py``), call the component, put the
outputs into this replica's own pool, reply with their descriptors. Between
batches it switches to an instance rebuilt for new versions of its needs.

A component that yields (a generator) streams: each chunk is placed and
sent as a ``chunk`` message as soon as it is yielded, before the batch's
result. An ``async def __call__`` runs on an event loop, several batches at
once (``serve_async``).

An output that is (a contiguous slice of) an input is passed back by
reference instead of copied. An exception in the component fails that batch
only; the worker keeps serving. The worker exits when the node says so or
closes the connection, and dies with the node (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import math
import mmap
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from slipstream import _core
from slipstream._internal import groups, protocol, tensors
from slipstream._internal.api import Batch, complete, drain_async
from slipstream._internal.app import load_pipelines, store_pools
from slipstream._internal.dtypes import DTYPES, NUMERIC_DTYPES, VAR_DTYPES
from slipstream._internal.needs import Replica, loaded_versions
from slipstream._internal.varlen import decode_var, encode_var, var_kind

#: Served dtype name -> numpy dtype (parsing the name costs more than the
#: view it makes, on every input of every batch).
_DTYPE = {n: np.dtype(n) for n in NUMERIC_DTYPES}


class Pools:
    """Shared-memory pools mapped into this process, opened on first use."""

    def __init__(self, prefix: str, own_id: int):
        self.prefix = prefix
        self.own_id = own_id
        self.own = _core.Pool.open(f"{prefix}-{own_id}")
        self._maps: dict[int, tuple[mmap.mmap, memoryview, int]] = {}

    def _map(self, pool: int) -> tuple[mmap.mmap, memoryview, int]:
        m = self._maps.get(pool)
        if m is None:
            with open(f"{self.prefix}-{pool}", "r+b") as f:
                mm = mmap.mmap(f.fileno(), 0)
            mv = memoryview(mm)
            base = np.frombuffer(mv, dtype=np.uint8, count=1).__array_interface__["data"][0]
            m = (mm, mv, base)
            self._maps[pool] = m
        return m

    def array(self, desc: Mapping[str, Any], writable: bool = False) -> np.ndarray:
        """A view of a descriptor's bytes; read-only unless `writable` (the
        torch path, which has no read-only tensors: see tensors.py)."""
        _, mv, _ = self._map(desc["pool"])
        shape = desc["shape"]
        if desc["dtype"] in VAR_DTYPES:
            return decode_var(mv[desc["offset"]:desc["offset"] + desc["nbytes"]], shape, desc["dtype"] == "string")
        count = math.prod(shape)  # np.prod costs 7 us a call on a small VM
        a = np.frombuffer(mv, dtype=_DTYPE[desc["dtype"]], count=count, offset=desc["offset"]).reshape(shape)
        a.flags.writeable = writable
        return a

    def locate(self, a: np.ndarray) -> tuple[int, int] | None:
        """(pool, offset) if `a` is a C-contiguous view into a mapped pool."""
        if not a.flags.c_contiguous or a.nbytes == 0:
            return None
        ptr = a.__array_interface__["data"][0]
        for pool, (mm, _, base) in self._maps.items():
            if base <= ptr and ptr + a.nbytes <= base + len(mm):
                return pool, ptr - base
        return None

    def put_bytes(self, data: bytes) -> tuple[int, int]:
        off = self.own.alloc(len(data))
        _, mv, _ = self._map(self.own_id)
        mv[off:off + len(data)] = data
        return off, len(data)

    def own_array(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[np.ndarray, int, int]:
        """A new block of this replica's pool as a writable array: (array, offset, nbytes)."""
        count = math.prod(shape)
        nbytes = count * dtype.itemsize
        off = self.own.alloc(nbytes)
        _, mv, _ = self._map(self.own_id)
        return np.frombuffer(mv, dtype=dtype, count=count, offset=off).reshape(shape), off, nbytes

    def put(self, a: np.ndarray) -> tuple[int, int]:
        """Copy `a` into a new block of this replica's pool: (offset, nbytes)."""
        dst, off, nbytes = self.own_array(a.dtype, a.shape)
        np.copyto(dst, a, casting="no")
        return off, nbytes


#: A fixed-size output's dtype -> its served name (``dtype.name`` is a
#: Python-level property that costs 5 us a call on a small VM, twice per
#: output per batch).
_SERVED = {d: n for n, d in _DTYPE.items()}


def _as_output(name: str, value: Any, rows: int) -> tuple[np.ndarray, str]:
    """The output as an array, with the name of its served dtype (one of
    ``DTYPES``)."""
    a = np.asarray(value)
    served = _SERVED.get(a.dtype)
    if served is None:
        if a.dtype.kind in "biuf" and a.dtype.newbyteorder("=") in _SERVED:
            a = a.astype(a.dtype.newbyteorder("="))  # served in the machine's byte order
            served = _SERVED[a.dtype]
        else:
            served = var_kind(a, strict=True)
    if served is None:
        raise TypeError(f"output {name!r} has dtype {a.dtype}, which cannot be served (use one of {', '.join(DTYPES)})")
    if a.ndim == 0 or a.shape[0] != rows:
        raise ValueError(
            f"output {name!r} has shape {list(a.shape)}; its first dimension must be the batch's {rows} rows"
        )
    return a, served


def batch_of(pools: Pools, msg: Mapping[str, Any], as_torch: tensors.TorchInputs | None = None) -> Batch:
    """The component's view of a batch message: arrays (or tensors) over
    shared memory, and each request's deadline on this process's clock (the
    node sends the time each had left: ``left_us``)."""
    arrays = {k: pools.array(d, writable=as_torch is not None) for k, d in msg["inputs"].items()}
    left = msg.get("left_us")
    deadlines = None if not left else [time.monotonic() + us / 1e6 for us in left]
    return Batch(arrays if as_torch is None else as_torch(arrays), msg["rows"], deadlines)


Emit = Callable[[dict[str, Any]], None]


def run_batch(instance: Any, pools: Pools, msg: Mapping[str, Any],
              as_torch: tensors.TorchInputs | None = None, emit: Emit | None = None) -> dict[str, Any]:
    """Run one batch. A component that yields (a generator) streams: each
    chunk goes to ``emit`` as a ``chunk`` message as soon as it is yielded,
    and the batch's result is the generator's return value, or its last
    chunk if it returns nothing."""
    batch = batch_of(pools, msg, as_torch)
    t0 = time.perf_counter()
    result = complete(instance(batch), lambda chunk: _emit_chunk(pools, msg, chunk, emit))
    return result_message(pools, msg, result, int((time.perf_counter() - t0) * 1e6))


async def run_batch_async(instance: Any, pools: Pools, msg: Mapping[str, Any],
                          as_torch: tensors.TorchInputs | None = None, emit: Emit | None = None) -> dict[str, Any]:
    """`run_batch` for an async component; an async generator streams (its
    result is its last chunk: async generators cannot return a value)."""
    batch = batch_of(pools, msg, as_torch)
    t0 = time.perf_counter()
    call = instance(batch)
    if inspect.isasyncgen(call):
        result = await drain_async(call, lambda chunk: _emit_chunk(pools, msg, chunk, emit))
    else:
        result = await call
    return result_message(pools, msg, result, int((time.perf_counter() - t0) * 1e6))


def _emit_chunk(pools: Pools, msg: Mapping[str, Any], chunk: Any, emit: Emit | None) -> None:
    if emit is not None:
        emit({**result_message(pools, msg, chunk, 0), "op": "chunk"})


def result_message(pools: Pools, msg: Mapping[str, Any], result: Any, compute_us: int) -> dict[str, Any]:
    """Place a component's outputs (in our pool, or by reference into an input) and describe them."""
    rows = int(sum(msg["rows"]))
    if result is None:
        raise TypeError("a component returns (or yields) a dict of arrays, got None")
    if not isinstance(result, Mapping):
        raise TypeError(f"a component returns a dict of arrays, got {type(result).__name__}")
    outputs: dict[str, Any] = {}
    written: list[tuple[int, int]] = []
    try:
        for name, value in result.items():
            placed = None  # a GPU tensor is copied into our pool on its way to numpy
            if tensors.is_torch(value):
                value, placed = tensors.host_output(str(name), value, pools)
                if placed is not None:
                    written.append(placed)
            a, served = _as_output(str(name), value, rows)
            if served in VAR_DTYPES:
                off, n = pools.put_bytes(encode_var(a))
                written.append((off, n))
                outputs[str(name)] = {"dtype": served, "shape": list(a.shape), "nbytes": n,
                                      "pool": pools.own_id, "offset": off, "origin": "copied"}
                continue
            where = pools.locate(a)
            desc: dict[str, Any] = {"dtype": served, "shape": list(a.shape), "nbytes": a.nbytes}
            if placed is not None:
                desc.update(pool=pools.own_id, offset=placed[0], origin="copied")
            elif where is not None:
                desc.update(pool=where[0], offset=where[1], origin="borrowed")
            else:
                off, n = pools.put(np.ascontiguousarray(a))
                written.append((off, n))
                desc.update(pool=pools.own_id, offset=off, origin="copied")
            outputs[str(name)] = desc
    except BaseException:
        for off, n in written:
            pools.own.free(off, n)
        raise
    reply: dict[str, Any] = {"op": "result", "id": msg["id"], "outputs": outputs, "compute_us": compute_us}
    versions = loaded_versions()
    if versions:
        # Which model computed this (the prediction cache keeps the newest's).
        reply["versions"] = versions
    return reply


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="slipstream-worker")
    ap.add_argument("--app", required=True)
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--stage", required=True)
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--connect", required=True)
    ap.add_argument("--pool-prefix", required=True)
    ap.add_argument("--pool", type=int, required=True)
    args = ap.parse_args(argv)
    parent = os.getppid()
    _die_with_parent()
    nice = int(os.environ.get("SLIPSTREAM_WORKER_NICE", "0") or 0)
    if nice > 0:
        os.nice(nice)  # below the node (see app_spec); also while the model loads
    # Ctrl-C reaches the whole process group; the node decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent:
        return 1

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.connect)
    reader = sock.makefile("rb")

    def send(msg: dict[str, Any]) -> None:
        sock.sendall(protocol.encode(msg))

    label = f"{args.pipeline}/{args.stage}[{args.replica}]"
    try:
        _, pipelines = load_pipelines(args.app)
        pipe = next((p for p in pipelines if p.name == args.pipeline), None)
        if pipe is None:
            raise LookupError(f"the app no longer defines pipeline {args.pipeline!r}")
        groups.configure(store_pools(pipelines))  # ss.store.group's affinity groups
        replica = Replica(pipe.stage(args.stage), label)
        comp = pipe.stage(args.stage)
        as_torch = tensors.for_component(comp.tensors, comp.device)  # imports torch only if asked
        pools = Pools(args.pool_prefix, args.pool)
    except BaseException as e:  # report why we cannot start, then exit
        tb = traceback.format_exc()
        sys.stderr.write(f"slipstream worker {label}: cannot start:\n{tb}")
        send({"op": "fatal", "message": f"{type(e).__name__}: {e}"})
        return 1

    send({"op": "ready", "pid": os.getpid()})
    if comp.is_async:
        return asyncio.run(serve_async(sock, replica, pools, as_torch, label))
    while True:
        msg = protocol.read(reader)
        if msg is None or msg["op"] == "shutdown":
            return 0
        if msg["op"] != "batch":
            continue
        try:
            reply = run_batch(replica.current(), pools, msg, as_torch, send)
        except Exception as e:
            reply = _failed(label, msg, e)
        send(reply)


def _failed(label: str, msg: Mapping[str, Any], e: Exception) -> dict[str, Any]:
    """A batch's error reply (the worker keeps serving)."""
    sys.stderr.write(f"slipstream worker {label}: batch {msg['id']} failed:\n{traceback.format_exc()}")
    return {"op": "error", "id": msg["id"], "kind": "component_error", "message": f"{type(e).__name__}: {e}"}


async def serve_async(sock: socket.socket, replica: Replica, pools: Pools,
                      as_torch: tensors.TorchInputs | None, label: str) -> int:
    """An async component's loop: every batch the node sends becomes a task
    on this event loop, so batches that wait on I/O overlap (the node keeps
    at most the stage's ``concurrency`` in flight); each answer goes back as
    soon as its batch finishes, tagged with its id."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    running: set[asyncio.Task[None]] = set()

    def emit(chunk: dict[str, Any]) -> None:
        writer.write(protocol.encode(chunk))

    async def one(msg: dict[str, Any]) -> None:
        try:
            reply = await run_batch_async(replica.current(), pools, msg, as_torch, emit)
        except Exception as e:
            reply = _failed(label, msg, e)
        writer.write(protocol.encode(reply))
        await writer.drain()

    while True:
        msg = await protocol.read_async(reader)
        if msg is None or msg["op"] == "shutdown":
            break
        if msg["op"] == "batch":
            task = asyncio.create_task(one(msg))
            running.add(task)
            task.add_done_callback(running.discard)
    if running:
        await asyncio.wait(running, timeout=5.0)
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
