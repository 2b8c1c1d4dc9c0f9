"""When to prefetch token embeddings, and how many, from what the searches
measure (ESPN's prefetcher, made to decide for itself).

ESPN (Shrestha et al., ISMM 2024) starts reading the candidates' token
embeddings after a fixed fraction of the IVF probes, so that the reads run
while the remaining probes do. Whether that pays depends on three
quantities this machine, corpus and index decide, not a constant:

- the time the remaining probes take (the window the reads can hide in):
  ``(nprobe - step) x`` the time a list takes to probe;
- how many passages the device can read in that window: the window x the
  measured bandwidth / the bytes of a passage (compressed passages are a
  seventh of fp16 ones: seven times as many fit);
- how many of the passages the partial top list names are still among the
  final targets (the *precision* of the prefetch at that step): an early
  step leaves a longer window but guesses worse.

Every search measures the per-list probe time and, at a few checkpoints
(1/8, 1/4 and 1/2 of the lists), how many of the final targets the partial
top list already held; :class:`PrefetchPolicy` keeps moving averages and
:meth:`PrefetchPolicy.plan` picks the step that hides the most read time a
query, ``precision x reads that fit the window (at most the depth) x time
a read``, and as many passages as the window brings. When the best step would hide less than one
passage's read, it does not prefetch, and says why (on the 2,000-passage
slice with fp16 tokens the probes take well under a millisecond and a
passage's read about a tenth of one: the device, not the policy, makes a
prefetch pointless there).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

#: Fractions of the lists at which the partial top list is compared with the final targets.
CHECKPOINTS = (0.125, 0.25, 0.5)
#: Searches measured before the policy trusts its averages (until then: ``fallback_at``, bandwidth-sized).
MIN_SEARCHES = 8


@dataclass(frozen=True)
class PrefetchPlan:
    """``step``: lists probed before the prefetch (0: no prefetch); ``k``:
    passages a query prefetches (None: as many as the bandwidth brings in the
    remaining probes' time, measured in the search itself); ``hidden_s``:
    read time a query the plan expects to hide; ``why``: in words."""

    step: int
    k: int | None
    hidden_s: float
    why: str


def marks(nprobe: int) -> list[tuple[float, int]]:
    """The checkpoints (fraction, lists probed) that fall strictly inside ``nprobe`` lists."""
    out: dict[int, float] = {}
    for f in CHECKPOINTS:
        step = max(1, math.ceil(f * nprobe))
        if step < nprobe and step not in out:
            out[step] = f
    return [(f, s) for s, f in sorted(out.items())]


class PrefetchPolicy:
    """Moving averages of the per-list probe time and of the prefetch's
    precision at each checkpoint, and the plan they imply. Thread-safe."""

    def __init__(self, fallback_at: float = 0.25, alpha: float = 0.1):
        if not 0 < fallback_at < 1 or not 0 < alpha <= 1:
            raise ValueError(f"fallback_at must be in (0, 1) and alpha in (0, 1], got {fallback_at}, {alpha}")
        self.fallback_at, self.alpha = fallback_at, alpha
        self.lock = threading.Lock()
        self.searches = 0
        self.per_list_s: float | None = None
        self.precision: dict[float, float] = {}

    def observe(self, per_list_s: float, precision: dict[float, float]) -> None:
        """One search: seconds a list took to probe, and for each checkpoint
        fraction the share of its final targets that the partial top list held."""
        if not per_list_s >= 0:
            return
        with self.lock:
            a = self.alpha if self.searches >= MIN_SEARCHES else 1.0 / (self.searches + 1)
            self.searches += 1
            self.per_list_s = per_list_s if self.per_list_s is None else (1 - a) * self.per_list_s + a * per_list_s
            for f, p in precision.items():
                old = self.precision.get(f)
                self.precision[f] = p if old is None else (1 - a) * old + a * p

    def plan(self, nprobe: int, depth: int, bandwidth: float, passage_bytes: float) -> PrefetchPlan:
        """The step and count for a search of ``nprobe`` lists re-ranking
        ``depth`` passages of ``passage_bytes`` each (mean) from a device
        giving ``bandwidth`` bytes/s to this search."""
        if nprobe < 2 or depth < 1:
            return PrefetchPlan(0, 0, 0.0, "off: nothing to overlap (one list probed or nothing re-ranked)")
        if not (bandwidth > 0 and passage_bytes > 0) or math.isinf(bandwidth):
            return PrefetchPlan(0, 0, 0.0, "off: reads are immediate (the rows are in memory)")
        with self.lock:
            searches, per_list, prec = self.searches, self.per_list_s, dict(self.precision)
        if searches < MIN_SEARCHES or per_list is None:
            step = min(nprobe - 1, max(1, math.ceil(self.fallback_at * nprobe)))
            return PrefetchPlan(step, None, 0.0, f"measuring ({searches} of {MIN_SEARCHES} searches): "
                                                 f"after {self.fallback_at:.0%} of the lists, bandwidth-sized")
        read_s = passage_bytes / bandwidth
        best: tuple[float, int, int, float, float] | None = None  # hidden, step, k, fraction, window
        for f, step in marks(nprobe):
            p = prec.get(f)
            if p is None:
                continue
            window = (nprobe - step) * per_list
            k = min(depth, int(window / read_s))
            hidden = p * k * read_s  # the whole reads that fit the window, the share of them still wanted
            if best is None or hidden > best[0]:
                best = (hidden, step, k, f, window)
        if best is None:
            return PrefetchPlan(0, 0, 0.0, "off: no checkpoint measured for this many lists")
        hidden, step, k, f, window = best
        if k < 1 or hidden < read_s:
            return PrefetchPlan(0, 0, hidden, f"off: the probes after {f:.0%} of the lists take {window * 1e3:.2f} ms "
                                              f"and one passage's read {read_s * 1e3:.2f} ms: less than one read to "
                                              "hide, so the device makes a prefetch pointless here")
        return PrefetchPlan(step, k, hidden, f"after {step} of {nprobe} lists ({f:.0%}): {k} passages "
                                             f"(precision {prec[f]:.2f}) hide about {hidden * 1e3:.2f} ms of reads "
                                             f"a query (probes left {window * 1e3:.2f} ms, a read {read_s * 1e3:.3f} ms)")

    def state(self) -> dict[str, object]:
        with self.lock:
            return {"searches": self.searches, "per_list_ms": None if self.per_list_s is None else self.per_list_s * 1e3,
                    "precision": {f"{f:g}": round(p, 4) for f, p in sorted(self.precision.items())}}
