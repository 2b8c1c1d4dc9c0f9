"""Ask the served AudioQuery pipeline (examples/audioquery.py) spoken
questions; save the spoken answers; report the word error rate of the
served speech recognition and the latency.

    .venv/bin/slipstream serve examples/audioquery.py &
    .venv/bin/python examples/audioquery_client.py --url http://127.0.0.1:8000 -n 100 --out answers/

The questions are the benchmark queries of the RAG corpus (one-line
summaries of Debian packages, ``<data>/rag/queries.jsonl``), spoken by
espeak-ng with the ``en-us+f5`` voice, resampled to 16 kHz and zero-padded
to the pipeline's declared ``audio`` length (read from
``GET /v1/pipelines/{name}``), with the true length in ``length``. Only
queries whose right passage is in the served index are used, so that
"answered with the right package" (top-1 accuracy) is measured too.

Reported: WER (word-level Levenshtein over all reference words, after
lower-casing, removing punctuation and spelling digits out), top-1 accuracy
(the answer is the package the question was written for), end-to-end latency
percentiles as seen by the client, and per-stage compute / queue-wait times
from the node's ``/v1/status`` (the node's counters are reset first).

``--out DIR`` gets, per query, ``NNNN-question.wav`` and ``NNNN-answer.wav``,
and ``results.jsonl`` (query, transcript, answer, package, latency).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import corpus, speech, vindex  # noqa: E402


def http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code} from {url}: {e.read()[:500].decode(errors='replace')}") from None


def max_samples(url: str, pipeline: str) -> int:
    """The fixed length of the pipeline's ``audio`` input."""
    desc = http("GET", f"{url}/v1/pipelines/{pipeline}")
    shape = desc["inputs"]["audio"]["shape"]
    if len(shape) != 2 or shape[1] <= 0:
        raise RuntimeError(f"pipeline {pipeline!r} declares audio of shape {shape}; expected (-1, samples)")
    return int(shape[1])


def request_body(clip: np.ndarray, width: int, exclude: str) -> dict:
    """One utterance as the pipeline's inputs: padded samples, length, exclusions."""
    audio, length = speech.pad_batch([clip], width)
    return {"inputs": {"audio": audio.tolist(), "length": length.tolist(), "exclude": [exclude]}}


def infer(url: str, pipeline: str, body: dict, timeout: float) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = http("POST", f"{url}/v1/pipelines/{pipeline}/infer", body, timeout)["outputs"]
    return out, time.perf_counter() - t0


