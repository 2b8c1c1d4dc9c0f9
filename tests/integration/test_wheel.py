"""The wheel installs into a fresh virtualenv and serves from outside the
repository: `maturin build` (in the repository's target directory, so the
artifacts `maturin develop` built are reused), `python -m venv`, `pip
install` of the wheel (numpy and the other dependencies from PyPI), then
`slipstream serve echo.py` from a directory that has only a copy of
examples/echo.py, queried over HTTP. Catches files that serving needs but
the wheel lacks, and imports of repository-only modules.

Slow (a minute or two, most of it pip): `pytest -m 'not wheel'` skips it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.wheel import build_wheel

pytestmark = pytest.mark.wheel


def _env() -> dict[str, str]:
    """This process's environment without anything pointing into the repository's virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != bindir)
    return env


def test_wheel_installs_and_serves_outside_the_repository(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "wheels")
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ("slipstream/__init__.py", "slipstream/_core.abi3.so", "slipstream/_internal/worker.py",
                 "slipstream/_internal/cli.py", "slipstream/_internal/tensors.py", "slipstream/py.typed"):
        assert need in names, f"{need} is not in {wheel.name}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=_env(), timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
                         capture_output=True, text=True, env=_env(), timeout=900)
    assert pip.returncode == 0, pip.stdout[-2000:] + pip.stderr[-4000:]

    app_dir = tmp_path / "app"
    app_dir.mkdir()
    shutil.copy(ROOT / "examples" / "echo.py", app_dir / "echo.py")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import slipstream; print(slipstream.__file__)"],
                           cwd=app_dir, capture_output=True, text=True, env=_env(), check=True)
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout

    proc = subprocess.Popen([str(venv / "bin" / "slipstream"), "serve", "echo.py", "--port", "0"],
                            cwd=app_dir, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "ready, serving" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(120) and proc.poll() is None, "".join(lines)
        port = next(int(m.group(1)) for line in lines if (m := re.search(r"listening on http://[\d.]+:(\d+)", line)))
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/pipelines/demo/infer",
                                     data=b'{"inputs": {"x": [[3, 4]]}}', method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read().decode()
        out = json.loads(body)["outputs"]
        assert [round(v, 5) for v in out["y"][0]] == [0.6, 0.8]
        assert round(out["score"][0][0], 5) == round((0.6 + 0.8) / 2 ** 0.5, 5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    assert rc == 0, "".join(lines)
