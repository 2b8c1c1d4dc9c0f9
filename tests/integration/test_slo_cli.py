"""The SLO contract from the command line, end to end: `slipstream profile`
measures the components, `slipstream slo --calibrate` serves the app on a real
node to measure this machine's overheads, then predicts the curve and names
the highest rate at which the SLO holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

APPS = Path(__file__).resolve().parent.parent / "apps"


def slipstream(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slipstream._internal.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_profile_calibrate_and_predict(tmp_path: Path) -> None:
    app = tmp_path / "chain.py"
    shutil.copy(APPS / "chain.py", app)
    r = slipstream("profile", str(app), "--pipeline", "chain", "--batches", "1,4,16", "--iters", "5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    prof = json.loads((tmp_path / "chain.profile.json").read_text())
    stages = prof["pipelines"][0]["stages"]
    assert set(stages) == {"Double", "AddOne"}
    assert [p["batch"] for p in stages["Double"]["points"]] == [1, 4, 16]
    assert "colocated" not in prof["pipelines"][0]

    r = slipstream("slo", str(app), "--pipeline", "chain", "--calibrate", "--calibration-rates", "40,200",
                   "--calibration-duration", "1.5", "--sim-duration", "3", "--rates", "100,500", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cal = json.loads((tmp_path / "chain.calibration.json").read_text())
    assert cal["cpu_per_request_us"] >= 0 and cal["batch_cpu_us"] >= 0 and cal["hop_us"] > 0
    qs = [q for q, _ in cal["external_us"]]
    assert qs == sorted(qs) and qs[-1] == 1.0
    assert [m["rate"] for m in cal["measured"]] == [40.0, 200.0]
    assert all(m["requests"] > 0 for m in cal["measured"])
    assert "highest offered rate at which the SLO holds" in r.stdout
    report = json.loads((tmp_path / "chain.slo.json").read_text())["chain"]
    assert [row["offered_rps"] for row in report["curve"]] == [100.0, 500.0]
    # A 5 s SLO on microsecond components holds at these loads, and the model says so.
    assert all(0 < row["p99_ms"] < 5000 and row["miss_rate"] == 0 for row in report["curve"])
    assert report["highest_rate_slo_holds"] == 500.0


def test_a_colocated_profile_is_measured_beside_neighbours_that_do_not_outlive_it(tmp_path: Path) -> None:
    """Short on purpose: a neighbour keeps a core busy while it runs, and
    the tests beside this one need that core."""
    app = tmp_path / "chain.py"
    shutil.copy(APPS / "chain.py", app)
    r = slipstream("profile", str(app), "--pipeline", "chain", "--batches", "1", "--iters", "3", "--budget", "0.2",
                   "--colocated", "--no-plot", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "co-located neighbour(s) running chain's stages" in r.stderr
    prof = json.loads((tmp_path / "chain.profile.json").read_text())["pipelines"][0]
    near = prof["colocated"]["1"]
    assert near["neighbours"] == max(1, len(os.sched_getaffinity(0)) - 1)
    assert near["neighbour_batches"] > 0, "the neighbours ran while the stages were measured"
    assert [p["batch"] for p in prof["stages"]["Double"]["points"]] == [1]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if "--neighbour" in line and str(app) in line], ps