def percentiles(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def stage_times(url: str, pipeline: str) -> dict[str, dict[str, float]]:
    """Per stage: mean / p99 compute and queue wait (ms), mean batch size, from /v1/status."""
    out = {}
    for p in http("GET", f"{url}/v1/status")["pipelines"]:
        if p["name"] == pipeline:
            for s in p["stages"]:
                out[s["name"]] = {"compute_mean": s["compute_ms"]["mean"], "compute_p99": s["compute_ms"]["p99"],
                                  "queue_mean": s["queue_wait_ms"]["mean"], "queue_p99": s["queue_wait_ms"]["p99"],
                                  "batch_mean": s["batch_size"]["mean"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--pipeline", default="audioquery")
    ap.add_argument("-n", type=int, default=100, help="spoken queries to send (default 100)")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    ap.add_argument("--exclude", default="", help="categories to exclude, comma-separated (default none)")
    ap.add_argument("--voice", default=speech.QUERY_VOICE, help=f"espeak-ng voice (default {speech.QUERY_VOICE})")
    ap.add_argument("--out", type=Path, help="folder for the question / answer WAVs and results.jsonl")
    ap.add_argument("--index-dir", type=Path, help="the served index (default: as the server chooses it)")
    ap.add_argument("--show", type=int, default=3, help="exchanges to print (default 3)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json", action="store_true", help="print the metrics as one JSON line at the end")
    args = ap.parse_args(argv)

    problems = speech.missing()
    if problems:
        print("audioquery_client: " + "; ".join(problems), file=sys.stderr)
        return 1
    try:
        if args.index_dir is None:
            import audioquery  # the server's choice of index, from the same environment

            args.index_dir = audioquery.index_dir()
        queries = vindex.held_queries(args.index_dir)[: args.n]
        width = max_samples(args.url, args.pipeline)
    except (FileNotFoundError, corpus.CorpusError, RuntimeError, OSError) as e:
        print(f"audioquery_client: {e}", file=sys.stderr)
        return 1
    if not queries:
        print(f"audioquery_client: no benchmark query has its answer in {args.index_dir}", file=sys.stderr)
        return 1

    t0 = time.perf_counter()
    clips = []
    for q in queries:
        clip = speech.synthesize(q["query"], args.voice)
        clips.append(clip[:width])  # an over-long question is cut to what the pipeline takes
    tts_s = time.perf_counter() - t0
    print(f"{len(queries)} spoken queries ({tts_s:.1f} s to synthesize, mean "
          f"{np.mean([len(c) for c in clips]) / speech.SAMPLE_RATE:.2f} s of speech) -> {args.url}, "
          f"concurrency {args.concurrency}", file=sys.stderr)

    try:
        http("POST", f"{args.url}/v1/admin/reset-metrics", {})
    except RuntimeError as e:
        print(f"audioquery_client: could not reset the node's metrics ({e})", file=sys.stderr)

    def one(i: int) -> tuple[dict | None, float, str]:
        t = time.perf_counter()
        try:
            out, dt = infer(args.url, args.pipeline, request_body(clips[i], width, args.exclude), args.timeout)
            return out, dt, ""
        except (RuntimeError, OSError) as e:  # counted and shown, the run goes on
            return None, time.perf_counter() - t, str(e)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        answered = list(pool.map(one, range(len(queries))))
    wall = time.perf_counter() - t0
    stages = stage_times(args.url, args.pipeline)
    failed = [(queries[i]["query"], err) for i, (out, _, err) in enumerate(answered) if out is None]
    for q, err in failed[:3]:
        print(f"audioquery_client: failed: {q!r}: {err}", file=sys.stderr)
    kept = [i for i, (out, _, _) in enumerate(answered) if out is not None]
    if not kept:
        print(f"audioquery_client: all {len(queries)} requests failed", file=sys.stderr)
        return 1
    results: list[tuple[dict, float]] = [(out, dt) for out, dt, _ in answered if out is not None]
    clips = [clips[i] for i in kept]
    queries = [queries[i] for i in kept]

    refs = [q["query"] for q in queries]
    hyps = [out["transcript"][0] for out, _ in results]
    latencies = [1000 * dt for _, dt in results]
    right = [out["passage_id"][0][0] == q["passage_id"] for (out, _), q in zip(results, queries, strict=True)]
    errors = [out["error"][0] for out, _ in results if out["error"][0]]

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "results.jsonl").open("w") as f:
            for i, ((out, dt), q) in enumerate(zip(results, queries, strict=True)):
                (args.out / f"{i:04d}-question.wav").write_bytes(speech.write_wav(clips[i]))
                (args.out / f"{i:04d}-answer.wav").write_bytes(base64.b64decode(out["speech"][0]))
                f.write(json.dumps({"query": q["query"], "transcript": out["transcript"][0],
                                    "answer": out["answer"][0], "package": out["package"][0],
                                    "category": out["category"][0], "right_package": q["package"],
                                    "latency_ms": round(1000 * dt, 1)}) + "\n")

    for (out, dt), q in list(zip(results, queries, strict=True))[: args.show]:
        print(f"\nsaid:   {q['query']}\nheard:  {out['transcript'][0]}\nanswer: {out['answer'][0]} "
              f"[{out['category'][0]}] ({1000 * dt:.0f} ms)")

    metrics: dict[str, Any] = {
        "queries": len(queries),
        "failed_requests": len(failed),
        "wer": round(speech.corpus_wer(refs, hyps), 4),
        "top1_right_package": round(float(np.mean(right)), 4),
        "errors": len(errors),
        "latency_ms": {k: round(v, 1) for k, v in percentiles(latencies).items()},
        "throughput_rps": round(len(queries) / wall, 2),
        "stages_ms": {s: {k: round(v, 1) for k, v in m.items()} for s, m in stages.items()},
    }
    lat = metrics["latency_ms"]
    print(f"\nWER {metrics['wer']:.3f} over {sum(len(speech.normalize_text(r)) for r in refs)} words; "
          f"right package {100 * metrics['top1_right_package']:.0f}%; "
          f"latency p50 {lat['p50']:.0f} ms, p90 {lat['p90']:.0f} ms, p99 {lat['p99']:.0f} ms; "
          f"{metrics['throughput_rps']} req/s", file=sys.stderr)
    for s, m in metrics["stages_ms"].items():
        print(f"  {s:7s} compute mean {m['compute_mean']:7.1f} ms  p99 {m['compute_p99']:7.1f} ms   "
              f"queue mean {m['queue_mean']:7.1f} ms   batch {m['batch_mean']:.1f}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} requests failed (not counted above)", file=sys.stderr)
    if errors:
        print(f"{len(errors)} rows answered with an error, e.g.: {errors[0]}", file=sys.stderr)
    if args.out:
        print(f"answers in {args.out}/", file=sys.stderr)
    if args.json:
        print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
