"""bench.limit on the smallest app: a short run writes a positive limit
that no stage's own throughput is below, and load_limit reads it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.limit import load_limit

ROOT = Path(__file__).resolve().parent.parent


def test_limit_of_the_echo_chain(tmp_path: Path) -> None:
    out = tmp_path / "limit.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.limit", "--pipelines", "examples/echo.py:demo", "--quick", "--threads", "1",
         "--cores", str(min(2, len(os.sched_getaffinity(0)))),
         "--seconds", "0.3", "--warmup", "0.1", "--batch-seconds", "0.05", "--force", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    p = doc["pipelines"]["demo"]
    stages = p["stages"]
    assert set(stages) == {"Normalize", "Score"}
    assert p["limit_rps"] > 0
    assert p["limit_rps"] <= min(s["requests_per_s"] for s in stages.values())
    assert p["stage_bound_rps"] == min(s["requests_per_s"] for s in stages.values())
    for s in stages.values():
        assert s["best_batch"] in (1, 2, 4, 8, 16, 32, 64), s  # a size the sweep tried, within max_batch_size
        assert s["threads"] == 1 and s["processes"] == p["cores"]
        assert s["cpu_us_per_request"] > 0
    assert (tmp_path / "limit.md").read_text().startswith("# Offline compute limit")

    # Beside the parallel suite the quick run may find its cores short, and a
    # limit so flagged is not used (test_bench_harness); the round trip of an
    # entry is checked on the measured one with the flag cleared.
    quiet = tmp_path / "quiet.json"
    quiet.write_text(json.dumps({"pipelines": {"demo": {**p, "cores_short": []}}}))
    assert load_limit("demo", quiet) == p["limit_rps"]
    assert (load_limit("demo", out) is None) == bool(p["cores_short"])
    assert load_limit("absent", out) is None
    assert load_limit("demo", tmp_path / "missing.json") is None
