"""Freshness of the live knowledge base: time from putting a document to
the first query that finds it, while the RAG pipeline serves queries.

Serves ``examples/rag.py`` (its ``ingest`` pipeline embeds documents put
under ``/docs/``; every Search replica follows ``/index/live/``), offers
Poisson query load at ``--load`` (default 0.5) of the pipeline's offline
compute limit (``bench.limit``; 160 req/s if it has not been measured)
with the project's load generator, and meanwhile, one at a time, puts a
made-up document and queries for it with its own text every ``--poll-ms``
until it is in the top 10. Freshness = first query that found it - the
moment the put was sent. Also reports what the background load got
(goodput, p99, errors), and the load average.

    .venv/bin/python -m bench.freshness      # -> bench/results/freshness.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import slipstream as ss

from bench import harness
from bench.goodput import run_rate
from bench.harness import EXAMPLES, RESULTS, percentile
from bench.limit import load_limit

WORDS = ("quantum ledger parser daemon widget codec mirror shell raster tensor cipher router gauge "
         "lattice beacon kernel vector fractal index packet signal").split()


def document(rng: np.random.Generator, i: int) -> tuple[str, str]:
    name = f"fresh{i:04d}x{int(rng.integers(1e9)):09d}"
    words = " ".join(rng.choice(WORDS, 12))
    return name, f"{name} - {words}\nA made-up package {name} that handles {words}."


def query(url: str, text: str) -> list[str]:
    body = json.dumps({"inputs": {"query": [text]}}).encode()
    req = urllib.request.Request(f"{url}/v1/pipelines/rag/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return list(json.loads(r.read())["outputs"]["package"][0])
    except OSError:
        return []  # refused (429) or late: poll again


def background(url: str, rate: float, seconds: float, slo_ms: float, out: dict[str, Any]) -> None:
    body = json.dumps({"inputs": {"query": ["how do I configure a reverse proxy with TLS termination"]}}).encode()
    out.update(run_rate(url, "rag", body, rate, seconds, slo_ms, warmup_s=0.0, seed=5))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=60, help="documents to put (one at a time)")
    ap.add_argument("--load", type=float, default=0.5, help="background load, a share of the offline limit")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "freshness.json")
    a = ap.parse_args()
    limit = load_limit("rag")
    rate = round((limit or 320.0) * a.load)
    machine = harness.machine()
    print(f"freshness: load average {machine['loadavg_before'][0]:.2f}; background load {rate} req/s "
          f"({a.load:.0%} of the {'measured' if limit else 'assumed'} limit {limit or 320.0:.0f} req/s)",
          file=sys.stderr)
    # Two query encoders (as the planner sizes RAG for two cores), fixed, unless set.
    env = {"RAG_EMBED_REPLICAS": os.environ.get("RAG_EMBED_REPLICAS", "2")}
    rng = np.random.default_rng(7)
    times: list[float] = []
    bg: dict[str, Any] = {}
    with harness.node(EXAMPLES / "rag.py", "--autoscale", "off", env=env) as node:
        store = ss.store.Store(node.url)
        seconds = 4.0 + a.docs * 0.6
        t = threading.Thread(target=background, args=(node.url, rate, seconds, 200.0, bg), daemon=True)
        t.start()
        time.sleep(2.0)  # the load settles
        for i in range(a.docs):
            if not t.is_alive():
                print("freshness: the background load ended early; stopping", file=sys.stderr)
                break
            name, text = document(rng, i)
            t0 = time.perf_counter()
            store.put(f"/docs/bench/{name}", text)
            while True:
                if name in query(node.url, text):
                    times.append((time.perf_counter() - t0) * 1e3)
                    break
                if time.perf_counter() - t0 > 30:
                    raise RuntimeError(f"{name} not found 30 s after its put")
                time.sleep(a.poll_ms / 1e3)
            time.sleep(0.1)
        t.join()
        stats = store.stats()
    result = {
        "docs": len(times), "load_avg_after": os.getloadavg()[0],
        "freshness_ms": {"p50": percentile(times, 50), "p99": percentile(times, 99),
                         "max": max(times, default=float("nan")),
                         "mean": statistics.fmean(times) if times else float("nan")},
        "poll_ms": a.poll_ms, "background": bg, "limit_rps": limit, "triggers": stats.get("triggers"),
    }
    f = result["freshness_ms"]
    md = (f"# Live knowledge base freshness\n\n"
          f"| documents | freshness p50 | p99 | max | background offered | goodput | p99 | errors |\n"
          f"|---|---|---|---|---|---|---|---|\n"
          f"| {len(times)} | {f['p50']:.0f} ms | {f['p99']:.0f} ms | {f['max']:.0f} ms | {bg.get('offered_rps')} req/s "
          f"| {bg.get('goodput_rps', 0):.0f} req/s | {bg.get('p99_ms', 0):.0f} ms | {bg.get('errors')} |\n")
    harness.write_results(a.out, result, md, machine)
    print(md)
    print(f"freshness: p50 {statistics.median(times):.0f} ms; written {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
