"""Machines on one LAN, made for real on one host: a network namespace per
machine, each joined by a veth pair to a bridge in this namespace. Each
machine has its own address and its own loopback, as separate hosts do;
this side (the bridge's address) is where a test's etcd and clients are.

Needs root (CAP_NET_ADMIN); ``Subnet`` raises when the host refuses, and
a test can fall back to loopback then."""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterable

_made = itertools.count()  # subnets made by this process: names and addresses differ


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


class Subnet:
    """Namespaces named after ``names`` on bridge ``10.K.M.0/24`` (K from
    the process, M from 78 up per subnet it makes): this side is
    ``host_ip`` (``.1``), machine ``i`` is ``ip[name]`` (``.i+2``)."""

    def __init__(self, names: Iterable[str]) -> None:
        pid, seq = os.getpid(), next(_made) % 100
        k, m = pid % 200 + 20, 78 + seq
        tag = f"{pid % 100000}{seq}"
        self.bridge = f"ssb{tag}"
        self.host_ip = f"10.{k}.{m}.1"
        self.ip: dict[str, str] = {}
        self.ns: dict[str, str] = {}
        self._links: dict[str, str] = {}  # machine -> this side's end of its veth pair
        self._cut: set[str] = set()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        try:
            _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                ns, host_if, ns_if = f"ss{tag}-{name}", f"sv{tag}h{i}", f"sv{tag}n{i}"
                ip = f"10.{k}.{m}.{i + 2}"
                _run("ip", "netns", "add", ns)
                self.ns[name] = ns
                _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
                self._links[name] = host_if
                _run("ip", "link", "set", ns_if, "netns", ns)
                _run("ip", "link", "set", host_if, "master", self.bridge)
                _run("ip", "link", "set", host_if, "up")
                for cmd in (["ip", "addr", "add", f"{ip}/24", "dev", ns_if], ["ip", "link", "set", ns_if, "up"],
                            ["ip", "link", "set", "lo", "up"]):
                    _run("ip", "netns", "exec", ns, *cmd)
                self.ip[name] = ip
        except Exception:
            self.close()
            raise

    def partition(self, name: str) -> None:
        """Cut machine ``name`` off from every other (its link goes down, as
        a pulled cable: packets go nowhere and nothing is refused)."""
        _run("ip", "link", "set", self._links[name], "down")
        self._cut.add(name)

    def heal(self, name: str) -> None:
        if name in self._cut:
            _run("ip", "link", "set", self._links[name], "up")
            self._cut.discard(name)

    def wrap(self, name: str) -> list[str]:
        """The command prefix that runs a process on machine ``name``."""
        return ["ip", "netns", "exec", self.ns[name]]

    def close(self) -> None:
        for cmd in ([["ip", "link", "del", link] for link in self._links.values()]
                    + [["ip", "netns", "del", ns] for ns in self.ns.values()]
                    + [["ip", "link", "del", self.bridge]]):
            subprocess.run(cmd, capture_output=True, timeout=10)
