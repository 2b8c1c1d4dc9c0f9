"""`make bench-store`: the node's object store through HTTP against Redis.

Put and get latency (p50, p99) and throughput (ops/s, and GB/s for large
values) for 1 KB, 1 MB and 100 MB values, with 1 client and with 8 clients
(separate processes, so the GIL does not limit the clients), against:

- slipstream: `slipstream serve bench/apps/store.py --store TMP` (a pool
  keeping one version per key under /bench/, so a put replaces the value,
  as SET does). A put is answered once it is durable: the value's blob
  file (values over 64 KiB) or the metadata commit is fsynced first.
- redis: /usr/bin/redis-server on loopback, no persistence
  (`--save '' --appendonly no`): the in-memory ceiling.
- redis-fsync: `--appendonly yes --appendfsync always`: every SET is
  written to the append-only file and fsynced before the reply, the
  durability the store promises.

Both sides are driven the same way: one raw keep-alive connection per
client (http.client for HTTP, RESP spoken over a socket for Redis, no
client library), values sent from memory and read into a preallocated
buffer. Each point is run `--repeats` times (3; interleaved across the
three servers) and the median of each repeat's p50, p99 and ops/s is
reported. Large-value gets are put beside this machine's memory copy
bandwidth (numpy, 1 GiB array), and a reader on the same machine is timed
mapping the 100 MB value's blob file (`GET ?meta=1` gives its path) against
reading it over HTTP.

Writes bench/results/store.{json,md}. Run it when the machine is idle (the
load average at the start is recorded). `--quick`: a smoke run (few ops,
one repeat, a 256 MiB copy).

    .venv/bin/python -m bench.store [--quick] [--sizes 1KB,1MB]
"""

from __future__ import annotations

import argparse
import http.client
import json
import mmap
import multiprocessing as mp
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.harness import RESULTS, ROOT, free_port, percentile

APP = ROOT / "bench" / "apps" / "store.py"
REDIS = "/usr/bin/redis-server"
SIZES = {"1KB": 1 << 10, "1MB": 1 << 20, "100MB": 100 << 20}
SIDES = ("slipstream", "redis", "redis-fsync")
REDIS_CONFIGS = {
    "redis": ["--save", "", "--appendonly", "no"],
    "redis-fsync": ["--save", "", "--appendonly", "yes", "--appendfsync", "always"],
}
CLIENTS = (1, 8)


@dataclass
class Mode:
    repeats: int
    # Operations per client per phase, by size, for 1 and for 8 clients.
    ops: dict[str, tuple[int, int]]
    # Distinct keys per client (values are overwritten in turn), by size.
    keys: dict[str, int]
    memcpy_bytes: int
    zero_copy_reads: int


FULL = Mode(repeats=3, ops={"1KB": (2000, 500), "1MB": (200, 50), "100MB": (6, 2)},
            keys={"1KB": 2000, "1MB": 16, "100MB": 1}, memcpy_bytes=1 << 30, zero_copy_reads=7)
QUICK = Mode(repeats=1, ops={"1KB": (200, 50), "1MB": (20, 5), "100MB": (2, 1)},
             keys={"1KB": 200, "1MB": 4, "100MB": 1}, memcpy_bytes=256 << 20, zero_copy_reads=3)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- clients ------------------------------------------------------------------------------


class HttpClient:
    """The store over one keep-alive HTTP/1.1 connection."""

    def __init__(self, addr: tuple[str, int]):
        self.c = http.client.HTTPConnection(*addr, timeout=600)
        self.c.connect()  # (sets TCP_NODELAY)

    def put(self, key: str, value: bytes) -> None:
        self.c.request("PUT", "/v1/store/objects" + key, body=value,
                       headers={"Content-Type": "application/octet-stream"})
        r = self.c.getresponse()
        out = r.read()
        if r.status != 201:
            raise RuntimeError(f"PUT {key}: {r.status} {out[:300]!r}")

    def get(self, key: str, buf: memoryview) -> int:
        self.c.request("GET", "/v1/store/objects" + key)
        r = self.c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"GET {key}: {r.status} {r.read()[:300]!r}")
        n = int(r.getheader("content-length") or -1)
        if not 0 <= n <= len(buf):
            raise RuntimeError(f"GET {key}: {n} bytes")
        got = 0
        while got < n:
            k = r.readinto(buf[got:n])
            if not k:
                raise RuntimeError(f"GET {key}: the body ended after {got} of {n} bytes")
            got += k
        r.read()  # (nothing left: lets the connection be reused)
        return n

    def close(self) -> None:
        self.c.close()


