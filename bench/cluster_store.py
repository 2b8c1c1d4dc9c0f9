"""`make bench-cluster-store`: the cluster's one store, beside one node and Redis.

On one real etcd and three nodes on this machine (loopback; each its own
process and store directory), for 1, 2 and 3 copies per value
(`slipstream node --store-replicas RF`), one client at a time:

- **put**: a put through node n1 (hash, copy to the RF nodes of the key's
  replica set, each fsyncs; one etcd transaction commits), p50 and p99;
- **get, from a peer**: the first read of a key through a node that holds
  no copy (sync with etcd, fetch from a holder over the data plane, check
  the digest, keep the copy);
- **get, local**: the same keys read again through that node (a latest
  read still asks etcd for the key's head first);
- **get, local, stale=1**: the same without the etcd round trip.

Beside them, in the same run: one node (`slipstream serve`, its own store)
and Redis (`--appendonly yes --appendfsync always`, the same durability
as a put's fsync, and without persistence), each with the same client
loop. Sizes 1 KB, 1 MB and 100 MB. Repeats are interleaved and the median
of each repeat's p50/p99 is reported. Writes
bench/results/cluster_store.{json,md}; the load average at the start is
recorded (run it on an idle machine).

    .venv/bin/python -m bench.cluster_store [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from slipstream.testing import Etcd, Node, deploy, free_port, start_node, stop_all, wait_for

from bench.harness import RESULTS, ROOT, percentile
from bench.store import REDIS, HttpClient, RedisClient, log

APP = ROOT / "bench" / "apps" / "store.py"
SIZES = {"1KB": 1 << 10, "1MB": 1 << 20, "100MB": 100 << 20}


def ops_for(label: str, quick: bool) -> int:
    n = {"1KB": 300, "1MB": 60, "100MB": 4}[label]
    return max(2, n // 5) if quick else n


def addr_of(url: str) -> tuple[str, int]:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def holders(url: str, key: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/v1/store/versions{key}", timeout=30) as r:
        versions = json.loads(r.read())["versions"]
    return list(versions[-1].get("holders", []))


def joined(n: Node, members: int) -> bool:
    """`n` is ready and sees `members` members."""
    return n.is_ready() and len(n.status()["cluster"]["members"]) == members


def timed(ops: list[Any]) -> dict[str, float]:
    """Run each zero-argument op in turn; p50/p99 of their times."""
    took = []
    for op in ops:
        t0 = time.perf_counter()
        op()
        took.append(time.perf_counter() - t0)
    return {"p50_ms": percentile(took, 50) * 1e3, "p99_ms": percentile(took, 99) * 1e3, "ops": len(ops)}


def puts(c: HttpClient | RedisClient, keys: list[str], value: bytes) -> dict[str, float]:
    return timed([functools.partial(c.put, k, value) for k in keys])


def gets(via: dict[str, HttpClient | RedisClient], keys: list[str], buf: memoryview,
         stale: bool = False) -> dict[str, float]:
    """Each key read through its client in `via`."""
    if stale:
        return timed([functools.partial(stale_get, via[k], k, buf) for k in keys])
    return timed([functools.partial(via[k].get, k, buf) for k in keys])


def stale_get(c: Any, key: str, buf: memoryview) -> None:
    c.c.request("GET", "/v1/store/objects" + key + "?stale=1")
    r = c.c.getresponse()
    got = r.readinto(buf)
    rest = r.read()
    if r.status != 200 or got is None:
        raise RuntimeError(f"GET {key}?stale=1: {r.status} {rest[:200]!r}")


def cluster_point(rf: int, rep: int, quick: bool) -> dict[str, Any]:
    """Put and get figures for each size on a fresh three-node cluster with `rf` copies."""
    etcd = Etcd(1)
    nodes: dict[str, Node] = {}
    out: dict[str, Any] = {}
    try:
        d = deploy(etcd, APP, wait=0)
        if d.returncode != 0:
            raise RuntimeError(d.stdout + d.stderr)
        for name in ("n1", "n2", "n3"):
            nodes[name] = start_node(etcd, name, "--store-replicas", str(rf))
        for n in nodes.values():
            wait_for(functools.partial(joined, n, 3), timeout=120)
        for label in SIZES:
            keys, value, buf = workload(label, rep, quick)
            c1 = HttpClient(addr_of(nodes["n1"].url))
            point: dict[str, Any] = {"put": puts(c1, keys, value)}
            c1.close()
            # Read each key through a node holding no copy of it (when RF < 3).
            outsiders = {}
            for k in keys:
                hs = holders(nodes["n1"].url, k)
                outsiders[k] = next((name for name in nodes if name not in hs), None)
            clients: dict[str, HttpClient | RedisClient] = {name: HttpClient(addr_of(nodes[name].url))
                                                            for name in nodes}
            if all(outsiders.values()):
                via = {k: clients[str(o)] for k, o in outsiders.items()}
                point["get_peer"] = gets(via, keys, buf)
            else:
                via = {k: clients["n2"] for k in keys}
            point["get_local"] = gets(via, keys, buf)
            point["get_local_stale"] = gets(via, keys, buf, stale=True)
            for c in clients.values():
                c.close()
            out[label] = point
            log(f"  RF {rf} {label}: " + ", ".join(f"{k} p50 {v['p50_ms']:.2f} ms" for k, v in point.items()))
    finally:
        stop_all(nodes.values())
        etcd.stop()
    return out


def workload(label: str, rep: int, quick: bool) -> tuple[list[str], bytes, memoryview]:
    """The keys, value and read buffer of one size's point."""
    size = SIZES[label]
    value = np.random.default_rng(rep).integers(0, 255, size=size, dtype=np.uint8).tobytes()
    return [f"/bench/r{rep}/{label}/{i}" for i in range(ops_for(label, quick))], value, memoryview(bytearray(size))


