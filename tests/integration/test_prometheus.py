"""`/metrics` read by a real Prometheus server, and the Grafana dashboard's
queries checked against what the node exports.

A real node serves tests/apps/metered.py; a real Prometheus (the Debian
`prometheus` binary) scrapes it every second into a temporary directory
while a pool of HTTP clients drives load at it. Then the p99 that
Prometheus computes from the exported histogram buckets must agree with the
node's own p99 (`/v1/status`, an HdrHistogram of the same observations)
within the resolution of the buckets, and the SLO attainment read from the
bucket at the SLO target must equal the node's own count of answers within
the target. The dashboard (deploy/helm/slipstream/dashboards/slipstream.json) may only name
metrics the node exports, and each of its queries must be valid PromQL that
Prometheus evaluates.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import APPS, ROOT, Node, wait_for

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is not installed (Debian package `prometheus`; scripts/bootstrap.sh installs it)",
)

PIPE = "metered"
SLO_LE = "0.037"  # tests/apps/metered.py: SLO(p99_ms=37), a target between the ladder's 30 and 40 ms
LATENCY = "slipstream_request_latency_seconds"
DASHBOARD = ROOT / "deploy" / "helm" / "slipstream" / "dashboards" / "slipstream.json"
LOAD_S = 12.0
CLIENTS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server scraping `target` (host:port) every second."""

    def __init__(self, target: str, workdir: Path):
        assert PROMETHEUS is not None
        port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: slipstream\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{port}"
        self.started = time.time()
        try:
            wait_for(self._ready, timeout=60, every=0.2)
        except AssertionError:
            self.stop()
            raise RuntimeError("prometheus did not become ready:\n" + self.log_path.read_text()) from None

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError("prometheus exited:\n" + self.log_path.read_text())
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        assert body["status"] == "success", (params, body)
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        data = self.api("query", query=expr, time=f"{at if at is not None else time.time():.3f}")
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def scalar(self, expr: str, at: float | None = None) -> float:
        r = self.query(expr, at)
        assert len(r) == 1, (expr, r)
        return float(r[0]["value"][1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Run:
    node: Node
    prom: Prometheus
    load_end: float
    statuses: dict[int, int]


def pipeline_status(node: Node) -> dict[str, Any]:
    return next(p for p in node.status()["pipelines"] if p["name"] == PIPE)


def drive_load(node: Node, seconds: float) -> dict[int, int]:
    """`CLIENTS` closed-loop clients; each request asks for a service time of
    mostly 1-8 ms, sometimes 10-30 ms, rarely 40-60 ms (beyond the SLO)."""
    stop_at = time.monotonic() + seconds

    def client(seed: int) -> dict[int, int]:
        rng = random.Random(seed)
        seen: dict[int, int] = {}
        while time.monotonic() < stop_at:
            u = rng.random()
            ms = rng.uniform(1, 8) if u < 0.85 else rng.uniform(10, 30) if u < 0.97 else rng.uniform(40, 60)
            status, _, _ = node.request(
                "POST", f"/v1/pipelines/{PIPE}/infer", {"inputs": {"x": [[seed, ms]]}}
            )
            seen[status] = seen.get(status, 0) + 1
            if status == 429:
                time.sleep(0.005)  # refused at once: do not spin
        return seen

    total: dict[int, int] = {}
    with ThreadPoolExecutor(CLIENTS) as pool:
        for seen in pool.map(client, range(CLIENTS)):
            for k, v in seen.items():
                total[k] = total.get(k, 0) + v
    return total


@pytest.fixture(scope="module")
def run() -> Iterator[Run]:
    node = Node(str(APPS / "metered.py"))
    with tempfile.TemporaryDirectory(prefix="slipstream-prom-") as tmp:
        prom: Prometheus | None = None
        try:
            node.wait_ready()
            prom = Prometheus(node.url.removeprefix("http://"), Path(tmp))
            # The first scrape (all counts zero) precedes any request, so an
            # increase() over the whole run starts from zero.
            wait_for(lambda: prom.query('up{job="slipstream"} == 1'), timeout=30, every=0.2)
            statuses = drive_load(node, LOAD_S)
            load_end = time.time()
            # Wait until Prometheus holds a scrape taken after the last answer.
            answered = pipeline_status(node)["latency_ms"]["count"]
            wait_for(
                lambda: prom.query(f'{LATENCY}_count{{pipeline="{PIPE}"}} == {answered}'),
                timeout=30,
                every=0.5,
            )
            yield Run(node, prom, load_end, statuses)
        finally:
            if prom is not None:
                prom.stop()
            node.stop()


def parse_exposition(text: str) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    """Parse Prometheus text format strictly: each family's HELP and TYPE
    once, before all of its samples, which are contiguous. Returns family ->
    (type, samples)."""
    families: dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]] = {}
    current: str | None = None
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in families, f"family {name} declared twice"
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            families[name] = (kind, [])
            current = name
            continue
        assert line and not line.startswith("#"), f"unexpected line {line!r}"
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        parsed: dict[str, str] = {}
        rest = labels.removesuffix("}")
        while rest:
            m = label_re.match(rest)
            assert m, f"bad labels in {line!r}"
            parsed[m.group(1)] = m.group(2)
            rest = rest[m.end() :]
        assert current is not None, f"sample before any TYPE: {line!r}"
        kind = families[current][0]
        allowed = {current} | (
            {current + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else set()
        )
        assert name in allowed, f"{name} inside family {current}: families interleaved"
        families[current][1].append((name, parsed, float(value)))
    return families


def check_histograms(families: dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]) -> None:
    for family, (kind, samples) in families.items():
        if kind != "histogram":
            continue
        series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for name, labels, value in samples:
            key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            s = series.setdefault(key, {"buckets": []})
            if name.endswith("_bucket"):
                s["buckets"].append((float(labels["le"]), value))
            else:
                s[name.rsplit("_", 1)[1]] = value
        for key, s in series.items():
            les = [le for le, _ in s["buckets"]]
            counts = [n for _, n in s["buckets"]]
            assert les == sorted(les) and len(set(les)) == len(les), (family, key)
            assert counts == sorted(counts), f"{family}{key}: buckets not cumulative"
            assert les[-1] == math.inf and counts[-1] == s["count"], f"{family}{key}: +Inf != _count"
            assert "sum" in s, (family, key)


