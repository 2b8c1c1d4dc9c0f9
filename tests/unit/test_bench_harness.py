"""bench.harness: the percentile convention, the machine record, the load
generators' output parsed from captured samples (oha, ghz, redis-benchmark,
nvidia-smi), the results writer, the project's generator against a local
server, and importing the examples' own modules."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from bench import harness

# `oha --no-tui --output-format json` against a node shedding part of the load
# (the shape of oha 1.x's report; latencies in seconds).
OHA_SAMPLE = """{
  "summary": {"successRate": 0.997, "total": 10.002, "slowest": 0.0412, "fastest": 0.0003,
              "average": 0.0021, "requestsPerSec": 3412.5, "totalData": 1706250, "sizePerRequest": 50,
              "sizePerSec": 170625.0},
  "responseTimeHistogram": {"0.0003": 10, "0.0044": 33000, "0.0412": 25},
  "latencyPercentiles": {"p10": 0.0009, "p25": 0.0012, "p50": 0.0018, "p75": 0.0024, "p90": 0.0031,
                         "p95": 0.0038, "p99": 0.0071, "p99.9": 0.0203, "p99.99": 0.0399},
  "rps": {"mean": 3412.5, "stddev": 120.2, "max": 3700.0,
          "percentiles": {"p10": 3200.0, "p25": 3300.0, "p50": 3410.0, "p75": 3500.0, "p90": 3600.0,
                          "p95": 3650.0, "p99": 3690.0, "p99.9": 3700.0, "p99.99": 3700.0}},
  "details": {"DNSDialup": {"average": 0.0001, "fastest": 0.00005, "slowest": 0.0004},
              "DNSLookup": {"average": 0.00001, "fastest": 0.000005, "slowest": 0.00003}},
  "statusCodeDistribution": {"200": 33000, "429": 1000},
  "errorDistribution": {"connection closed before message completed": 125}
}"""

# `ghz --format json` (the fields read; latencies in nanoseconds).
GHZ_SAMPLE = """{
  "date": "2026-11-20T10:00:00Z", "count": 20000, "total": 10001000000, "average": 3900000,
  "fastest": 400000, "slowest": 52000000, "rps": 1999.8,
  "histogram": [{"mark": 0.0004, "count": 1, "frequency": 0.00005}],
  "latencyDistribution": [{"percentage": 10, "latency": 1200000}, {"percentage": 25, "latency": 2000000},
                          {"percentage": 50, "latency": 3100000}, {"percentage": 75, "latency": 4500000},
                          {"percentage": 90, "latency": 6800000}, {"percentage": 95, "latency": 8800000},
                          {"percentage": 99, "latency": 17500000}],
  "statusCodeDistribution": {"OK": 19800, "ResourceExhausted": 200},
  "errorDistribution": {"rpc error: code = ResourceExhausted desc = overloaded": 200}
}"""

REDIS_BENCHMARK_SAMPLE = '''"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
"SET","81967.21","0.320","0.080","0.303","0.495","0.711","2.847"
"GET","90090.09","0.291","0.072","0.279","0.431","0.607","1.919"
'''

NVIDIA_SMI_SAMPLE = "NVIDIA H100 80GB HBM3, 81559, 550.54.15\nNVIDIA H100 80GB HBM3, 81559, 550.54.15\n"


# --------------------------------------------------------------------------- percentiles

def test_percentile_interpolates_linearly_between_closest_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert harness.percentile(xs, 0) == 1.0
    assert harness.percentile(xs, 100) == 4.0
    assert harness.percentile(xs, 50) == 2.5  # halfway between ranks 1 and 2 (0-based)
    assert harness.percentile(xs, 25) == pytest.approx(1.75)  # h = 0.75
    assert harness.percentile(xs, 99) == pytest.approx(3.97)  # h = 2.97
    assert harness.percentile([7.0], 99) == 7.0


def test_percentile_is_numpys_default_and_takes_any_iterable() -> None:
    rng = np.random.default_rng(3)
    xs = rng.exponential(5.0, size=1001)
    for q in (1, 10, 50, 90, 99, 99.9):
        assert harness.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
        assert harness.percentile(iter(xs.tolist()), q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_of_nothing_is_nan() -> None:
    assert np.isnan(harness.percentile([], 50))
    assert np.isnan(harness.percentile(np.zeros(0), 99))


# --------------------------------------------------------------------------- the machine record

def test_machine_record_has_every_field() -> None:
    m = harness.machine()
    assert set(m) == {"cores", "usable_cores", "cpu_model", "memory_gib", "gpus", "platform", "python", "git_sha",
                      "git_dirty", "loadavg_before", "time", "command"}
    assert m["cores"] == os.cpu_count() and 1 <= m["usable_cores"] <= m["cores"]
    assert isinstance(m["cpu_model"], str) and m["cpu_model"]
    assert m["memory_gib"] > 0
    assert isinstance(m["gpus"], list)
    assert len(m["loadavg_before"]) == 3 and all(x >= 0 for x in m["loadavg_before"])
    assert re.fullmatch(r"[0-9a-f]{40}", m["git_sha"] or ""), m["git_sha"]  # this is a git checkout
    assert isinstance(m["git_dirty"], bool)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4}", m["time"])
    json.dumps(m)  # it goes into JSON as it is


def test_gpus_from_nvidia_smi() -> None:
    gpus = harness.parse_nvidia_smi(NVIDIA_SMI_SAMPLE)
    assert gpus == [{"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "driver": "550.54.15"}] * 2
    assert harness.parse_nvidia_smi("") == []


def test_describe_machine_names_cpu_gpu_load_and_commit() -> None:
    m = harness.machine() | {"gpus": harness.parse_nvidia_smi(NVIDIA_SMI_SAMPLE), "git_sha": "a" * 40,
                             "git_dirty": True, "loadavg_before": [1.5, 1.0, 0.5]}
    line = harness.describe_machine(m)
    assert m["cpu_model"] in line and "NVIDIA H100 80GB HBM3 (80 GiB)" in line
    assert "aaaaaaaaaa with uncommitted changes" in line and "1.50 1.00 0.50" in line
    assert "no GPU" in harness.describe_machine(m | {"gpus": []})


# --------------------------------------------------------------------------- load generators' output

def test_oha_report_parsed() -> None:
    r = harness.parse_oha(OHA_SAMPLE)
    assert r["rps"] == 3412.5 and r["requests"] == 34000 and r["ok"] == 33000
    assert r["ok_rps"] == pytest.approx(3412.5 * 33000 / 34000)
    assert r["p50_ms"] == pytest.approx(1.8) and r["p90_ms"] == pytest.approx(3.1)
    assert r["p99_ms"] == pytest.approx(7.1) and r["p999_ms"] == pytest.approx(20.3)
    assert r["status"] == {"200": 33000, "429": 1000}
    assert r["errors"] == {"429": 1000, "connection closed before message completed": 125}


def test_oha_report_counts_every_2xx_as_answered() -> None:
    d = json.loads(OHA_SAMPLE) | {"statusCodeDistribution": {"201": 10}, "errorDistribution": {}}
    r = harness.parse_oha(json.dumps(d))
    assert r["ok"] == r["requests"] == 10 and r["errors"] == {}


def test_ghz_report_parsed() -> None:
    r = harness.parse_ghz(GHZ_SAMPLE)
    assert r["rps"] == 1999.8 and r["requests"] == 20000 and r["ok"] == 19800
    assert r["ok_rps"] == pytest.approx(1999.8 * 0.99)
    assert r["p50_ms"] == pytest.approx(3.1) and r["p90_ms"] == pytest.approx(6.8) and r["p99_ms"] == pytest.approx(17.5)
    assert np.isnan(r["p999_ms"])  # ghz reports no p99.9
    assert r["status"] == {"OK": 19800, "ResourceExhausted": 200}
    assert r["errors"] == {"rpc error: code = ResourceExhausted desc = overloaded": 200}


def test_redis_benchmark_csv_parsed() -> None:
    r = harness.parse_redis_benchmark(REDIS_BENCHMARK_SAMPLE)
    assert r == {"set": {"ops_s": 81967.21, "p50_ms": 0.303, "p99_ms": 0.711},
                 "get": {"ops_s": 90090.09, "p50_ms": 0.279, "p99_ms": 0.607}}


def test_a_missing_generator_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "OHA", None)
    with pytest.raises(RuntimeError, match="cargo install oha"):
        harness.oha("http://127.0.0.1:9/", seconds=1, concurrency=1)


def test_tool_prefers_the_environment_then_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NO_SUCH_TOOL_XYZ", "/opt/x")
    assert harness.tool("no-such-tool-xyz") == "/opt/x"
    monkeypatch.delenv("NO_SUCH_TOOL_XYZ")
    fallback = tmp_path / "x"
    assert harness.tool("no-such-tool-xyz", fallback) is None
    fallback.touch()
    assert harness.tool("no-such-tool-xyz", fallback) == str(fallback)


@pytest.fixture
def http_200() -> Iterator[str]:
    """A local HTTP/1.1 server answering every POST with 200."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (the http.server hook)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/infer"
    server.shutdown()
    server.server_close()