def one_server(c: HttpClient | RedisClient, rep: int, quick: bool) -> dict[str, Any]:
    """Puts then gets of each size through one client of one server."""
    out: dict[str, Any] = {}
    for label in SIZES:
        keys, value, buf = workload(label, rep, quick)
        out[label] = {"put": puts(c, keys, value), "get_local": gets(dict.fromkeys(keys, c), keys, buf)}
        if isinstance(c, RedisClient):
            c.command(b"FLUSHALL")
    c.close()
    return out


def single_point(rep: int, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d, Node(str(APP), "--store", d) as node:
        return one_server(HttpClient(addr_of(node.url)), rep, quick)


def redis_point(rep: int, quick: bool, fsync: bool) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        args = ["--appendonly", "yes", "--appendfsync", "always"] if fsync else ["--appendonly", "no"]
        proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d,
                                 "--proto-max-bulk-len", "1gb", *args], stdout=subprocess.DEVNULL)
        try:
            client = wait_for(lambda: _try_redis(port), timeout=20)
            assert client is not None
            return one_server(client, rep, quick)
        finally:
            proc.terminate()
            proc.wait(10)


def _try_redis(port: int) -> RedisClient | None:
    try:
        return RedisClient(("127.0.0.1", port))
    except OSError:
        return None


def medians(reps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label in reps[0]:
        out[label] = {}
        for op in reps[0][label]:
            out[label][op] = {m: float(np.median([r[label][op][m] for r in reps])) for m in ("p50_ms", "p99_ms")}
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# The cluster store (bench/cluster_store.py)\n\nload average at start: {res['load_avg']}; "
             f"{res['repeats']} repeat(s), medians of each repeat's p50/p99 (ms); one client.\n",
             "| side | size | put p50 | put p99 | get from a peer p50 | p99 | get local p50 | p99 | "
             "get local stale=1 p50 | p99 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for side, figs in res["sides"].items():
        for label, f in figs.items():
            def cell(op: str, m: str, f: dict[str, Any] = f) -> str:
                return f"{f[op][m]:.2f}" if op in f else "-"
            lines.append(f"| {side} | {label} | {cell('put', 'p50_ms')} | {cell('put', 'p99_ms')} | "
                         f"{cell('get_peer', 'p50_ms')} | {cell('get_peer', 'p99_ms')} | "
                         f"{cell('get_local', 'p50_ms')} | {cell('get_local', 'p99_ms')} | "
                         f"{cell('get_local_stale', 'p50_ms')} | {cell('get_local_stale', 'p99_ms')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: few operations, one repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"of {','.join(SIZES)}")
    ap.add_argument("--out", default=None, help="results file (default bench/results/cluster_store.json)")
    a = ap.parse_args()
    for s in a.sizes.split(","):
        if s not in SIZES:
            ap.error(f"--sizes: {s} is not one of {','.join(SIZES)}")
    for s in list(SIZES):
        if s not in a.sizes.split(","):
            del SIZES[s]
    if not Path(REDIS).exists():
        ap.error(f"{REDIS} is missing (Debian: apt-get install redis-server)")
    repeats = 1 if a.quick else a.repeats
    load = os.getloadavg()
    log(f"load average at start: {load}")
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(repeats):
        for rf in (1, 2, 3):
            log(f"repeat {rep + 1}/{repeats}: cluster, RF {rf}")
            runs.setdefault(f"cluster RF {rf}", []).append(cluster_point(rf, rep, a.quick))
        log(f"repeat {rep + 1}/{repeats}: one node")
        runs.setdefault("one node", []).append(single_point(rep, a.quick))
        for fsync in (True, False):
            runs.setdefault(f"redis{' fsync' if fsync else ''}", []).append(redis_point(rep, a.quick, fsync))
    res = {"load_avg": [round(x, 2) for x in load], "repeats": repeats, "quick": a.quick,
           "sides": {side: medians(reps) for side, reps in runs.items()}, "runs": runs}
    out = Path(a.out) if a.out else RESULTS / f"cluster_store{'-quick' if a.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
