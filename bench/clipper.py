"""`make bench-clipper`: Clipper's selection layer (Crankshaw et al., NSDI
2017) as Slipstream serves it, on four real scikit-learn digit classifiers
(examples/clipper.py, examples/models/digits.py): model selection from
feedback, a degraded model, the straggler bound, and the prediction cache.
Writes bench/results/clipper.{json,md} and clipper_accuracy.png.

(a) **Selection under feedback.** One node serves ``digits_exp3`` and
    ``digits_exp4``. The test half of ``load_digits`` is sent as a stream
    (shuffled, reshuffled once used up), one image per request, each image
    to both pipelines, one request at a time; after each answer its true
    label goes back as feedback (``client.feedback``). Each model's own
    accuracy on the same stream is computed here from the same model files
    (the served candidates answer exactly as they do: same pickles, same
    code). Reported over the last ``last`` queries before the degrade:
    Exp3's share of picks of the best single model, and each pipeline's
    accuracy beside every single model's.
(b) **Degrade.** After ``phase1`` queries the model Exp3 currently favours
    most is put again under its store key, scrambled (its labels through a
    fixed permutation without fixed points; ``digits.Scrambled``). From the
    put on, the policy state is read after every feedback event: reported
    are the feedback events (one per query and pipeline) until that model's
    share of the policy (Exp3: its probability; Exp4: its normalised
    weight) falls below 1/K, and until the accuracy recovers (the first
    query from which the next ``window`` answers are at least as accurate as
    the best healthy model on the rest of the stream, less 0.05).
(c) **Straggler bound.** A node serves ``digits_exp4`` (answers
    ``CLIPPER_WAIT_MS`` = 20 ms after dispatch with what has arrived) and
    ``digits_exp4_all`` (waits for every model, up to its 2 s deadline),
    with ``CLIPPER_SLOW=knn:0.1:200``: 10% of KNN's batches sleep 200 ms.
    After a warm-up with feedback, each pipeline in turn gets Poisson
    arrivals at ``rate`` req/s for ``seconds`` s (open loop,
    ``ss.AsyncClient``; latency counted from the scheduled send, so queueing
    behind a stall is not hidden). Reported: p50/p99/max, accuracy, mean
    contributors, the share of answers with fewer than four, errors.
(d) **Cache.** A node serves ``digits_cached`` (the SVM, ``cache=True``) and
    ``digits_single`` (the same model, no cache). A Zipf-skewed stream
    (s = 1.1 over the 899 test images) one request at a time: latency of
    hits (an image seen before in the stream) and misses, and of the same
    stream with the cache off; the hit rate (checked against the node's
    counters). Then throughput: ``conc`` closed-loop async clients on a
    second stream over the same popular images (warm cache) for
    ``tput_s`` s each way; and ``oha`` with one body repeated (every
    request after the first a hit) against the uncached pipeline (every
    request a miss): the hit path's and the miss path's cost at the node
    without the Python client's.

The load average is recorded before each part; every part is repeated
(``--repeats``, 3 by default) on a fresh node, and performance figures are
medians of the repeats. A full run takes about 15 minutes on two cores.
``--parts cache`` reruns some parts and keeps the others' results from the
last run's JSON. ``--quick`` is a short smoke run (its figures are noisy;
it writes bench/results/clipper-quick* unless ``--out``).

    .venv/bin/python -m bench.clipper [--quick] [--parts cache]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import slipstream as ss
from slipstream.testing import Node

from bench import harness
from bench.harness import EXAMPLES, RESULTS, percentile

APP = EXAMPLES / "clipper.py"
digits = harness.example_module("models.digits")
clipper_client = harness.example_module("clipper_client")
put_model, select_state, shares = clipper_client.put_model, clipper_client.select_state, clipper_client.shares

K = len(digits.MODELS)
EXP3, EXP4, EXP4_ALL = "digits_exp3", "digits_exp4", "digits_exp4_all"
CACHED, SINGLE = "digits_cached", "digits_single"
SLOW = "knn:0.1:200"
PARTS = ("selection", "straggler", "cache")
WAIT_MS = 20.0


@dataclass(frozen=True)
class Sizes:
    phase1: int  # queries before the degrade
    phase2: int  # queries after it
    last: int  # queries at the end of phase 1 that (a) is judged on
    window: int  # answers per window when judging recovery
    warm: int  # (c): queries with feedback before the load
    rate: float  # (c): offered req/s
    seconds: float  # (c): per pipeline
    zipf: int  # (d): sequential queries per pipeline
    conc: int  # (d): closed-loop clients
    tput_s: float  # (d): seconds per throughput run (async clients, and oha)
    repeats: int


FULL = Sizes(phase1=3000, phase2=1500, last=500, window=50, warm=300, rate=40.0, seconds=20.0, zipf=5000,
             conc=8, tput_s=10.0, repeats=3)
QUICK = Sizes(phase1=500, phase2=300, last=150, window=50, warm=100, rate=30.0, seconds=5.0, zipf=800,
              conc=8, tput_s=3.0, repeats=1)


def log(msg: str) -> None:
    print(f"[bench-clipper] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def med(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def node(pipelines: str, **env: str) -> Node:
    """``examples/clipper.py`` serving ``pipelines``, with these app variables."""
    return harness.node(APP, env={"CLIPPER_PIPELINES": pipelines, "CLIPPER_SLOW": "", **env})


def status_of(url: str) -> dict[str, Any]:
    with ss.Client(url) as c:
        return c.status()


def pipeline_status(url: str, name: str) -> dict[str, Any]:
    return next(p for p in status_of(url)["pipelines"] if p["name"] == name)


def stage_cache(url: str, pipeline: str, stage: str) -> dict[str, Any]:
    return next(s for s in pipeline_status(url, pipeline)["stages"] if s["name"] == stage)["cache"]


# --------------------------------------------------------------------- (a) + (b)

def predictions() -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Each model's label for every test image, and the fixed scramble."""
    s = digits.split()
    preds = {n: digits.predict(digits.load(p.read_bytes()), s.x_test)[0]
             for n, p in digits.ensure_models().items()}
    return preds, digits.derangement()


