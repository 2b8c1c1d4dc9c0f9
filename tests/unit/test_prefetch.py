"""The prefetch policy (examples/models/prefetch.py): what it decides from
probe time, bandwidth and precision, including not prefetching at all and
saying why; and the searcher feeding it from real searches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from models import prefetch  # noqa: E402
from models.prefetch import PrefetchPolicy  # noqa: E402


def trained(per_list_s: float, precision: dict[float, float], searches: int = prefetch.MIN_SEARCHES) -> PrefetchPolicy:
    p = PrefetchPolicy()
    for _ in range(searches):
        p.observe(per_list_s, precision)
    return p


def test_marks_fall_inside_the_lists_and_do_not_repeat() -> None:
    assert prefetch.marks(64) == [(0.125, 8), (0.25, 16), (0.5, 32)]
    assert prefetch.marks(4) == [(0.125, 1), (0.5, 2)]  # 1/8 and 1/4 of 4 lists are both one list
    assert prefetch.marks(2) == [(0.125, 1)]
    assert prefetch.marks(1) == []


def test_until_measured_it_prefetches_at_the_fallback_step_sized_by_bandwidth() -> None:
    plan = PrefetchPolicy().plan(nprobe=40, depth=100, bandwidth=500e6, passage_bytes=64e3)
    assert plan.step == 10 and plan.k is None and "measuring" in plan.why


def test_a_slow_probe_phase_and_a_fast_device_prefetch_the_whole_depth_early() -> None:
    # 100 lists of 1 ms each, 8 KiB passages at 500 MB/s: 16 us a read; the window after 1/8 is 87 ms
    p = trained(1e-3, {0.125: 0.6, 0.25: 0.75, 0.5: 0.9})
    plan = p.plan(nprobe=100, depth=100, bandwidth=500e6, passage_bytes=8192)
    # every step's window holds all 100 reads, so the best precision wins: the latest checkpoint
    assert (plan.step, plan.k) == (50, 100), plan
    assert plan.hidden_s == pytest.approx(0.9 * 100 * 8192 / 500e6)


def test_a_short_window_trades_precision_for_time() -> None:
    # 64 KiB passages at 500 MB/s: 131 us a read; 64 lists of 50 us: windows of 2.8, 2.4 and 1.6 ms
    p = trained(50e-6, {0.125: 0.5, 0.25: 0.7, 0.5: 0.9})
    plan = p.plan(nprobe=64, depth=100, bandwidth=500e6, passage_bytes=65536)
    read = 65536 / 500e6
    hidden = {8: 0.5 * int(56 * 50e-6 / read), 16: 0.7 * int(48 * 50e-6 / read), 32: 0.9 * int(32 * 50e-6 / read)}
    best = max(hidden, key=lambda s: hidden[s])
    assert plan.step == best == 16, (plan, hidden)
    assert plan.k == int(48 * 50e-6 / read)
    assert "precision 0.70" in plan.why


def test_when_the_probes_hide_less_than_one_read_it_does_not_prefetch_and_says_why() -> None:
    # the 2,000-passage slice's shape: 32 lists probed in 0.3 ms, 64 KiB passages at 450 MB/s
    p = trained(0.3e-3 / 32, {0.125: 0.6, 0.25: 0.7, 0.5: 0.85})
    plan = p.plan(nprobe=32, depth=100, bandwidth=450e6, passage_bytes=65536)
    assert plan.step == 0 and plan.k == 0
    assert "pointless" in plan.why and "one passage's read 0.15 ms" in plan.why, plan.why
    # the same probes, a seventh of the bytes a passage (compressed): now it pays
    assert p.plan(nprobe=32, depth=100, bandwidth=450e6, passage_bytes=65536 / 7).step > 0


def test_memory_storage_and_degenerate_searches_never_prefetch() -> None:
    p = trained(1e-3, {0.125: 0.9})
    assert p.plan(64, 100, float("inf"), 8192).step == 0
    assert p.plan(1, 100, 500e6, 8192).step == 0
    assert p.plan(64, 0, 500e6, 8192).step == 0


def test_averages_follow_the_measurements() -> None:
    p = PrefetchPolicy(alpha=0.5)
    for _ in range(prefetch.MIN_SEARCHES):
        p.observe(1e-3, {0.25: 0.2})
    p.observe(3e-3, {0.25: 0.6})
    st = p.state()
    assert st["searches"] == prefetch.MIN_SEARCHES + 1
    assert st["per_list_ms"] == pytest.approx(2.0) and st["precision"] == {"0.25": pytest.approx(0.4)}
    p.observe(float("nan"), {0.25: 1.0})  # a broken measurement is ignored
    assert p.state()["searches"] == prefetch.MIN_SEARCHES + 1
    with pytest.raises(ValueError):
        PrefetchPolicy(fallback_at=1.0)
