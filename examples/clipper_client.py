"""Send the digits query stream to a selecting pipeline of
``examples/clipper.py``, feed the true labels back, and watch the policy
learn: running accuracy, which models it picks, and its weights.

    .venv/bin/slipstream serve examples/clipper.py &
    .venv/bin/python examples/clipper_client.py --url http://127.0.0.1:8000 -n 2000
    .venv/bin/python examples/clipper_client.py --pipeline digits_exp4 -n 2000 --degrade svm:1000
    .venv/bin/python examples/clipper_client.py --pipeline digits_ctx --user alice -n 500

Each query is one test image of ``models.digits`` (the half of
``load_digits`` no model was trained on), in a shuffled order that starts
again once all 899 are used. After each answer the client sends the
image's true label as feedback for the answer's request id (in batches of
``--feedback-batch``: labels that arrive late, as they do in practice).
At the end it prints the pipeline's accuracy beside each model's own
accuracy on the same queries (computed here from the same model files).

``--degrade svm:1000`` puts the SVM with its labels scrambled (a fixed
permutation) under ``/models/digits/svm`` after 1000 queries, then shows
how fast the policy moves away; the original model is put back at the end
(unless ``--keep-degraded``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import slipstream as ss

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import digits  # noqa: E402


def select_state(url: str, pipeline: str, context: str | None = None, name: str = "select") -> dict[str, Any]:
    """The policy state of ``pipeline``'s selection ``name`` (one context's,
    or the default context's)."""
    q = "" if context is None else "?" + urllib.parse.urlencode({"context": context})
    with urllib.request.urlopen(f"{url}/v1/pipelines/{pipeline}/select{q}", timeout=10) as r:
        selects = json.loads(r.read())["selects"]
    return next(s for s in selects if s["name"] == name)


def shares(state: dict[str, Any]) -> dict[str, float]:
    """Each candidate's share of the policy: its probability of being
    picked (Exp3), or its normalised weight (Exp4)."""
    names = state["candidates"]
    p = state.get("probabilities") or []
    if len(p) != len(names):
        w = np.asarray(state["weights"], dtype=np.float64)
        p = list(w / w.sum()) if w.sum() > 0 else [1 / len(names)] * len(names)
    return {n: float(v) for n, v in zip(names, p, strict=True)}


def put_model(url: str, name: str, degraded: bool) -> int:
    """Put model ``name`` (scrambled if ``degraded``, else the trained one)
    as a new version of its store key; returns the version."""
    value = digits.scrambled_bytes(name) if degraded else digits.model_bytes(name)
    return ss.store.Store(url).put(digits.key(name), value).version