def selection_run(sz: Sizes, seed: int) -> dict[str, Any]:
    s = digits.split()
    n = sz.phase1 + sz.phase2
    order = digits.query_stream(n, seed=seed)
    y = s.y_test[order]
    preds, perm = predictions()
    pipes = (EXP3, EXP4)
    correct = {p: np.zeros(n, dtype=bool) for p in pipes}
    latency = {p: np.zeros(n) for p in pipes}
    picked: list[str] = []
    contributors = np.zeros(n, dtype=np.int64)
    trace: dict[str, list[tuple[int, dict[str, float]]]] = {p: [] for p in pipes}
    degraded: str | None = None
    load = loadavg()
    with node("exp3,exp4") as server, server.client() as c:
        url = server.url
        for i, j in enumerate(order):
            if i == sz.phase1:
                favoured = shares(select_state(url, EXP3))
                degraded = max(favoured, key=lambda k: favoured[k]).lower()
                version = put_model(url, degraded, degraded=True)
                log(f"  query {i}: put {digits.key(degraded)} v{version}, scrambled "
                    f"(Exp3 shares then: {', '.join(f'{k} {v:.2f}' for k, v in favoured.items())})")
            x = s.x_test[j:j + 1]
            for p in pipes:
                t0 = time.perf_counter()
                out = c.infer(p, {"x": x})
                latency[p][i] = time.perf_counter() - t0
                correct[p][i] = int(out["label"][0]) == int(y[i])
                if p == EXP3:
                    picked.append(str(out["model"][0]))
                else:
                    contributors[i] = int(out["contributors"][0])
                c.feedback(p, out.request_id, label=int(y[i]))
            after = i >= sz.phase1
            if i % 10 == 9 or (after and i < sz.phase1 + 400) or i == n - 1:
                for p in pipes:
                    trace[p].append((i, shares(select_state(url, p))))
            if i % 500 == 499:
                log(f"  {i + 1}/{n}: accuracy of the last 500: Exp3 {correct[EXP3][i - 499:i + 1].mean():.3f}, "
                    f"Exp4 {correct[EXP4][i - 499:i + 1].mean():.3f}")
        final = {p: select_state(url, p) for p in pipes}
    assert degraded is not None
    single = {m: preds[m][order] == y for m in preds}
    single[degraded][sz.phase1:] = perm[preds[degraded][order[sz.phase1:]]] == y[sz.phase1:]
    return summarise_selection(sz, correct, latency, picked, contributors, trace, single, degraded, final, load)


