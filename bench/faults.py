"""`make bench-faults`: a fault soak of the node, with its books checked.

For 60 s (``--duration``), a steady open-loop Poisson load (20% of each
app's capacity alone, both at once) runs on a 2-replica chain and on a
fan-in app (bench/apps/soak.py, every stage two replicas) while, at random
moments (seeded):

- a worker of a random stage is killed with SIGKILL;
- a 1 s burst goes to one app at 3x its capacity;
- clients send valid requests and vanish before the answer (~20/s);
- malformed bodies (mutated JSON, crafted KServe v2 sizes, duplicates)
  are mixed in (~20/s).

Every request is counted by outcome, per source. The checks (the robustness
issue's bar):

- zero accepted requests lost: every request of the steady and burst loads
  gets an answer (no client timeout, reset or refused connection), and an
  admitted request that fails gets its 503/504 within 1.5x the SLO;
- no 5xx other than 503/504 (a stage with no live replica, a late request);
- after each restarted worker is ready again (the node's own event), the
  steady load's p99 over [ready + 1 s, ready + 2 s] is under the SLO;
- after each burst, the steady load's goodput over [end + 1 s, end + 2 s]
  is at least 95% of its level over the 3 s before the burst;
- memory flat (node RSS at the end within 10% or 20 MB of its level after
  warm-up) and the books balanced once idle: nothing in flight, the
  admission gates at zero, the arena empty, and admitted = answered +
  cancelled + failed after admission.

Capacity (per app, alone) is measured first with a short sweep. Writes
bench/results/faults.{json,md} and exits 1 if a check fails. Run it when
nothing else runs on the machine; the load average is recorded.

    .venv/bin/python -m bench.faults [--duration 60] [--calm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import RESULTS, ROOT

APP = ROOT / "bench" / "apps" / "soak.py"
D = 64
SLO_MS = 150.0  # the apps' SLO (bench/apps/soak.py): about twice the calm p99 here
BUCKET_MS = 100.0
PIPELINES = ("chain", "fanin")
# Steady load per app, as a share of its capacity alone: both apps run at
# once on the same cores, so about 40% of the machine.
STEADY = 0.2
# Errors a request gets before it is admitted (refused or rejected at ingress).
BEFORE_ADMISSION = {"overloaded", "bad_request", "bad_input", "payload_too_large", "unknown_pipeline",
                    "shutting_down", "not_found", "method_not_allowed", "unauthorized", "forbidden",
                    "unknown_stage", "arena_full"}


def body(rows: int = 1) -> bytes:
    return json.dumps({"inputs": {"x": [[0.01 * (i + j) for j in range(D)] for i in range(rows)]}}).encode()


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def load(url: str, rate: float, duration: float, *, timeline: bool = False, warmup: float = 0.0,
         seed: int = 1, timeout: float = 5.0) -> dict[str, Any]:
    return harness.loadgen(url, body(), [rate], duration, warmup_s=warmup, timeout_s=timeout, seed=seed,
                           slo_ms=SLO_MS, timeline_ms=BUCKET_MS if timeline else 0.0, timeline_latencies=timeline)[0]


def capacity(base: str, pipeline: str) -> float:
    """Highest rate (of a fixed ladder) whose answers are >= 99% within the
    SLO; a rate that fails is tried once more (a noisy machine stalls)."""
    best = 0.0
    for rate in (250, 500, 1000, 1500, 2000, 2500, 3000, 4000, 5000, 6000, 8000):
        for _attempt in (1, 2):
            r = load(f"{base}/v1/pipelines/{pipeline}/infer", rate, 3.0, warmup=1.0)
            good = r["ok"] - r["slower_than_slo"]
            print(f"  capacity {pipeline}: {rate}/s -> {good / r['duration_s']:.0f}/s within SLO "
                  f"(p99 {r['latency_ms']['p99']:.1f} ms, errors {r['errors_by_kind']})", flush=True)
            if good >= 0.99 * r["sent"]:
                break
        else:
            return best
        best = rate
    return best


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def vanish(host: str, port: int, path: str, linger: float) -> None:
    raw = body()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=2) as s:
        s.sendall(head + raw)
        time.sleep(linger)


def malformed(rng: random.Random) -> tuple[str, bytes, dict[str, str]]:
    """A hostile request: (path, body, headers)."""
    p = rng.choice(PIPELINES)
    good = body(rng.randint(1, 3))
    kind = rng.randrange(6)
    if kind == 0:  # mutated pipeline-API JSON
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] = rng.choice(b'{}[]",:-0123456789e \x00\xff')
        return f"/v1/pipelines/{p}/infer", bytes(b), {}
    if kind == 1:  # duplicate input name
        return f"/v1/pipelines/{p}/infer", b'{"inputs": {"x": [[1]], "x": [[2]]}}', {}
    if kind == 2:  # wrapping KServe v2 shape
        head = json.dumps({"inputs": [{"name": "x", "shape": [2**62, D], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 0}}]}).encode()
        return f"/v2/models/{p}/infer", head, {"Inference-Header-Content-Length": str(len(head))}
    if kind == 3:  # binary sizes past the body
        head = json.dumps({"inputs": [{"name": "x", "shape": [1, D], "datatype": "FP32",
                                       "parameters": {"binary_data_size": 2**64 - 1}}]}).encode()
        return f"/v2/models/{p}/infer", head + b"\x01", {"Inference-Header-Content-Length": str(len(head))}
    if kind == 4:  # wrong shape / dtype
        return f"/v2/models/{p}/infer", json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "INT8",
                                                                  "data": [1, 2, 3]}]}).encode(), {}
    return f"/v1/pipelines/{p}/infer", good[: rng.randrange(len(good))], {}  # truncated


def post(base: str, path: str, data: bytes, headers: dict[str, str]) -> str:
    req = urllib.request.Request(base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            r.read()
            return str(r.status)
    except urllib.error.HTTPError as e:
        e.read()
        return str(e.code)
    except (OSError, urllib.error.URLError) as e:
        return "lost:" + type(e).__name__


class Soak:
    def __init__(self, base: str, caps: dict[str, float], duration: float, seed: int):
        self.base = base
        self.caps = caps
        self.duration = duration
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.kills: list[dict[str, Any]] = []
        self.bursts: list[dict[str, Any]] = []
        self.steady: dict[str, dict[str, Any]] = {}
        self.vanished = 0
        self.hostile: dict[str, int] = {}
        self.samples: list[dict[str, float]] = []
        self.lock = threading.Lock()

    def plan(self) -> list[tuple[float, str, str]]:
        """(seconds from start, kill|burst, pipeline), alternating, 5-8 s apart."""
        out, t, i = [], 5.0, 0
        while t < self.duration - 6.0:
            out.append((t, "kill" if i % 2 == 0 else "burst", PIPELINES[(i // 2) % 2]))
            t += self.rng.uniform(5.0, 8.0)
            i += 1
        return out

    def kill(self, pipeline: str) -> None:
        st = get(self.base + "/v1/status")
        p = next(p for p in st["pipelines"] if p["name"] == pipeline)
        stage = self.rng.choice(p["stages"])
        ready = [r for r in stage["replicas"] if r["state"] == "ready" and r["pid"]]
        if not ready:
            return
        r = self.rng.choice(ready)
        at = time.time()
        os.kill(r["pid"], signal.SIGKILL)
        self.kills.append({"t": at, "pipeline": pipeline, "stage": stage["name"], "replica": r["id"], "pid": r["pid"]})
        print(f"  t={at - self.t0:5.1f}s  SIGKILL {pipeline}/{stage['name']}[{r['id']}] pid {r['pid']}", flush=True)

    def burst(self, pipeline: str) -> None:
        rate = 3 * self.caps[pipeline]
        print(f"  t={time.time() - self.t0:5.1f}s  burst {pipeline} at {rate:.0f}/s for 1 s", flush=True)
        r = load(f"{self.base}/v1/pipelines/{pipeline}/infer", rate, 1.0, seed=self.rng.randrange(1 << 30))
        self.bursts.append({"t0": r["wall_start"], "t1": r["wall_start"] + 1.0, "pipeline": pipeline,
                            "rate": rate, "report": {k: v for k, v in r.items() if k != "timeline"}})

    def chaos(self) -> None:
        threads = []
        for at, what, pipeline in self.plan():
            wait = self.t0 + at - time.time()
            if wait > 0 and self.stop.wait(wait):
                break
            if what == "kill":
                self.kill(pipeline)
            else:
                t = threading.Thread(target=self.burst, args=(pipeline,))
                t.start()
                threads.append(t)
        for t in threads:
            t.join()

    def vanishers(self) -> None:
        host, port = self.base.removeprefix("http://").split(":")
        while not self.stop.wait(self.rng.expovariate(20.0)):
            p = self.rng.choice(PIPELINES)
            try:
                vanish(host, int(port), f"/v1/pipelines/{p}/infer", self.rng.uniform(0.0, 0.03))
                self.vanished += 1
            except OSError:
                with self.lock:
                    self.hostile["vanish_connect_failed"] = self.hostile.get("vanish_connect_failed", 0) + 1

    def attackers(self) -> None:
        rng = random.Random(self.rng.randrange(1 << 30))
        while not self.stop.wait(rng.expovariate(20.0)):
            path, data, headers = malformed(rng)
            status = post(self.base, path, data, headers)
            with self.lock:
                self.hostile[status] = self.hostile.get(status, 0) + 1

    def monitor(self, pid: int) -> None:
        while not self.stop.wait(0.5):
            try:
                st = get(self.base + "/v1/status")
            except OSError:
                continue
            self.samples.append({"t": time.time() - self.t0, "rss_mb": rss_mb(pid),
                                 "arena_mb": st["arena_used_bytes"] / 1e6, "inflight": st["inflight"]})

    def steady_load(self, pipeline: str) -> None:
        rate = STEADY * self.caps[pipeline]
        self.steady[pipeline] = load(f"{self.base}/v1/pipelines/{pipeline}/infer", rate, self.duration,
                                     timeline=True, seed=self.rng.randrange(1 << 30))

    def run(self, node_pid: int, calm: bool = False) -> None:
        self.t0 = time.time()
        workers = [threading.Thread(target=self.steady_load, args=(p,)) for p in PIPELINES]
        side = [] if calm else [threading.Thread(target=f) for f in (self.chaos, self.vanishers, self.attackers)]
        side.append(threading.Thread(target=self.monitor, args=(node_pid,)))
        for t in workers + side:
            t.start()
        for t in workers:
            t.join()
        self.stop.set()
        for t in side:
            t.join()


def window(report: dict[str, Any], t0: float, t1: float) -> list[dict[str, Any]]:
    """The timeline buckets of `report` that lie within wall times [t0, t1)."""
    start = report["wall_start"]
    return [b for b in report["timeline"] if t0 <= start + b["t_s"] and start + b["t_s"] + BUCKET_MS / 1e3 <= t1 + 1e-6]


def p99(buckets: list[dict[str, Any]]) -> float:
    """The p99 of the OK latencies scheduled in `buckets` (0 for none)."""
    lat = [x for b in buckets for x in b.get("latencies_ms", [])]
    return harness.percentile(lat, 99) if lat else 0.0


def good_share(buckets: list[dict[str, Any]]) -> float:
    """Share of the requests scheduled in `buckets` answered within the SLO
    (a share, not a count: Poisson arrivals vary by a few % per second)."""
    sent = sum(b["ok"] + sum(b["errors_by_kind"].values()) for b in buckets)
    return sum(b["ok"] - b["slower_than_slo"] for b in buckets) / sent if sent else 0.0


def analyse(soak: Soak, final: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    checks: list[tuple[str, bool, str]] = []
    # Outcomes by source.
    table: dict[str, dict[str, int]] = {}
    for p, r in soak.steady.items():
        table[f"steady {p}"] = {"200": r["ok"], **{k.removeprefix("status_"): v for k, v in r["errors_by_kind"].items()}}
    for b in soak.bursts:
        row = table.setdefault(f"burst {b['pipeline']}", {})
        for k, v in [("200", b["report"]["ok"]), *b["report"]["errors_by_kind"].items()]:
            row[k.removeprefix("status_")] = row.get(k.removeprefix("status_"), 0) + v
    table["clients that vanish"] = {"sent, then gone": soak.vanished}
    table["malformed"] = dict(soak.hostile)
    lost = sum(v for row in list(table.values())[:-2] for k, v in row.items() if k in ("timeout", "io", "connect"))
    lost += sum(v for k, v in soak.hostile.items() if k.startswith("lost:"))
    checks.append(("no accepted request lost (no client timeout, reset or refused connection)", lost == 0,
                   f"{lost} lost"))
    bad5xx = {k: v for row in table.values() for k, v in row.items() if k.startswith("5") and k not in ("503", "504")}
    checks.append(("no 5xx other than 503/504", not bad5xx, str(bad5xx or "none")))
    def slowest(kinds: tuple[str, ...]) -> float:
        return max((ms for r in soak.steady.values() for b in r["timeline"]
                    for k, ms in b["max_error_ms"].items() if k in kinds), default=0.0)
    late, refused = slowest(("status_503", "status_504")), slowest(("status_429",))
    checks.append(("admitted requests that fail get a clear error (503/504) within 1.5x the SLO",
                   late <= 1.5 * SLO_MS, f"slowest 503/504 {late:.1f} ms, slowest 429 {refused:.1f} ms "
                   "(from the send)"))
    # Recovery after each kill.
    recoveries = []
    for k in soak.kills:
        ready = next((e for e in events if e["what"] == "ready" and e["pipeline"] == k["pipeline"]
                      and e["stage"] == k["stage"] and e["replica"] == k["replica"] and e["unix_ms"] / 1e3 > k["t"]),
                     None)
        if ready is None:
            recoveries.append({**k, "ready_after_s": None, "p99_ms": None})
            continue
        t_ready = ready["unix_ms"] / 1e3
        after = window(soak.steady[k["pipeline"]], t_ready + 1.0, t_ready + 2.0)
        during = window(soak.steady[k["pipeline"]], k["t"], t_ready + 1.0)
        recoveries.append({**k, "ready_after_s": t_ready - k["t"], "p99_ms": p99(after),
                           "p99_during_ms": p99(during)})
    worst = max((r["p99_ms"] or 1e9 for r in recoveries), default=0.0)
    checks.append(("p99 under the SLO from 1 s after each restarted worker is ready",
                   bool(recoveries) and worst <= SLO_MS,
                   ", ".join(f"{r['stage']}: ready in {r['ready_after_s'] or float('nan'):.2f} s, "
                             f"p99 {r['p99_ms'] or float('nan'):.1f} ms" for r in recoveries)))
    # Goodput after each burst.
    spikes = []
    for b in soak.bursts:
        r = soak.steady[b["pipeline"]]
        rate = r["offered_rps"]
        before = rate * good_share(window(r, b["t0"] - 3.0, b["t0"]))
        after = rate * good_share(window(r, b["t1"] + 1.0, b["t1"] + 2.0))
        spikes.append({"pipeline": b["pipeline"], "rate": b["rate"], "before": before, "after": after,
                       "ratio": after / before if before else 0.0})
    checks.append(("goodput (offered x share within SLO) back to >= 95% of its level 1-2 s after each burst",
                   bool(spikes) and all(s["ratio"] >= 0.95 for s in spikes),
                   ", ".join(f"{s['pipeline']}: {s['before']:.0f} -> {s['after']:.0f}/s" for s in spikes)))
    # Memory and books.
    warm = [s for s in soak.samples if s["t"] >= 5.0]
    rss0, rss1 = (warm[0]["rss_mb"], warm[-1]["rss_mb"]) if warm else (0.0, 0.0)
    checks.append(("node memory flat", rss1 <= max(rss0 * 1.10, rss0 + 20),
                   f"RSS {rss0:.0f} -> {rss1:.0f} MB (max {max((s['rss_mb'] for s in warm), default=0):.0f})"))
    books = {"inflight": final["inflight"], "arena_used_bytes": final["arena_used_bytes"]}
    balanced = final["inflight"] == 0 and final["arena_used_bytes"] == 0
    for p in final["pipelines"]:
        after_admission = sum(v for k, v in p["errors"].items() if k not in BEFORE_ADMISSION)
        settled = p["ok"] + p["cancelled"] + after_admission
        books[p["name"]] = {"admitted": p["admitted"], "answered": p["ok"], "cancelled": p["cancelled"],
                            "failed_after_admission": after_admission, "gate_inflight": p["admission"]["inflight"],
                            "errors": p["errors"], "shed": p["shed"]}
        balanced &= p["admission"]["inflight"] == 0 and settled == p["admitted"]
    checks.append(("books balanced once idle (in flight 0, gates 0, arena 0, admitted = settled)", balanced,
                   json.dumps(books)))
    return {"checks": [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks], "outcomes": table,
            "recoveries": recoveries, "bursts": spikes, "books": books,
            "memory": {"rss_mb_after_warmup": rss0, "rss_mb_end": rss1, "samples": soak.samples}}


def markdown(res: dict[str, Any]) -> str:
    kinds = sorted({k for row in res["outcomes"].values() for k in row})
    lines = [f"# Fault soak ({res['duration_s']:.0f} s, seed {res['seed']})", "",
             f"Capacity alone (within SLO {SLO_MS:.0f} ms): " +
             ", ".join(f"{p} {c:.0f}/s" for p, c in res["capacity"].items()) +
             f"; steady load {STEADY:.0%} of each (both at once), bursts 3x.", "",
             "| source | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
    for src, row in res["outcomes"].items():
        lines.append(f"| {src} | " + " | ".join(str(row.get(k, "")) for k in kinds) + " |")
    lines += ["", "| check | ok | detail |", "|---|---|---|"]
    for c in res["checks"]:
        lines.append(f"| {c['check']} | {'yes' if c['ok'] else 'NO'} | {c['detail']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=8)
    ap.add_argument("--capacity", help="skip the sweep: chain,fanin rates (req/s)")
    ap.add_argument("--calm", action="store_true", help="the same steady load with no faults (a baseline)")
    ap.add_argument("--out", default=str(RESULTS / "faults.json"))
    a = ap.parse_args()
    machine = harness.machine()
    print(f"load average before: {machine['loadavg_before']}", flush=True)
    with harness.node(APP) as node:
        base = node.url
        node_pid = get(base + "/v1/status")["pid"]
        if a.capacity:
            caps = dict(zip(PIPELINES, (float(x) for x in a.capacity.split(",")), strict=True))
        else:
            caps = {p: capacity(base, p) for p in PIPELINES}
        print(f"capacity: {caps}", flush=True)
        urllib.request.urlopen(urllib.request.Request(base + "/v1/admin/reset-metrics", method="POST")).read()
        soak = Soak(base, caps, a.duration, a.seed)
        print(f"soak: {a.duration:.0f} s, steady {', '.join(f'{p} {STEADY * c:.0f}/s' for p, c in caps.items())}",
              flush=True)
        soak.run(node_pid, calm=a.calm)
        time.sleep(2.0)  # let abandoned and retried work settle
        final = get(base + "/v1/status")
    res = {"duration_s": a.duration, "seed": a.seed, "slo_ms": SLO_MS,
           "worker_nice": os.environ.get("SLIPSTREAM_WORKER_NICE", "0"),
           "calm_p99_ms": {p: p99(r["timeline"]) for p, r in soak.steady.items()} if a.calm else None,
           "capacity": caps, **analyse(soak, final, final["events"]),
           "steady": {p: {k: v for k, v in r.items() if k != "timeline"} for p, r in soak.steady.items()},
           "timeline": {p: [{k: v for k, v in b.items() if k != "latencies_ms"} for b in r["timeline"]]
                        for p, r in soak.steady.items()}}
    md = markdown(res)
    json_path, md_path = harness.write_results(a.out, res, md, machine)
    print("\n" + md)
    print(f"wrote {json_path} and {md_path}")
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
