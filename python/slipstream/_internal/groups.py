"""The affinity-group object cache behind ``ss.store.group(key)``.

A pool's affinity expression maps keys to groups (a document's chunks and
embeddings, a user's history, ...), and the node sends the requests of one
group to the same replica. This cache is what makes that pay: the first
request for a group loads all of the group's live objects, later ones are
memory hits. A group is the unit of loading and of eviction (least
recently used first, while the cached values exceed ``SLIPSTREAM_CACHE_MB``,
default 1024), so a group is never half-cached.

Freshness: a long poll on the prefix of each pool the cache has loaded
from drops a group as soon as any of its keys changes (the next call
reloads it), and a load that a change overtook is not cached. A key outside
every affinity group is a group of its own.

The pools come from the app (the worker passes its pipelines' ``ss.Pool``
declarations to ``configure``); elsewhere from the node (``GET /v1/store``).
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slipstream._internal.api import Pool
from slipstream._internal.errors import StoreError, StoreGone, StoreNotFound
from slipstream._internal.keys import check_key
from slipstream._internal.store import Object, Store, default_store

#: Keys listed per group load: the most the node's key listing returns.
MAX_POOL_KEYS = 100_000


@dataclass(frozen=True)
class _Rule:
    prefix: str
    pattern: re.Pattern[str] | None


#: A group: (pool prefix, capture) for an affinity group, ("", key) for a
#: key outside every affinity group.
GroupId = tuple[str, str]


@dataclass
class _Load:
    """A load in progress; a change to its group meanwhile makes it stale."""

    stale: bool = False


@dataclass
class _Group:
    objects: dict[str, Object]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(o.size for o in self.objects.values())


class GroupCache:
    """Affinity groups of store objects, loaded, kept fresh and evicted together. Thread-safe."""

    #: How long one watch request waits for a change (ms).
    WATCH_MS = 30_000

    def __init__(self, store: Callable[[], Store] = default_store, budget_bytes: int | None = None):
        self._store = store
        self._budget = budget_bytes
        self._lock = threading.Lock()
        self._rules: list[_Rule] | None = None
        self._groups: OrderedDict[GroupId, _Group] = OrderedDict()
        self._loads: dict[GroupId, list[_Load]] = {}
        self._watched: set[str] = set()
        self._bytes = 0
        self._counts = {"groups_loaded": 0, "hits": 0, "evictions": 0}
        self._stop = threading.Event()

    def configure(self, pools: Iterable[Pool | Mapping[str, Any]]) -> None:
        """The pools to group keys by (``ss.Pool`` objects or the node's JSON)."""
        rules = []
        for p in pools:
            prefix, affinity = (p.prefix, p.affinity) if isinstance(p, Pool) else (p["prefix"], p.get("affinity"))
            try:
                pattern = None if affinity is None else re.compile(affinity)
            except re.error as e:
                raise StoreError(f"pool {prefix}: affinity {affinity!r} does not compile in Python: {e}") from None
            rules.append(_Rule(prefix, pattern))
        rules.sort(key=lambda r: len(r.prefix), reverse=True)
        with self._lock:
            self._rules = rules

    def _rules_now(self) -> list[_Rule]:
        if self._rules is None:
            self.configure(self._store().stats().get("pools", []))
        assert self._rules is not None
        return self._rules

    def _budget_bytes(self) -> int:
        if self._budget is None:
            try:
                mb = float(os.environ.get("SLIPSTREAM_CACHE_MB", "1024"))
            except ValueError:
                mb = 1024.0
            self._budget = int(mb * (1 << 20))
        return self._budget

    def group_of(self, key: str) -> tuple[GroupId, str]:
        """``key``'s group, and the prefix of the pool it belongs to."""
        rule = next((r for r in self._rules_now() if key.startswith(r.prefix)), None)
        prefix = rule.prefix if rule is not None else "/"
        if rule is not None and rule.pattern is not None:
            m = rule.pattern.search(key)
            if m is not None and m.group(1) is not None:
                return (rule.prefix, m.group(1)), prefix
        return ("", key), prefix

    def group(self, key: str) -> dict[str, Object]:
        """All live objects of ``key``'s affinity group, by key (key order)."""
        check_key(key)
        gid, prefix = self.group_of(key)
        with self._lock:
            hit = self._groups.get(gid)
            if hit is not None:
                self._groups.move_to_end(gid)
                self._counts["hits"] += 1
                return dict(hit.objects)
            load = _Load()
            self._loads.setdefault(gid, []).append(load)
        try:
            self._ensure_watch(prefix)
            objects = self._load(gid, prefix, key)
        finally:
            with self._lock:
                self._loads[gid].remove(load)
                if not self._loads[gid]:
                    del self._loads[gid]
        with self._lock:
            self._counts["groups_loaded"] += 1
            if not load.stale:
                self._insert(gid, _Group(objects))
        return dict(objects)

    def _load(self, gid: GroupId, prefix: str, key: str) -> dict[str, Object]:
        store = self._store()
        if gid[0] == "":
            names = [key]
        else:
            listing = store.keys(prefix, limit=MAX_POOL_KEYS)
            if listing.truncated:
                raise StoreError(f"the affinity group of {key}: pool {prefix} has more than {MAX_POOL_KEYS} live "
                                 "keys, more than one listing returns; use a narrower pool", key=key)
            names = [v.key for v in listing if self.group_of(v.key)[0] == gid]
        out = {}
        for k in names:
            try:
                out[k] = store.get(k)
            except StoreNotFound:  # deleted since the listing
                continue
        return out

    def _insert(self, gid: GroupId, g: _Group) -> None:
        old = self._groups.pop(gid, None)
        if old is not None:
            self._bytes -= old.nbytes
        self._groups[gid] = g
        self._bytes += g.nbytes
        budget = self._budget_bytes()
        while self._bytes > budget and len(self._groups) > 1:
            _, evicted = self._groups.popitem(last=False)
            self._bytes -= evicted.nbytes
            self._counts["evictions"] += 1

    def invalidate(self, key: str) -> None:
        """Forget ``key``'s group (its next use reloads it)."""
        gid, _ = self.group_of(key)
        with self._lock:
            self._drop(gid)

    def _drop(self, gid: GroupId) -> None:
        g = self._groups.pop(gid, None)
        if g is not None:
            self._bytes -= g.nbytes
        for load in self._loads.get(gid, []):
            load.stale = True

    def clear(self) -> None:
        with self._lock:
            for gid in list(self._groups) + list(self._loads):
                self._drop(gid)

    def close(self) -> None:
        """Stop following the change feed (a watch in flight ends within ``WATCH_MS``)."""
        self._stop.set()

    def stats(self) -> dict[str, int]:
        """``groups_loaded`` (loads, hits excepted), ``hits``, ``evictions``
        (for space), and what is cached now: ``groups`` and ``bytes``."""
        with self._lock:
            return {**self._counts, "groups": len(self._groups), "bytes": self._bytes}

    # -- freshness

    def _ensure_watch(self, prefix: str) -> None:
        """Follow the change feed under ``prefix`` from now on (the cursor is
        taken before the caller lists and reads, so no change slips by)."""
        with self._lock:
            if prefix in self._watched:
                return
            self._watched.add(prefix)
        try:
            since = self._store().cursor(prefix)
        except BaseException:
            with self._lock:
                self._watched.discard(prefix)
            raise
        threading.Thread(target=self._follow, args=(prefix, since), name=f"slipstream-cache-watch {prefix}",
                         daemon=True).start()

    def _follow(self, prefix: str, since: int) -> None:
        store = self._store()
        backoff = 0.0
        while not self._stop.is_set():
            try:
                if backoff:
                    self._stop.wait(backoff)
                seq, changes = store.watch(prefix, since=since, timeout_ms=self.WATCH_MS)
            except StoreGone:
                # Changes were missed: nothing cached can be trusted.
                self.clear()
                try:
                    since = store.cursor(prefix)
                except StoreError as e:
                    backoff = _log_retry(prefix, e, backoff)
                continue
            except StoreError as e:
                backoff = _log_retry(prefix, e, backoff)
                continue
            backoff = 0.0
            since = seq
            for c in changes:
                self.invalidate(c.key)


def _log_retry(prefix: str, e: StoreError, backoff: float) -> float:
    if not backoff:
        print(f"slipstream: object cache: watching {prefix} failed ({e}); cached groups may be stale until it "
              "answers again", file=sys.stderr)
    return min(max(backoff * 2, 0.5), 30.0)


_cache = GroupCache()


def group(key: str) -> dict[str, Object]:
    """All live objects of ``key``'s affinity group (``ss.Pool(affinity=...)``),
    by key: loaded together on first use, then served from this process's
    cache until one of them changes or the group is evicted."""
    return _cache.group(key)


def cache_stats() -> dict[str, int]:
    """This process's group cache counters: ``groups_loaded``, ``hits``,
    ``evictions``, ``groups``, ``bytes``."""
    return _cache.stats()


def configure(pools: Iterable[Pool | Mapping[str, Any]]) -> None:
    """Group keys by these pools (the worker passes its app's)."""
    _cache.configure(pools)
