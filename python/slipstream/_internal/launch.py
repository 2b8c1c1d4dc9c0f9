"""Run `slipstream serve` in the background from Python: for scripts,
notebooks, clients and benchmarks that need a live node.

    with ss.launch("examples/rag.py") as node:
        requests.post(f"{node.url}/v1/pipelines/rag/infer", json={...})

The node is a child process on a free port; `launch` returns once every
worker is ready (or raises with the node's output if it could not start) and
the context manager stops it gracefully (SIGINT: drain, then exit). Its
object store is ephemeral unless `store=DIR` names a directory to keep it
in (then `ss.store.Store(node.url)` reads what a previous run left).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

from slipstream._internal.errors import ServeError


class Server:
    """A `slipstream serve` child process."""

    def __init__(self, proc: subprocess.Popen[str], url: str, log: list[str]):
        self.proc = proc
        self.url = url
        self.log = log

    def stop(self, timeout: float = 30.0) -> int:
        """Drain in-flight requests and stop; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.stop()


def launch(app: str | Path, *flags: str, echo: bool = False, cwd: str | Path | None = None,
           store: str | Path | None = None) -> Server:
    """Start `slipstream serve APP --port 0 FLAGS...` and wait until it is ready.

    `echo` copies the node's start-up lines to stderr. `store`: the object
    store's directory (`--store`; default: `$SLIPSTREAM_STORE`, else an
    ephemeral store)."""
    cmd = [sys.executable, "-m", "slipstream._internal.cli", "serve", str(app), "--port", "0", *flags]
    if store is not None:
        cmd += ["--store", str(store)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=cwd)
    assert proc.stderr is not None
    url, log, ready = None, [], False
    for line in proc.stderr:
        log.append(line)
        if echo:
            sys.stderr.write("  " + line)
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            url = m.group(1)
        if "ready, serving" in line:
            ready = True
            break
    if not ready or url is None:
        proc.kill()
        proc.wait()
        raise ServeError("start", f"the node for {app} did not start:\n{''.join(log)}")
    # Keep draining its output so the node never blocks on a full pipe.
    import threading

    def drain() -> None:
        for line in proc.stderr or []:
            log.append(line)
            if echo:
                sys.stderr.write("  " + line)

    threading.Thread(target=drain, daemon=True).start()
    return Server(proc, url, log)