def first_below(trace: list[tuple[int, dict[str, float]]], stage: str, start: int) -> int | None:
    """Feedback events after the put (the query at ``start`` is the first)
    until ``stage``'s share is below 1/K; None if it never is."""
    for i, sh in trace:
        if i >= start and sh[stage] < 1.0 / K:
            return i - start + 1
    return None


def recovered_at(ok: np.ndarray, start: int, window: int, target: float) -> int | None:
    """Queries after ``start`` until the next ``window`` answers reach ``target`` accuracy."""
    for k in range(0, len(ok) - start - window + 1):
        if ok[start + k:start + k + window].mean() >= target:
            return k
    return None


def summarise_selection(sz: Sizes, correct: dict[str, np.ndarray], latency: dict[str, np.ndarray],
                        picked: list[str], contributors: np.ndarray,
                        trace: dict[str, list[tuple[int, dict[str, float]]]], single: dict[str, np.ndarray],
                        degraded: str, final: dict[str, Any], load: list[float]) -> dict[str, Any]:
    p1, last = sz.phase1, sz.last
    tail = slice(p1 - last, p1)
    single_p1 = {m: float(v[:p1].mean()) for m, v in single.items()}
    best = max(single_p1, key=lambda m: single_p1[m])
    picks_tail = np.asarray(picked[p1 - last:p1])
    healthy_p2 = {m: float(v[p1:].mean()) for m, v in single.items() if m != degraded}
    target = max(healthy_p2.values()) - 0.05
    stage = degraded.upper()
    return {
        "load_before": load,
        "best_single": best,
        "single_accuracy_phase1": single_p1,
        "single_accuracy_last": {m: float(v[tail].mean()) for m, v in single.items()},
        "accuracy_last": {p: float(v[tail].mean()) for p, v in correct.items()},
        "accuracy_phase1": {p: float(v[:p1].mean()) for p, v in correct.items()},
        "exp3_best_pick_share_last": float((picks_tail == best.upper()).mean()),
        "exp3_pick_shares_last": {m.upper(): float((picks_tail == m.upper()).mean()) for m in digits.MODELS},
        "policy_at_degrade": {p: next((sh for i, sh in reversed(tr) if i < p1), {}) for p, tr in trace.items()},
        "exp4_contributors_mean": float(contributors[:p1].mean()),
        "exp4_answers_short": int((contributors < K).sum()),
        "latency_ms": {p: {"p50": percentile(v * 1e3, 50), "p99": percentile(v * 1e3, 99)} for p, v in latency.items()},
        "degraded": degraded,
        "events_until_share_below_1_over_k": {p: first_below(tr, stage, p1) for p, tr in trace.items()},
        "recovery_target": target,
        "queries_until_recovered": {p: recovered_at(v, p1, sz.window, target) for p, v in correct.items()},
        "accuracy_first_100_after": {p: float(v[p1:p1 + 100].mean()) for p, v in correct.items()},
        "accuracy_phase2": {p: float(v[p1:].mean()) for p, v in correct.items()},
        "single_accuracy_phase2": {m: float(v[p1:].mean()) for m, v in single.items()},
        "final_policy": {p: {k: final[p].get(k) for k in ("policy", "candidates", "weights", "probabilities", "eta",
                                                          "gamma", "feedback", "unknown_feedback", "picks")}
                         for p in final},
        # for the plot
        "series": {"correct": {p: v.astype(int).tolist() for p, v in correct.items()},
                   "single": {m: v.astype(int).tolist() for m, v in single.items()},
                   "trace": {p: [[i, sh] for i, sh in tr] for p, tr in trace.items()}},
    }


# --------------------------------------------------------------------- (c)

