"""Shared fixtures: start a real node (`slipstream serve`) with real worker
processes on a free port, and talk to it over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
APPS = Path(__file__).resolve().parent / "apps"
SLIPSTREAM = [sys.executable, "-m", "slipstream._internal.cli"]


class Node:
    """A running `slipstream serve` process."""

    def __init__(self, app: str, *args: str, ready_timeout: float = 60.0, env: dict[str, str] | None = None,
                 command: str = "serve", wrap: list[str] | None = None):
        argv = [command, app] if command == "serve" else [command]
        self.proc = subprocess.Popen(
            [*(wrap or []), *SLIPSTREAM, *argv, "--port", "0", *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._port: int | None = None
        self._ready = threading.Event()
        self._listening = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._listening.wait(ready_timeout):
            self.stop()
            raise RuntimeError("node did not start listening:\n" + self.log())
        self.url = f"http://127.0.0.1:{self._port}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on http://[\d.]+:(\d+)", line)
            if m:
                self._port = int(m.group(1))
                self._listening.set()
            if "ready, serving" in line:
                self._ready.set()
        self._listening.set()

    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 60.0) -> None:
        if not self._ready.wait(timeout):
            raise RuntimeError("node did not become ready:\n" + self.log())

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        status, _, raw = self.request("POST", path, body, **kw)
        return status, json.loads(raw)

    def get(self, path: str) -> tuple[int, Any]:
        status, _, raw = self.request("GET", path)
        return status, json.loads(raw)

    def infer(self, pipeline: str, **inputs: Any) -> tuple[int, Any]:
        return self.post(f"/v1/pipelines/{pipeline}/infer", {"inputs": inputs})

    def status(self) -> Any:
        return self.get("/v1/status")[1]

    def stage(self, pipeline: str, stage: str) -> Any:
        for p in self.status()["pipelines"]:
            if p["name"] == pipeline:
                for s in p["stages"]:
                    if s["name"] == stage:
                        return s
        raise KeyError(stage)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def chain_node() -> Iterator[Node]:
    node = Node(str(APPS / "chain.py"), "--request-timeout", "2", "--max-body-mb", "1")
    node.wait_ready()
    yield node
    node.stop()


def wait_for(pred: Any, timeout: float = 20.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError("condition not met in time")


def shm_files_of(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"slipstream-{pid}-")] if os.path.isdir("/dev/shm") else []
