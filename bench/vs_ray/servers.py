"""Start and stop the two systems under test, each serving one pipeline.

* ``SlipstreamServer``: ``slipstream serve app.py[:var] --port 0`` as every
  benchmark starts a node (``bench.harness.node``).
* ``RayServer``: ``bench/vs_ray/.venv-ray/bin/python ray_adapter.py serve
  app.py:name --port P``, which starts a private Ray instance (see
  ``ray_adapter.py``), and prints the same ``listening on http://HOST:PORT``
  and ``ready, serving`` lines as the node.

Ray runs in its own session (process group), is stopped with a signal and,
after a grace period, the whole group is killed: Ray leaves agent
processes behind its driver, and ``ray stop`` would kill every Ray on the
machine, other people's included. This process makes itself a child
subreaper so the orphans it kills are reaped here rather than left as
zombies.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.testing import Node

from bench import harness
from bench.harness import ROOT, free_port

HERE = Path(__file__).resolve().parent
RAY_PY = HERE / ".venv-ray" / "bin" / "python"
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def http(method: str, url: str, body: bytes | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"} if body is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()


class Server:
    """A system under test serving one pipeline: ``start()`` sets ``base``
    (http://HOST:PORT) and ``start_s``; ``stop()`` leaves its output in
    ``log_path``."""

    system = "?"

    def __init__(self, app: str, pipeline: str, log_dir: Path) -> None:
        self.app, self.pipeline = app, pipeline
        self.log_path = log_dir / f"vs_ray_{self.system}_{pipeline}.log"
        self.base = ""
        self.start_s = 0.0

    @property
    def infer_url(self) -> str:
        return f"{self.base}/v1/pipelines/{self.pipeline}/infer"

    def start(self, timeout: float = 300.0) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def infer(self, body: bytes, timeout: float = 60.0) -> tuple[int, Any]:
        code, data = http("POST", self.infer_url, body, timeout)
        try:
            return code, json.loads(data)
        except ValueError:
            return code, data.decode(errors="replace")

    def reset_metrics(self) -> None:
        http("POST", f"{self.base}/v1/admin/reset-metrics", b"{}", 10)

    def stage_stats(self) -> dict[str, dict[str, Any]]:
        """Per stage: batch_size, compute_ms, hop_ms (and in_bytes for Ray)."""
        code, data = http("GET", f"{self.base}/v1/status", None, 30)
        if code != 200:
            return {}
        st = json.loads(data)
        keep = ("batch_size", "compute_ms", "hop_ms", "queue_wait_ms", "in_bytes", "batches", "requests")
        for p in st.get("pipelines", []):
            if p["name"] == self.pipeline:
                return {s["name"]: {k: s[k] for k in keep if k in s} for s in p["stages"]}
        return {}

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SlipstreamServer(Server):
    system = "slipstream"

    def __init__(self, app: str, pipeline: str, log_dir: Path, serve_target: str,
                 extra: list[str] | None = None) -> None:
        super().__init__(app, pipeline, log_dir)
        self.serve_target = serve_target
        self.extra = list(extra or [])
        self.node: Node | None = None

    def start(self, timeout: float = 300.0) -> None:
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Static replica counts, as Ray's deployments get (`num_replicas` =
        # the component's starting count): the comparison is of the runtimes,
        # not of autoscalers (bench.surge compares those).
        self.node = harness.node(self.serve_target, "--autoscale", "off", *self.extra, ready_timeout=timeout)
        try:
            self.node.wait_ready()
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"slipstream did not start serving {self.app} within {timeout:.0f}s; "
                               f"see {self.log_path}") from None
        self.base = self.node.url
        self.start_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.node is None:
            return
        self.node.stop(signal.SIGINT, timeout=45)
        self.log_path.write_text(self.node.log())
        self.node = None


class RayServer(Server):
    system = "ray"

    def __init__(self, app: str, pipeline: str, log_dir: Path, options: list[str],
                 env: dict[str, str] | None = None) -> None:
        super().__init__(app, pipeline, log_dir)
        self.options = list(options)  # a copy: pick_transport may add to it for this pipeline only
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[str] | None = None
        self._log: Any = None

    def command(self) -> list[str]:
        if not RAY_PY.exists():
            raise RuntimeError(f"{RAY_PY} is missing: run bench/vs_ray/setup_ray.sh")
        return [str(RAY_PY), str(HERE / "ray_adapter.py"), "serve", f"{self.app}:{self.pipeline}",
                "--port", str(free_port()), *self.options]

    # A stage input above this (bytes per request) goes through the object store.
    BY_REFERENCE_ABOVE = 1_000_000

    def largest_input(self) -> float:
        return max((s.get("in_bytes", {}).get("mean", 0.0) for s in self.stage_stats().values()), default=0.0)

    def pick_transport(self) -> bool:
        """Whether to restart with ``--by-reference``: measured on this machine
        (multimodal, 6.4 MB per request between two stages), Ray's object
        store hands it over in ~13 ms where gRPC by value, through the
        ingress, takes ~70 ms; for small tensors gRPC is the faster path.
        Call after a few requests have gone through."""
        return "--by-reference" not in self.options and self.largest_input() > self.BY_REFERENCE_ABOVE

    def by_reference_if_large(self, log: Callable[[str], None]) -> bool:
        """Restart with ``--by-reference`` when `pick_transport` says so
        (saying why with `log`); whether it did."""
        if not self.pick_transport():
            return False
        log(f"  {self.system}: a stage receives {self.largest_input() / 1e6:.1f} MB per request: "
            "restarting with stage outputs passed through Ray's object store (faster than gRPC here)")
        self.stop()
        self.options.append("--by-reference")
        self.start()
        return True

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The Ray venv's own interpreter and packages; nothing from the main .venv.
        for k in ("VIRTUAL_ENV", "PYTHONHOME", "RAY_ADDRESS"):
            env.pop(k, None)
        return env | self.extra_env

    def start(self, timeout: float = 300.0) -> None:
        become_subreaper()
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, env=self.env(), stdout=self._log,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        ready = threading.Event()
        url: dict[str, str] = {}

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self._log.write(line)
                self._log.flush()
                m = re.search(r"listening on (http://\S+:\d+)", line)
                if m and "base" not in url:
                    url["base"] = m.group(1)
                if "ready, serving" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or "base" not in url or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"ray did not start serving {self.app} within {timeout:.0f}s; see {self.log_path}")
        self.base = url["base"]
        self.start_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(45)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the group (Ray's agents outlive its driver).
        for sig, pause in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.5)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            time.sleep(pause)
            reap()
        if self.proc.poll() is None:
            self.proc.wait(10)
        reap()
        self.proc = None
        if self._log is not None:
            self._log.close()
