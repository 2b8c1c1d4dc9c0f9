"""Profiling under co-location: neighbour processes that keep the rest of
the machine busy with the pipeline's own stages while a stage is measured.

A profile taken with the machine otherwise idle says how fast a stage is
alone; served at full load, every stage's replicas run at once and share
the cores, their caches, the memory bandwidth and, on many machines, a
core's two hyperthreads. On the 2-vCPU machine this project is measured on,
multimodal's VisionEncoder took 85 ms a batch profiled alone and 138 ms
served (docs/benchmarks.md), so a plan built from the lone profile
promised capacity the deployment did not have. `slipstream profile
--colocated` measures each stage while ``max(1, cores - threads)``
single-threaded neighbours run all the pipeline's stages in a loop (the
cores the measured replica does not use, and at least one: a deployment
always has other stages); the profile records how many ran and how many
batches they did, so a reader knows what the figures were measured beside.

The neighbours are `slipstream profile APP --neighbour` processes: each
builds the pipeline's components, runs one warm-up round, prints
``ready``, then runs the stages round-robin at a small batch until its
stdin closes, and prints the batches it ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

#: Batch size the neighbours run (capped by each stage's max batch size): busy, not huge.
NEIGHBOUR_BATCH = 4


@dataclass
class Neighbours:
    """What ran beside the measurement: processes, and batches they completed."""

    count: int
    batches: int = 0

    def record(self) -> dict[str, int]:
        return {"neighbours": self.count, "neighbour_batches": self.batches}


def neighbour_count(cores: int, threads: int) -> int:
    """The cores the measured replica leaves, and at least one."""
    return max(1, int(cores) - int(threads))


@contextmanager
def neighbours(app: str, pipeline: str, count: int) -> Iterator[Neighbours]:
    """Run ``count`` neighbours of `pipeline` for the block (each
    single-threaded); they are ready (components built, warmed up) when the
    block starts and stopped, their batches counted, when it ends. Waiting
    for one takes as long as building the components takes (the measuring
    process builds the same ones); one that exits first is an error."""
    from slipstream._internal.app import THREAD_VARS

    env = dict(os.environ, SLIPSTREAM_PROFILE_CHILD="1", SLIPSTREAM_THREADS="1")
    for var in THREAD_VARS:
        env[var] = "1"
    procs: list[subprocess.Popen[str]] = []
    out = Neighbours(count)
    try:
        for _ in range(count):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "slipstream._internal.cli", "profile", app, "--pipeline", pipeline,
                 "--neighbour"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
        for p in procs:
            assert p.stdout is not None
            line = "?"
            while line and line.strip() != "ready":  # what components print first is skipped
                line = p.stdout.readline()  # blocks until the neighbour has built and warmed up
            if not line:
                raise RuntimeError(f"a co-location neighbour did not start (exit {p.wait()}; its errors are above)")
        print(f"  {count} co-located neighbour(s) running {pipeline}'s stages", file=sys.stderr)
        yield out
    finally:
        for p in procs:
            if p.stdin is not None and not p.stdin.closed:
                p.stdin.close()  # the neighbour stops at its next stage boundary
        for p in procs:
            rest = p.stdout.read() if p.stdout is not None else ""  # to its exit, after its current round
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for line in rest.splitlines():
                if line.startswith("batches "):
                    out.batches += int(line.split()[1])


def run_neighbour(pipe: Any) -> int:
    """The neighbour's loop (see the module docs); returns its exit status."""
    import select

    from slipstream._internal.api import completing
    from slipstream._internal.slo import stage_batches

    order = pipe.graph.topological_order()
    instances = {n: completing(pipe.stage(n).instantiate()) for n in order}
    b = max(1, min([NEIGHBOUR_BATCH] + [pipe.stage(n).max_batch_size for n in order]))
    batches = dict(stage_batches(pipe, instances, b))  # each stage run once: a warm-up
    print("ready", flush=True)
    done = 0
    while True:
        for name in order:
            instances[name](batches[name])
            done += 1
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.read(1):
            break  # stdin closed: the measurement is over
    print(f"batches {done}", flush=True)
    return 0
