"""bench.ceiling: the M/D/c simulation behind the queueing ceiling agrees
with what queueing theory says exactly, and the ceiling moves the way the
SLO and the cores say it must."""

from __future__ import annotations

import pytest

import bench.ceiling as bench_ceiling
from bench.ceiling import ceiling, miss_rate


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.9])
def test_in_one_server_the_share_that_waits_is_the_utilisation(rho: float) -> None:
    # M/G/1: an arrival finds the server busy with probability rho (PASTA), so
    # the share whose time in the system exceeds the service time is rho.
    d = 0.01
    assert miss_rate(rho / d, d, 1, d * 1.0001, arrivals=60_000) == pytest.approx(rho, abs=0.02)


def test_waits_in_one_server_match_pollaczek_khinchine() -> None:
    # M/D/1 at rho 0.5: mean wait rho d / (2 (1 - rho)) = d / 2; the share
    # waiting more than 3 d is small but not zero, and more than 30 d none.
    d = 0.01
    assert 0 < miss_rate(50.0, d, 1, 4 * d, arrivals=60_000) < 0.05
    assert miss_rate(50.0, d, 1, 31 * d, arrivals=60_000) == 0.0


def test_the_ceiling_rises_with_the_slo_and_the_servers_and_is_zero_when_one_request_misses() -> None:
    tight = ceiling(100_000, 2, 300, 0.01, arrivals=40_000)
    loose = ceiling(100_000, 2, 3000, 0.01, arrivals=40_000)
    wide = ceiling(100_000 / 8, 16, 300, 0.01, arrivals=40_000)  # the same limit on 8x the cores
    assert 0 < tight["fraction"] < loose["fraction"] < 1
    assert tight["limit_rps"] == pytest.approx(20.0) and wide["limit_rps"] == pytest.approx(1280.0)
    assert wide["fraction"] > tight["fraction"]
    # 600 ms of CPU against 500 ms: no core alone can; split over two (300 ms), a little can.
    alone = ceiling(600_000, 2, 500, 0.01, arrivals=40_000)
    assert alone["models"]["M/D/2"] == alone["models"]["M/D/2, gated"] == 0.0
    assert 0.0 < alone["models"]["M/D/1 at 2x"] <= alone["fraction"]
    assert ceiling(1_200_000, 2, 500, 0.01)["fraction"] == 0.0


def test_the_ceiling_is_the_best_of_a_core_per_request_and_a_perfect_split_with_an_ideal_gate() -> None:
    # Few requests' worth of SLO (audioquery: 1.8 s of CPU against 5 s on 2
    # cores): a request split across both cores waits less, and refusing
    # what would miss anyway keeps it from delaying the rest.
    few = ceiling(1_800_000, 2, 5000, 0.01, arrivals=40_000)
    m = few["models"]
    assert m["M/D/1 at 2x"] > m["M/D/2"] > 0
    assert m["M/D/2, gated"] >= m["M/D/2"] and m["M/D/1 at 2x, gated"] >= m["M/D/1 at 2x"]
    assert few["fraction"] == max(m.values()) and few["model"].endswith("gated")
    one = ceiling(100_000, 1, 500, 0.01, arrivals=40_000)
    assert one["models"]["M/D/1"] == one["models"]["M/D/1 at 1x"]


def test_an_ideal_gate_refuses_only_what_capacity_cannot_serve() -> None:
    # One server at 1.5x its capacity with a loose SLO: the gate admits what
    # the server can finish (2/3 of the arrivals) and refuses the rest; never
    # more misses than without a gate, which at 1.5x misses nearly all.
    d = 0.01
    assert miss_rate(150.0, d, 1, 10 * d, arrivals=60_000, gate=True) == pytest.approx(1 / 3, abs=0.02)
    assert miss_rate(150.0, d, 1, 10 * d, arrivals=60_000) > 0.9
    for rate in (50.0, 80.0, 95.0):
        assert miss_rate(rate, d, 1, 4 * d, arrivals=40_000, gate=True) <= miss_rate(rate, d, 1, 4 * d, arrivals=40_000)


def test_routings_shared_is_the_m_d_c_queue_and_the_others_order_as_they_should() -> None:
    """One shared queue is miss_rate's M/D/c queue, draw for draw; binding on
    arrival to the replica with the fewest outstanding misses at least as
    often; a replica taking both cores while alone misses at most as often,
    and exactly as often when the cores give it nothing (speedup 1)."""
    rate, service, slo = 26.0, 0.065, 0.3
    shared = bench_ceiling.routed_miss_rate(rate, service, 2, slo, "shared", arrivals=40_000)
    assert shared == bench_ceiling.miss_rate(rate, service, 2, slo, arrivals=40_000)
    assert 0.0 < shared < 0.2
    assert bench_ceiling.routed_miss_rate(rate, service, 2, slo, "shortest", arrivals=40_000) >= shared
    assert bench_ceiling.routed_miss_rate(rate, service, 2, slo, "elastic", speedup=1.0, arrivals=40_000) == shared
    assert bench_ceiling.routed_miss_rate(rate, service, 2, slo, "elastic", speedup=2.0, arrivals=40_000) < shared
    # Service variance lengthens the tail.
    assert bench_ceiling.routed_miss_rate(rate, service, 2, slo, "shared", cv=0.5, arrivals=40_000) > shared


def test_routings_report_a_share_of_the_limit_for_each() -> None:
    r = bench_ceiling.routings(65_000, 2, 500, 0.01, speedup=1.4, cv=0.3, arrivals=20_000)
    assert set(r) == set(bench_ceiling.ROUTINGS)
    assert all(0.5 < v < 1.0 for v in r.values()), r
    assert r["shortest"] <= r["shared"] + 0.01
