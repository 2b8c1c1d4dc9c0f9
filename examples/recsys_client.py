"""Ask the ``recsys`` pipeline for recommendations, then put it under load.

    python examples/recsys_client.py                  # starts its own node on a free port
    python examples/recsys_client.py --url http://127.0.0.1:8000 --requests 2000 --concurrency 32

First a few users one at a time (their top 10 items, scores and the round
trip), then ``--requests`` requests from ``--concurrency`` threads, each a
different user with a random history: latency percentiles as this client
saw them, and the batch sizes the node formed per stage (from
``/v1/status``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import slipstream as ss

HERE = Path(__file__).resolve().parent
N_ITEMS = 200_000
HISTORY = 8


def post(url: str, body: dict, timeout: float = 30.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())




def body_for(user: int, history: list[int]) -> dict:
    history = (list(history) + [-1] * HISTORY)[:HISTORY]
    return {"inputs": {"user": [[user]], "history": [history]}}


def show_users(url: str, users: int) -> None:
    rng = np.random.default_rng(0)
    for user in range(users):
        history = [int(h) for h in rng.integers(0, N_ITEMS, size=user % (HISTORY + 1))]
        t0 = time.perf_counter()
        out = post(f"{url}/v1/pipelines/recsys/infer", body_for(user, history))["outputs"]
        ms = (time.perf_counter() - t0) * 1e3
        items, scores = out["items"][0], out["scores"][0]
        top = "  ".join(f"{i}:{s:.3f}" for i, s in zip(items[:5], scores[:5], strict=True))
        print(f"user {user:3d}  history {len(history)} items  {ms:6.2f} ms  top-5 (item:score) {top}")


def load(url: str, requests: int, concurrency: int) -> None:
    rng = np.random.default_rng(1)
    bodies = [
        body_for(int(u), [int(h) for h in rng.integers(0, N_ITEMS, size=int(rng.integers(0, HISTORY + 1)))])
        for u in rng.integers(0, 10**6, size=requests)
    ]
    target = f"{url}/v1/pipelines/recsys/infer"

    def one(body: dict) -> float | None:
        """Latency in ms, or None if the node shed the request for its SLO
        (429: refused at ingress, 504: its deadline passed in a queue)."""
        t0 = time.perf_counter()
        try:
            post(target, body)
        except urllib.error.HTTPError as e:
            if e.code in (429, 504):
                return None
            raise
        return (time.perf_counter() - t0) * 1e3

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, bodies))
    wall = time.perf_counter() - t0
    lat = np.array([r for r in results if r is not None])
    print(f"\n{requests} requests, {concurrency} in flight: {len(lat) / wall:.0f} answers/s, "
          f"{requests - len(lat)} shed for the SLO")
    if len(lat):
        p50, p99 = np.percentile(lat, [50, 99])
        print(f"client-side latency of the answered: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    status = get(f"{url}/v1/status")
    pipe = next(p for p in status["pipelines"] if p["name"] == "recsys")
    print(f"node-side latency p50 {pipe['latency_ms']['p50']:.2f} ms, p99 {pipe['latency_ms']['p99']:.2f} ms "
          f"(SLO p99 <= {pipe['slo']['p99_ms']:.0f} ms)")
    for s in pipe["stages"]:
        print(f"  {s['name']:<10} batches {s['batches']:6d}  batch size mean {s['batch_size']['mean']:6.1f} "
              f"max {s['batch_size']['max']:4.0f}  compute per batch mean {s['compute_ms']['mean']:.2f} ms, "
              f"per request {s['compute_ms']['mean'] * s['batches'] / max(s['requests'], 1):.3f} ms, "
              f"hop p50 {s['hop_ms']['p50']:.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a node serving examples/recsys.py (default: start one)")
    ap.add_argument("--users", type=int, default=8, help="users to show one by one")
    ap.add_argument("--requests", type=int, default=1000, help="requests in the load phase (0: none)")
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    node = None
    url = args.url
    if url is None:
        node = ss.launch(HERE / "recsys.py", echo=True)
        url = node.url
    try:
        show_users(url.rstrip("/"), args.users)
        if args.requests:
            load(url.rstrip("/"), args.requests, args.concurrency)
    finally:
        if node is not None:
            node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