def test_loadgen_reports_each_rate(http_200: str) -> None:
    reports = harness.loadgen(http_200, b"{}", [50, 100], 0.4, warmup_s=0.1, slo_ms=1000.0)
    assert [r["offered_rps"] for r in reports] == [50, 100]
    for r in reports:
        assert r["ok"] > 0 and r["errors"] == 0 and r["sent"] == r["ok"]
        assert {"p50", "p99", "p999", "max"} <= set(r["latency_ms"])
    assert "wall_start" in reports[0]


# --------------------------------------------------------------------------- results

def test_results_carry_the_machine_record(tmp_path: Path) -> None:
    m = harness.machine()
    json_path, md_path = harness.write_results(tmp_path / "sub" / "thing.json", {"x": 1, "machine": "old"}, "# T\n", m)
    assert json_path == tmp_path / "sub" / "thing.json" and md_path == tmp_path / "sub" / "thing.md"
    doc = json.loads(json_path.read_text())
    assert list(doc) == ["machine", "x"] and doc["machine"] == m
    md = md_path.read_text()
    assert md.startswith("# T\n\nMachine: ") and md.endswith(harness.describe_machine(m) + ".\n")
    # A path without a suffix names the same two files.
    assert harness.write_results(tmp_path / "sub" / "thing", {"x": 2}, "# T", m) == (json_path, md_path)


