"""Real nodes, etcd members and clusters on free ports: the implementation
behind the public ``slipstream.testing`` (see its docstring for the why).

Invariants:

- Every process is a child of the caller, started on port 0 (or on a port
  just found free, where the program cannot take port 0: etcd), so tests
  and benchmarks running side by side never collide.
- A ``Node`` knows its URL from the node's own log line ``listening on
  http(s)://HOST:PORT`` (a TLS port answers plain HTTP from this machine, so
  ``url`` is always ``http://``; ``scheme`` says what others must speak)
  and its readiness from ``ready, serving``; both are
  matched as substrings, whatever prefix or other lines the node prints.
- The node's output is drained by a thread into ``Node.lines`` from the
  start, so a node never blocks on a full pipe and a failure can show it.
- ``stop()`` is idempotent and always reaps the process; a Pipeline bundle
  written for a node goes with it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from slipstream._internal import bundle

if TYPE_CHECKING:
    from slipstream._internal.api import Pipeline
    from slipstream._internal.client import Client

#: The command line of the `slipstream` CLI in this interpreter.
CLI = [sys.executable, "-m", "slipstream._internal.cli"]
#: The cluster token `deploy`, `start_node` and `Cluster` use unless given another.
TOKEN = "test-cluster-token"

_LISTENING = re.compile(r"listening on (https?)://(\S+):(\d+)")
_GRPC_LISTENING = re.compile(r"gRPC listening on (\S+:\d+)")
_READY = "ready, serving"

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (for programs that cannot take port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], timeout: float = 20.0, every: float = 0.05) -> T:
    """Call `predicate` every `every` seconds until it returns something true
    and return that; AssertionError after `timeout` seconds. A connection
    reset or refused while polling counts as "not yet" (a node that waited
    for a deployment hands its port from the waiting server to the node,
    and a request caught in between is reset); the last one is named if
    time runs out."""
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (ConnectionError, urllib.error.URLError) as e:
            # urllib wraps a refused connection in a URLError (no
            # ConnectionError): that is "not yet" too; any other URLError is not.
            if isinstance(e, urllib.error.URLError) and not isinstance(e.reason, ConnectionError):
                raise
            last = e
        else:
            if value:
                return value
        time.sleep(every)
    raise AssertionError("condition not met in time" + (f" (last: {last!r})" if last else ""))


class Node:
    """A `slipstream serve APP` (or `slipstream node`) child process on port 0.

    The constructor returns once the node listens (``url`` is known);
    ``wait_ready()`` waits for every worker. As a context manager it waits
    for readiness on entry and stops the node on exit.
    """

    def __init__(self, app: str | Path | Pipeline | Iterable[Pipeline] | None, *args: str,
                 command: str = "serve", env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 wrap: list[str] | None = None, echo: bool = False, ready_timeout: float = 60.0) -> None:
        """`app`: an app file or `Pipeline` objects (None for `command="node"`,
        a cluster member, which gets its app from the cluster); `args`: more
        flags; `env`: variables over this process's environment; `wrap`: a
        command prefix (e.g. ``ip netns exec NS``); `echo`: copy the node's
        output to stderr; `ready_timeout`: seconds to wait for the listening
        line here, and for readiness in ``wait_ready()`` by default."""
        self.ready_timeout = ready_timeout
        self.echo = echo
        self.bundle_path: Path | None = None
        argv = [command]
        if command == "serve":
            if app is None:
                raise ValueError("slipstream serve needs an app")
            pipelines = bundle.as_pipelines(app)
            if pipelines is not None:
                self.bundle_path = bundle.write(pipelines)
            argv.append(str(self.bundle_path or app))
        try:
            self.proc = subprocess.Popen(
                [*(wrap or []), *CLI, *argv, "--port", "0", *args],
                cwd=cwd,
                env={**os.environ, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        except BaseException:
            if self.bundle_path is not None:
                bundle.remove(self.bundle_path)
            raise
        #: Every line the node printed so far (stdout and stderr together).
        self.lines: list[str] = []
        #: "HOST:PORT" of its gRPC endpoint, None when it has none.
        self.grpc_url: str | None = None
        self._url: str | None = None
        #: "https" when the node's ports speak TLS (its ingress_tls setting).
        self.scheme = "http"
        self._serving = False  # it printed the ready line
        self._ready = threading.Event()  # or exited
        self._listening = threading.Event()  # or exited
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._listening.wait(ready_timeout):
            self.stop()
            raise RuntimeError("node did not start listening:\n" + self.log())
        #: "http://HOST:PORT" of its HTTP endpoint ("" if it exited before
        #: listening: see ``proc.returncode`` and ``log()``).
        self.url: str = self._url or ""

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.echo:
                sys.stderr.write("  " + line)
            grpc = _GRPC_LISTENING.search(line)
            if grpc:
                self.grpc_url = grpc.group(1)
            http = _LISTENING.search(line)
            if http and self._url is None:
                scheme, host, port = http.groups()
                # A node listening on every interface is reached on loopback.
                host = "127.0.0.1" if host in ("0.0.0.0", "[::]") else host
                self.scheme = scheme
                # A TLS port answers plain HTTP from this machine too: the
                # helpers below need no certificate.
                self._url = f"http://{host}:{port}"
                self._listening.set()
            if _READY in line:
                self._serving = True
                self._ready.set()
        # It exited: stop waiting for either line.
        self._listening.set()
        self._ready.set()

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def log(self) -> str:
        """Everything the node printed so far."""
        return "".join(self.lines)

    def is_ready(self) -> bool:
        """Whether ``GET /readyz`` answers 200 (every stage it serves has a live replica)."""
        return self.request("GET", "/readyz")[0] == 200

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait until every worker is ready (`ready, serving`); RuntimeError
        with the node's output if it is not within `timeout` or exits."""
        self._ready.wait(self.ready_timeout if timeout is None else timeout)
        if not self._serving or self.proc.poll() is not None:
            raise RuntimeError("node did not become ready:\n" + self.log())

    def client(self, **options: Any) -> Client:
        """An ``ss.Client`` for this node (`options`: as ``ss.Client``'s)."""
        from slipstream._internal.client import Client

        return Client(self.url, **options)

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        """One HTTP request: (status, headers, body); `body` is bytes or JSON-able."""
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()
        except urllib.error.URLError as e:
            if not isinstance(e.reason, ConnectionRefusedError):
                raise
            # Nothing listens: say whether the node ended and what it printed,
            # or a failure in a parallel run leaves nothing to go on.
            code = self.proc.poll()
            state = "still running" if code is None else f"exited with {code}"
            raise ConnectionRefusedError(
                f"{method} {self.url}{path}: connection refused; the node (pid {self.pid}) is {state}. "
                f"It printed:\n{self.log()[-6000:]}") from e

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
        """One stage's entry of ``/v1/status``."""
        for p in self.status()["pipelines"]:
            if p["name"] == pipeline:
                for s in p["stages"]:
                    if s["name"] == stage:
                        return s
        raise KeyError(stage)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` (SIGTERM: drain, then exit), kill after `timeout` s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.bundle_path is not None:
            bundle.remove(self.bundle_path)
            self.bundle_path = None
        return int(self.proc.returncode)

    def __enter__(self) -> Node:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class ClusterCA:
    """A cluster CA in a private directory (``slipstream tls ca``);
    ``issue(name, ...)`` is the directory of a certificate for `name` (made
    once: ``slipstream tls cert``), what ``--tls`` takes."""

    def __init__(self) -> None:
        from slipstream import _core

        self.dir = Path(tempfile.mkdtemp(prefix="slipstream-ca-"))
        _core.tls_make_ca(self.dir / "ca", 2)

    def issue(self, *names: str) -> Path:
        from slipstream import _core

        out = self.dir / names[0]
        if not out.exists():
            _core.tls_issue(self.dir / "ca", out, list(names), 1)
        return out

    def stop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Etcd:
    """`members` real etcd processes forming one cluster on `host`, each in a
    private data directory removed by ``stop()``. With ``tls=True`` they
    speak TLS to clients and to each other and require client certificates,
    all from a ``ClusterCA`` of their own (``ca``): ``url`` is then
    ``etcds://``, and ``deploy``/``start_node`` show certificates of it."""

    def __init__(self, members: int = 1, host: str = "127.0.0.1", tls: bool = False) -> None:
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd not found: apt-get install etcd-server (scripts/bootstrap.sh does)")
        self.host = host
        self.dir = Path(tempfile.mkdtemp(prefix="slipstream-etcd-"))
        self.ca = ClusterCA() if tls else None
        self.scheme = "https" if tls else "http"
        self.names = [f"e{i}" for i in range(members)]
        self.client = [free_port() for _ in self.names]
        self.peer = [free_port() for _ in self.names]
        self.initial = ",".join(f"{n}={self.scheme}://127.0.0.1:{p}"
                                for n, p in zip(self.names, self.peer, strict=True))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        try:
            for i in range(members):
                self.start(i)
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The cluster address nodes take: ``etcd://HOST:PORT,...`` (``etcds://`` with TLS)."""
        return ("etcds://" if self.ca else "etcd://") + ",".join(f"{self.host}:{p}" for p in self.client)

    def tls_args(self, name: str) -> list[str]:
        """``--tls DIR`` with a certificate for `name`, when etcd speaks TLS."""
        return ["--tls", str(self.ca.issue(name))] if self.ca else []

    def start(self, i: int) -> None:
        """Start member `i` (again: on its data directory, rejoining the cluster)."""
        n = self.names[i]
        tls: list[str] = []
        if self.ca:
            d = self.ca.issue(f"etcd-{n}", self.host, "127.0.0.1")
            files = ["--cert-file", str(d / "tls.crt"), "--key-file", str(d / "tls.key"),
                     "--trusted-ca-file", str(d / "ca.crt")]
            tls = [*files, "--client-cert-auth", *[f.replace("--", "--peer-", 1) for f in files],
                   "--peer-client-cert-auth"]
        log = open(self.dir / f"{n}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        self.procs[i] = subprocess.Popen(
            ["etcd", "--name", n, "--data-dir", str(self.dir / n),
             "--listen-client-urls", f"{self.scheme}://{self.host}:{self.client[i]}",
             "--advertise-client-urls", f"{self.scheme}://{self.host}:{self.client[i]}",
             "--listen-peer-urls", f"{self.scheme}://127.0.0.1:{self.peer[i]}",
             "--initial-advertise-peer-urls", f"{self.scheme}://127.0.0.1:{self.peer[i]}",
             "--initial-cluster", self.initial,
             "--initial-cluster-state", "existing" if (self.dir / n).exists() else "new",
             "--heartbeat-interval", "50", "--election-timeout", "500", *tls],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child has its own descriptor

    def kill(self, i: int) -> None:
        """SIGKILL member `i` (its data stays: ``start(i)`` brings it back)."""
        p = self.procs[i]
        if p is not None:
            p.kill()
            p.wait()
            self.procs[i] = None

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                port = next(c for c, p in zip(self.client, self.procs, strict=True) if p is not None)
                context = None
                if self.ca:
                    from slipstream._internal.cluster_cli import _etcd_tls

                    context = _etcd_tls(self.ca.issue("health"))
                with urllib.request.urlopen(f"{self.scheme}://{self.host}:{port}/health", timeout=1,
                                            context=context) as r:
                    if b"true" in r.read():
                        return
            except (OSError, StopIteration):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not become healthy (logs in {self.dir})")

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.ca:
            self.ca.stop()

    def __enter__(self) -> Etcd:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def deploy(etcd: Etcd, app: str | Path, *args: str, token: str = TOKEN, wait: float = 60.0,
           env: dict[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.CompletedProcess[str]:
    """`slipstream deploy APP --cluster ETCD`: publish an app to the cluster
    (`wait`: seconds to wait for it to be placed, 0 to return at once)."""
    return subprocess.run([*CLI, "deploy", str(app), "--cluster", etcd.url, "--token", token,
                           "--wait", str(wait), *etcd.tls_args("deploy"), *args], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=wait + 60)


def stop_all(nodes: Iterable[Node]) -> None:
    """SIGTERM every node at once and wait for all (each drains, or is killed
    after 30 s, on its own clock). Cluster members stopped one by one would
    each hand their stages over to the ones still running first."""
    stops = [threading.Thread(target=n.stop) for n in nodes]
    for t in stops:
        t.start()
    for t in stops:
        t.join()


def start_node(etcd: Etcd, name: str, *args: str, token: str = TOKEN, ttl: int = 2, wrap: list[str] | None = None,
               env: dict[str, str] | None = None) -> Node:
    """A cluster member (`slipstream node`) named `name`, joined through
    `etcd`, with a `ttl`-second lease (short, so a killed member leaves soon);
    with a certificate for `name` (``--tls``) when etcd speaks TLS."""
    return Node(None, "--cluster", etcd.url, "--token", token, "--name", name, "--ttl", str(ttl),
                "--request-timeout", "10", *etcd.tls_args(name), *args, command="node", wrap=wrap, env=env)


# --- machines on one LAN, on one host ----------------------------------------------------------
# A network namespace per machine, each joined by a veth pair to a bridge in
# this namespace: each machine has its own address and its own loopback, as
# separate hosts do; this side (the bridge's address) is where etcd and the
# clients are. Needs root (CAP_NET_ADMIN); ``Subnet`` raises when the host
# refuses, and a caller can fall back to loopback then.

_subnets_made = itertools.count()  # subnets made by this process: names and addresses differ


def _ip(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


class Subnet:
    """Namespaces named after ``names`` on bridge ``10.K.M.0/24`` (K from
    the process, M from 78 up per subnet it makes): this side is
    ``host_ip`` (``.1``), machine ``i`` is ``ip[name]`` (``.i+2``)."""

    def __init__(self, names: Iterable[str]) -> None:
        pid, seq = os.getpid(), next(_subnets_made) % 100
        k, m = pid % 200 + 20, 78 + seq
        tag = f"{pid % 100000}{seq}"
        self.bridge = f"ssb{tag}"
        self.host_ip = f"10.{k}.{m}.1"
        self.ip: dict[str, str] = {}
        self.ns: dict[str, str] = {}
        self._links: dict[str, str] = {}  # machine -> this side's end of its veth pair
        self._cut: set[str] = set()
        _ip("ip", "link", "add", self.bridge, "type", "bridge")
        try:
            _ip("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _ip("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                ns, host_if, ns_if = f"ss{tag}-{name}", f"sv{tag}h{i}", f"sv{tag}n{i}"
                ip = f"10.{k}.{m}.{i + 2}"
                _ip("ip", "netns", "add", ns)
                self.ns[name] = ns
                _ip("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
                self._links[name] = host_if
                _ip("ip", "link", "set", ns_if, "netns", ns)
                _ip("ip", "link", "set", host_if, "master", self.bridge)
                _ip("ip", "link", "set", host_if, "up")
                for cmd in (["ip", "addr", "add", f"{ip}/24", "dev", ns_if], ["ip", "link", "set", ns_if, "up"],
                            ["ip", "link", "set", "lo", "up"]):
                    _ip("ip", "netns", "exec", ns, *cmd)
                self.ip[name] = ip
        except Exception:
            self.close()
            raise

    def partition(self, name: str) -> None:
        """Cut machine ``name`` off from every other (its link goes down, as
        a pulled cable: packets go nowhere and nothing is refused)."""
        _ip("ip", "link", "set", self._links[name], "down")
        self._cut.add(name)

    def heal(self, name: str) -> None:
        if name in self._cut:
            _ip("ip", "link", "set", self._links[name], "up")
            self._cut.discard(name)

    def wrap(self, name: str) -> list[str]:
        """The command prefix that runs a process on machine ``name``."""
        return ["ip", "netns", "exec", self.ns[name]]

    def node_flags(self, name: str) -> tuple[str, ...]:
        """A node's flags to serve and listen on machine ``name``'s address."""
        ip = self.ip[name]
        return ("--host", ip, "--data-listen", f"{ip}:0")

    def close(self) -> None:
        for cmd in ([["ip", "link", "del", link] for link in self._links.values()]
                    + [["ip", "netns", "del", ns] for ns in self.ns.values()]
                    + [["ip", "link", "del", self.bridge]]):
            subprocess.run(cmd, capture_output=True, timeout=10)


class Cluster:
    """etcd and `nodes` cluster members serving `app`, every member ready.

    The app is deployed before the members start, so each one's first
    placement already includes it; ``url`` is the first member's (any
    member's ingress routes across the cluster)."""

    def __init__(self, app: str | Path, nodes: int = 3, *node_args: str, etcd_members: int = 1,
                 env: dict[str, str] | None = None, token: str = TOKEN, ttl: int = 2,
                 timeout: float = 120.0, deploy_args: Sequence[str] = (), subnet: Subnet | None = None) -> None:
        """`subnet`: run member ``nK`` on that subnet's machine ``nK`` (its
        own network namespace and address), etcd on the subnet's host side."""
        self.etcd = Etcd(etcd_members, host=subnet.host_ip if subnet else "127.0.0.1")
        self.nodes: list[Node] = []
        try:
            out = deploy(self.etcd, app, *deploy_args, token=token, wait=0, env=env)
            if out.returncode != 0:
                raise RuntimeError(f"slipstream deploy {app} failed:\n{out.stdout}{out.stderr}")
            for i in range(nodes):
                name = f"n{i + 1}"
                at = subnet.node_flags(name) if subnet else ()
                self.nodes.append(start_node(self.etcd, name, *node_args, *at, token=token, ttl=ttl, env=env,
                                             wrap=subnet.wrap(name) if subnet else None))
            first = self.nodes[0]
            wait_for(lambda: len(first.status()["cluster"]["members"]) == nodes, timeout=timeout)
            for n in self.nodes:
                wait_for(n.is_ready, timeout=timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        stop_all(self.nodes)
        self.etcd.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
