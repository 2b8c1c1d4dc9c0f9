"""Query the ``multimodal`` pipeline with synthetic scenes, then report how
the 6.4 MB vision tensor moved between stages.

    python examples/multimodal_client.py                 # starts its own node on a free port
    python examples/multimodal_client.py --url http://127.0.0.1:8000 --requests 60 --concurrency 2

1. Each of the 12 planted scenes (its picture and its caption): the top 3
   items (a planted scene's caption, or "distractor") and the round trip.
2. Probes: a caption with another scene's picture, and paraphrased
   captions with the right picture.
3. ``--requests`` queries from ``--concurrency`` threads: client-side
   latency, how many the node shed for the SLO, and per stage the batch
   sizes, compute and ``hop_ms`` (node -> worker -> node round trip minus
   compute), with the copy counters of that phase: how many bytes the
   workers wrote and whether the node copied anything between stages.
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
sys.path.insert(0, str(HERE))
import multimodal as mm  # noqa: E402  (scenes, captions, planted ids, sizes; loads no model)


def infer(url: str, text: str, image: np.ndarray) -> tuple[int, dict, float]:
    body = json.dumps({"inputs": {"text": [text], "image": image[None].tolist()}}).encode()
    req = urllib.request.Request(f"{url}/v1/pipelines/multimodal/infer", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, out = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, out = e.code, json.loads(e.read() or b"{}")
    return status, out, (time.perf_counter() - t0) * 1e3


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())




LABELS = {pid: mm.caption(*p) for pid, p in zip(mm.PLANTED_IDS, mm.PLANTED, strict=True)}


def show(name: str, status: int, out: dict, ms: float) -> None:
    if status != 200:
        print(f"{name:<48} HTTP {status}: {out.get('error', out)}")
        return
    ids, scores = out["outputs"]["ids"][0], out["outputs"]["scores"][0]
    top = "; ".join(f"{s:.3f} {LABELS.get(i, f'distractor #{i}')}" for i, s in zip(ids[:3], scores[:3], strict=True))
    print(f"{name:<48} {ms:6.0f} ms  {top}")


def retrying(url: str, text: str, image: np.ndarray, tries: int = 6) -> tuple[int, dict, float]:
    for attempt in range(tries):
        status, out, ms = infer(url, text, image)
        if status not in (429, 504):
            break
        time.sleep(0.25 * (attempt + 1))
    return status, out, ms


def stages(url: str) -> dict:
    status = get(f"{url}/v1/status")
    return {"copies": status["copies"], "stages": next(p for p in status["pipelines"] if p["name"] == "multimodal")["stages"]}


def load(url: str, requests: int, concurrency: int) -> None:
    images, texts = mm.planted_queries()
    before = stages(url)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: infer(url, texts[i % 12], images[i % 12]), range(requests)))
    wall = time.perf_counter() - t0
    after = stages(url)
    ok = [ms for s, _, ms in results if s == 200]
    shed = sum(1 for s, _, _ in results if s in (429, 504))
    right = sum(1 for i, (s, out, _) in enumerate(results)
                if s == 200 and out["outputs"]["ids"][0][0] == mm.PLANTED_IDS[i % 12])
    print(f"\n{requests} queries, {concurrency} in flight, {wall:.1f} s: {len(ok)} answered "
          f"({right} found their planted item first), {shed} shed for the SLO")
    if ok:
        p50, p99 = np.percentile(ok, [50, 99])
        print(f"client-side latency of the answered: p50 {p50:.0f} ms, p99 {p99:.0f} ms")
    print(f"\nper stage, since the node started:\n{'stage':<15} {'batches':>7} {'mean batch':>10} "
          f"{'compute p50':>12} {'hop p50':>8} {'hop p90':>8} {'hop max':>8}")
    for s in after["stages"]:
        h = s["hop_ms"]
        print(f"{s['name']:<15} {s['batches']:7d} {s['batch_size']['mean']:10.2f} {s['compute_ms']['p50']:9.2f} ms "
              f"{h['p50']:5.2f} ms {h['p90']:5.2f} ms {h['max']:5.2f} ms")
    c0, c1 = before["copies"], after["copies"]
    d = {k: c1[k] - c0[k] for k in c1}
    vision = next(s for s in after["stages"] if s["name"] == "VisionEncoder")
    vision_before = next(s for s in before["stages"] if s["name"] == "VisionEncoder")
    encoded = vision["requests"] - vision_before["requests"]
    print(f"\ncopies in this phase: ingress {d['ingress']}, gather {d['gather']} ({d['gather_bytes'] / 1e6:.1f} MB), "
          f"worker {d['worker']} ({d['worker_bytes'] / 1e6:.1f} MB), egress {d['egress']}")
    print(f"vision output: {mm.VISION.output_nbytes() / 1e6:.2f} MB per image, written once into the vision "
          f"worker's pool; {encoded} images encoded in this phase, all workers wrote "
          f"{d['worker_bytes'] / max(encoded, 1) / 1e6:.2f} MB per image; the node copied "
          f"{d['gather_bytes'] / 1e6:.1f} MB between stages")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a node serving examples/multimodal.py (default: start one)")
    ap.add_argument("--requests", type=int, default=36, help="queries in the load phase (0: none)")
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()
    node = None
    url = args.url
    if url is None:
        node = ss.launch(HERE / "multimodal.py", echo=True)
        url = node.url
    url = url.rstrip("/")
    try:
        images, texts = mm.planted_queries()
        for i, text in enumerate(texts):
            show(f"[{i:2d}] {text}", *retrying(url, text, images[i]))
        print()
        show("text of [1], picture of [0]", *retrying(url, texts[1], images[0]))
        show("text of [0], picture of [1]", *retrying(url, texts[0], images[1]))
        show("[0] captioned 'red circle, white backdrop'", *retrying(url, "red circle, white backdrop", images[0]))
        show("[1] captioned 'a dark blue box on black'", *retrying(url, "a dark blue box on black", images[1]))
        if args.requests:
            load(url, args.requests, args.concurrency)
    finally:
        if node is not None:
            node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