class RedisClient:
    """SET and GET in RESP over one socket."""

    def __init__(self, addr: tuple[str, int]):
        self.s = socket.create_connection(addr, timeout=600)
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.pending = bytearray()
        self.chunk = bytearray(1 << 16)

    def _fill(self) -> None:
        n = self.s.recv_into(self.chunk)
        if n == 0:
            raise ConnectionError("redis closed the connection")
        self.pending += memoryview(self.chunk)[:n]

    def _line(self) -> bytes:
        while (i := self.pending.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.pending[:i])
        del self.pending[:i + 2]
        return line

    def _cmd(self, *parts: bytes) -> None:
        head = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts[:-1])
        last = parts[-1]
        if len(last) <= 1 << 16:
            self.s.sendall(head + b"$%d\r\n%s\r\n" % (len(last), last))
        else:
            self.s.sendall(head + b"$%d\r\n" % len(last))
            self.s.sendall(last)
            self.s.sendall(b"\r\n")

    def command(self, *parts: bytes) -> bytes:
        self._cmd(*parts)
        return self._line()

    def info(self, section: str) -> dict[str, str]:
        """`INFO section` as a dict."""
        self._cmd(b"INFO", section.encode())
        n = int(self._line()[1:])
        buf = memoryview(bytearray(n + 2))
        take = min(n + 2, len(self.pending))
        buf[:take] = self.pending[:take]
        del self.pending[:take]
        while take < n + 2:
            take += self.s.recv_into(buf[take:])
        rows = bytes(buf[:n]).decode().splitlines()
        return dict(r.split(":", 1) for r in rows if ":" in r)

    def put(self, key: str, value: bytes) -> None:
        line = self.command(b"SET", key.encode(), value)
        if line != b"+OK":
            raise RuntimeError(f"SET {key}: {line[:300]!r}")

    def get(self, key: str, buf: memoryview) -> int:
        self._cmd(b"GET", key.encode())
        line = self._line()
        if not line.startswith(b"$") or int(line[1:]) < 0:
            raise RuntimeError(f"GET {key}: {line[:300]!r}")
        n = int(line[1:])
        if n > len(buf):
            raise RuntimeError(f"GET {key}: {n} bytes")
        take = min(n, len(self.pending))
        buf[:take] = self.pending[:take]
        del self.pending[:take]
        got = take
        while got < n:
            k = self.s.recv_into(buf[got:n])
            if k == 0:
                raise ConnectionError("redis closed the connection")
            got += k
        while len(self.pending) < 2:
            self._fill()
        del self.pending[:2]
        return n

    def close(self) -> None:
        self.s.close()


def connect(side: str, addr: tuple[str, int]) -> HttpClient | RedisClient:
    return HttpClient(addr) if side == "slipstream" else RedisClient(addr)


def client_proc(side: str, addr: tuple[str, int], size: int, ops: int, keys: list[str], start: Any,
                out: Any) -> None:
    """One client process: a put phase, then a get phase, each started with the others."""
    try:
        value = os.urandom(size)
        buf = memoryview(bytearray(size))
        c = connect(side, addr)
        # Warm up, and check a round trip once.
        c.put(keys[0], value)
        if c.get(keys[0], buf) != size or buf[:size] != value:
            raise RuntimeError(f"{side}: a get does not return what was put")
        res: dict[str, Any] = {}
        for phase in ("put", "get"):
            lat = []
            start.wait()
            t0 = time.perf_counter()
            for i in range(ops):
                key = keys[i % len(keys)]
                s = time.perf_counter_ns()
                if phase == "put":
                    c.put(key, value)
                elif c.get(key, buf) != size:
                    raise RuntimeError(f"{side}: GET {key} is short")
                lat.append(time.perf_counter_ns() - s)
            res[phase] = {"t0": t0, "t1": time.perf_counter(), "lat_ns": lat}
        c.close()
        out.put(res)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        out.put({"error": f"{type(e).__name__}: {e}"})
        start.abort()