def exported_names(families: dict[str, tuple[str, list[Any]]]) -> set[str]:
    names = set(families)
    for f, (kind, _) in families.items():
        if kind == "histogram":
            names |= {f + "_bucket", f + "_sum", f + "_count"}
    return names


def test_the_exposition_is_grouped_and_its_histograms_well_formed(run: Run) -> None:
    _, _, raw = run.node.request("GET", "/metrics")
    families = parse_exposition(raw.decode())
    check_histograms(families)
    assert families[LATENCY][0] == "histogram"
    for f in ("queue_wait", "compute", "hop", "slack", "dispatch_lateness"):
        assert families[f"slipstream_stage_{f}_seconds"][0] == "histogram", f
    les = {labels["le"] for name, labels, _ in families[LATENCY][1] if name.endswith("_bucket")}
    assert SLO_LE in les, "the SLO target is a bucket boundary"
    slo = [labels for _, labels, _ in families["slipstream_pipeline_slo_seconds"][1]]
    assert slo == [{"pipeline": PIPE, "bucket": SLO_LE}]
    # Prometheus itself scraped it without error.
    target = run.prom.api("targets")["activeTargets"][0]
    assert target["health"] == "up" and target["lastError"] == "", target


def test_prometheus_p99_agrees_with_the_node_within_a_bucket(run: Run) -> None:
    node, prom = run.node, run.prom
    assert run.statuses.get(200, 0) >= 300, run.statuses
    lat = pipeline_status(node)["latency_ms"]
    at = time.time()
    window = f"{math.ceil(at - prom.started) + 5}s"  # the whole life of the series, from its zero
    # The same observations: the node's HdrHistogram and the scraped buckets count alike.
    assert prom.scalar(f'sum({LATENCY}_count{{pipeline="{PIPE}"}})', at) == lat["count"]
    p99 = prom.scalar(
        f'histogram_quantile(0.99, sum by (le) (increase({LATENCY}_bucket{{pipeline="{PIPE}"}}[{window}])))',
        at,
    )
    raw = sorted(
        (float(r["metric"]["le"]), float(r["value"][1]))
        for r in prom.query(f'sum by (le) ({LATENCY}_bucket{{pipeline="{PIPE}"}})', at)
    )
    # The bucket (lo, hi] holding the 99th-percentile rank holds both the
    # node's p99 (the sample at that rank, to HdrHistogram's 3 significant
    # digits: 0.1%, so 0.2% of slack) and Prometheus' estimate (linear
    # interpolation inside it): they agree to that bucket's width, at most a
    # third of its lower bound on the 1 ms .. 1 s ladder.
    rank = 0.99 * raw[-1][1]
    i = next(i for i, (_, n) in enumerate(raw) if n >= rank)
    lo, hi = (raw[i - 1][0] if i else 0.0), raw[i][0]
    assert math.isfinite(hi), raw
    node_p99 = lat["p99"] / 1e3
    assert lo <= p99 <= hi, (p99, lo, hi)
    assert lo * (1 - 2e-3) <= node_p99 <= hi * (1 + 2e-3), (node_p99, lo, hi, p99)
    # increase() over the whole run scales every bucket alike (each starts
    # from zero), so the estimate is exactly the interpolation of the raw counts.
    below = raw[i - 1][1] if i else 0.0
    expected = lo + (hi - lo) * (rank - below) / (raw[i][1] - below)
    assert p99 == pytest.approx(expected, rel=1e-6), (p99, expected)


