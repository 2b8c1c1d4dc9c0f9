"""The package's wheel, built as a user (or the Dockerfile's wheel stage)
builds it: `maturin build --release --locked` in the repository, whose
target directory holds what `maturin develop` already compiled (`make test`
runs that command once before the tests and hands its wheel over in
``$SLIPSTREAM_TEST_WHEELS``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT


def build_wheel(out: Path) -> Path:
    """Build the wheel into `out`; its path (skips the test without maturin).
    Under `make test` it was built once before the tests, with the same
    command, into ``$SLIPSTREAM_TEST_WHEELS``: that one is copied."""
    built = os.environ.get("SLIPSTREAM_TEST_WHEELS")
    if built:
        wheels = sorted(Path(built).glob("slipstream-*.whl"))
        assert len(wheels) == 1, f"expected one wheel in $SLIPSTREAM_TEST_WHEELS={built}: {wheels}"
        out.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(wheels[0], out / wheels[0].name))
    maturin = shutil.which("maturin", path=str(Path(sys.executable).parent)) or shutil.which("maturin")
    if maturin is None:
        pytest.skip("maturin is not installed")
    t0 = time.monotonic()
    build = subprocess.run(
        [maturin, "build", "--release", "--locked", "--interpreter", sys.executable, "-o", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    assert build.returncode == 0, build.stderr[-4000:]
    print(f"maturin build: {time.monotonic() - t0:.1f} s")  # seconds when `maturin develop` built the same sources
    (wheel,) = out.glob("slipstream-*.whl")
    return wheel
