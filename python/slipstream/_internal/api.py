"""The declarative API: components, graphs, pipelines, SLOs, tensor specs,
and what they ask of the object store (needs, watches, pools, seeds).

Nothing here runs a model. These objects describe what to serve; ``serve``
turns them into the JSON spec the node reads (see ``app.py``), and each
worker process imports the same app file to find its component class.
"""

from __future__ import annotations

import base64
import copy
import inspect
import keyword
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slipstream._internal.dtypes import DTYPES, VAR_DTYPES
from slipstream._internal.errors import ConfigError
from slipstream._internal.keys import RESERVED_PREFIX, declared_key, declared_prefix
from slipstream._internal.needs import resolve
from slipstream._internal.seeds import SEEDS, declare_seed

#: Batches an async component's replica runs at once unless it says otherwise.
DEFAULT_ASYNC_CONCURRENCY = 16

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class Tensor:
    """Declared dtype and shape of a named tensor. ``-1`` (or ``None``) in a
    dimension accepts any length. ``dtype`` is a numpy dtype, or ``"string"``
    (``str``) for text, or ``"bytes"`` for raw byte strings; workers see those
    two as numpy object arrays of ``str`` / ``bytes``. The first dimension is the row dimension:
    a request may carry several rows and a batch concatenates them."""

    dtype: str
    shape: tuple[int, ...]

    def __init__(self, dtype: Any, shape: Sequence[int | None]):
        if dtype is str:
            name = "string"
        elif dtype is bytes:
            name = "bytes"
        elif isinstance(dtype, str) and dtype in DTYPES:
            name = dtype
        else:
            try:
                name = np.dtype(dtype).name
            except TypeError:
                name = str(dtype)
        if name not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
        dims = tuple(-1 if d is None else int(d) for d in shape)
        if not dims:
            raise ConfigError("a tensor needs at least one dimension (the row dimension)")
        if any(d < -1 for d in dims):
            raise ConfigError(f"invalid shape {shape!r}: dimensions are >= 0, or -1 for any")
        object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "shape", dims)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}


#: What a put or delete under a watched prefix gives the pipeline: one row
#: each. ``value`` is the value when it is at most 1 MiB, else empty (read
#: it with ``ss.store.get``).
TRIGGER_INPUTS = {
    "key": Tensor("string", (-1,)),
    "version": Tensor("int64", (-1,)),
    "op": Tensor("string", (-1,)),
    "value": Tensor("bytes", (-1,)),
}


def _check_affinity_input(stage: str, name: str, inputs: Mapping[str, Tensor]) -> None:
    spec = inputs.get(name)
    if spec is None or spec.dtype != "string":
        raise ConfigError(f"{stage}: affinity={name!r} must name a string input (inputs: "
                          + ", ".join(f"{k} ({v.dtype})" for k, v in inputs.items()) + ")")


@dataclass(frozen=True)
class Pool:
    """Settings for the store keys under ``prefix`` (a key belongs to the
    pool with the longest matching prefix; the root pool ``/`` keeps 16
    versions and has no affinity).

    Retention keeps each key's last ``keep_versions`` versions, and drops
    older ones past ``keep_age_s`` seconds (None: no age limit).
    ``affinity`` is a regular expression whose first capture group maps a
    key to its affinity group, e.g. ``r"^/docs/([^/]+)/"``: the objects of
    one group are routed to, cached and evicted on one replica together.

    In a cluster, ``copies`` is how many nodes hold each value (None: the
    node's ``--store-replicas``, 2 by default), and ``write_copies`` how many
    of them must have it durably before a put is acknowledged (None: all
    ``copies``), e.g. ``copies=3, write_copies=2`` for models, ``copies=1``
    for scratch data. Fewer when fewer nodes are up; ignored on one node."""

    prefix: str
    keep_versions: int = 16
    keep_age_s: float | None = None
    affinity: str | None = None
    copies: int | None = None
    write_copies: int | None = None

    def __post_init__(self) -> None:
        where = f"ss.Pool({self.prefix!r})"
        declared_prefix(self.prefix, where)
        if self.prefix.startswith(RESERVED_PREFIX):
            raise ConfigError(f"{where}: keys under {RESERVED_PREFIX} are the node's own")
        if isinstance(self.keep_versions, bool) or not isinstance(self.keep_versions, int) or self.keep_versions < 1:
            raise ConfigError(f"{where}: keep_versions must be an integer >= 1, got {self.keep_versions!r}")
        if self.keep_age_s is not None and (
            isinstance(self.keep_age_s, bool) or not isinstance(self.keep_age_s, (int, float)) or not self.keep_age_s > 0
        ):
            raise ConfigError(f"{where}: keep_age_s must be a number of seconds > 0, or None, got {self.keep_age_s!r}")
        for name in ("copies", "write_copies"):
            n = getattr(self, name)
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64):
                raise ConfigError(f"{where}: {name} must be an integer in 1..64, or None, got {n!r}")
        if self.write_copies is not None and self.copies is not None and self.write_copies > self.copies:
            raise ConfigError(f"{where}: write_copies ({self.write_copies}) cannot exceed copies ({self.copies})")
        if self.affinity is not None:
            if not isinstance(self.affinity, str):
                raise ConfigError(f"{where}: affinity is a regular expression string, got {self.affinity!r}")
            try:
                groups = re.compile(self.affinity).groups
            except re.error as e:
                raise ConfigError(f"{where}: affinity {self.affinity!r} is not a regular expression: {e}") from None
            if groups < 1:
                raise ConfigError(f"{where}: affinity {self.affinity!r} needs a capture group: "
                                  "its first group names a key's affinity group")

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "keep_versions": self.keep_versions, "keep_age_s": self.keep_age_s,
                "affinity": self.affinity, "copies": self.copies, "write_copies": self.write_copies}


