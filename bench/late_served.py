"""How much of its re-rank rag_late's answers complete, served at fixed
loads by Slipstream (out of the box) and by Ray Serve (at the same counts),
and offline at each batch size: the quality its goodput, its limit and its
comparison are measured at.

    .venv/bin/python -m bench.late_served --slipstream 38.4,98,147 --ray 38.4 \
        --equal-quality 30,40,50,60,70

rag_late's Search is elastic: it re-ranks candidates by MaxSim until its
batch's time (at most ``RAG_LATE_BUDGET_MS``, 50 ms by default) runs out,
then answers the rest in single-vector order. Its throughput is therefore
bought with re-rank work, and a goodput, a limit or a ratio means little
without the share of the re-rank behind it.

- Served: open-loop Poisson requests of the benchmark mix for
  ``--duration`` s; the share is of the candidates a query has.
  Slipstream: a fresh ``slipstream serve examples/rag_late.py`` (the
  out-of-box plan) per rate, driven by the project's generator (Rust, in
  this process); the share is the Search replica's own count, from its
  summary in the node's log (``RAG_LATE_LOG_S=1``). Ray Serve: bench.goodput's
  ``ray-planned`` server, driven by a Python client (a thread a request,
  cheap at Ray's rates; at 100-150 req/s such a client takes enough of a
  core to cut Slipstream's share by a third) that reads each answer's own
  count (``reranked``, of ``target``): the same quantity.
- Like answers (``--equal-quality RATES``): each system's highest rate of
  RATES (rising; it stops at its first failure) that holds the SLO with
  answers re-ranking at least ``--min-share`` (95%) of their candidates,
  both driven by the Python client and counted from the answers, one
  server each: the goodput ratio of answers of the same quality.
- Offline: the Search component in this process, as bench.limit runs it
  (ready batches of the mix, no deadline, the budget), at each batch size,
  and once with no budget: milliseconds a query and the share re-ranked.

Writes bench/results/late_served.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import RESULTS, ROOT

APP = ROOT / "examples" / "rag_late.py"
#: The Search replica's summary (``RAG_LATE_LOG_S``): its searches so far,
#: the share of their candidates re-ranked, how many candidates a query has.
SUMMARY = re.compile(r"(\d+) searches: re-ranked (\d+)% of their (\d+) candidates")


@dataclass
class Late:
    """rag_late, loaded once: the example's module (its settings and
    components), the benchmark's request mix, the pipeline and its SLO."""

    module: Any
    bodies: list[bytes]
    pipe: Any

    @property
    def slo_ms(self) -> float:
        return float(self.pipe.slo.p99_ms) if self.pipe.slo else 0.0

    @property
    def max_miss(self) -> float:
        return float(self.pipe.slo.max_miss_rate) if self.pipe.slo else 0.01

    @property
    def each(self) -> int:
        """The candidates a query re-ranks when no budget cuts it short."""
        return int(self.module.RERANK_FULL)


def load() -> Late:
    from slipstream._internal.app import load_pipelines

    from bench.vs_ray.bodies import mix

    sys.path.insert(0, str(APP.parent))
    import rag_late

    _, pipes = load_pipelines(str(APP))
    pipe = next(p for p in pipes if p.name == "rag_late")
    bodies, _ = mix(APP, pipe)
    return Late(rag_late, bodies, pipe)