def test_slo_attainment_from_the_target_bucket_is_exact(run: Run) -> None:
    node, prom = run.node, run.prom
    p = pipeline_status(node)
    assert p["slo_missed"] > 0 and p["slo_met"] > 0, "the load has answers on both sides of the target"
    at = time.time()
    window = f"{math.ceil(at - prom.started) + 5}s"
    # The bucket whose le is the pipeline's target (named by the SLO gauge's
    # `bucket` label, as the dashboard selects it), without naming the target.
    target = 'on (pipeline, le) label_replace(slipstream_pipeline_slo_seconds, "le", "$1", "bucket", "(.*)")'
    # Answers within the target: that bucket counts exactly what the node counts as met.
    assert prom.scalar(f'sum({LATENCY}_bucket{{pipeline="{PIPE}"}} and {target})', at) == p["slo_met"]
    attainment = prom.scalar(
        f'sum(increase({LATENCY}_bucket{{pipeline="{PIPE}"}}[{window}]) and {target}) '
        f'/ sum(increase({LATENCY}_count{{pipeline="{PIPE}"}}[{window}]))',
        at,
    )
    assert attainment == pytest.approx(p["slo_met"] / (p["slo_met"] + p["slo_missed"]), rel=1e-9)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of the dashboard, templating included."""
    board = json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str]] = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in board.get("templating", {}).get("list", []):
        q = var.get("query")
        if var.get("type") == "query":
            out.append((f"variable {var['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def test_the_grafana_dashboard_queries_only_what_the_node_exports(run: Run) -> None:
    _, _, raw = run.node.request("GET", "/metrics")
    families = parse_exposition(raw.decode())
    exported = exported_names(families)
    with_samples = exported_names({f: v for f, v in families.items() if v[1]})
    queries = dashboard_queries()
    titles = {t for t, _ in queries}
    for needed in (
        "Latency p50 / p99 vs SLO",
        "SLO attainment",
        "Goodput",
        "Refused and failed",
        "Queue depth",
        "Batch size",
        "Replicas",
    ):
        assert any(t.startswith(needed) for t in titles), f"no panel {needed!r}"
    referenced: set[str] = set()
    for title, expr in queries:
        names = set(re.findall(r"\bslipstream_[a-zA-Z0-9_]+", expr))
        assert names, (title, expr)
        assert names <= exported, f"{title}: {sorted(names - exported)} not exported by the node"
        referenced |= names
        if expr.startswith("label_values("):
            continue  # Grafana's own function, not PromQL
        # Valid PromQL that Prometheus evaluates, with Grafana's variables as
        # Grafana would fill them in, over the window that saw the load.
        promql = (
            expr.replace("$__rate_interval", "10s")
            .replace("$pipeline", ".*")
            .replace("$stage", ".*")
            .replace("$__range", "60s")
        )
        assert "$" not in promql.replace('"$1"', ""), (title, expr)
        result = run.prom.query(promql, at=run.load_end - 1)
        if names <= with_samples:
            assert result, f"{title}: {promql} found nothing"
    assert len(referenced) >= 10, referenced