def worker_threads() -> int:
    """The thread budget of the replica this code runs in (its component's
    ``threads``): size a model runtime's thread pool with it."""
    try:
        return max(1, int(os.environ.get("SLIPSTREAM_THREADS", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class SLO:
    """A latency objective: ``p99_ms`` at the 99th percentile, and at most
    ``max_miss_rate`` of requests slower than it."""

    p99_ms: float
    max_miss_rate: float = 0.01
    #: Drop a request whose deadline passed while it waited inside the
    #: pipeline (the default: no compute on a certain miss). Set False when
    #: late answers are still worth having, e.g. after an expensive first stage.
    drop_late: bool = True

    def __post_init__(self) -> None:
        if not self.p99_ms > 0:
            raise ConfigError(f"SLO p99_ms must be > 0, got {self.p99_ms}")
        if not 0 <= self.max_miss_rate < 1:
            raise ConfigError(f"SLO max_miss_rate must be in [0, 1), got {self.max_miss_rate}")


def complete(result: Any, on_chunk: Callable[[Any], None] | None = None) -> Any:
    """A component call's result as the node receives it. A generator (a
    streaming component) runs to its end, each chunk passed to `on_chunk`,
    and the result is its return value, else its last chunk; a coroutine (an
    async component) is run (``asyncio.run``: outside a worker's loop); an
    async generator is drained the same way (its last chunk). Anything else
    is the result already."""
    if inspect.isgenerator(result):
        last = None
        while True:
            try:
                chunk = next(result)
            except StopIteration as stop:
                return last if stop.value is None else stop.value
            if on_chunk is not None:
                on_chunk(chunk)
            last = chunk
    if inspect.iscoroutine(result):
        import asyncio

        return asyncio.run(result)
    if inspect.isasyncgen(result):
        import asyncio

        return asyncio.run(drain_async(result, on_chunk))
    return result


async def drain_async(chunks: Any, on_chunk: Callable[[Any], None] | None = None) -> Any:
    """An async generator's chunks, each passed to `on_chunk`; its result is
    its last chunk (async generators cannot return a value)."""
    last = None
    async for chunk in chunks:
        if on_chunk is not None:
            on_chunk(chunk)
        last = chunk
    return last


def completing(instance: Any) -> Callable[[Batch], Any]:
    """A component instance as a plain function of a batch (`complete` on
    each call): what profiling and benchmarks call outside a worker, so that
    streaming and async components are measured for their whole work."""
    return lambda batch: complete(instance(batch))


class Batch(Mapping[str, np.ndarray]):
    """The inputs of one batched call.

    ``batch[name]`` is a read-only numpy array whose first dimension is the
    total number of rows of the batch; it is a view over shared memory, not
    a copy (a ``torch.Tensor`` over the same memory for a component declared
    with ``tensors="torch"``). ``batch.sizes[i]`` is how many of those rows request ``i`` owns,
    in order. A component returns a dict of arrays whose first dimension is
    ``batch.rows``; row ``j`` of an output belongs to the request that owns
    row ``j`` of the inputs.

    ``batch.time_left()`` says how long each request has before its deadline
    (its SLO or its timeout), so that a component can answer with what it
    has when time runs short (e.g. a re-ranker that stops reading
    candidates).
    """

    __slots__ = ("_tensors", "sizes", "deadlines")

    def __init__(self, tensors: dict[str, np.ndarray], sizes: Sequence[int],
                 deadlines: Sequence[float] | None = None):
        self._tensors = tensors
        self.sizes = list(sizes)
        #: Each request's deadline on ``time.monotonic()``'s clock, or None
        #: when the batch did not come from a node (a direct call, a benchmark).
        self.deadlines = None if deadlines is None else np.asarray(deadlines, dtype=np.float64)

    def time_left(self) -> np.ndarray:
        """Seconds each request has left before its deadline, now (negative
        once passed; ``inf`` for a batch that did not come from a node)."""
        if self.deadlines is None:
            return np.full(len(self.sizes), np.inf)
        return self.deadlines - time.monotonic()

    @property
    def rows(self) -> int:
        return int(sum(self.sizes))

    def __getitem__(self, key: str) -> np.ndarray:
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError(f"no input {key!r} in this batch (inputs: {', '.join(self._tensors)})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self._tensors.items())
        return f"Batch(requests={len(self.sizes)}, rows={self.rows}, {shapes})"


@dataclass(frozen=True)
class Cache:
    """A component's prediction cache (Clipper's): results kept per request
    by a hash of its inputs (``key``: the names of the inputs that make the
    key; all of them when None), at most ``max_bytes`` of tensor data,
    evicted by CLOCK. A cached request skips the queue and the worker.
    Results are kept per model version: putting a new version of an object
    the component ``needs`` empties the cache once the new model serves.
    ``@ss.component(cache=True)`` is ``cache=ss.Cache()``."""

    key: tuple[str, ...] | None = None
    max_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.key is not None:
            if isinstance(self.key, str) or not all(isinstance(k, str) and k for k in self.key) or not self.key:
                raise ConfigError(f"Cache(key=...) takes a list of input names, got {self.key!r}")
            object.__setattr__(self, "key", tuple(self.key))
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ConfigError(f"Cache(max_bytes=...) takes a positive integer, got {self.max_bytes!r}")

    def to_json(self) -> dict[str, Any]:
        return {"key": None if self.key is None else list(self.key), "max_bytes": self.max_bytes}


def _cache_option(cache: Any, where: str) -> Cache | None:
    if cache is None or cache is False:
        return None
    if cache is True:
        return Cache()
    if isinstance(cache, Cache):
        return cache
    if isinstance(cache, (list, tuple)):
        return Cache(key=tuple(cache))
    raise ConfigError(f"{where}: cache is True, a list of input names or ss.Cache(...), got {cache!r}")


@dataclass
class Component:
    """A component class with its serving options. Made by ``@component``."""

    cls: type
    name: str
    max_batch_size: int = 1
    #: Replicas to start with. ``@component(replicas=(lo, hi))`` starts
    #: ``lo`` and lets the autoscaler move between the bounds; not given
    #: (None), ``slipstream serve`` plans it (1 when serving as declared).
    replicas: int = None  # type: ignore[assignment]  # None or (lo, hi) are resolved in __post_init__
    inputs: dict[str, Tensor] = field(default_factory=dict)
    outputs: dict[str, Tensor] = field(default_factory=dict)
    init_args: tuple[Any, ...] = ()
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Threads per replica: its worker runs with OMP_NUM_THREADS (and the
    #: other numeric libraries' variables) and SLIPSTREAM_THREADS set to it;
    #: a component that sizes its own thread pool reads ``ss.worker_threads()``.
    #: Not given (None): planned like ``replicas``.
    threads: int = None  # type: ignore[assignment]  # resolved in __post_init__
    min_replicas: int = 0
    max_replicas: int = 0
    #: Store objects the constructor takes: keyword argument name -> key.
    #: Each replica gets them (``ss.Object``) before it is ready, and is
    #: rebuilt beside the old one when a new version is put.
    needs: dict[str, str] = field(default_factory=dict)
    #: A store prefix ("/docs/"): every put or delete under it invokes the
    #: pipeline this component is the root of, with ``TRIGGER_INPUTS``.
    watch: str | None = None
    #: A string input naming a store key per request: requests are routed to
    #: the replica that holds that key's affinity group (see ``ss.Pool``).
    affinity: str | None = None
    #: What ``batch[name]`` holds: ``"numpy"`` arrays, or ``"torch"``
    #: tensors (views over the same shared memory; see ``tensors.py``).
    tensors: str = "numpy"
    #: ``"cpu"``, ``"cuda"`` (each replica bound to one GPU, spread over them)
    #: or ``"cuda:N"`` (the node's Nth GPU or MIG slice).
    device: str = "cpu"
    #: Batches one replica runs at once. Only an ``async def __call__`` may
    #: run more than one (requests that wait on I/O overlap on the worker's
    #: event loop); None: 1, or ``DEFAULT_ASYNC_CONCURRENCY`` for async.
    concurrency: int | None = None
    #: Results kept by input (``ss.Cache``), or None.
    cache: Cache | None = None
    #: A string or bytes input the component pads to the batch's longest
    #: element (a tokenizer padding to the longest sentence): the node
    #: groups queued requests of similar length into a batch.
    length_of: str | None = None
    #: With ``length_of``: the most padded positions (rows x the longest
    #: element's bytes) one batch may hold; None: no bound.
    max_batch_tokens: int | None = None
    #: An elastic (anytime) component: it reads ``batch.time_left()`` and
    #: answers this many ms before its batch's deadline, doing less with
    #: less time, and takes at least this long. None: its latency is what
    #: its profile says (docs/design/scheduling.md, "Elastic stages").
    elastic_ms: float | None = None
    #: With ``device="cuda"``: the devices (places in ``nvidia-smi -L``'s
    #: list, as ``cuda:N`` names them) its replicas take, each the one with
    #: the fewest of them on it; set by ``serve --plan`` from a GPU plan,
    #: binding each replica to the GPU or MIG slice the plan chose. Empty: all.
    devices: tuple[int, ...] = ()
    #: What the author fixed, of ``"replicas"`` (a count) and ``"threads"``:
    #: the planner sizes the rest (docs/design/planner.md).
    pinned: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"component name {self.name!r} may use letters, digits, '_', '-' and '.' only")
        if int(self.max_batch_size) < 1:
            raise ConfigError(f"{self.name}: max_batch_size must be >= 1")
        pinned = set(self.pinned)
        if self.replicas is None:
            self.replicas = self.min_replicas if self.autoscaled else 1
        elif not isinstance(self.replicas, (tuple, list)):
            pinned.add("replicas")
        if self.threads is None:
            self.threads = 1
        else:
            pinned.add("threads")
        self.pinned = frozenset(pinned)
        self._set_replicas(self.replicas, keep_bounds=True)
        if not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"{self.name}: threads must be an integer >= 1, got {self.threads!r}")
        if "__call__" not in dir(self.cls):
            raise ConfigError(f"{self.name}: a component class needs a __call__(self, batch) method")
        self._check_store_options()
        self._check_device()
        self._check_concurrency()
        self._check_cache()
        self._check_length()
        self._check_elastic()

    @property
    def is_async(self) -> bool:
        """``__call__`` is a coroutine function: the worker awaits it on an event loop."""
        call = next((vars(k)["__call__"] for k in self.cls.__mro__ if "__call__" in vars(k)), None)
        return inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call)

    def _check_concurrency(self) -> None:
        c = self.concurrency
        if c is None:
            self.concurrency = DEFAULT_ASYNC_CONCURRENCY if self.is_async else 1
            return
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 1024:
            raise ConfigError(f"{self.name}: concurrency must be an integer from 1 to 1024, got {c!r}")
        if c > 1 and not self.is_async:
            raise ConfigError(f"{self.name}: concurrency={c} needs an `async def __call__` "
                              "(a plain __call__ runs one batch at a time)")

    def _check_length(self) -> None:
        name, budget = self.length_of, self.max_batch_tokens
        if budget is not None:
            if name is None:
                raise ConfigError(f"{self.name}: max_batch_tokens needs length_of (the input whose length it bounds)")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise ConfigError(f"{self.name}: max_batch_tokens must be an integer >= 1, got {budget!r}")
        if name is None:
            return
        spec = self.inputs.get(name)
        if spec is None:
            known = ", ".join(self.inputs) or "none declared"
            raise ConfigError(f"{self.name}: length_of={name!r} is not one of its inputs ({known})")
        if spec.dtype not in ("string", "bytes"):
            raise ConfigError(f"{self.name}: length_of={name!r} must be a string or bytes input, not {spec.dtype}")

    def _check_elastic(self) -> None:
        ms = self.elastic_ms
        if ms is None:
            return
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms <= 0:
            raise ConfigError(f"{self.name}: elastic_ms must be a number of milliseconds > 0, got {ms!r}")
        self.elastic_ms = float(ms)

    def _check_cache(self) -> None:
        self.cache = _cache_option(self.cache, self.name)
        if self.cache is None:
            return
        if self.watch is not None:
            raise ConfigError(f"{self.name}: a component that watches the store cannot cache its results")
        call = next((vars(k)["__call__"] for k in self.cls.__mro__ if "__call__" in vars(k)), None)
        if inspect.isgeneratorfunction(call) or inspect.isasyncgenfunction(call):
            raise ConfigError(f"{self.name}: a streaming component cannot cache its results "
                              "(a cached answer has no chunks)")
        if self.cache.key is not None and self.inputs:
            missing = [k for k in self.cache.key if k not in self.inputs]
            if missing:
                raise ConfigError(f"{self.name}: cache key input(s) {missing} are not among its inputs "
                                  f"{sorted(self.inputs)}")

    def _check_device(self) -> None:
        if self.tensors not in ("numpy", "torch"):
            raise ConfigError(f"{self.name}: tensors is \"numpy\" or \"torch\", got {self.tensors!r}")
        d = self.device
        index = d[5:] if isinstance(d, str) and d.startswith("cuda:") else "0"
        if not isinstance(d, str) or not (d in ("cpu", "cuda") or (d.startswith("cuda:") and index.isdigit())):
            raise ConfigError(f"{self.name}: device is \"cpu\", \"cuda\" or \"cuda:N\", got {d!r}")
        self.devices = tuple(self.devices)
        if self.devices and d != "cuda":
            raise ConfigError(f"{self.name}: devices (a plan's binding) needs device=\"cuda\", got {d!r}")
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in self.devices):
            raise ConfigError(f"{self.name}: devices are places in nvidia-smi -L's list (integers >= 0), "
                              f"got {list(self.devices)!r}")

    def _check_store_options(self) -> None:
        """``needs``, ``watch`` and ``affinity``; a watching component without
        declared inputs gets the trigger's."""
        if self.needs is None:
            self.needs = {}
        if not isinstance(self.needs, Mapping):
            raise ConfigError(f"{self.name}: needs maps constructor argument names to store keys, got {self.needs!r}")
        self.needs = dict(self.needs)
        for arg, key in self.needs.items():
            if not isinstance(arg, str) or not arg.isidentifier() or keyword.iskeyword(arg):
                raise ConfigError(f"{self.name}: needs name {arg!r} must be a Python identifier "
                                  "(it is passed as a keyword argument to the constructor)")
            declared_key(key, f"{self.name}: needs {arg!r}")
        self._check_init_kwargs(self.init_kwargs)
        if self.watch is not None:
            declared_prefix(self.watch, f"{self.name}: watch")
            if not self.inputs:
                self.inputs = dict(TRIGGER_INPUTS)
            for k, t in self.inputs.items():
                want = TRIGGER_INPUTS.get(k)
                if want is None or t.dtype != want.dtype or len(t.shape) != 1:
                    raise ConfigError(
                        f"{self.name}: a watching component's inputs are among "
                        + ", ".join(f"{n} ({v.dtype}, one dimension)" for n, v in TRIGGER_INPUTS.items())
                        + f"; got {k!r}: {t.dtype}{list(t.shape)}"
                    )
        if self.affinity is not None:
            if not isinstance(self.affinity, str) or not _NAME.match(self.affinity):
                raise ConfigError(f"{self.name}: affinity names one of its string inputs, got {self.affinity!r}")
            if self.inputs:
                _check_affinity_input(self.name, self.affinity, self.inputs)

    def _check_init_kwargs(self, kwargs: Mapping[str, Any]) -> None:
        both = sorted(set(kwargs) & set(self.needs))
        if both:
            raise ConfigError(f"{self.name}: {', '.join(both)} come from the store (needs); "
                              "do not also bind them")

    def _set_replicas(self, replicas: Any, keep_bounds: bool = False) -> None:
        """``replicas`` is a count (fixed) or ``(lo, hi)`` bounds (start at lo,
        autoscaled). With ``keep_bounds``, bounds already set are kept when
        they contain the count (a copy made by ``options``)."""
        if isinstance(replicas, (tuple, list)):
            if len(replicas) != 2 or not all(isinstance(v, int) for v in replicas):
                raise ConfigError(f"{self.name}: replicas=(lo, hi) takes two integers, got {replicas!r}")
            lo, hi = int(replicas[0]), int(replicas[1])
            if not 1 <= lo <= hi:
                raise ConfigError(f"{self.name}: replicas=(lo, hi) needs 1 <= lo <= hi, got {replicas!r}")
            self.replicas, self.min_replicas, self.max_replicas = lo, lo, hi
            return
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ConfigError(f"{self.name}: replicas must be an integer >= 1 or (lo, hi), got {replicas!r}")
        self.replicas = replicas
        if not (keep_bounds and 1 <= self.min_replicas <= replicas <= self.max_replicas):
            self.min_replicas = self.max_replicas = replicas

    @property
    def autoscaled(self) -> bool:
        """Declared with bounds the autoscaler may move between."""
        return self.max_replicas > self.min_replicas

    def options(self, **changes: Any) -> Component:
        """A copy with other options, e.g. ``Encoder.options(name="enc2", replicas=4)``
        or ``replicas=(1, 4)``, ``threads=2``."""
        unknown = set(changes) - {"name", "max_batch_size", "replicas", "threads", "inputs", "outputs", "needs",
                                  "watch", "affinity", "tensors", "device", "cache", "length_of",
                                  "max_batch_tokens", "elastic_ms", "devices"}
        if unknown:
            raise ConfigError(f"unknown component option(s): {', '.join(sorted(unknown))}")
        c = copy.copy(self)
        # What was planned stays to be planned unless changed here.
        c.pinned = frozenset()
        if "replicas" not in self.pinned:
            c.replicas = None  # type: ignore[assignment]
        if "threads" not in self.pinned:
            c.threads = None  # type: ignore[assignment]
        for k, v in changes.items():
            if k == "replicas":
                c.min_replicas = c.max_replicas = 0
            setattr(c, k, v)
        c.__post_init__()
        return c

    def bind(self, *args: Any, **kwargs: Any) -> Component:
        """A copy whose class is constructed with these arguments in each worker."""
        self._check_init_kwargs(kwargs)
        c = copy.copy(self)
        c.init_args, c.init_kwargs = args, kwargs
        return c

    def instantiate(self, objects: Mapping[str, Any] | None = None) -> Any:
        """Construct the class with its bound arguments and, as keyword
        arguments, the store objects of its ``needs``: ``objects`` (the
        worker passes what it fetched), or when not given, what
        ``needs.resolve`` finds outside a worker (profiling, benchmarks)."""
        if objects is None and self.needs:
            objects = resolve(self)
        missing = set(self.needs) - set(objects or {})
        if missing:
            raise ConfigError(f"{self.name}: constructing it needs the store objects {', '.join(sorted(missing))}")
        return self.cls(*self.init_args, **self.init_kwargs, **(objects or {}))

    def __rshift__(self, other: Any) -> Graph:
        return Graph.of(self) >> other

    def __rrshift__(self, other: Any) -> Graph:
        return Graph.of(other) >> self

    def __repr__(self) -> str:
        reps = f"({self.min_replicas}, {self.max_replicas})" if self.autoscaled else str(self.replicas)
        return f"Component({self.name}, max_batch_size={self.max_batch_size}, replicas={reps}, threads={self.threads})"


def component(
    cls: type | None = None,
    *,
    name: str | None = None,
    max_batch_size: int = 1,
    replicas: int | tuple[int, int] | None = None,
    threads: int | None = None,
    inputs: Mapping[str, Tensor] | None = None,
    outputs: Mapping[str, Tensor] | None = None,
    needs: Mapping[str, str] | None = None,
    watch: str | None = None,
    affinity: str | None = None,
    tensors: str = "numpy",
    device: str = "cpu",
    concurrency: int | None = None,
    cache: bool | Sequence[str] | Cache | None = None,
    length_of: str | None = None,
    max_batch_tokens: int | None = None,
    elastic_ms: float | None = None,
) -> Any:
    """Declare a component: a class whose ``__call__(self, batch)`` takes a
    :class:`Batch` and returns a dict of arrays. The class is constructed once
    per replica, in that replica's worker process (load models in
    ``__init__``).

    ``replicas`` is a fixed count, or ``(lo, hi)``: start ``lo`` and let the
    autoscaler add replicas up to ``hi`` when load rises (and retire them
    when it falls). ``threads`` is each replica's thread budget. What is not
    given is planned: ``slipstream serve`` sizes replicas (within the
    bounds), threads and batch limits from a profile of this machine,
    measured on first start and cached (``--sizing declared`` serves 1
    replica with 1 thread instead). A count given pins it.

    Store options (docs/design/store.md):

    - ``needs={"encoder": "/models/minilm"}``: the constructor gets
      ``encoder=<ss.Object>``, the key's latest version, before the replica
      is ready. A new version builds a new instance beside the old one; the
      worker switches to it between batches (``ss.loaded_versions()`` says
      which versions serve).
    - ``watch="/docs/"``: every put or delete under the prefix invokes the
      pipeline this component is the root of, with inputs among ``key``,
      ``version``, ``op`` and ``value`` (all four when none are declared).
    - ``affinity="doc"``: the string input ``doc`` names a store key; the
      node sends requests for one affinity group (``ss.Pool(affinity=...)``)
      to the same replica, whose ``ss.store.group(key)`` then hits its cache.

    Tensors and devices:

    - ``tensors="torch"``: ``batch[name]`` is a ``torch.Tensor`` instead of a
      numpy array, a view over the same shared memory (no copy; string and
      bytes inputs stay numpy object arrays). Like the numpy views, inputs
      must not be written: other stages and requests read the same bytes
      (torch has no read-only tensors, so this is not enforced). Outputs may
      be torch tensors in either mode: CPU ones are passed on without a
      copy (a slice of an input by reference), GPU ones are copied once
      into shared memory. torch is imported only by workers of components
      that use it (``pip install slipstream[torch]``).
    - ``device="cuda"``: the node binds each replica to one GPU (or MIG
      slice) of its machine, spread over them, by starting its worker with
      ``CUDA_VISIBLE_DEVICES`` set to that device's UUID; ``"cuda:N"`` binds
      every replica to the Nth device ``nvidia-smi -L`` lists. Inside the
      worker the device is ``cuda`` (``cuda:0``); with ``tensors="torch"``
      the inputs are moved there once per batch. A GPU stage on a machine
      without a GPU fails at start-up.

    Async components: a class with ``async def __call__(self, batch)`` (a
    stage that waits on I/O: a remote API, a database) runs on an event loop
    in its worker, with up to ``concurrency`` batches in flight per replica
    (default 16); the node keeps that many batches out and matches answers
    to batches as they finish, in any order. A plain ``__call__`` runs one
    batch at a time.

    ``cache=True`` (or a list of input names, or ``ss.Cache(...)``) keeps
    results by a hash of the request's inputs: a repeated request is
    answered by the node without queueing or running the component (see
    :class:`Cache`).

    Variable-length inputs: ``length_of="query"`` says the component pads
    the string (or bytes) input ``query`` to the batch's longest element, as
    a tokenizer pads a batch of sentences. When more requests are queued
    than one batch takes, the node then fills the batch with requests of a
    length close to the most urgent one's (never holding back one that
    could not wait for the next batch), and predicts a batch's latency from
    its padded length. ``max_batch_tokens=N`` also bounds a batch to N
    padded positions: rows x the longest element's bytes (bytes stand in
    for tokens: the node does not tokenize).

    Elastic components: ``elastic_ms=20`` says the component does less
    with less time (an anytime computation: a re-rank under a time budget,
    an iterative search): it reads ``batch.time_left()`` and answers 20 ms
    before its batch's deadline (keeping that for the work that does not
    shrink and the answer's way back), and takes at least that long. The
    node then runs whatever is queued for it as one batch (up to its
    limit), counts it at most 20 ms when it predicts a request's finish and
    the time the stages before it have, and the planner counts it the same
    way, so that the time it would spend when unhurried is not planned as
    if it were its cost."""

    def wrap(c: type) -> Component:
        if not isinstance(c, type):
            raise ConfigError("@component decorates a class")
        return Component(
            cls=c,
            name=name or c.__name__,
            max_batch_size=max_batch_size,
            replicas=replicas,  # type: ignore[arg-type]  # None or (lo, hi) is resolved in __post_init__
            threads=threads,  # type: ignore[arg-type]  # None is resolved in __post_init__
            inputs=dict(inputs or {}),
            outputs=dict(outputs or {}),
            needs=dict(needs or {}),
            watch=watch,
            affinity=affinity,
            tensors=tensors,
            device=device,
            concurrency=concurrency,
            cache=cache,  # type: ignore[arg-type]  # resolved to a Cache in __post_init__
            length_of=length_of,
            max_batch_tokens=max_batch_tokens,
            elastic_ms=elastic_ms,
        )

    return wrap(cls) if cls is not None else wrap


#: What a selection answers with, per row.
SELECT_OUTPUTS = {
    "label": Tensor("int64", (-1,)),
    "confidence": Tensor("float32", (-1,)),
    "contributors": Tensor("int32", (-1,)),
    "model": Tensor("string", (-1,)),
}

SELECT_POLICIES = ("exp3", "exp4")


class Select:
    """Model selection over candidate components (Clipper's selection
    layer), run by the node. Each candidate answers the same question: it
    outputs ``label`` (int64, one per row) and optionally ``proba`` (float32,
    rows x classes).

    - ``policy="exp3"``: one candidate per request, chosen by Exp3 (a
      bandit); feedback on the chosen one moves the choice toward the best.
    - ``policy="exp4"``: every candidate runs; their answers are combined
      by a vote weighted by learned weights; feedback judges each one. The
      ensemble answers at its straggler cutoff with what has arrived:
      ``wait_ms`` after the candidates were dispatched, and never later than
      the request's deadline less the rest of the pipeline.
    - ``context="user"``: the first string of that pipeline input keys its
      own policy state (a user, a session).

    Outputs: ``label``, ``confidence`` (exp4: the weighted share of the
    ensemble that agrees, lower when models are missing; exp3: the chosen
    model's probability for its label, or the policy's for the choice),
    ``contributors`` (models combined) and ``model`` (the chosen candidate,
    or ``"ensemble"``). Feedback: ``POST /v1/pipelines/{name}/feedback`` with
    the answer's ``x-slipstream-request-id`` and the true ``label`` (or a
    ``reward`` in [0, 1], exp3 only); ``ss.Client.feedback``. ``eta`` is the
    learning rate (exp3 0.1, exp4 0.2), ``gamma`` exp3's exploration share
    (0.05)."""

    def __init__(self, candidates: Iterable[Component], *, policy: str = "exp3", name: str = "select",
                 context: str | None = None, wait_ms: float | None = None, eta: float | None = None,
                 gamma: float | None = None):
        self.candidates = list(candidates)
        if len(self.candidates) < 2 or not all(isinstance(c, Component) for c in self.candidates):
            raise ConfigError(f"ss.Select takes two or more components, got {self.candidates!r}")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ConfigError(f"ss.Select: candidates share a name ({names}); use .options(name=...)")
        if policy not in SELECT_POLICIES:
            raise ConfigError(f"ss.Select: policy is one of {SELECT_POLICIES}, got {policy!r}")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"ss.Select: name {name!r} may use letters, digits, '_', '-' and '.' only")
        if context is not None and not isinstance(context, str):
            raise ConfigError(f"ss.Select: context names a string input, got {context!r}")
        for arg, v in (("wait_ms", wait_ms), ("eta", eta)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                raise ConfigError(f"ss.Select: {arg} must be a positive number, got {v!r}")
        if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1):
            raise ConfigError(f"ss.Select: gamma must lie in (0, 1], got {gamma!r}")
        if policy == "exp3" and wait_ms is not None:
            raise ConfigError("ss.Select: wait_ms bounds an ensemble's stragglers; exp3 runs one model")
        for c in self.candidates:
            extra = set(c.outputs) - {"label", "proba"}
            if c.outputs and ("label" not in c.outputs or extra):
                raise ConfigError(f"ss.Select: candidate {c.name} must output 'label' (and optionally 'proba'), "
                                  f"not {sorted(c.outputs)}")
        self.policy, self.name, self.context = policy, name, context
        self.wait_ms, self.eta, self.gamma = wait_ms, eta, gamma

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "candidates": [c.name for c in self.candidates], "policy": self.policy,
                "context": self.context, "wait_ms": self.wait_ms, "eta": self.eta, "gamma": self.gamma}

    def __rshift__(self, other: Any) -> Graph:
        return Graph.of(self) >> other

    def __rrshift__(self, other: Any) -> Graph:
        return Graph.of(other) >> self

    def __repr__(self) -> str:
        return f"Select({[c.name for c in self.candidates]}, policy={self.policy!r})"


