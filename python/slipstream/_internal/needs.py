"""A replica's component instance and the store objects it was built from.

A component that declares ``needs={"encoder": "/models/minilm"}`` is
constructed with the key's latest version (``encoder=<ss.Object>``) before
its worker reports ready. When a new version of a needed key is put, a
background thread builds a new instance *beside* the old one, which keeps
serving meanwhile; the worker switches to the new instance between batches
(never during one), so a model update costs no failed or paused requests.
A construction that fails is logged and the old instance stays.

``ss.loaded_versions()`` tells the component (or a test through it) which
versions the serving instance was built from.

Outside a worker (``slipstream profile``, benchmarks that construct a
component in-process), ``resolve`` finds the objects: from the store of
the node named by ``$SLIPSTREAM_NODE_URL`` when it is set, else from the
files the app seeds the keys with, so an app that seeds its models
profiles offline.

A component is what ``api`` declares, and ``api.Component.instantiate``
calls ``resolve`` here; so this module knows a component only by what it
uses of one (``NeedsOwner``), and the seed files by their registry
(``seeds.py``), never by importing ``api``.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import traceback
from collections.abc import Mapping
from typing import Any, Protocol

from slipstream._internal.errors import ConfigError, StoreError, StoreGone, StoreNotFound, StoreUnavailable
from slipstream._internal.seeds import SEEDS
from slipstream._internal.store import Object, Store, Version, default_store, map_blob

_loaded: dict[str, int] = {}


class NeedsOwner(Protocol):
    """What this module uses of a component (``api.Component``)."""

    name: str
    #: Constructor argument name -> store key.
    needs: dict[str, str]

    def instantiate(self, objects: Mapping[str, Any] | None = None) -> Any: ...


def loaded_versions() -> dict[str, int]:
    """In a worker: the store version of each of its component's ``needs``
    that the instance serving now was built from, ``{name: version}``
    (empty elsewhere, or without needs)."""
    return dict(_loaded)


def fetch(store: Store, comp: NeedsOwner) -> dict[str, Object]:
    """The latest version of each object ``comp`` needs, by argument name."""
    out = {}
    for name, key in comp.needs.items():
        try:
            out[name] = store.get(key)
        except StoreNotFound:
            raise StoreNotFound(f"{comp.name} needs {name}={key}, which has no live version in the store: "
                                "seed it (ss.Pipeline(seed=...)) or put it before the pipeline starts",
                                status=404, key=key) from None
    return out


def resolve(comp: NeedsOwner) -> dict[str, Object]:
    """``comp``'s needs outside a worker: from the store at
    ``$SLIPSTREAM_NODE_URL`` if set, else mapped from the app's seed files
    (as version 0: not a store version)."""
    if os.environ.get("SLIPSTREAM_NODE_URL"):
        return fetch(default_store(), comp)
    out = {}
    for name, key in comp.needs.items():
        seed = SEEDS.get(key)
        try:
            buf = None if seed is None else map_blob(seed.path, os.path.getsize(seed.path))
        except OSError:  # gone since the app declared it
            buf = None
        if seed is None or buf is None:
            raise ConfigError(f"{comp.name} needs {name}={key}: outside a worker it is read from the app's seed "
                              "file for the key (Pipeline(seed=...)), or from a running node's store when "
                              "SLIPSTREAM_NODE_URL names one; neither is there")
        meta = Version(key, 0, os.path.getmtime(seed.path), len(buf), seed.content_type)
        out[name] = Object(meta, buf, seed.path)
    return out


class Replica:
    """The instance a worker serves with, and its replacement in the making.

    ``current()`` (called before each batch) returns the instance to run
    the batch with, switching to a newly built one if there is one."""

    #: How long one watch request waits for a change (ms).
    WATCH_MS = 30_000

    def __init__(self, comp: NeedsOwner, label: str, store: Store | None = None):
        self.comp = comp
        self.label = label
        self._lock = threading.Lock()
        self._pending: tuple[Any, dict[str, Object]] | None = None
        self._changes: queue.Queue[tuple[str, int] | None] = queue.Queue()  # None: stop
        self._stop = threading.Event()
        if not comp.needs:
            self.store = None
            self.instance = comp.instantiate()
            self._objects: dict[str, Object] = {}
            _publish({})
            return
        self.store = store or default_store()
        # Cursors first: a put after them reaches the watchers even if it
        # lands before the first fetch (the version check skips repeats).
        cursors = {name: self.store.cursor(key) for name, key in comp.needs.items()}
        self._objects = fetch(self.store, comp)
        self.instance = comp.instantiate(self._objects)
        _publish(self._objects)
        # Written by the builder thread only: the newest objects built with and versions tried.
        self._built = dict(self._objects)
        self._tried = {name: o.version for name, o in self._objects.items()}
        for name, key in comp.needs.items():
            threading.Thread(target=self._watch, args=(name, key, cursors[name]), daemon=True,
                             name=f"slipstream-needs-watch {name}").start()
        threading.Thread(target=self._build_loop, daemon=True, name="slipstream-needs-build").start()

    def current(self) -> Any:
        if self._pending is None:  # the common case, without the lock
            return self.instance
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return self.instance
        instance, objects = pending
        was = {n: o.version for n, o in self._objects.items()}
        now = {n: o.version for n, o in objects.items()}
        self.instance, self._objects = instance, objects
        _publish(objects)
        moves = ", ".join(f"{n} {self.comp.needs[n]} v{was.get(n)} -> v{v}" for n, v in now.items() if was.get(n) != v)
        self._log(f"now serving with {moves}")
        return instance

    def close(self) -> None:
        """Stop watching (a watch in flight ends within ``WATCH_MS``)."""
        self._stop.set()
        self._changes.put(None)

    def _log(self, msg: str) -> None:
        sys.stderr.write(f"slipstream worker {self.label}: {msg}\n")

    def _watch(self, name: str, key: str, since: int) -> None:
        """Report new versions of ``key`` (puts, not deletes) to the builder."""
        assert self.store is not None
        backoff = 0.0
        while not self._stop.is_set():
            try:
                if backoff:
                    self._stop.wait(backoff)
                try:
                    seq, changes = self.store.watch(key, since=since, timeout_ms=self.WATCH_MS)
                except StoreGone:
                    # Changes were missed: restart from now and check the latest version.
                    since = self.store.cursor(key)
                    latest = self.store.meta(key)
                    if not latest.deleted:
                        self._changes.put((name, latest.version))
                    continue
            except StoreError as e:
                if not backoff:
                    self._log(f"watching {key} failed ({e}); retrying")
                backoff = min(max(backoff * 2, 0.5), 30.0)
                continue
            if backoff:
                self._log(f"watching {key} again")
            backoff = 0.0
            since = seq
            for c in changes:
                if c.key == key and not c.deleted:  # the prefix also matches longer keys
                    self._changes.put((name, c.version))

    def _build_loop(self) -> None:
        while True:
            newest: dict[str, int] = {}
            item = self._changes.get()
            while item is not None:  # take every change reported so far: one build for all
                newest[item[0]] = max(item[1], newest.get(item[0], 0))
                try:
                    item = self._changes.get_nowait()
                except queue.Empty:
                    break
            if self._stop.is_set():
                return
            todo = [n for n, v in newest.items() if v > self._tried[n]]
            if todo:
                self._build(todo, newest)

    def _build(self, todo: list[str], newest: dict[str, int]) -> None:
        assert self.store is not None
        objects = dict(self._built)
        for name in list(todo):
            key = self.comp.needs[name]
            try:
                objects[name] = self.store.get(key)
            except StoreUnavailable as e:  # try again in a while
                self._log(f"cannot read {key} v{newest[name]} yet ({e}); retrying in 1 s")
                self._stop.wait(1.0)
                for n in todo:
                    self._changes.put((n, newest[n]))
                return
            except StoreError as e:  # deleted or removed since: nothing newer to build with
                self._log(f"cannot read {key} v{newest[name]} ({e}); keeping v{self._built[name].version}")
                self._tried[name] = newest[name]
                todo.remove(name)
        if not todo:
            return
        for name in todo:
            self._tried[name] = max(newest[name], objects[name].version)
        versions = ", ".join(f"{n} v{objects[n].version}" for n in todo)
        self._log(f"building a new instance with {versions} beside the serving one")
        try:
            instance = self.comp.instantiate(objects)
        except Exception:
            self._log(f"building with {versions} failed; the serving instance stays:\n{traceback.format_exc()}")
            return
        self._built = objects
        if not self._rolled_out(todo, objects):
            return
        with self._lock:
            self._pending = (instance, objects)

    def _rolled_out(self, todo: list[str], objects: dict[str, Object]) -> bool:
        """The update's second phase waits for its first: the new instance
        serves only once every node that runs a stage needing the updated
        keys holds their new versions, so no node serves a version while
        another still cannot (a model update is two-phase across a
        cluster; on one machine this passes at once). False: stopping, or
        the instance is stale (a newer version came, or this one went)."""
        assert self.store is not None
        waiting: list[str] | None = None
        for name in todo:
            key, version = self.comp.needs[name], objects[name].version
            while not self._stop.is_set():
                if not self._changes.empty():
                    self._log(f"{key} changed again while v{version} rolled out; building with the newer one")
                    return False
                try:
                    left = self.store.rollout(key, version, timeout_ms=1000)
                except StoreNotFound:
                    self._log(f"{key} v{version} is gone from the store; the serving instance stays")
                    return False
                except StoreError as e:  # e.g. a node restarting: ask again
                    self._log(f"cannot ask whether every node holds {key} v{version} ({e}); asking again in 1 s")
                    self._stop.wait(1.0)
                    continue
                if not left:
                    break
                if left != waiting:
                    self._log(f"built with {key} v{version}; waiting for {', '.join(left)} to hold it too "
                              "before switching")
                    waiting = left
        if self._stop.is_set():
            return False
        if waiting:
            self._log("every node that runs it holds the new version now; switching")
        return True


def _publish(objects: dict[str, Object]) -> None:
    global _loaded
    _loaded = {name: o.version for name, o in objects.items()}
