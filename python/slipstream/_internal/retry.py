"""Retries that do not become storms: the clients' policy for 429 and 503.

A refusal is cheap for the node, but a client that comes straight back
turns it into a storm: each refused request returns at once, the node
spends its CPU refusing, and goodput collapses. So ``ss.Client`` and
``ss.AsyncClient`` retry only what the node asks to be retried later
(``Overloaded``, 429; ``Unavailable``, 503, when the node is draining or
its memory is full, not when a worker died: see ``NOT_RETRIED``), and only:

- **after the node's wait**: no sooner than its ``Retry-After`` (the
  node's predicted drain time, in ms in ``x-slipstream-retry-after-ms``),
  plus full jitter (a random wait in ``[0, backoff]``, the backoff doubling
  per attempt; AWS's "exponential backoff and jitter"), so that clients
  refused together do not return together;
- **within the call's deadline**: a retry whose wait would pass the
  deadline is not made, the refusal is raised instead; a retry carries the
  deadline that is left;
- **within a budget**: every call puts ``ratio`` of a token into a bucket
  (at most ``burst`` tokens), every retry takes one out, so retries stay
  near ``ratio`` of calls however hard the node pushes back (gRPC's retry
  throttling and Finagle's retry budget; Google SRE's "Handling
  Overload"). The bucket starts full, so a client that makes few calls
  can still retry a few times.

Nothing else retries: the node never retries between its own stages on a
refusal (admission is decided once, at the edge), and other errors
(``DeadlineExceeded``, ``BadRequest``...) are raised as they come.

``Client(url, retry=None)`` turns it off; ``RetryPolicy(...)`` tunes it.
``client.retry_stats`` counts calls, retries and retries refused by the
budget.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from slipstream._internal.errors import BadRequest, Overloaded, RequestError, Unavailable

#: 503 kinds a client does not retry: ``unavailable`` (a worker died with
#: the request: the node has retried it on another replica already, and a
#: request that kills its worker must not be sent again and again) and
#: ``unreachable`` (no node answered: not a refusal).
NOT_RETRIED = frozenset({"unavailable", "unreachable"})


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries 429 and 503 (see the module doc).

    ``attempts``: tries in all, the first included. ``backoff_s``: the first
    retry's jitter range, doubling per attempt up to ``max_backoff_s``.
    ``ratio``: retries per call the budget allows over time; ``burst``: the
    bucket's size (and its start)."""

    attempts: int = 3
    backoff_s: float = 0.005
    max_backoff_s: float = 1.0
    ratio: float = 0.1
    burst: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise BadRequest(f"attempts is at least 1, got {self.attempts}", status=None)
        for name in ("backoff_s", "max_backoff_s", "ratio", "burst"):
            v = getattr(self, name)
            if not (v >= 0 and v != float("inf")):
                raise BadRequest(f"{name} is a finite number >= 0, got {v!r}", status=None)


@dataclass
class RetryStats:
    """What a client's retry policy did: ``calls`` made, ``retries`` sent,
    ``throttled`` (retries the budget refused) and ``gave_up`` (refusals
    raised because the deadline or the attempts ran out)."""

    calls: int = 0
    retries: int = 0
    throttled: int = 0
    gave_up: int = 0


@dataclass
class Retrier:
    """One client's retry state: its policy, its token bucket and its counts.
    Thread-safe (the synchronous client is shared by threads)."""

    policy: RetryPolicy = field(default_factory=RetryPolicy)
    stats: RetryStats = field(default_factory=RetryStats)
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._tokens = self.policy.burst
        self._lock = threading.Lock()

    def called(self) -> None:
        """A call began: count it and add its share to the budget."""
        with self._lock:
            self.stats.calls += 1
            self._tokens = min(self.policy.burst, self._tokens + self.policy.ratio)

    def wait_before(self, err: RequestError, attempt: int, remaining_s: float | None) -> float | None:
        """How long to wait before retry number ``attempt`` (1: the first)
        after ``err``, or None to raise ``err`` instead: not a kind to
        retry, out of attempts, out of deadline, or out of budget."""
        if not isinstance(err, (Overloaded, Unavailable)) or err.kind in NOT_RETRIED:
            return None
        p = self.policy
        if attempt >= p.attempts:
            self._gave_up()
            return None
        jitter = self.rng.uniform(0.0, min(p.max_backoff_s, p.backoff_s * 2 ** (attempt - 1)))
        wait = max(0.0, err.retry_after or 0.0) + jitter
        if remaining_s is not None and wait >= remaining_s:
            self._gave_up()
            return None
        with self._lock:
            if self._tokens < 1.0:
                self.stats.throttled += 1
                return None
            self._tokens -= 1.0
            self.stats.retries += 1
        return wait

    def _gave_up(self) -> None:
        with self._lock:
            self.stats.gave_up += 1


def as_retrier(retry: RetryPolicy | None | bool) -> Retrier | None:
    """A client's ``retry`` argument as its retry state: the default policy
    (True), none (None or False), or the policy given."""
    if retry is None or retry is False:
        return None
    if retry is True:
        return Retrier()
    if not isinstance(retry, RetryPolicy):
        raise BadRequest(f"retry is a RetryPolicy, True or None, got {type(retry).__name__}", status=None)
    return Retrier(retry)


def remaining(deadline_at: float | None) -> float | None:
    """Seconds left until ``deadline_at`` (a ``time.monotonic()`` instant), or None."""
    return None if deadline_at is None else deadline_at - time.monotonic()