class Graph:
    """A DAG of components. ``A >> B`` chains; ``A >> [B, C] >> D`` fans out
    to B and C in parallel and joins their outputs in D (fan-in). A
    :class:`Select` is its candidates side by side, whose one combined
    answer goes on."""

    def __init__(self) -> None:
        self.nodes: dict[str, Component] = {}
        self.edges: list[tuple[str, str]] = []
        self.sources: list[str] = []
        self.sinks: list[str] = []
        self.selects: list[Select] = []

    @staticmethod
    def of(x: Any) -> Graph:
        if isinstance(x, Graph):
            return x
        if isinstance(x, Select):
            g = Graph.of(list(x.candidates))
            g.selects.append(x)
            return g
        if isinstance(x, Component):
            g = Graph()
            g._add(x)
            g.sources, g.sinks = [x.name], [x.name]
            return g
        if isinstance(x, (list, tuple)):
            g = Graph()
            for part in x:
                sub = Graph.of(part)
                g._merge(sub)
                g.sources += sub.sources
                g.sinks += sub.sinks
            if not g.nodes:
                raise ConfigError("an empty list cannot be part of a pipeline")
            return g
        raise ConfigError(f"cannot put {x!r} in a pipeline: use components, lists of components, or graphs")

    def _add(self, c: Component) -> None:
        have = self.nodes.get(c.name)
        if have is not None and have is not c:
            raise ConfigError(
                f"two different components are named {c.name!r}; use .options(name=...) to tell them apart"
            )
        self.nodes[c.name] = c

    def _merge(self, other: Graph) -> None:
        for c in other.nodes.values():
            self._add(c)
        for e in other.edges:
            if e not in self.edges:
                self.edges.append(e)
        for sel in other.selects:
            if any(s is sel for s in self.selects):
                continue
            if any(s.name == sel.name for s in self.selects):
                raise ConfigError(f"two selections are named {sel.name!r}; pass name=... to tell them apart")
            self.selects.append(sel)

    def select_of(self, name: str) -> Select | None:
        """The selection whose candidate stage ``name`` is, if any."""
        return next((s for s in self.selects if any(c.name == name for c in s.candidates)), None)

    def __rshift__(self, other: Any) -> Graph:
        right = Graph.of(other)
        g = Graph()
        g._merge(self)
        g._merge(right)
        for a in self.sinks:
            for b in right.sources:
                if (a, b) not in g.edges:
                    g.edges.append((a, b))
        g.sources = list(self.sources)
        g.sinks = list(right.sinks)
        return g

    def __rrshift__(self, other: Any) -> Graph:
        return Graph.of(other) >> self

    def parents(self, name: str) -> list[str]:
        return [a for a, b in self.edges if b == name]

    def topological_order(self) -> list[str]:
        """The stages, each after its parents (the first ready one in
        declaration order, each time). The graph must be acyclic, as a
        ``Pipeline`` checks."""
        order: list[str] = []
        remaining = list(self.nodes)
        while remaining:
            n = next(n for n in remaining if all(p in order for p in self.parents(n)))
            order.append(n)
            remaining.remove(n)
        return order


