"""The clients' retry policy (python/slipstream/_internal/retry.py): what it
retries, how long it waits, and the budget that keeps retries near a tenth
of calls however hard the node pushes back."""

from __future__ import annotations

import random

import pytest
from slipstream._internal.errors import (
    ArenaFull,
    BadRequest,
    DeadlineExceeded,
    Overloaded,
    ShuttingDown,
    Unavailable,
    Unreachable,
)
from slipstream._internal.retry import Retrier, RetryPolicy, as_retrier


def refused(after_s: float | None = 0.002) -> Overloaded:
    return Overloaded("refused", status=429, retry_after=after_s)


def test_only_refusals_and_unavailability_are_retried() -> None:
    r = Retrier()
    r.called()
    assert r.wait_before(refused(), 1, None) is not None
    assert r.wait_before(ShuttingDown("draining", status=503, retry_after=1.0), 1, None) is not None
    assert r.wait_before(ArenaFull("memory full", status=503, retry_after=1.0), 1, None) is not None
    for err in (BadRequest("bad", status=400), DeadlineExceeded("late", status=504),
                Unreachable("no node", status=None),
                Unavailable("a worker died with it; the node retried it already", status=503, retry_after=1.0)):
        assert r.wait_before(err, 1, None) is None, err


def test_the_wait_is_no_shorter_than_retry_after_plus_bounded_jitter() -> None:
    r = Retrier(RetryPolicy(backoff_s=0.01, attempts=10, burst=1000), rng=random.Random(7))
    waits = [r.wait_before(refused(0.05), 1, None) for _ in range(200)]
    assert all(w is not None and 0.05 <= w <= 0.06 for w in waits)
    assert max(waits) - min(waits) > 0.005  # jittered, not in lock step
    third = [r.wait_before(refused(0.0), 3, None) for _ in range(50)]
    assert all(w is not None and w <= 0.04 for w in third)  # 0.01 * 2**2


def test_no_retry_past_the_deadline_or_the_attempts() -> None:
    r = Retrier(RetryPolicy(attempts=3))
    assert r.wait_before(refused(0.05), 1, remaining_s=0.04) is None
    assert r.wait_before(refused(0.001), 3, remaining_s=10.0) is None
    assert r.stats.gave_up == 2 and r.stats.retries == 0


def test_the_budget_holds_retries_near_a_tenth_of_calls() -> None:
    """Every call refused, every refusal asking for a retry: after the
    initial burst, retries are a tenth of calls."""
    r = Retrier(RetryPolicy(ratio=0.1, burst=10, attempts=5))
    retried = 0
    for _ in range(10_000):
        r.called()
        attempt = 1
        while r.wait_before(refused(0.0), attempt, None) is not None:
            retried += 1
            attempt += 1
    assert r.stats.calls == 10_000
    assert retried == r.stats.retries
    assert 1000 <= retried <= 1000 + 10 + 1
    assert r.stats.throttled >= 10_000 - retried - 10


def test_policy_arguments_are_checked() -> None:
    with pytest.raises(BadRequest):
        RetryPolicy(attempts=0)
    with pytest.raises(BadRequest):
        RetryPolicy(ratio=float("nan"))
    with pytest.raises(BadRequest):
        as_retrier("yes")  # type: ignore[arg-type]
    assert as_retrier(None) is None and as_retrier(False) is None
    assert as_retrier(True) is not None
