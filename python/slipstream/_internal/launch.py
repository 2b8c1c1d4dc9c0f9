"""Run `slipstream serve` in the background from Python: for scripts,
notebooks, clients and benchmarks that need a live node.

    with ss.launch("examples/rag.py") as node:
        requests.post(f"{node.url}/v1/pipelines/rag/infer", json={...})

The node is a child process on a free port; `launch` returns once every
worker is ready (or raises with the node's output if it could not start) and
the context manager stops it gracefully (SIGINT: drain, then exit). Its
object store is ephemeral unless `store=DIR` names a directory to keep it
in (then `ss.store.Store(node.url)` reads what a previous run left).
Its gRPC endpoint (the Open Inference Protocol, for `tritonclient.grpc`)
is on a free port too, `node.grpc_url` ("HOST:PORT"; None with
`--no-grpc`).

`launch` and `serve` (the same in the foreground) take an app file or
`Pipeline` objects: those are written to a temporary bundle that the node
and its workers load as the app (bundle.py), removed when the node stops.
Keyword options are `slipstream serve` flags (`request_timeout=2` is
`--request-timeout 2`), parsed by the command's own parser (serve_cli.py).
"""

from __future__ import annotations

import contextlib
import io
import re
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from slipstream._internal import bundle
from slipstream._internal.api import Pipeline
from slipstream._internal.client import Client
from slipstream._internal.errors import ConfigError, ServeError
from slipstream._internal.serve_cli import parse_serve_args


class Server:
    """A `slipstream serve` child process."""

    def __init__(self, proc: subprocess.Popen[str], url: str, log: list[str], bundle_path: Path | None = None,
                 grpc_url: str | None = None):
        self.proc = proc
        self.url = url
        #: "HOST:PORT" of the gRPC endpoint (Open Inference Protocol), None when it is off.
        self.grpc_url = grpc_url
        self.log = log
        #: The temporary app file of a node started for Pipeline objects (None for an app file).
        self.bundle_path = bundle_path
        # The bundle goes when the node stops, or at the latest with this object.
        self._finalizer = weakref.finalize(self, bundle.remove, bundle_path) if bundle_path else None

    def client(self, **options: Any) -> Client:
        """An `ss.Client` for this node (`options`: as `ss.Client`'s)."""
        return Client(self.url, **options)

    def stop(self, timeout: float = 30.0) -> int:
        """Drain in-flight requests and stop; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._finalizer is not None:
            self._finalizer()
        return int(self.proc.returncode)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self.stop()


def option_flags(options: Mapping[str, Any]) -> list[str]:
    """Keyword options as `slipstream serve` flags: `request_timeout=2` ->
    `--request-timeout 2`, `True` -> the bare flag, a list -> the flag per
    item; `None` and `False` are left out."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                flags += [flag, str(v)]
        else:
            flags += [flag, str(value)]
    return flags


def _app_path(app: Any) -> tuple[str, Path | None, str]:
    """The app argument of `slipstream serve`, the bundle written for
    Pipeline objects (None for an app file), and what to call the app."""
    pipelines = bundle.as_pipelines(app)
    if pipelines is None:
        if not isinstance(app, (str, Path)):
            raise ConfigError(f"serve an app file or slipstream.Pipeline objects, not {type(app).__name__}")
        return str(app), None, str(app)
    path = bundle.write(pipelines)
    return str(path), path, "pipelines " + ", ".join(p.name for p in pipelines)


def _serve_args(argv: list[str]) -> Any:
    """`slipstream serve` arguments parsed by the command's parser (a usage error is a ConfigError)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse_serve_args(argv)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise ConfigError(f"invalid serve options {argv[1:]}: {lines[-1] if lines else 'see slipstream serve --help'}") \
            from None


def serve(app: str | Path | Pipeline | Iterable[Pipeline], *flags: str, **options: Any) -> None:
    """Serve an app file or `Pipeline` objects in this process until SIGINT
    or SIGTERM, as `slipstream serve APP FLAGS...` does; `options` are
    further flags (`port=8001`, `request_timeout=2`, `no_admission=True`)."""
    target, path, _ = _app_path(app)
    try:
        a = _serve_args([target, *flags, *option_flags(options)])
        a.fn(a)
    finally:
        if path is not None:
            bundle.remove(path)


def _start(target: str, flags: list[str], cwd: str | Path | None, store: str | Path | None
           ) -> subprocess.Popen[str]:
    # Both listeners on free ports; the caller's flags come after, so they win.
    argv = [target, "--port", "0", "--grpc-port", "0", *flags]
    if store is not None:
        argv += ["--store", str(store)]
    _serve_args(argv)  # a wrong option is a ConfigError here, not a node that does not start
    cmd = [sys.executable, "-m", "slipstream._internal.cli", "serve", *argv]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=cwd)


def launch(app: str | Path | Pipeline | Iterable[Pipeline], *flags: str, echo: bool = False,
           cwd: str | Path | None = None, store: str | Path | None = None, **options: Any) -> Server:
    """Start `slipstream serve APP --port 0 FLAGS...` and wait until it is ready.

    `app`: an app file, or `Pipeline` objects (one or a list; their classes
    may be defined anywhere, `__main__` and function bodies included).
    `options` are further flags, as for `serve`. `echo` copies the node's
    start-up lines to stderr. `store`: the object store's directory
    (`--store`; default: `$SLIPSTREAM_STORE`, else an ephemeral store)."""
    target, path, what = _app_path(app)
    try:
        proc = _start(target, [*flags, *option_flags(options)], cwd, store)
    except BaseException:
        if path is not None:
            bundle.remove(path)
        raise
    assert proc.stderr is not None
    url, grpc_url, log, ready = None, None, [], False
    for line in proc.stderr:
        log.append(line)
        if echo:
            sys.stderr.write("  " + line)
        m = re.search(r"listening on https?://([\d.]+:\d+)", line)
        if m:
            url = "http://" + m.group(1)  # plain HTTP is answered from this machine on a TLS port too
        m = re.search(r"gRPC listening on (\S+:\d+)", line)
        if m:
            grpc_url = m.group(1)
        if "ready, serving" in line:
            ready = True
            break
    if not ready or url is None:
        proc.kill()
        proc.wait()
        if path is not None:
            bundle.remove(path)
        raise ServeError("start", f"the node for {what} did not start:\n{''.join(log)}")
    # Keep draining its output so the node never blocks on a full pipe.
    def drain() -> None:
        for line in proc.stderr or []:
            log.append(line)
            if echo:
                sys.stderr.write("  " + line)

    threading.Thread(target=drain, daemon=True).start()
    return Server(proc, url, log, path, grpc_url)