class Pipeline:
    """A named DAG of components with declared inputs and an optional SLO.

    ``inputs`` defaults to the declared inputs of the root components.
    ``pools`` declares store pools (``ss.Pool``) and ``seed`` files to put in
    the store at start-up, ``{"/models/minilm": path}`` or ``{key: (path,
    content_type)}`` (relative paths are taken from the current directory;
    the node puts a seed only while its key has no live version).
    ``example`` is one realistic request (input name -> values with a
    leading row dimension), what `slipstream profile` and first-start sizing
    measure the stages on; without one they run synthetic inputs, which
    can cost a stage nothing (a speech recogniser given silence). A function
    returning it is called when it is first needed.
    """

    def __init__(
        self,
        name: str,
        graph: Component | Graph | Iterable[Any],
        *,
        inputs: Mapping[str, Tensor] | None = None,
        outputs: Mapping[str, Tensor] | None = None,
        slo: SLO | None = None,
        example: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        fallback: Mapping[str, Any] | None = None,
        pools: Iterable[Pool] = (),
        seed: Mapping[str, Any] | None = None,
    ):
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"pipeline name {name!r} may use letters, digits, '_', '-' and '.' only")
        self.name = name
        self.graph = Graph.of(graph)
        roots = [c for n, c in self.graph.nodes.items() if not self.graph.parents(n)]
        if inputs is None:
            merged: dict[str, Tensor] = {}
            for c in roots:
                merged.update(c.inputs)
            inputs = merged
        if not inputs:
            raise ConfigError(
                f"pipeline {name!r} declares no inputs: pass inputs={{'x': ss.Tensor('float32', (-1, 4))}} "
                "or declare inputs on its first component"
            )
        for k, v in inputs.items():
            if not isinstance(v, Tensor):
                raise ConfigError(f"pipeline {name!r}: input {k!r} must be an ss.Tensor, got {v!r}")
        self.inputs = dict(inputs)
        if outputs is None:
            outs: dict[str, Tensor] = {}
            for n in self.graph.nodes:
                if not any(a == n for a, _ in self.graph.edges):
                    outs.update(SELECT_OUTPUTS if self.graph.select_of(n) else self.graph.nodes[n].outputs)
            outputs = outs
        self.outputs = dict(outputs)
        if slo is not None and not isinstance(slo, SLO):
            raise ConfigError(f"pipeline {name!r}: slo must be an ss.SLO")
        self.slo = slo
        # An example may be costly to make (speech synthesised by a tool):
        # a function is called, and its result checked, when first needed.
        self._example_of = example if callable(example) else None
        self._example = None if callable(example) else self._check_example(example)
        self.fallback = self._check_fallback(fallback)
        self._check_acyclic()
        self._check_store_stages(roots)
        for sel in self.graph.selects:
            if sel.context is not None and (sel.context not in self.inputs
                                            or self.inputs[sel.context].dtype != "string"):
                raise ConfigError(f"pipeline {name!r}: selection {sel.name!r} keys its state on input "
                                  f"{sel.context!r}, which must be a string input: pass inputs={{..., "
                                  f"{sel.context!r}: ss.Tensor('string', (-1,))}}")
        self.pools = list(pools)
        for pool in self.pools:
            if not isinstance(pool, Pool):
                raise ConfigError(f"pipeline {name!r}: pools takes ss.Pool objects, got {pool!r}")
        prefixes = [pool.prefix for pool in self.pools]
        if len(set(prefixes)) != len(prefixes):
            raise ConfigError(f"pipeline {name!r} declares a pool prefix twice")
        if seed is not None and not isinstance(seed, Mapping):
            raise ConfigError(f"pipeline {name!r}: seed maps store keys to files, got {seed!r}")
        self.seeds = [declare_seed(k, v, f"pipeline {name!r}") for k, v in (seed or {}).items()]
        SEEDS.update((s.key, s) for s in self.seeds)

    def _check_store_stages(self, roots: list[Component]) -> None:
        """A watching stage is the pipeline's root (at most one), and the
        pipeline's inputs are the trigger's; an affinity input of a root
        stage is one of the pipeline's string inputs."""
        watching = [c for c in self.graph.nodes.values() if c.watch is not None]
        if len(watching) > 1:
            raise ConfigError(f"pipeline {self.name!r}: only one stage may watch a prefix "
                              f"({', '.join(c.name for c in watching)} do)")
        if watching:
            w = watching[0]
            if w not in roots:
                raise ConfigError(f"pipeline {self.name!r}: {w.name} watches {w.watch} but is not the pipeline's root")
            bad = [k for k, v in self.inputs.items() if k not in TRIGGER_INPUTS or TRIGGER_INPUTS[k].dtype != v.dtype]
            if bad:
                raise ConfigError(f"pipeline {self.name!r} is invoked by puts under {w.watch}: its inputs must be "
                                  f"among {', '.join(TRIGGER_INPUTS)} with their dtypes, not {', '.join(bad)}")
        for c in roots:
            if c.affinity is not None:
                _check_affinity_input(f"pipeline {self.name!r}: {c.name}", c.affinity, self.inputs)

    def _check_fallback(self, fallback: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The answer for one row (Clipper's default output), per declared
        output: returned with the header `x-slipstream-fallback` instead of a
        429 (refused) or 504 (out of time)."""
        if fallback is None:
            return None
        if not self.outputs or set(fallback) != set(self.outputs):
            raise ConfigError(
                f"pipeline {self.name!r}: a fallback needs declared outputs and must give every one of them "
                f"(outputs: {sorted(self.outputs)}, fallback: {sorted(fallback)})"
            )
        out = {}
        for k, v in fallback.items():
            spec = self.outputs[k]
            a = np.asarray(v, dtype=object if spec.dtype in VAR_DTYPES else spec.dtype)
            want = spec.shape[1:]
            if a.ndim != len(want) or any(w >= 0 and w != g for w, g in zip(want, a.shape, strict=True)):
                raise ConfigError(f"pipeline {self.name!r}: fallback {k!r} must be one row of shape {list(want)}, "
                                  f"got {list(a.shape)}")
            out[k] = a.tolist()
        return out

    @property
    def example(self) -> dict[str, Any] | None:
        """One realistic request, as checked lists (None: not declared)."""
        if self._example is None and self._example_of is not None:
            self._example = self._check_example(self._example_of())
            self._example_of = None
        return self._example

    def _check_example(self, example: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """One realistic request (input name -> nested list with a leading row
        dimension): used by `slipstream profile` and as `slipstream bench`'s
        default body."""
        if example is None:
            return None
        missing = set(self.inputs) - set(example)
        extra = set(example) - set(self.inputs)
        if missing or extra:
            raise ConfigError(
                f"pipeline {self.name!r}: example must give exactly the inputs "
                f"{sorted(self.inputs)} (missing {sorted(missing)}, unexpected {sorted(extra)})"
            )
        out = {}
        for k, v in example.items():
            a = np.asarray(v, dtype=object if self.inputs[k].dtype in VAR_DTYPES else self.inputs[k].dtype)
            if a.ndim != len(self.inputs[k].shape):
                raise ConfigError(f"pipeline {self.name!r}: example input {k!r} has {a.ndim} dims, "
                                  f"the declared shape has {len(self.inputs[k].shape)}")
            out[k] = a.tolist()
        return out

    def _example_json(self) -> dict[str, Any] | None:
        """The example as the pipeline API's JSON `inputs` (bytes as base64)."""
        if self.example is None:
            return None

        def conv(x: Any) -> Any:
            if isinstance(x, list):
                return [conv(v) for v in x]
            if isinstance(x, (bytes, bytearray)):
                return base64.b64encode(bytes(x)).decode()
            return x

        return {k: conv(v) for k, v in self.example.items()}

    def example_batch(self, rows: int = 1) -> dict[str, np.ndarray]:
        """`rows` requests' worth of inputs: the declared example repeated, or
        synthetic values of the declared dtypes and shapes."""
        out: dict[str, np.ndarray] = {}
        rng = np.random.default_rng(0)
        for k, spec in self.inputs.items():
            if self.example is not None:
                one = np.asarray(self.example[k], dtype=object if spec.dtype in VAR_DTYPES else spec.dtype)
            else:
                shape = [1] + [d if d >= 0 else 8 for d in spec.shape[1:]]
                if spec.dtype == "string":
                    one = np.full(shape, "an example request", dtype=object)
                elif spec.dtype == "bytes":
                    one = np.full(shape, b"example", dtype=object)
                elif spec.dtype == "bool":
                    one = np.zeros(shape, dtype=bool)
                elif spec.dtype.startswith(("int", "uint")):
                    one = rng.integers(0, 10, size=shape).astype(spec.dtype)
                else:
                    one = rng.standard_normal(shape).astype(spec.dtype)
            out[k] = np.concatenate([one] * rows, axis=0)
        return out

    def _check_acyclic(self) -> None:
        state: dict[str, int] = {}

        def visit(n: str) -> None:
            if state.get(n) == 1:
                raise ConfigError(f"pipeline {self.name!r} has a cycle through {n!r}")
            if state.get(n) == 2:
                return
            state[n] = 1
            for a, b in self.graph.edges:
                if a == n:
                    visit(b)
            state[n] = 2

        for n in self.graph.nodes:
            visit(n)

    @property
    def watch(self) -> str | None:
        """The store prefix whose puts invoke this pipeline (its root watches
        it), or None for a pipeline that requests invoke."""
        return next((c.watch for c in self.graph.nodes.values() if c.watch is not None), None)

    def stage(self, name: str) -> Component:
        try:
            return self.graph.nodes[name]
        except KeyError:
            raise ConfigError(f"pipeline {self.name!r} has no stage {name!r}") from None

    def to_spec(self) -> dict[str, Any]:
        """The JSON-shaped description the node reads."""
        return {
            "name": self.name,
            "inputs": {k: v.to_json() for k, v in self.inputs.items()},
            "outputs": {k: v.to_json() for k, v in self.outputs.items()},
            "slo": None if self.slo is None else {"p99_ms": self.slo.p99_ms, "max_miss_rate": self.slo.max_miss_rate,
                                                  "drop_late": self.slo.drop_late},
            "example": self._example_json(),
            "fallback": self.fallback,
            "stages": [
                {
                    "name": n,
                    "component": f"{c.cls.__module__}.{c.cls.__qualname__}",
                    "parents": self.graph.parents(n),
                    "replicas": int(c.replicas),
                    "min_replicas": int(c.min_replicas),
                    "max_replicas": int(c.max_replicas),
                    "threads": int(c.threads),
                    "max_batch_size": int(c.max_batch_size),
                    "needs": dict(c.needs),
                    "watch": c.watch,
                    "affinity": c.affinity,
                    "device": c.device,
                    **({"devices": list(c.devices)} if c.devices else {}),
                    "concurrency": int(c.concurrency or 1),
                    "cache": None if c.cache is None else c.cache.to_json(),
                    "length_input": c.length_of,
                    "max_batch_tokens": c.max_batch_tokens,
                    "elastic_ms": c.elastic_ms,
                }
                for n, c in self.graph.nodes.items()
            ],
            "selects": [sel.to_json() for sel in self.graph.selects],
        }

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={list(self.graph.nodes)})"
