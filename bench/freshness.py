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

With ``--cluster N`` the same runs on N nodes of one cluster on a real
etcd (this machine; ``slipstream deploy`` and ``slipstream node``): the
document is put through the first node and found by queries through the
last, so the figure includes the cluster store's commit, the trigger
leader's ingest and every node's Search following the live index.

    .venv/bin/python -m bench.freshness      # -> bench/results/freshness.{json,md}
    .venv/bin/python -m bench.freshness --cluster 3   # -> freshness-cluster3.{json,md}
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import slipstream as ss
from slipstream.testing import Etcd, Node, deploy, start_node, stop_all, wait_for

from bench import harness
from bench.goodput import run_rate
from bench.harness import EXAMPLES, RESULTS, ROOT, percentile
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
    out.update(run_rate(url, "rag", [body], rate, seconds, slo_ms, warmup_s=0.0, seed=5))


@contextmanager
def serving(cluster: int, env: dict[str, str]) -> Iterator[tuple[str, str, str]]:
    """(put, load, query) URLs: one node's for all three; or, with `cluster`
    > 1, nodes of one cluster on a real etcd (the app deployed as `slipstream
    deploy` does, its files carried by the deployment), puts through the
    first, background load through the middle one, queries through the last."""
    if cluster <= 1:
        with harness.node(EXAMPLES / "rag.py", "--autoscale", "off", env=env) as node:
            yield node.url, node.url, node.url
        return
    env = {**env, "SLIPSTREAM_DATA": os.environ.get("SLIPSTREAM_DATA", str(ROOT / "data"))}
    etcd = Etcd(1)
    nodes: list[Node] = []
    try:
        out = deploy(etcd, EXAMPLES / "rag.py", wait=0, env=env, cwd=ROOT)
        if out.returncode != 0:
            raise RuntimeError(out.stdout + out.stderr)
        nodes = [start_node(etcd, f"n{i + 1}", env=env) for i in range(cluster)]
        for n in nodes:
            wait_for(n.is_ready, timeout=900)
        wait_for(lambda: all(len(n.status()["cluster"]["members"]) == cluster for n in nodes), timeout=60)
        print(f"freshness: {cluster} nodes ready", file=sys.stderr)
        yield nodes[0].url, nodes[len(nodes) // 2].url, nodes[-1].url
    finally:
        stop_all(nodes)
        etcd.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=60, help="documents to put (one at a time)")
    ap.add_argument("--load", type=float, default=0.5, help="background load, a share of the offline limit")
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--cluster", type=int, default=1, metavar="N",
                    help="serve on N nodes on one etcd (deployed as `slipstream deploy` does): documents put "
                         "through the first, queried through the last, the background load through another")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/freshness[-clusterN].json")
    a = ap.parse_args()
    if a.out is None:
        a.out = RESULTS / ("freshness.json" if a.cluster <= 1 else f"freshness-cluster{a.cluster}.json")
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
    with serving(a.cluster, env) as (put_url, load_url, query_url):
        store = ss.store.Store(put_url)
        seconds = 4.0 + a.docs * 0.6
        t = threading.Thread(target=background, args=(load_url, rate, seconds, 200.0, bg), daemon=True)
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
                if name in query(query_url, text):
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
    where = "one node" if a.cluster <= 1 else f"{a.cluster} nodes (put via n1, queried via n{a.cluster})"
    result["nodes"] = max(1, a.cluster)
    md = (f"# Live knowledge base freshness: {where}\n\n"
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
