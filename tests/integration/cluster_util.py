"""Real etcd members and cluster nodes for the cluster tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.conftest import APPS, ROOT, SLIPSTREAM, Node

TOKEN = "test-cluster-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """`members` real etcd processes forming one cluster, on loopback."""

    def __init__(self, members: int = 1, host: str = "127.0.0.1") -> None:
        self.host = host
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd not found: apt-get install etcd-server (scripts/bootstrap.sh does)")
        self.dir = Path(tempfile.mkdtemp(prefix="slipstream-etcd-"))
        self.names = [f"e{i}" for i in range(members)]
        self.client = [free_port() for _ in self.names]
        self.peer = [free_port() for _ in self.names]
        self.initial = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer, strict=True))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        for i in range(members):
            self.start(i)
        self.wait_healthy()

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{self.host}:{p}" for p in self.client)

    def start(self, i: int) -> None:
        """Start member `i` (again: on its data directory, rejoining the cluster)."""
        n = self.names[i]
        log = open(self.dir / f"{n}.log", "ab")  # noqa: SIM115 (lives as long as the process)
        self.procs[i] = subprocess.Popen(
            ["etcd", "--name", n, "--data-dir", str(self.dir / n),
             "--listen-client-urls", f"http://{self.host}:{self.client[i]}",
             "--advertise-client-urls", f"http://{self.host}:{self.client[i]}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
             "--initial-cluster", self.initial,
             "--initial-cluster-state", "existing" if (self.dir / n).exists() else "new",
             "--heartbeat-interval", "50", "--election-timeout", "500"],
            stdout=log, stderr=subprocess.STDOUT)

    def kill(self, i: int) -> None:
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
                with urllib.request.urlopen(f"http://{self.host}:{port}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("etcd did not become healthy")

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)
        shutil.rmtree(self.dir, ignore_errors=True)


def deploy(etcd: Etcd, app: str, *args: str, token: str = TOKEN, wait: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SLIPSTREAM, "deploy", app, "--cluster", etcd.url, "--token", token,
                           "--wait", str(wait), *args], cwd=ROOT, capture_output=True, text=True, timeout=wait + 60)


def start_node(etcd: Etcd, name: str, *args: str, token: str = TOKEN, ttl: int = 2,
               wrap: list[str] | None = None) -> Node:
    return Node("", "--cluster", etcd.url, "--token", token, "--name", name, "--ttl", str(ttl),
                "--request-timeout", "10", *args, command="node", wrap=wrap)


class Netns:
    """A network namespace joined to this one by a veth pair: this side is
    `host_ip`, the namespace's side `ns_ip`. `partition()` drops every packet
    between them (a blackhole route: established connections go silent, as
    in a real partition); `heal()` undoes it."""

    def __init__(self) -> None:
        import os

        k = os.getpid() % 200 + 20
        self.name = f"ssp{os.getpid()}"
        self.host_if, self.ns_if = f"sh{os.getpid()}"[:15], f"sn{os.getpid()}"[:15]
        self.host_ip, self.ns_ip = f"10.{k}.77.1", f"10.{k}.77.2"
        run = self.run
        run("ip", "netns", "add", self.name)
        try:
            run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            run("ip", "link", "set", self.ns_if, "netns", self.name)
            run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            run("ip", "link", "set", self.host_if, "up")
            for cmd in (["ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if],
                        ["ip", "link", "set", self.ns_if, "up"], ["ip", "link", "set", "lo", "up"]):
                run(*self.wrap, *cmd)
        except Exception:
            self.close()
            raise
        self.partitioned = False

    @property
    def wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    @staticmethod
    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, timeout=10)

    def partition(self) -> None:
        self.run("ip", "route", "add", "blackhole", f"{self.ns_ip}/32")
        self.partitioned = True

    def heal(self) -> None:
        if self.partitioned:
            self.run("ip", "route", "del", "blackhole", f"{self.ns_ip}/32")
            self.partitioned = False

    def close(self) -> None:
        for cmd in (["ip", "route", "del", "blackhole", f"{self.ns_ip}/32"], ["ip", "link", "del", self.host_if],
                    ["ip", "netns", "del", self.name]):
            subprocess.run(cmd, capture_output=True, timeout=10)


CLUSTER_APP = str(APPS / "cluster.py")