def run_point(side: str, addr: tuple[str, int], label: str, clients: int, mode: Mode, rep: int) -> dict[str, Any]:
    """`clients` processes against one server: put then get; per phase p50/p99 (ms) and ops/s."""
    size = SIZES[label]
    ops = mode.ops[label][0 if clients == 1 else 1]
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(clients + 1, timeout=600)
    out = ctx.Queue()
    procs = [ctx.Process(target=client_proc, daemon=True,
                         args=(side, addr, size, ops,
                               [f"/bench/{label}/c{clients}/{c}/{k}" for k in range(mode.keys[label])], start, out))
             for c in range(clients)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in ("put", "get"):
            start.wait()
        results = [out.get(timeout=900) for _ in procs]
    except Exception:  # noqa: BLE001 - a client failed: say which
        while not out.empty():
            results.append(out.get())
        errors = [r["error"] for r in results if "error" in r]
        raise RuntimeError(f"{side} {label} x{clients}: {errors or 'a client failed'}") from None
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{side} {label} x{clients}: {errors}")
    point: dict[str, Any] = {}
    for phase in ("put", "get"):
        lat = np.concatenate([np.asarray(r[phase]["lat_ns"], dtype=np.float64) for r in results]) / 1e6
        wall = max(r[phase]["t1"] for r in results) - min(r[phase]["t0"] for r in results)
        n = len(lat)
        point[phase] = {"n": n, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                        "ops_s": n / wall, "gb_s": n * size / wall / 1e9}
    log(f"  {label:>5} {side:<12} x{clients} #{rep + 1}: "
        + "  ".join(f"{ph} p50 {point[ph]['p50_ms']:.3f} ms p99 {point[ph]['p99_ms']:.3f} ms "
                    f"{point[ph]['ops_s']:,.0f}/s" for ph in ("put", "get")))
    return point


def median_point(reps: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for phase in ("put", "get"):
        rs = [r[phase] for r in reps]
        out[phase] = {k: statistics.median(r[k] for r in rs) for k in ("p50_ms", "p99_ms", "ops_s", "gb_s")}
        out[phase]["n"] = rs[0]["n"]
        out[phase]["repeats"] = rs
    return out


# --- servers ------------------------------------------------------------------------------


class Redis:
    def __init__(self, name: str, args: list[str]):
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        self.port = free_port()
        self.cmd = [REDIS, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.dir),
                    "--daemonize", "no", "--logfile", str(self.dir / "redis.log"), *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                c = RedisClient(("127.0.0.1", self.port))
                if c.command(b"PING") == b"+PONG":
                    c.close()
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{name} did not start: {' '.join(self.cmd)}")
            time.sleep(0.05)

    def persistence(self) -> dict[str, Any]:
        """What Redis did on disk (AOF rewrites it started on its own, with its default settings)."""
        c = RedisClient(("127.0.0.1", self.port))
        info = c.info("persistence")
        c.close()
        keys = ("aof_enabled", "aof_rewrites", "aof_current_size", "rdb_saves")
        return {k: int(info[k]) for k in keys if k in info and info[k].isdigit()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def independent(node_url: str, addrs: dict[str, tuple[str, int]], seconds: float, n: int) -> dict[str, Any]:
    """1 KB puts and gets measured by generators in Rust and C instead of
    this script's Python clients: `oha` against the store (and `/healthz`,
    the node's HTTP floor), `redis-benchmark` against both Redis servers."""
    out: dict[str, Any] = {}
    if harness.OHA is None or harness.REDIS_BENCHMARK is None:
        log("independent generators: oha or redis-benchmark missing; skipped")
        return out
    value = os.urandom(1024)
    for c in CLIENTS:
        runs: dict[str, tuple[str, bytes | None, str]] = {
            "slipstream put": ("PUT", value, f"{node_url}/v1/store/objects/bench/oha{c}"),
            "slipstream get": ("GET", None, f"{node_url}/v1/store/objects/bench/oha{c}"),
            "http floor (GET /healthz)": ("GET", None, f"{node_url}/healthz")}
        for what, (method, body, url) in runs.items():
            r = harness.oha(url, seconds=seconds, concurrency=c, method=method, body=body)
            out[f"{what} x{c}"] = {"ops_s": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                                   "status": r["status"]}
        for name in ("redis", "redis-fsync"):
            host, port = addrs[name]
            tests = "set,get" if name == "redis" else "set"
            got = harness.redis_benchmark(host, port, tests=tests, clients=c,
                                          requests=n if name == "redis" else n // 5, value_bytes=1024)
            for test, figures in got.items():
                out[f"{name} {test} x{c}"] = figures
    return out


# --- memory bandwidth and reads on the same machine -------------------------------------------


def memcpy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch both
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def zero_copy(url: str, reads: int) -> dict[str, Any]:
    """A 100 MB value read by a process on this machine: over HTTP (into a
    preallocated buffer) vs mapping the blob file named by `GET ?meta=1`;
    each followed by a full pass over the bytes (a sum)."""
    size = SIZES["100MB"]
    key = "/bench/zero-copy/v"
    host, port = url.removeprefix("http://").split(":")
    addr = (host, int(port))
    value = os.urandom(size)
    c = HttpClient(addr)
    c.put(key, value)
    expect = int(np.frombuffer(value, dtype=np.uint64).sum(dtype=np.uint64))
    buf = memoryview(bytearray(size))
    t_sum = []
    arr = np.frombuffer(value, dtype=np.uint64)
    for _ in range(reads):
        t = time.perf_counter()
        arr.sum(dtype=np.uint64)
        t_sum.append(time.perf_counter() - t)
    rows: dict[str, list[dict[str, float]]] = {"http": [], "mmap": [], "np.memmap": []}
    for _ in range(reads):
        t0 = time.perf_counter()
        c.get(key, buf)
        t1 = time.perf_counter()
        s = int(np.frombuffer(buf, dtype=np.uint64).sum(dtype=np.uint64))
        t2 = time.perf_counter()
        assert s == expect, "HTTP read a different value"
        rows["http"].append({"fetch_ms": (t1 - t0) * 1e3, "sum_ms": (t2 - t1) * 1e3, "total_ms": (t2 - t0) * 1e3})
        for how in ("mmap", "np.memmap"):
            t0 = time.perf_counter()
            meta = json.loads(http_get(c, f"/v1/store/objects{key}?meta=1"))
            t1 = time.perf_counter()
            if how == "mmap":
                with open(meta["path"], "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                a = np.frombuffer(mm, dtype=np.uint64)
            else:
                a = np.memmap(meta["path"], dtype=np.uint64, mode="r")
            t2 = time.perf_counter()
            s = int(a.sum(dtype=np.uint64))
            t3 = time.perf_counter()
            del a
            if how == "mmap":
                mm.close()
            assert s == expect, f"{how} read a different value"
            rows[how].append({"meta_ms": (t1 - t0) * 1e3, "map_ms": (t2 - t1) * 1e3, "sum_ms": (t3 - t2) * 1e3,
                              "total_ms": (t3 - t0) * 1e3})
    c.close()
    med = {how: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for how, rs in rows.items()}
    return {"size": size, "reads": reads, "sum_in_memory_ms": statistics.median(t_sum) * 1e3, "median": med,
            "runs": rows}


def floor(node_url: str, redis_addr: tuple[str, int], n: int) -> dict[str, float]:
    """What one round trip costs each client with no store work: GET /healthz, and a Redis PING."""
    host, port = node_url.removeprefix("http://").split(":")
    c = HttpClient((host, int(port)))
    r = RedisClient(redis_addr)
    lat, ping = [], []
    for _ in range(n):
        t = time.perf_counter_ns()
        http_get(c, "/healthz")
        lat.append(time.perf_counter_ns() - t)
    for _ in range(n):
        t = time.perf_counter_ns()
        if r.command(b"PING") != b"+PONG":
            raise RuntimeError("redis: PING")
        ping.append(time.perf_counter_ns() - t)
    c.close()
    r.close()
    a, b = np.asarray(lat) / 1e6, np.asarray(ping) / 1e6
    return {"n": n, "p50_ms": percentile(a, 50), "p99_ms": percentile(a, 99),
            "redis_ping_p50_ms": percentile(b, 50), "redis_ping_p99_ms": percentile(b, 99)}


def http_get(c: HttpClient, path: str) -> bytes:
    c.c.request("GET", path)
    r = c.c.getresponse()
    body = r.read()
    if r.status != 200:
        raise RuntimeError(f"GET {path}: {r.status} {body[:300]!r}")
    return body


# --- report -------------------------------------------------------------------------------


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Object store vs Redis ({res['mode']} run)", "",
        f"Load average at the end {' '.join(f'{x:.2f}' for x in res['loadavg_end'])} (at the start: below).", "",
        "slipstream: PUT/GET `/v1/store/objects/...` over HTTP, a put answered once durable (fsynced); "
        "one version kept per key (bench/apps/store.py). redis: Redis "
        f"{res['redis_version']}, `{shlex.join(REDIS_CONFIGS['redis'])}` (no persistence); redis-fsync: "
        f"`{shlex.join(REDIS_CONFIGS['redis-fsync'])}` (each SET fsynced before the reply). "
        "Clients: one keep-alive connection each, raw (http.client / RESP on a socket), separate "
        f"processes; median over {res['settings']['repeats']} repeat(s) of each repeat's p50, p99 and ops/s. "
        f"n: operations per repeat (all clients).", "",
        "| size | clients | server | put p50 ms | put p99 ms | put ops/s | put GB/s "
        "| get p50 ms | get p99 ms | get ops/s | get GB/s | n |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in res["points"]:
        pu, ge = p["put"], p["get"]
        lines.append(f"| {p['size']} | {p['clients']} | {p['side']} | {pu['p50_ms']:.3f} | {pu['p99_ms']:.3f} "
                     f"| {pu['ops_s']:,.0f} | {pu['gb_s']:.3f} | {ge['p50_ms']:.3f} | {ge['p99_ms']:.3f} "
                     f"| {ge['ops_s']:,.0f} | {ge['gb_s']:.3f} | {pu['n']} |")
    big = [p for p in res["points"] if p["size"] == "100MB"]
    lines += ["", f"Memory copy bandwidth (numpy, {res['memcpy']['bytes'] >> 20} MiB array): "
              f"**{res['memcpy']['gb_s']:.2f} GB/s**." + (" 100 MB gets: " + ", ".join(
                  f"{p['side']} x{p['clients']} {p['get']['gb_s']:.2f} GB/s "
                  f"({p['get']['gb_s'] / res['memcpy']['gb_s']:.0%})" for p in big) + "." if big else "")]
    f = res["http_floor"]
    lines += ["", f"The HTTP client's floor: `GET /healthz` (no store) over the same kind of connection, "
              f"1 client: p50 {f['p50_ms']:.3f} ms, p99 {f['p99_ms']:.3f} ms; a Redis `PING`: p50 "
              f"{f['redis_ping_p50_ms']:.3f} ms. Small-value latencies are mostly these."]
    ind = res.get("independent")
    if ind:
        reps = len(next(iter(ind.values())).get("runs", [0]))
        lines += ["", "## 1 KB values with independent generators (`oha` for HTTP, `redis-benchmark` for Redis)", "",
                  f"Median of {reps} run(s) of each, interleaved.", "",
                  "| what | ops/s | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {v['ops_s']:,.0f} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} |" for k, v in ind.items()]
    rw = {k: v["aof_rewrites"] for k, v in res.get("redis_persistence", {}).items() if v.get("aof_rewrites")}
    if rw:
        lines += ["", "Redis rewrote its append-only file in the background on its own (default "
                  "`auto-aof-rewrite-percentage 100`) during: " + ", ".join(f"{k} ({n}x)" for k, n in rw.items())
                  + "; a fresh pair of Redis servers serves each size."]
    z = res.get("zero_copy")
    if z:
        md = z["median"]
        lines += [
            "", f"## Reading the 100 MB value on the same machine (median of {z['reads']})", "",
            "| how | metadata ms | fetch or map ms | full pass (sum) ms | total ms |", "|---|---:|---:|---:|---:|",
            f"| HTTP GET into a buffer | - | {md['http']['fetch_ms']:.2f} | {md['http']['sum_ms']:.2f} "
            f"| {md['http']['total_ms']:.2f} |",
        ]
        for how in ("mmap", "np.memmap"):
            lines.append(f"| `GET ?meta=1`, {how} of the blob file | {md[how]['meta_ms']:.2f} | "
                         f"{md[how]['map_ms']:.3f} | {md[how]['sum_ms']:.2f} | {md[how]['total_ms']:.2f} |")
        lines += ["", f"The same sum over a value already in this process's memory: {z['sum_in_memory_ms']:.2f} ms."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run: few operations, one repeat")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"value sizes to run, of {','.join(SIZES)}")
    ap.add_argument("--out", help="results file (default bench/results/store.json; with --quick, "
                                  "store_quick.json in the temporary directory, so a smoke run keeps the results)")
    a = ap.parse_args()
    mode = QUICK if a.quick else FULL
    if a.out is None:
        a.out = str(Path(tempfile.gettempdir()) / "store_quick.json" if a.quick else RESULTS / "store.json")
    sizes = [s for s in a.sizes.split(",") if s]
    unknown = set(sizes) - set(SIZES)
    if unknown:
        ap.error(f"unknown sizes {sorted(unknown)}")
    if not os.path.exists(REDIS):
        ap.error(f"{REDIS} is missing (Debian: apt-get install redis-server)")
    machine = harness.machine()
    log(f"load average before: {machine['loadavg_before']}")
    redis_version = subprocess.run([REDIS, "--version"], capture_output=True, text=True).stdout.split()[2]
    res: dict[str, Any] = {
        "mode": "quick" if a.quick else "full",
        "settings": asdict(mode), "sizes": {s: SIZES[s] for s in sizes},
        "redis_version": redis_version.removeprefix("v="),
        "redis_configs": REDIS_CONFIGS,
        "points": [],
    }
    log(f"memory copy bandwidth ({mode.memcpy_bytes >> 20} MiB)...")
    res["memcpy"] = {"bytes": mode.memcpy_bytes, "gb_s": memcpy_gbps(mode.memcpy_bytes)}
    log(f"  {res['memcpy']['gb_s']:.2f} GB/s")
    store_dir = Path(tempfile.mkdtemp(prefix="bench-store-"))
    redises: dict[str, Redis] = {}
    try:
        with harness.node(APP, "--store", str(store_dir)) as node:
            host, port = node.url.removeprefix("http://").split(":")
            addrs: dict[str, tuple[str, int]] = {"slipstream": (host, int(port))}
            log(f"slipstream node at {node.url}, store in {store_dir}")
            for label in sizes:
                # Fresh Redis servers per size: the append-only file of the 100 MB
                # puts would otherwise pile up on disk.
                for name, args in REDIS_CONFIGS.items():
                    redises[name] = Redis(name, args)
                    addrs[name] = ("127.0.0.1", redises[name].port)
                if "http_floor" not in res:
                    res["http_floor"] = floor(node.url, addrs["redis"], mode.ops["1KB"][0])
                if label == "1KB":
                    log(f"1 KB with independent generators (oha, redis-benchmark), {mode.repeats} repeat(s)...")
                    runs = [independent(node.url, addrs, 2.0 if a.quick else 6.0, 20_000 if a.quick else 100_000)
                            for _ in range(mode.repeats)]
                    res["independent"] = {k: {m: statistics.median(r[k][m] for r in runs)
                                              for m in ("ops_s", "p50_ms", "p99_ms")} | {"runs": [r[k] for r in runs]}
                                          for k in runs[0]}
                for clients in CLIENTS:
                    reps: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
                    for rep in range(mode.repeats):
                        for side in SIDES:
                            reps[side].append(run_point(side, addrs[side], label, clients, mode, rep))
                    for side in SIDES:
                        res["points"].append({"size": label, "bytes": SIZES[label], "clients": clients, "side": side,
                                              **median_point(reps[side])})
                for name, r in redises.items():
                    res.setdefault("redis_persistence", {})[f"{name} {label}"] = r.persistence()
                    r.stop()
                redises.clear()
            if "100MB" in sizes:
                log("reading the 100 MB value on this machine: HTTP vs mapping its blob file...")
                res["zero_copy"] = zero_copy(node.url, mode.zero_copy_reads)
    finally:
        for r in redises.values():
            r.stop()
        shutil.rmtree(store_dir, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    md = markdown(res)
    json_path, md_path = harness.write_results(a.out, res, md, machine)
    print("\n" + md)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