def stage_of(name: str) -> str:
    """The candidate stage serving model ``name`` (``svm`` -> ``SVM``)."""
    return digits.check(name).upper()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--pipeline", default="digits_exp3")
    ap.add_argument("-n", type=int, default=2000, help="queries (default 2000)")
    ap.add_argument("--feedback-batch", type=int, default=1, help="labels sent per feedback call (default 1)")
    ap.add_argument("--no-feedback", action="store_true", help="send no labels (the policy stays where it is)")
    ap.add_argument("--user", help="the context (digits_ctx: the user input)")
    ap.add_argument("--degrade", metavar="MODEL:N", help="put MODEL scrambled after N queries")
    ap.add_argument("--keep-degraded", action="store_true", help="leave the scrambled model in the store")
    ap.add_argument("--every", type=int, default=250, help="print progress every N queries (default 250)")
    ap.add_argument("--seed", type=int, default=1, help="order of the query stream")
    ap.add_argument("--json", action="store_true", help="print the final metrics as one JSON line")
    args = ap.parse_args(argv)

    degrade_model, degrade_at = None, -1
    if args.degrade:
        try:
            degrade_model, at = args.degrade.split(":")
            degrade_at = int(at)
            digits.check(degrade_model)
        except ValueError as e:
            ap.error(f"--degrade takes MODEL:N, e.g. svm:1000 ({e})")
    s = digits.split()
    order = digits.query_stream(args.n, seed=args.seed)
    models = {n: digits.load(p.read_bytes()) for n, p in digits.ensure_models().items()}
    scrambled = digits.Scrambled(models[degrade_model], digits.derangement()) if degrade_model else None

    correct = np.zeros(args.n, dtype=bool)
    single = {n: np.zeros(args.n, dtype=bool) for n in models}
    picks: Counter[str] = Counter()
    pending: list[dict[str, Any]] = []
    latency: list[float] = []
    applied = unknown = 0
    with ss.Client(args.url) as client:
        meta = client.metadata(args.pipeline)
        with_user = "user" in meta.get("inputs", {})
        if args.user and not with_user:
            ap.error(f"{args.pipeline} takes no user input (digits_ctx does)")
        print(f"{args.n} queries to {args.pipeline} at {args.url}"
              + (f", user {args.user}" if args.user else "")
              + ("" if args.no_feedback else f", feedback in batches of {args.feedback_batch}"), file=sys.stderr)
        for i, j in enumerate(order):
            if i == degrade_at and degrade_model:
                v = put_model(args.url, degrade_model, degraded=True)
                print(f"-- query {i}: put {digits.key(degrade_model)} v{v}, scrambled", file=sys.stderr)
            x = s.x_test[j:j + 1]
            inputs: dict[str, Any] = {"x": x}
            if with_user:
                inputs["user"] = np.array([args.user or "anonymous"], dtype=object)
            t0 = time.perf_counter()
            out = client.infer(args.pipeline, inputs)
            latency.append(time.perf_counter() - t0)
            truth = int(s.y_test[j])
            correct[i] = int(out["label"][0]) == truth
            picks[str(out["model"][0])] += 1
            for n, m in models.items():
                use = scrambled if (n == degrade_model and i >= degrade_at >= 0) else m
                single[n][i] = int(digits.predict(use, x)[0][0]) == truth
            if not args.no_feedback:
                pending.append({"request_id": out.request_id, "label": truth})
                if len(pending) >= args.feedback_batch or i == args.n - 1:
                    r = client.feedback(args.pipeline, items=pending)
                    applied, unknown = applied + int(r["applied"]), unknown + int(r["unknown"])
                    pending = []
            if (i + 1) % args.every == 0 or i == args.n - 1:
                lo = max(0, i + 1 - args.every)
                state = shares(select_state(args.url, args.pipeline, args.user))
                print(f"{i + 1:6d}: accuracy {correct[lo:i + 1].mean():.3f} (last {i + 1 - lo}), "
                      f"{correct[:i + 1].mean():.3f} overall; policy "
                      + ", ".join(f"{k} {v:.2f}" for k, v in state.items()), file=sys.stderr)
        if degrade_model and not args.keep_degraded and degrade_at < args.n:
            v = put_model(args.url, degrade_model, degraded=False)
            print(f"-- put {digits.key(degrade_model)} v{v}, the trained model again", file=sys.stderr)

    lat = np.asarray(latency) * 1e3
    result = {
        "pipeline": args.pipeline, "queries": args.n, "accuracy": float(correct.mean()),
        "single_accuracy": {n: float(v.mean()) for n, v in single.items()},
        "picks": dict(picks), "feedback_applied": applied, "feedback_unknown": unknown,
        "latency_ms": {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))},
    }
    print(f"accuracy {result['accuracy']:.4f} on {args.n} queries; each model alone on the same queries: "
          + ", ".join(f"{n} {a:.4f}" for n, a in result["single_accuracy"].items()))
    print("answers by model: " + ", ".join(f"{k} {v}" for k, v in picks.most_common())
          + f"; feedback applied {applied}, unknown {unknown}; "
          f"latency p50 {result['latency_ms']['p50']:.1f} ms, p99 {result['latency_ms']['p99']:.1f} ms")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ss.Error, urllib.error.URLError, ConnectionError) as e:
        print(f"clipper_client: {e}", file=sys.stderr)
        sys.exit(1)