# --------------------------------------------------------------------------- the examples' modules

def test_example_module_imports_a_package_by_its_own_name(tmp_path: Path) -> None:
    pkg = tmp_path / "bench_harness_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("VALUE = 41\n")
    (pkg / "sub.py").write_text("from bench_harness_pkg import VALUE\n\nANSWER = VALUE + 1\n")
    (tmp_path / "bench_harness_client.py").write_text("import bench_harness_pkg.sub as s\n\nANSWER = s.ANSWER\n")
    try:
        assert harness.example_module("bench_harness_pkg.sub", tmp_path).ANSWER == 42
        assert harness.example_module("bench_harness_client", tmp_path).ANSWER == 42
        assert str(tmp_path) not in sys.path
    finally:
        for name in ("bench_harness_pkg", "bench_harness_pkg.sub", "bench_harness_client"):
            sys.modules.pop(name, None)


def test_goodput_configurations_by_name() -> None:
    from bench import goodput

    assert goodput.config("out-of-box") == ([], "plan")
    assert goodput.config("no-admission") == (["--no-admission"], "plan")
    assert goodput.config("max-wait-50") == (["--max-wait-ms", "50"], "plan")
    assert goodput.config("max-wait-0.5") == (["--max-wait-ms", "0.5"], "plan")
    # +v2: the same serving, the requests as KServe v2 binary bodies (Ray's adapter takes JSON only).
    assert goodput.config("out-of-box+v2") == ([], "plan")
    assert goodput.config("max-wait-50+v2") == (["--max-wait-ms", "50"], "plan")
    for bad in ("max-wait-", "max-wait--1", "max-wait-x", "fastest", "ray-planned+v2", "+v2"):
        with pytest.raises(ValueError, match="unknown configuration"):
            goodput.config(bad)


def test_goodput_repeats_draw_their_own_arrivals() -> None:
    """Each repeat of a rate runs with its own seed, and the row kept is the
    median of the runs, arrivals included."""
    from bench import goodput

    seeds: list[int] = []

    def run(seed: int) -> dict[str, float]:
        seeds.append(seed)
        x = float(len(seeds))
        return {"offered_rps": 10.0, "arrived_rps": 9.0 + x, "goodput_rps": 8.0 + x, "p50_ms": x, "p99_ms": 10 * x,
                "miss_rate": 0.0, "load_avg": 0.5}

    m = goodput.repeated(run, 3)
    assert len(set(seeds)) == 3
    assert (m["arrived_rps"], m["goodput_rps"], m["p99_ms"]) == (11.0, 10.0, 20.0)
    assert [r["arrived_rps"] for r in m["runs"]] == [10.0, 11.0, 12.0]


