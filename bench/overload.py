"""Goodput under overload, for every kind of client that production sends:
closed-loop clients that retry at once (oha, ``-c 32/128/512``), open-loop
clients that retry at once, open-loop clients that honour ``Retry-After``
with a retry budget (the project client's policy, in the project's
generator), and the project's own client (``ss.Client``, threads) beside
such a load; then how fast the node recovers after a 1.4x and a 4x spike.

    make bench-overload
    python -m bench.overload [--app bench/apps/overload.py --pipeline offcpu] [--duration 10] [--runs 3] [--quick]

Capacity is measured first, on the same node and inputs: the highest
goodput (2xx answers within the SLO, per second) of an open-loop sweep
without retries. Goodput everywhere is answers within the SLO per second,
from the client's clock where the client reports latency per request (the
project's generator; for oha, which reports only percentiles over every
response, the node's own count of answers within the SLO, beside oha's
2xx/s). Each point runs ``--runs`` times in a row.

Pass (issue 22): at 2x and 4x capacity the goodput is at least 90% of the
peak, and no run of three falls below 90% of the best of its point.
Writes bench/results/overload.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import slipstream as ss

from bench import harness

HONOR = {"mode": "honor"}  # the project client's defaults (slipstream-loadgen's RetryConfig)
NOW = {"mode": "now", "attempts": 1000}
SPIKE_AT, SPIKE_S, AFTER_S = 3.0, 1.0, 3.0
BUCKET_MS = 20.0


def body_of(node: Any, pipeline: str) -> bytes:
    desc = node.get(f"/v1/pipelines/{pipeline}")[1]
    if desc.get("example"):
        return json.dumps({"inputs": desc["example"]}).encode()
    return json.dumps({"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}).encode()


def slo_of(node: Any, pipeline: str) -> float:
    return float(node.get(f"/v1/pipelines/{pipeline}")[1]["slo"]["p99_ms"])


def counters(node: Any, pipeline: str) -> dict[str, Any]:
    st = node.status()
    p = next(p for p in st["pipelines"] if p["name"] == pipeline)
    return {"met": p["slo_met"], "missed": p["slo_missed"], "shed": p["shed"], "admitted": p["admitted"],
            "held": st.get("overload", {}).get("held_refusals", 0)}


def delta(a: dict[str, Any], b: dict[str, Any], seconds: float) -> dict[str, float]:
    return {f"{k}_per_s": (b[k] - a[k]) / seconds for k in a}


def open_loop(node: Any, pipeline: str, body: bytes, rate: float, seconds: float, slo_ms: float,
              retry: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
    url = f"{node.url}/v1/pipelines/{pipeline}/infer"
    before = counters(node, pipeline)
    r = harness.loadgen(url, body, [rate], seconds, warmup_s=kw.pop("warmup_s", 1.0), slo_ms=slo_ms, retry=retry,
                        timeout_s=kw.pop("timeout_s", max(1.0, 4 * slo_ms / 1e3)), max_connections=1024, **kw)[0]
    after = counters(node, pipeline)
    good = (r["ok"] - r["slower_than_slo"]) / r["duration_s"]
    return {"offered": rate, "goodput": good, "ok_per_s": r["ok"] / r["duration_s"],
            "retries_per_request": r["retries"] / max(r["sent"], 1), "errors": r["errors_by_kind"],
            "p99_ms": r["latency_ms"]["p99"], "late_sends": r["late_sends"],
            "node": delta(before, after, r["duration_s"]), "timeline": r.get("timeline", [])}


def closed_loop(node: Any, pipeline: str, body: bytes, c: int, seconds: float) -> dict[str, Any]:
    url = f"{node.url}/v1/pipelines/{pipeline}/infer"
    before, t0 = counters(node, pipeline), time.monotonic()
    r = harness.oha(url, seconds=seconds, concurrency=c, body=body, headers=["content-type: application/json"])
    after, took = counters(node, pipeline), time.monotonic() - t0
    node_rates = delta(before, after, took)
    return {"clients": c, "goodput": node_rates["met_per_s"], "ok_per_s": r["ok_rps"],
            "responses_per_s": r["rps"], "errors": r["errors"], "p99_ms": r["p99_ms"], "node": node_rates}


def client_population(node: Any, pipeline: str, body: bytes, threads: int, seconds: float, slo_ms: float
                      ) -> dict[str, Any]:
    """`threads` closed-loop ``ss.Client`` callers (default retry policy),
    each call with the SLO as its deadline (refusals it gives up on, and
    misses, are failures)."""
    inputs = json.loads(body)["inputs"]
    stop = time.monotonic() + seconds
    good, calls, failed = [0], [0], [0]
    clients = [node.client(timeout=slo_ms * 4 / 1e3) for _ in range(threads)]
    lock = threading.Lock()

    def run(client: Any) -> None:
        g = n = f = 0
        while time.monotonic() < stop:
            t0 = time.monotonic()
            try:
                client.infer(pipeline, inputs, deadline_ms=slo_ms)
                g += (time.monotonic() - t0) * 1e3 <= slo_ms
            except ss.RequestError:
                f += 1
            n += 1
        with lock:
            good[0] += g
            calls[0] += n
            failed[0] += f

    ts = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    retries = sum(c.retry_stats.retries for c in clients)
    return {"threads": threads, "calls": calls[0], "goodput": good[0] / seconds, "failed": failed[0],
            "retries_per_call": retries / max(calls[0], 1)}


def recovery_ms(timeline: list[dict[str, Any]], spike_end_s: float, hold: int = 10) -> float | None:
    """Time from the spike's end to the first bucket from which `hold`
    buckets in a row answer at least 90% of their arrivals within the SLO."""
    after = [b for b in timeline if b["t_s"] >= spike_end_s - 1e-9]

    def good(b: dict[str, Any]) -> bool:
        arrivals = b["ok"] + sum(b["errors_by_kind"].values())
        return arrivals == 0 or (b["ok"] - b["slower_than_slo"]) >= 0.9 * arrivals

    for i in range(len(after) - hold + 1):
        if all(good(b) for b in after[i:i + hold]):
            return (after[i]["t_s"] - spike_end_s) * 1e3
    return None


def capacity_of(node: Any, pipeline: str, body: bytes, slo_ms: float, seconds: float) -> tuple[float, list]:
    """The peak goodput of an open-loop sweep without retries: rates rise by
    1.3x until the goodput falls below 80% of the offered load."""
    sweep, rate = [], 1000.0
    while True:
        r = open_loop(node, pipeline, body, rate, seconds, slo_ms, None)
        r.pop("timeline")
        sweep.append(r)
        print(f"capacity sweep: offered {rate:,.0f}/s -> goodput {r['goodput']:,.0f}/s", flush=True)
        if r["goodput"] < 0.8 * rate or rate > 200_000:
            break
        rate *= 1.3
    return max(r["goodput"] for r in sweep), sweep


def summarise(runs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs),
            "worst_over_best": min(runs) / max(runs) if max(runs) > 0 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--app", default="bench/apps/overload.py")
    ap.add_argument("--pipeline", default="offcpu")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    ap.add_argument("--runs", type=int, default=3, help="consecutive runs per point")
    ap.add_argument("--quick", action="store_true", help="3 s runs, one run per point, fewer points")
    ap.add_argument("--out", default=str(harness.RESULTS / "overload"))
    a = ap.parse_args()
    if a.quick:
        a.duration, a.runs = 3.0, 1
    machine = harness.machine()
    print(f"load average before: {machine['loadavg_before']}", flush=True)
    result: dict[str, Any] = {"app": a.app, "pipeline": a.pipeline, "duration_s": a.duration, "runs": a.runs}
    with harness.node(a.app) as node:
        body, slo_ms = body_of(node, a.pipeline), slo_of(node, a.pipeline)
        result["slo_ms"] = slo_ms
        cap, sweep = capacity_of(node, a.pipeline, body, slo_ms, min(a.duration, 5.0))
        result["capacity"], result["capacity_sweep"] = cap, sweep
        print(f"capacity (peak goodput): {cap:,.0f}/s at SLO p99 {slo_ms:g} ms", flush=True)

        closed = []
        for c in ([128] if a.quick else [32, 128, 512]):
            runs = [closed_loop(node, a.pipeline, body, c, a.duration) for _ in range(a.runs)]
            for r in runs:
                print(f"oha -c {c}: goodput {r['goodput']:,.0f}/s (2xx {r['ok_per_s']:,.0f}/s, "
                      f"refused {r['node']['shed_per_s']:,.0f}/s, held {r['node']['held_per_s']:,.0f}/s)", flush=True)
            closed.append({"clients": c, "runs": runs, "goodput": summarise([r["goodput"] for r in runs])})
        result["closed_loop_retry_at_once"] = closed

        opened: dict[str, list[dict[str, Any]]] = {"honor": [], "now": []}
        multiples = [0.5, 1.0, 2.0, 4.0] if not a.quick else [1.0, 4.0]
        for name, retry in (("honor", HONOR), ("now", NOW)):
            for m in multiples if name == "honor" else [x for x in multiples if x >= 1]:
                runs = []
                for _ in range(a.runs):
                    r = open_loop(node, a.pipeline, body, m * cap, a.duration, slo_ms, retry)
                    r.pop("timeline")
                    runs.append(r)
                    print(f"{name} {m:g}x ({m * cap:,.0f}/s): goodput {r['goodput']:,.0f}/s, "
                          f"{r['retries_per_request']:.2f} retries/request, p99 {r['p99_ms']:.1f} ms", flush=True)
                opened[name].append({"multiple": m, "runs": runs, "goodput": summarise([r["goodput"] for r in runs]),
                                     "retries_per_request": statistics.median(r["retries_per_request"] for r in runs)})
        result["open_loop"] = opened

        # The project's client beside a 2x load of clients that honour Retry-After.
        bg: dict[str, Any] = {}
        t = threading.Thread(target=lambda: bg.update(open_loop(node, a.pipeline, body, 2 * cap, a.duration + 1,
                                                                slo_ms, HONOR, warmup_s=0.5)))
        t.start()
        time.sleep(1.0)
        client = client_population(node, a.pipeline, body, 16, a.duration - 1, slo_ms)
        t.join()
        bg.pop("timeline", None)
        result["project_client"] = {**client, "beside": {"multiple": 2.0, "goodput": bg.get("goodput")}}
        print(f"ss.Client x16 beside 2x: {client['goodput']:,.0f} good calls/s, "
              f"{client['retries_per_call']:.3f} retries/call", flush=True)

        spikes = []
        for k in (1.4, 4.0):
            sched = [(0.0, 0.7 * cap), (SPIKE_AT, k * cap), (SPIKE_AT + SPIKE_S, 0.7 * cap)]
            r = open_loop(node, a.pipeline, body, 0.7 * cap, SPIKE_AT + SPIKE_S + AFTER_S, slo_ms, HONOR,
                          schedule=sched, timeline_ms=BUCKET_MS)
            rec = recovery_ms(r.pop("timeline"), SPIKE_AT + SPIKE_S)
            spikes.append({"spike": k, "recovery_ms": rec, "goodput": r["goodput"]})
            print(f"spike {k:g}x for {SPIKE_S:g} s: recovered {rec} ms after it ended", flush=True)
        result["spikes"] = spikes

    # The open-loop clients that retry at once are shown, not judged: each
    # insists on its request until its timeout, so past capacity their own
    # queue grows without bound and every answer comes too late, whatever
    # the server does (the closed-loop population is the storm to hold).
    checks = []
    for row in result["open_loop"]["honor"]:
        if row["multiple"] >= 2:
            checks.append((f"honor {row['multiple']:g}x", row["goodput"]))
    for row in closed:
        checks.append((f"oha -c {row['clients']}", row["goodput"]))
    verdicts = []
    for label, g in checks:
        ok = g["median"] >= 0.9 * cap and g["worst_over_best"] >= 0.9
        verdicts.append({"point": label, "median_over_peak": g["median"] / cap,
                         "worst_over_best": g["worst_over_best"], "pass": ok})
    result["verdicts"] = verdicts
    result["pass"] = all(v["pass"] for v in verdicts)

    md = [f"# Goodput under overload: `{a.app}` ({a.pipeline}), SLO p99 {slo_ms:g} ms", "",
          f"Capacity (peak goodput, open loop without retries): **{cap:,.0f}/s**. "
          f"{a.runs} consecutive runs of {a.duration:g} s per point; goodput = answers within the SLO per second.",
          "", "| population | load | goodput (median) | worst/best | median/peak | retries per request |",
          "|---|---|---|---|---|---|"]
    for row in closed:
        g = row["goodput"]
        md.append(f"| closed loop, retry at once (oha) | -c {row['clients']} | {g['median']:,.0f}/s "
                  f"| {g['worst_over_best']:.2f} | {g['median'] / cap:.2f} | (every refusal) |")
    for name, rows in result["open_loop"].items():
        label = "open loop, honour Retry-After + budget" if name == "honor" else "open loop, retry at once"
        for row in rows:
            g = row["goodput"]
            md.append(f"| {label} | {row['multiple']:g}x | {g['median']:,.0f}/s | {g['worst_over_best']:.2f} "
                      f"| {g['median'] / cap:.2f} | {row['retries_per_request']:.2f} |")
    pc = result["project_client"]
    md += ["", f"The project client (16 threads of `ss.Client`, default retries) beside a 2x load that honours "
           f"Retry-After: {pc['goodput']:,.0f} calls/s within the SLO, {pc['retries_per_call']:.3f} retries per call.",
           "", "| spike (1 s, from 0.7x) | recovery after it ends |", "|---|---|"]
    for s in spikes:
        rec = "not within the run" if s["recovery_ms"] is None else f"{s['recovery_ms']:.0f} ms"
        md.append(f"| {s['spike']:g}x | {rec} |")
    md += ["", "Open-loop clients that retry at once are shown, not judged: each insists on its request until "
           "its timeout, so past capacity their own queue grows without bound and their answers come too late "
           "whatever the server does.",
           "", f"Pass (the oha populations and the Retry-After population at 2x and 4x: median >= 90% of peak, "
           f"worst run >= 90% of best): **{'yes' if result['pass'] else 'no'}**"]
    for v in verdicts:
        if not v["pass"]:
            md.append(f"- {v['point']}: median/peak {v['median_over_peak']:.2f}, worst/best {v['worst_over_best']:.2f}")
    paths = harness.write_results(a.out, result, "\n".join(md), machine)
    print("\n".join(md))
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