def _drive(late: Late, url: str, rate: float, seconds: float) -> dict[str, Any]:
    """Open-loop Poisson requests at `rate` for `seconds` (a thread each, up
    to 64 in flight); the answers' own ``reranked`` (of ``target``) counts.
    Misses: errors and answers later than the SLO."""
    rng = random.Random(5)
    shares: list[float] = []
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()

    def one(body: bytes) -> None:
        nonlocal errors
        t0 = time.perf_counter()
        req = urllib.request.Request(url + "/v1/pipelines/rag_late/infer", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                out = json.loads(r.read())["outputs"]
        except (OSError, ValueError, KeyError):
            with lock:
                errors += 1
            return
        with lock:
            shares.append(min(out["reranked"][0], out["target"][0]) / late.each)
            latencies.append((time.perf_counter() - t0) * 1e3)

    sent = 0
    with ThreadPoolExecutor(64) as pool:
        t = time.perf_counter()
        end = t + seconds
        while t < end:
            t += rng.expovariate(rate)
            time.sleep(max(0.0, t - time.perf_counter()))
            pool.submit(one, late.bodies[sent % len(late.bodies)])
            sent += 1
    missed = errors + sum(ms > late.slo_ms for ms in latencies)
    return {"rate_rps": rate, "sent": sent, "ok": len(shares), "errors": errors,
            "miss_rate": missed / max(1, sent),
            "reranked_share": sum(shares) / len(shares) if shares else None,
            "p99_ms": harness.percentile(latencies, 99) if latencies else None}


@contextmanager
def _ray(late: Late) -> Iterator[str]:
    """Ray Serve at the plan's counts (bench.goodput's ``ray-planned``): its URL."""
    from bench import goodput

    with goodput.serving(str(APP.relative_to(ROOT)), late.pipe, [], "ray", late.bodies[0]) as (url, _):
        yield url


def equal_quality(late: Late, systems: dict[str, list[float]], seconds: float, min_share: float
                  ) -> dict[str, Any]:
    """Each system's highest rate (of those given, rising) that holds the
    SLO (bench.goodput's criterion) with answers that re-rank at least
    `min_share` of their candidates on average: a goodput of like answers.
    Both systems are driven and counted the same way (the Python client,
    the answers' own counts), one server each for all its rates; a system
    stops at its first rate that fails."""
    from bench.goodput import holds

    out: dict[str, Any] = {"min_share": min_share, "slo_ms": late.slo_ms, "max_miss_rate": late.max_miss,
                           "systems": {}}

    def run(system: str, url: str) -> None:
        rows, best = [], None
        for rate in systems[system]:
            row = _drive(late, url, rate, seconds)
            row["holds"] = bool(holds(row, late.slo_ms, late.max_miss)
                                and (row["reranked_share"] or 0.0) >= min_share)
            print(f"  {system} at {rate:g} req/s: re-ranked {row['reranked_share'] or 0:.0%}, p99 "
                  f"{row['p99_ms'] or 0:.0f} ms, missed {row['miss_rate']:.2%}: "
                  f"{'holds' if row['holds'] else 'fails'}", file=sys.stderr)
            rows.append(row)
            if not row["holds"]:
                break
            best = rate
        out["systems"][system] = {"rows": rows, "best_rps": best}

    if systems.get("slipstream"):
        with harness.node(APP, sizing="plan") as node:
            time.sleep(1.0)
            run("slipstream", node.url)
    if systems.get("ray"):
        with _ray(late) as url:
            run("ray", url)
    return out


def served(late: Late, systems: dict[str, list[float]], seconds: float) -> list[dict[str, Any]]:
    """Each system's answers at each of its rates: Slipstream out of the box
    (a fresh node per rate), Ray Serve at the plan's counts (one server for
    its rates)."""
    from bench.goodput import Wire

    rows = []

    def record(system: str, row: dict[str, Any]) -> None:
        row = {"system": system, "load_avg_before": list(os.getloadavg()), **row}
        share = "-" if row["reranked_share"] is None else f"{row['reranked_share']:.0%}"
        p99 = "-" if row["p99_ms"] is None else f"{row['p99_ms']:.0f}"
        print(f"  {system} at {row['rate_rps']:g} req/s: re-ranked {share} of {late.each} candidates; p99 {p99} ms, "
              f"{row['errors']} errors of {row['sent']}", file=sys.stderr)
        rows.append(row)

    wire = Wire(late.bodies)
    for rate in systems.get("slipstream", []):
        with harness.node(APP, sizing="plan", env={"RAG_LATE_LOG_S": "1"}) as node:
            time.sleep(1.0)
            r = wire.run(node.url, "rag_late", rate, seconds, warmup_s=0.0, seed=5, slo_ms=late.slo_ms)
            time.sleep(1.5)  # the replica's next summary counts the last batches
            found = [m for m in map(SUMMARY.search, node.log().splitlines()) if m]
        if not found:
            raise RuntimeError(f"no Search summary in the node's log at {rate:g} req/s")
        searches, share, of = int(found[-1].group(1)), int(found[-1].group(2)) / 100, int(found[-1].group(3))
        assert of == late.each, (of, late.each)
        record("slipstream", {"rate_rps": rate, "sent": int(r["ok"]) + int(r["errors"]), "ok": searches,
                              "errors": int(r["errors"]), "reranked_share": share, "p99_ms": r["latency_ms"]["p99"]})
    if systems.get("ray"):
        with _ray(late) as url:
            for rate in systems["ray"]:
                record("ray", _drive(late, url, rate, seconds))
    return rows


def offline(late: Late, batches: list[int], queries: int = 128) -> list[dict[str, Any]]:
    import numpy as np

    rl = late.module
    texts = [json.loads(b)["inputs"]["query"][0] for b in late.bodies[:queries]]
    emb, toks, lens = rl.Embed.cls().encoder.encode_tokens(texts, max_tokens=rl.QUERY_TOKENS)
    toks = toks.astype(np.float16)
    searcher = rl.Search.cls().searcher
    rows = []
    for budget_ms in (rl.BUDGET_MS, None):
        for b in batches:
            wall, reranked = 0.0, 0
            for i in range(0, queries, b):
                t0 = time.perf_counter()
                r = searcher.search(emb[i:i + b], toks[i:i + b], lens[i:i + b],
                                    budget_s=None if budget_ms is None else budget_ms / 1e3)
                wall += time.perf_counter() - t0
                reranked += int(np.minimum(r.reranked, r.target).sum())
            row = {"budget_ms": budget_ms, "batch": b, "ms_per_query": wall / queries * 1e3,
                   "reranked_share": reranked / (queries * late.each), "candidates": late.each}
            print(f"  offline batch {b}, budget {_budget(budget_ms)}: {row['ms_per_query']:.1f} ms a query, "
                  f"re-ranked {row['reranked_share']:.0%}", file=sys.stderr)
            rows.append(row)
    return rows


def _budget(ms: float | None) -> str:
    return "none" if ms is None else f"{ms:g} ms"


def markdown(doc: dict[str, Any]) -> str:
    each = doc["candidates"]
    md = ["# rag_late: the share of the re-rank behind its goodput, its limit and its comparison", "",
          f"Served: open-loop Poisson, {doc['duration_s']:g} s a rate, the share of each query's {each} "
          "candidates re-ranked. Slipstream out of the box, a fresh node a rate; Ray Serve at the same counts "
          "(see the module doc for how each is counted). `python -m bench.late_served`.", "",
          "| system (how counted) | offered | re-ranked | p99 (ms) | errors |", "|---|---:|---:|---:|---:|"]
    for r in doc["served"]:
        share = "-" if r["reranked_share"] is None else f"{r['reranked_share']:.0%}"
        p99 = "-" if r["p99_ms"] is None else f"{r['p99_ms']:.0f}"
        how = "replica's count" if r["system"] == "slipstream" else "answers' count"
        md.append(f"| {r['system']} ({how}) | {r['rate_rps']:g} req/s | {share} | {p99} | {r['errors']} of {r['sent']} |")
    eq = doc.get("equal_quality")
    if eq:
        md += ["", f"Goodput of like answers: the highest rate (of those tried, rising) holding the "
               f"{eq['slo_ms']:g} ms SLO (misses within {eq['max_miss_rate']:.0%}) with answers that re-rank at "
               f"least {eq['min_share']:.0%} of their candidates; both systems driven and counted alike (the "
               "Python client, the answers' counts), one server each:", "",
               "| system | highest rate holding | rates tried (re-ranked, p99 ms) |", "|---|---:|---|"]
        for system, res in eq["systems"].items():
            tried = "; ".join(f"{r['rate_rps']:g}: {r['reranked_share'] or 0:.0%}, {r['p99_ms'] or 0:.0f}"
                              f"{'' if r['holds'] else ' (fails)'}" for r in res["rows"])
            best = "none" if res["best_rps"] is None else f"{res['best_rps']:g} req/s"
            if res["rows"] and res["rows"][-1]["holds"]:
                best += " or more (the highest tried)"
            md.append(f"| {system} | {best} | {tried} |")
        ours, ray = (eq["systems"].get(s, {}) for s in ("slipstream", "ray"))
        if ours.get("best_rps") and ray.get("best_rps"):
            open_ended = bool(ours["rows"] and ours["rows"][-1]["holds"])
            md += ["", f"Ratio at like answers: {'at least ' if open_ended else ''}"
                       f"{ours['best_rps'] / ray['best_rps']:.2f}x."]
    md += ["", "Offline, as bench.limit runs the stage (one process, one thread, ready batches):", "",
           "| batch | budget | ms a query | re-ranked |", "|---:|---:|---:|---:|"]
    md += [f"| {r['batch']} | {_budget(r['budget_ms'])} | {r['ms_per_query']:.1f} | {r['reranked_share']:.0%} |"
           for r in doc["offline"]]
    return "\n".join(md) + "\n"


def _rates(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slipstream", type=_rates, default=[38.4, 98.0, 147.0], help="Slipstream's rates, req/s")
    ap.add_argument("--ray", type=_rates, default=[38.4], help="Ray Serve's rates, req/s ('' for none)")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--batches", default="1,4,8,16", help="offline batch sizes ('' for none)")
    ap.add_argument("--equal-quality", type=_rates, default=[],
                    help="rates (req/s, rising) at which to find each system's goodput of like answers")
    ap.add_argument("--min-share", type=float, default=0.95,
                    help="the re-rank share answers must keep for --equal-quality")
    ap.add_argument("--out", type=Path, default=RESULTS / "late_served")
    a = ap.parse_args()
    machine = harness.machine()
    print(f"load average before: {machine['loadavg_before']}", file=sys.stderr)
    late = load()
    if a.ray or a.equal_quality:
        subprocess.run(["bash", str(ROOT / "bench/vs_ray/setup_ray.sh")], cwd=ROOT, check=True)
    doc = {"candidates": late.each, "duration_s": a.duration,
           "served": served(late, {"slipstream": a.slipstream, "ray": a.ray}, a.duration),
           "offline": offline(late, [int(x) for x in a.batches.split(",") if x])}
    if a.equal_quality:
        doc["equal_quality"] = equal_quality(late, {"slipstream": a.equal_quality, "ray": a.equal_quality},
                                             a.duration, a.min_share)
    harness.write_results(a.out, doc, markdown(doc), machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