def test_goodput_rate_search() -> None:
    """The rates bench.goodput measures: the fractions rising until one
    past 90% of the limit misses; halving when none held; refining between
    the highest held and the lowest missed above it."""
    from bench import goodput

    def system(capacity: float) -> Callable[[float], bool]:
        return lambda rate: rate <= capacity

    rates = [60.0, 75.0, 85.0, 95.0, 105.0]
    assert goodput.search(rates, 100, system(90), 0) == [60, 75, 85, 95]
    # A miss below 90% of the limit does not stop the rise (a noisy point).
    assert goodput.search(rates, 100, lambda r: r != 75, 0) == [60, 75, 85, 95, 105]
    # Nothing held: halve (Ray Serve at a twentieth of the limit).
    assert goodput.search(rates, 100, system(5), 0) == [60, 75, 85, 95, 30, 15, 7.5, 3.75]
    # Never below 1/256 of the limit.
    assert min(goodput.search(rates, 100, system(0), 0)) > 100 / 512
    # Everything held: 1.5x until a rate misses, up to the limit.
    assert goodput.search([15, 25, 35], 100, system(60), 0) == [15, 25, 35, 52, 78]
    assert goodput.search([15, 25, 35], 100, system(60), 1) == [15, 25, 35, 52, 78, 64]
    assert goodput.search([60, 80], 100, system(200), 0) == [60, 80, 100]
    # Refining: geometric means towards the lowest rate that missed above the highest held.
    assert goodput.search(rates, 100, system(80), 3) == [60, 75, 85, 95, 80]  # 82 is within 4%: stop
    assert goodput.search(rates, 100, system(5), 2) == [60, 75, 85, 95, 30, 15, 7.5, 3.75, 5.3, 4.46]


def test_a_limit_measured_cores_short_is_not_used(tmp_path: Path) -> None:
    """A limit measured while other work took cores is low: every share of it
    would read high, so the benchmarks get none, and are told why."""
    from bench.limit import limit_entry, load_limit, missing_limit

    path = tmp_path / "limit.json"
    quiet = {"limit_rps": 238.0, "cpu_us_per_request": 8400.0, "cores": 2, "cores_short": []}
    short = {**quiet, "limit_rps": 167.0, "cores_short": ["Search"]}
    path.write_text(json.dumps({"pipelines": {"quiet": quiet, "short": short}}))
    assert limit_entry("quiet", path) == quiet
    assert load_limit("quiet", path) == 238.0
    assert limit_entry("short", path) is None and load_limit("short", path) is None
    said = missing_limit("short", path)
    assert "cores short" in said and "Search" in said and "bench.limit --force --pipelines short" in said
    assert "no offline limit" in missing_limit("absent", path)


def test_late_served_says_when_a_system_held_every_rate_tried() -> None:
    """A like-for-like goodput found at the top of the rates tried is a lower
    bound, and so is its ratio; the table says so."""
    from bench.late_served import markdown

    def row(rate: float, share: float, holds: bool) -> dict[str, object]:
        return {"rate_rps": rate, "reranked_share": share, "p99_ms": 100.0, "holds": holds}

    doc = {"candidates": 100, "duration_s": 15.0, "served": [], "offline": [],
           "equal_quality": {"min_share": 0.95, "slo_ms": 200.0, "max_miss_rate": 0.01, "systems": {
               "slipstream": {"rows": [row(30, 0.99, True), row(50, 0.96, True)], "best_rps": 50.0},
               "ray": {"rows": [row(30, 1.0, True), row(40, 1.0, False)], "best_rps": 30.0}}}}
    md = markdown(doc)
    assert "| slipstream | 50 req/s or more (the highest tried) |" in md
    assert "| ray | 30 req/s | 30: 100%, 100; 40: 100%, 100 (fails) |" in md
    assert "Ratio at like answers: at least 1.67x." in md
    doc["equal_quality"]["systems"]["slipstream"]["rows"].append(row(60, 0.9, False))
    assert "Ratio at like answers: 1.67x." in markdown(doc)