async def open_loop(url: str, pipeline: str, rate: float, seconds: float, seed: int) -> list[dict[str, Any]]:
    """Poisson arrivals for ``seconds``; latency from each request's
    scheduled send time."""
    s = digits.split()
    rng = np.random.default_rng(seed)
    client = ss.AsyncClient(url, max_connections=64)
    await client.metadata(pipeline)
    out: list[dict[str, Any]] = []

    async def one(at: float, j: int) -> None:
        rec: dict[str, Any] = {"truth": int(s.y_test[j])}
        try:
            r = await client.infer(pipeline, {"x": s.x_test[j:j + 1]})
            rec.update(ok=True, label=int(r["label"][0]), contributors=int(r["contributors"][0]),
                       confidence=float(r["confidence"][0]))
        except ss.RequestError as e:
            rec.update(ok=False, error=type(e).__name__)
        rec["latency_ms"] = (time.perf_counter() - at) * 1e3
        out.append(rec)

    loop_start = time.perf_counter()
    t, tasks = loop_start, []
    while t - loop_start < seconds:
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(t, int(rng.integers(len(s.y_test))))))
        t += rng.exponential(1.0 / rate)
    await asyncio.gather(*tasks)
    await client.close()
    return out


def summarise_load(recs: list[dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    ok = [r for r in recs if r["ok"]]
    lat = [r["latency_ms"] for r in recs]
    contrib = np.array([r["contributors"] for r in ok]) if ok else np.zeros(0)
    errors: dict[str, int] = {}
    for r in recs:
        if not r["ok"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {"requests": len(recs), "answered": len(ok), "errors": errors,
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "max_ms": max(lat) if lat else None,
            "over_ms": slo_ms, "over": sum(1 for x in lat if x > slo_ms),
            "accuracy": float(np.mean([r["label"] == r["truth"] for r in ok])) if ok else None,
            "contributors_mean": float(contrib.mean()) if ok else None,
            "short_share": float((contrib < K).mean()) if ok else None}


def straggler_run(sz: Sizes, seed: int) -> dict[str, Any]:
    s = digits.split()
    result: dict[str, Any] = {"slow": SLOW, "wait_ms": WAIT_MS}
    with node("exp4,exp4_all", CLIPPER_SLOW=SLOW, CLIPPER_WAIT_MS=str(WAIT_MS)) as server, server.client() as c:
        url = server.url
        slo = {p["name"]: p["slo"]["p99_ms"] for p in status_of(url)["pipelines"] if p.get("slo")}
        bound = slo.get(EXP4, 100.0)  # both judged against the interactive pipeline's objective
        # Warm-up with feedback, so the weights are learned ones (the
        # straggler is there too: its answers count when they come in time).
        for j in digits.query_stream(sz.warm, seed=seed + 100):
            for p in (EXP4, EXP4_ALL):
                out = c.infer(p, {"x": s.x_test[j:j + 1]})
                c.feedback(p, out.request_id, label=int(s.y_test[j]))
        order = (EXP4, EXP4_ALL) if seed % 2 else (EXP4_ALL, EXP4)
        for p in order:
            load = loadavg()
            recs = asyncio.run(open_loop(url, p, sz.rate, sz.seconds, seed))
            result[p] = {"load_before": load, "slo_ms": slo.get(p), **summarise_load(recs, bound)}
            log(f"  {p}: p50 {result[p]['p50_ms']:.1f} ms, p99 {result[p]['p99_ms']:.1f} ms, "
                f"accuracy {result[p]['accuracy']}, contributors {result[p]['contributors_mean']}")
        for p in order:
            st = select_state(url, p)
            result[p]["select"] = {k: st.get(k) for k in ("cut_short", "held", "weights", "feedback")}
    return result


# --------------------------------------------------------------------- (d)

async def closed_loop(url: str, pipeline: str, stream: np.ndarray, conc: int, seconds: float) -> dict[str, Any]:
    s = digits.split()
    client = ss.AsyncClient(url, max_connections=conc)
    await client.metadata(pipeline)
    done, errors, lat = 0, 0, []
    end = time.perf_counter() + seconds
    nxt = 0

    async def worker() -> None:
        nonlocal done, errors, nxt
        while time.perf_counter() < end:
            j = int(stream[nxt % len(stream)])
            nxt += 1
            t0 = time.perf_counter()
            try:
                await client.infer(pipeline, {"x": s.x_test[j:j + 1]})
                done += 1
                lat.append(time.perf_counter() - t0)
            except ss.RequestError:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    took = time.perf_counter() - t0
    await client.close()
    ms = np.asarray(lat) * 1e3
    return {"rps": done / took, "answered": done, "errors": errors, "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99)}


def cache_run(sz: Sizes, seed: int) -> dict[str, Any]:
    s = digits.split()
    stream = digits.zipf_stream(sz.zipf, seed=seed)
    seen: set[int] = set()
    hit = np.zeros(len(stream), dtype=bool)
    for i, j in enumerate(stream):
        hit[i] = int(j) in seen
        seen.add(int(j))
    result: dict[str, Any] = {"stream": len(stream), "distinct": len(seen), "expected_hit_rate": float(hit.mean())}
    with node("cached,single") as server, server.client() as c:
        url = server.url
        before = stage_cache(url, CACHED, "Cached")
        for p in (CACHED, SINGLE):
            load = loadavg()
            lat = np.zeros(len(stream))
            for i, j in enumerate(stream):
                t0 = time.perf_counter()
                c.infer(p, {"x": s.x_test[j:j + 1]})
                lat[i] = time.perf_counter() - t0
            lat *= 1e3
            if p == CACHED:
                after = stage_cache(url, CACHED, "Cached")
                result["sequential"] = {
                    "load_before": load,
                    "hit": {"p50_ms": percentile(lat[hit], 50), "p99_ms": percentile(lat[hit], 99)},
                    "miss": {"p50_ms": percentile(lat[~hit], 50), "p99_ms": percentile(lat[~hit], 99)},
                    "all": {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)},
                    "node_hits": after["hits"] - before["hits"], "node_misses": after["misses"] - before["misses"],
                    "cache": after,
                }
            else:
                result["sequential"]["off"] = {"load_before": load, "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
        second = digits.zipf_stream(20 * sz.zipf, seed=seed + 1000)  # same popular images, new draws
        result["throughput"] = {}
        for p in (CACHED, SINGLE):
            load = loadavg()
            b = stage_cache(url, CACHED, "Cached")
            r = asyncio.run(closed_loop(url, p, second, sz.conc, sz.tput_s))
            if p == CACHED:
                a = stage_cache(url, CACHED, "Cached")
                total = (a["hits"] - b["hits"]) + (a["misses"] - b["misses"])
                r["hit_rate"] = (a["hits"] - b["hits"]) / total if total else None
            result["throughput"][p] = {"load_before": load, **r}
        if harness.OHA is not None:
            body = json.dumps({"inputs": {"x": s.x_test[int(stream[0]):int(stream[0]) + 1].tolist()}}).encode()
            result["oha"] = {}
            for p in (CACHED, SINGLE):
                load = loadavg()
                r = harness.oha(f"{url}/v1/pipelines/{p}/infer", seconds=sz.tput_s, concurrency=sz.conc, body=body,
                                headers=["Content-Type: application/json"])
                result["oha"][p] = {"load_before": load, **r}
        else:
            log("  oha not found: `cargo install oha --locked` for the node-side throughput")
        result["cache_after"] = stage_cache(url, CACHED, "Cached")
    return result


# --------------------------------------------------------------------- report

def median_of(runs: list[dict[str, Any]], *path: str) -> Any:
    vals = []
    for r in runs:
        v: Any = r
        for k in path:
            v = None if v is None else v.get(k)
        vals.append(v)
    return med(vals)


def rolling(x: list[int], w: int) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(a)])
    i = np.arange(1, len(a) + 1)
    lo = np.maximum(0, i - w)
    return (c[i] - c[lo]) / (i - lo)


def plot(run: dict[str, Any], sz: Sizes, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = 100
    ser = run["series"]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colors = {"lr": "tab:blue", "rf": "tab:brown", "svm": "tab:green", "knn": "tab:purple"}
    for m, v in ser["single"].items():
        label = f"{m} alone" + (" (scrambled at the line)" if m == run["degraded"] else "")
        ax.plot(rolling(v, w), color=colors[m], lw=1, ls="--", alpha=0.8, label=label)
    ax.plot(rolling(ser["correct"][EXP3], w), color="black", lw=2, label="Exp3 (one model per request)")
    ax.plot(rolling(ser["correct"][EXP4], w), color="tab:red", lw=2, label="Exp4 (weighted ensemble)")
    for a in (ax, bx):
        a.axvline(sz.phase1, color="grey", lw=1)
    ax.set_ylabel(f"accuracy of the last {w} answers")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower left", fontsize=8, ncol=2)
    ax.set_title(f"digits: selection from feedback; {run['degraded']} scrambled after {sz.phase1} queries")
    for p, style in ((EXP3, "-"), (EXP4, ":")):
        tr = ser["trace"][p]
        xs = [i for i, _ in tr]
        for m in digits.MODELS:
            bx.plot(xs, [sh[m.upper()] for _, sh in tr], color=colors[m], ls=style, lw=1.5,
                    label=f"{'Exp3 probability' if p == EXP3 else 'Exp4 weight'}: {m}")
    bx.axhline(1.0 / K, color="grey", lw=0.8, ls="--")
    bx.set_ylabel("policy share")
    bx.set_xlabel("query (one feedback event per query and pipeline)")
    bx.set_ylim(0, 1.02)
    bx.legend(loc="center left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(v: Any, spec: str = ".3f", none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def markdown(res: dict[str, Any], sz: Sizes, quick: bool) -> str:
    sel, strag, cache = res["selection"], res["straggler"], res["cache"]
    md = ["# Clipper's selection layer on digits (bench/clipper.py)", ""]
    if quick:
        md += ["**Quick mode: a short smoke run on a noisy machine; not figures to quote.**", ""]
    md += [f"{sz.repeats} repeat(s) per part, each on a fresh node; medians of the repeats where it is about "
           "performance. Load averages before each part are in the JSON.", ""]
    if sel:
        r0 = sel[0]
        best = r0["best_single"]
        gamma = r0["final_policy"][EXP3].get("gamma") or 0.0
        md += ["## (a) Selection under feedback", "",
               f"{sz.phase1} queries (the 899 test images, reshuffled each pass), each to `digits_exp3` and "
               f"`digits_exp4`, true label fed back after each answer. Over the last {sz.last} before the degrade:",
               "", "| | accuracy (last queries) | accuracy (whole phase) |", "|---|---:|---:|"]
        for p, label in ((EXP3, "Exp3"), (EXP4, "Exp4")):
            md.append(f"| {label} | {fmt(median_of(sel, 'accuracy_last', p))} | "
                      f"{fmt(median_of(sel, 'accuracy_phase1', p))} |")
        for m in digits.MODELS:
            md.append(f"| {m} alone{' (best)' if m == best else ''} | {fmt(median_of(sel, 'single_accuracy_last', m))}"
                      f" | {fmt(median_of(sel, 'single_accuracy_phase1', m))} |")
        md += ["", f"Exp3 picked the best single model ({best}) for "
               f"**{fmt(median_of(sel, 'exp3_best_pick_share_last'), '.1%')}** of the last {sz.last} queries "
               "(median of the repeats; per repeat: "
               + ", ".join(fmt(r["exp3_best_pick_share_last"], ".1%") for r in sel) + f"; Exp3 keeps exploring: with "
               f"gamma = {gamma:g} no model gets more than {1 - gamma * (K - 1) / K:.2%} of the picks). Exp4's answers had "
               f"{fmt(median_of(sel, 'exp4_contributors_mean'), '.2f')} contributors on average. Latency one request "
               f"at a time: Exp3 p50 {fmt(median_of(sel, 'latency_ms', EXP3, 'p50'), '.1f')} ms / p99 "
               f"{fmt(median_of(sel, 'latency_ms', EXP3, 'p99'), '.1f')} ms, Exp4 p50 "
               f"{fmt(median_of(sel, 'latency_ms', EXP4, 'p50'), '.1f')} / p99 "
               f"{fmt(median_of(sel, 'latency_ms', EXP4, 'p99'), '.1f')} ms.", "",
               "![accuracy over time](clipper_accuracy.png)", "",
               "## (b) A model degraded mid-run", "",
               f"After {sz.phase1} queries the model Exp3 favoured ({', '.join(sorted({r['degraded'] for r in sel}))}) "
               "was put again under its store key with its labels scrambled. Feedback events after the put until "
               f"its share of the policy fell below 1/K = {1 / K:.2f}, and queries until the next {sz.window} answers "
               "were within 0.05 of the best healthy model's accuracy (per repeat):", "",
               "| | share < 1/K after (events) | accuracy recovered after (queries) | accuracy, first 100 after "
               "| accuracy, rest of the run |", "|---|---|---|---:|---:|"]
        for p, label in ((EXP3, "Exp3"), (EXP4, "Exp4")):
            md.append(f"| {label} | {', '.join(str(r['events_until_share_below_1_over_k'][p]) for r in sel)} | "
                      f"{', '.join(str(r['queries_until_recovered'][p]) for r in sel)} | "
                      f"{fmt(median_of(sel, 'accuracy_first_100_after', p))} | "
                      f"{fmt(median_of(sel, 'accuracy_phase2', p))} |")
        md += ["", "Each model alone over the same post-put queries: " + ", ".join(
            f"{m} {fmt(median_of(sel, 'single_accuracy_phase2', m))}" for m in digits.MODELS) + ".", ""]
    if strag:
        md += ["## (c) Straggler bound", "",
               f"`CLIPPER_SLOW={SLOW}` (10% of KNN's batches sleep 200 ms). Poisson arrivals at {sz.rate:g} req/s "
               f"for {sz.seconds:g} s per pipeline after {sz.warm} warm-up queries with feedback; latency from the "
               "scheduled send. Medians of the repeats:", "",
               "| pipeline | its SLO p99 | p50 ms | p99 ms | max ms | answers over "
               f"{fmt(median_of(strag, EXP4, 'over_ms'), '.0f')} ms | accuracy | contributors (mean) "
               "| answers with < 4 | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for p, label in ((EXP4, f"`digits_exp4` (bound {WAIT_MS:g} ms)"), (EXP4_ALL, "`digits_exp4_all` (no bound)")):
            errs = "; ".join(", ".join(f"{k} {v}" for k, v in r[p]["errors"].items()) or "none" for r in strag)
            md.append(f"| {label} | {fmt(median_of(strag, p, 'slo_ms'), '.0f')} | "
                      f"{fmt(median_of(strag, p, 'p50_ms'), '.1f')} | {fmt(median_of(strag, p, 'p99_ms'), '.1f')} | "
                      f"{fmt(median_of(strag, p, 'max_ms'), '.0f')} | {fmt(median_of(strag, p, 'over'), '.0f')} | "
                      f"{fmt(median_of(strag, p, 'accuracy'))} | {fmt(median_of(strag, p, 'contributors_mean'), '.2f')}"
                      f" | {fmt(median_of(strag, p, 'short_share'), '.1%')} | {errs} |")
        md.append("")
    if cache:
        md += ["## (d) Prediction cache on a Zipf stream", "",
               f"`digits_cached` (the SVM, `cache=True`) vs `digits_single` (same model, no cache). "
               f"{cache[0]['stream']} queries drawn Zipf(1.1) over the 899 test images ({cache[0]['distinct']} distinct, "
               f"so a hit rate of {fmt(cache[0]['expected_hit_rate'], '.1%')} from a cold cache), one at a time:", "",
               "| path | p50 ms | p99 ms |", "|---|---:|---:|",
               f"| hit | {fmt(median_of(cache, 'sequential', 'hit', 'p50_ms'), '.2f')} | "
               f"{fmt(median_of(cache, 'sequential', 'hit', 'p99_ms'), '.2f')} |",
               f"| miss | {fmt(median_of(cache, 'sequential', 'miss', 'p50_ms'), '.2f')} | "
               f"{fmt(median_of(cache, 'sequential', 'miss', 'p99_ms'), '.2f')} |",
               f"| whole stream, cache on | {fmt(median_of(cache, 'sequential', 'all', 'p50_ms'), '.2f')} | "
               f"{fmt(median_of(cache, 'sequential', 'all', 'p99_ms'), '.2f')} |",
               f"| whole stream, cache off | {fmt(median_of(cache, 'sequential', 'off', 'p50_ms'), '.2f')} | "
               f"{fmt(median_of(cache, 'sequential', 'off', 'p99_ms'), '.2f')} |", "",
               "The node counted " + ", ".join(f"{r['sequential']['node_hits']} hits / "
                                               f"{r['sequential']['node_misses']} misses" for r in cache)
               + " on that stream (per repeat).", "",
               f"Throughput, {sz.conc} closed-loop clients for {sz.tput_s:g} s (median):", "",
               "| generator | cache on req/s | hit rate | p50 / p99 ms | cache off req/s | p50 / p99 ms |",
               "|---|---:|---:|---|---:|---|"]
        t = ("throughput",)
        md.append(f"| Python async client, second Zipf stream (warm cache) | "
                  f"{fmt(median_of(cache, *t, CACHED, 'rps'), '.0f')} | "
                  f"{fmt(median_of(cache, *t, CACHED, 'hit_rate'), '.1%')} | "
                  f"{fmt(median_of(cache, *t, CACHED, 'p50_ms'), '.2f')} / "
                  f"{fmt(median_of(cache, *t, CACHED, 'p99_ms'), '.2f')} | "
                  f"{fmt(median_of(cache, *t, SINGLE, 'rps'), '.0f')} | "
                  f"{fmt(median_of(cache, *t, SINGLE, 'p50_ms'), '.2f')} / "
                  f"{fmt(median_of(cache, *t, SINGLE, 'p99_ms'), '.2f')} |")
        if all("oha" in r for r in cache):
            md.append(f"| oha, one image repeated (every request a hit / a miss) | "
                      f"{fmt(median_of(cache, 'oha', CACHED, 'rps'), '.0f')} | ~100% | "
                      f"{fmt(median_of(cache, 'oha', CACHED, 'p50_ms'), '.2f')} / "
                      f"{fmt(median_of(cache, 'oha', CACHED, 'p99_ms'), '.2f')} | "
                      f"{fmt(median_of(cache, 'oha', SINGLE, 'rps'), '.0f')} | "
                      f"{fmt(median_of(cache, 'oha', SINGLE, 'p50_ms'), '.2f')} / "
                      f"{fmt(median_of(cache, 'oha', SINGLE, 'p99_ms'), '.2f')} |")
        md.append("")
    md += ["Command: `make bench-clipper` (`python -m bench.clipper" + (" --quick" if quick else "") + "`)."]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short smoke run (noisy figures)")
    ap.add_argument("--repeats", type=int, help="runs of each part (default 3; 1 with --quick)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="which parts to run (the others' results are kept from the last run's JSON)")
    ap.add_argument("--out", type=Path, help="output stem (default bench/results/clipper, or clipper-quick)")
    a = ap.parse_args(argv)
    sz = QUICK if a.quick else FULL
    if a.repeats:
        sz = Sizes(**{**asdict(sz), "repeats": a.repeats})
    out = a.out or RESULTS / ("clipper-quick" if a.quick else "clipper")
    parts = {p.strip() for p in a.parts.split(",") if p.strip()}
    unknown = parts - set(PARTS)
    if unknown:
        ap.error(f"unknown parts: {', '.join(sorted(unknown))}")
    digits.ensure_models()
    machine = harness.machine()
    res: dict[str, Any] = {"quick": a.quick, "sizes": asdict(sz), "selection": [], "straggler": [], "cache": []}
    for rep in range(sz.repeats):
        seed = 1 + rep
        if "selection" in parts:
            log(f"(a)+(b) selection, repeat {rep + 1}/{sz.repeats}, load {loadavg()}")
            res["selection"].append(selection_run(sz, seed))
        if "straggler" in parts:
            log(f"(c) straggler bound, repeat {rep + 1}/{sz.repeats}, load {loadavg()}")
            res["straggler"].append({"load_before": loadavg(), **straggler_run(sz, seed)})
        if "cache" in parts:
            log(f"(d) cache, repeat {rep + 1}/{sz.repeats}, load {loadavg()}")
            res["cache"].append({"load_before": loadavg(), **cache_run(sz, seed)})
    res["load_end"] = loadavg()
    previous = out.with_suffix(".json")
    if parts != set(PARTS) and previous.is_file():
        # A rerun of some parts keeps the others' results from the last run.
        old = json.loads(previous.read_text())
        for p in set(PARTS) - parts:
            res[p] = old.get(p, [])
    out.parent.mkdir(parents=True, exist_ok=True)
    if res["selection"]:
        plot(res["selection"][0], sz, out.parent / f"{out.name}_accuracy.png")
    md = markdown(res, sz, a.quick)
    if out.name != "clipper":
        md = md.replace("clipper_accuracy.png", f"{out.name}_accuracy.png")
    harness.write_results(out, res, md, machine)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
