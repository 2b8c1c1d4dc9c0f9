"""Clipper's selection layer (examples/clipper.py) on real scikit-learn
models, end to end: Exp3 and Exp4 select nodes answer with their
documented outputs, feedback moves the policy (and a scrambled model's
weight falls), per-user contexts keep their own state, a model put through
the store replaces cached answers, and the straggler bound holds.

Two nodes: ``main`` (Exp3, Exp4 and the cached model; no slow model, loose
deadlines: a busy CI machine must not cut answers short by accident) and
``slow`` (KNN sleeps in every batch, so the bound must cut it out). Each
candidate replica is a worker that imports scikit-learn (seconds on a busy
machine), so the nodes serve only what is tested; the mechanics themselves
(contexts, bad feedback) are tested on cheap components in
test_selection.py. The models are trained on first use (~2 s) under the
data directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import slipstream as ss

from tests.conftest import ROOT, Node, wait_for

sys.path.insert(0, str(ROOT / "examples"))

from models import digits  # noqa: E402

APP = str(ROOT / "examples" / "clipper.py")
CANDIDATES = ["LR", "RF", "SVM", "KNN"]
SLOW_MS = 1000
WAIT_MS = 150


# ------------------------------------------------------------ the models alone

def test_models_differ_and_the_scramble_breaks_one() -> None:
    acc = digits.accuracies()
    assert acc["svm"] > 0.97 and acc["rf"] < 0.92, acc  # the spread the demo relies on
    assert max(acc, key=lambda m: acc[m]) == "svm"
    perm = digits.derangement()
    assert sorted(perm.tolist()) == list(range(10)) and (perm != np.arange(10)).all()
    s = digits.split()
    label, proba = digits.predict(digits.load(digits.scrambled_bytes("svm")), s.x_test)
    healthy, _ = digits.predict(digits.load(digits.model_bytes("svm")), s.x_test)
    np.testing.assert_array_equal(label, perm[healthy])
    assert (label == s.y_test).mean() < 0.05 and proba.dtype == np.float32
    z = digits.zipf_stream(2000)
    counts = np.bincount(z, minlength=len(s.y_test))
    assert np.sort(counts)[-10:].sum() > 0.2 * len(z)  # skewed: ten images take a fifth of the stream
    q = digits.query_stream(1000)
    assert len(set(q[:len(s.y_test)].tolist())) == len(s.y_test)  # one pass covers the split


# ------------------------------------------------------------ served

def start(pipelines: str, *flags: str, **env: str) -> Node:
    return Node(APP, *flags, env={"CLIPPER_PIPELINES": pipelines, "CLIPPER_SLO_MS": "5000", **env})


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Node]]:
    digits.ensure_models()  # once, here, rather than in both nodes at once
    started: dict[str, Node] = {}
    try:
        started["main"] = start("exp3,exp4,cached", CLIPPER_WAIT_MS="5000")
        # Its stop need not wait out KNN's backlog of sleeping batches (16 s in CI).
        started["slow"] = start("exp4", "--drain-timeout", "1", CLIPPER_WAIT_MS=str(WAIT_MS),
                                CLIPPER_SLOW=f"knn:1:{SLOW_MS}")
        for n in started.values():
            n.wait_ready(180)
        yield started
    finally:
        for n in started.values():
            n.stop()


@pytest.fixture(scope="module")
def node(nodes: dict[str, Node]) -> Node:
    return nodes["main"]


def images(n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    s = digits.split()
    return s.x_test[start:start + n], s.y_test[start:start + n]


def select(node: Node, pipeline: str, context: str | None = None) -> dict[str, Any]:
    status, body = node.get(f"/v1/pipelines/{pipeline}/select" + (f"?context={context}" if context else ""))
    assert status == 200, body
    (state,) = body["selects"]
    assert state["name"] == "select"
    return state


def weight_shares(state: dict[str, Any]) -> dict[str, float]:
    w = np.asarray(state["weights"], dtype=np.float64)
    return dict(zip(state["candidates"], (w / w.sum()).tolist(), strict=True))


_drive = iter(range(10 ** 6))


def put_svm(node: Node, pipeline: str, degraded: bool) -> int:
    """Put the SVM (scrambled or trained) and wait until ``pipeline``'s
    replica serves it. A replica switches to a new instance between
    batches, so requests (each a new image: a cache hit would not reach the
    worker) drive it there."""
    value = digits.scrambled_bytes("svm") if degraded else digits.model_bytes("svm")
    v = ss.store.Store(node.url).put(digits.key("svm"), value).version
    train = digits.split().x_train

    def switched() -> bool:
        with ss.Client(node.url) as c:
            i = next(_drive) % len(train)
            c.infer(pipeline, {"x": train[i:i + 1]})
        return any(f"slipstream worker {pipeline}/" in line and "/models/digits/svm v" in line
                   and line.rstrip().endswith(f"-> v{v}") for line in node.lines)

    wait_for(switched, timeout=60, every=0.05)
    return v


def test_exp3_answers_with_one_model_per_request(node: Node) -> None:
    x, y = images(3)
    with ss.Client(node.url) as c:
        out = c.infer("digits_exp3", {"x": x})
    assert set(out) == {"label", "confidence", "contributors", "model"}
    assert out["label"].dtype == np.int64 and out["label"].shape == (3,)
    assert out["confidence"].dtype == np.float32 and out["confidence"].shape == (3,)
    assert out["contributors"].dtype == np.int32 and (out["contributors"] == 1).all()
    assert len(set(out["model"].tolist())) == 1 and out["model"][0] in CANDIDATES  # one pick per request
    assert isinstance(out.request_id, int)
    # The raw route says the same, with the id in a header.
    status, headers, raw = node.request("POST", "/v1/pipelines/digits_exp3/infer",
                                        {"inputs": {"x": x[:1].tolist()}})
    rid = {k.lower(): v for k, v in headers.items()}["x-slipstream-request-id"]
    assert status == 200 and int(rid) > out.request_id
    assert json.loads(raw)["outputs"]["model"][0] in CANDIDATES


def test_exp4_combines_all_four(node: Node) -> None:
    x, y = images(40, start=100)
    with ss.Client(node.url) as c:
        outs = [c.infer("digits_exp4", {"x": x[i:i + 1]}) for i in range(len(y))]
    labels = np.array([o["label"][0] for o in outs])
    assert all(o["model"][0] == "ensemble" and o["contributors"][0] == 4 for o in outs)
    assert all(0 < o["confidence"][0] <= 1.0 + 1e-6 for o in outs)
    assert (labels == y).mean() >= 0.9


def test_feedback_counts_and_errors(node: Node) -> None:
    x, y = images(4, start=200)
    before = select(node, "digits_exp3")
    with ss.Client(node.url) as c:
        ids = [c.infer("digits_exp3", {"x": x[i:i + 1]}).request_id for i in range(4)]
        r = c.feedback("digits_exp3", ids[0], label=int(y[0]))
        assert (r["applied"], r["unknown"]) == (1, 0), r
        r = c.feedback("digits_exp3", items=[{"request_id": ids[1], "label": int(y[1])},
                                             {"request_id": ids[2], "reward": 1.0},
                                             {"request_id": 10 ** 12, "label": 3}])
        assert (r["applied"], r["unknown"]) == (2, 1), r
    status, body = node.post("/v1/pipelines/digits_exp3/feedback", {"request_id": ids[3], "label": [int(y[3])]})
    assert status == 200 and body["applied"] == 1, body
    status, body = node.post("/v1/pipelines/digits_exp3/feedback", {"request_id": 10 ** 12, "label": 1})
    assert status == 404, body
    after = select(node, "digits_exp3")
    assert after["feedback"] == before["feedback"] + 4
    assert after["unknown_feedback"] >= before["unknown_feedback"] + 1
    assert after["policy"] == "exp3" and after["candidates"] == CANDIDATES
    assert abs(sum(after["probabilities"]) - 1) < 1e-6
    (sel,) = next(p for p in node.status()["pipelines"] if p["name"] == "digits_exp3")["selects"]
    assert sel["feedback"] == after["feedback"] and sel["probabilities"] == after["probabilities"]


def test_scrambled_model_loses_weight_under_feedback(node: Node) -> None:
    put_svm(node, "digits_exp4", degraded=True)
    try:
        start = weight_shares(select(node, "digits_exp4"))["SVM"]
        x, y = images(40, start=300)
        with ss.Client(node.url) as c:
            for i in range(len(y)):
                out = c.infer("digits_exp4", {"x": x[i:i + 1]})
                c.feedback("digits_exp4", out.request_id, label=int(y[i]))
        shares = weight_shares(select(node, "digits_exp4"))
        assert shares["SVM"] < start / 2 and shares["SVM"] < 1 / len(CANDIDATES), shares
        assert shares["SVM"] == min(shares.values()), shares
    finally:
        put_svm(node, "digits_exp4", degraded=False)


def test_the_context_pipeline_keys_its_policy_on_the_user() -> None:
    """Contexts themselves are tested on cheap components (test_selection.py);
    here only that the demo declares its pipeline right."""
    import clipper

    spec = clipper.digits_ctx.to_spec()
    assert spec["selects"] == [{"name": "select", "candidates": CANDIDATES, "policy": "exp3", "context": "user",
                                "wait_ms": None, "eta": None, "gamma": None}]
    assert spec["inputs"]["user"]["dtype"] == "string"


def cache_stats(node: Node) -> dict[str, Any]:
    return node.stage("digits_cached", "Cached")["cache"]


def test_cache_hits_skip_the_worker_and_a_new_model_replaces_them(node: Node) -> None:
    x, y = images(1, start=500)
    with ss.Client(node.url) as c:
        first = c.infer("digits_cached", {"x": x})
        s0 = cache_stats(node)
        again = [c.infer("digits_cached", {"x": x}) for _ in range(5)]
        s1 = cache_stats(node)
        assert s1["hits"] - s0["hits"] == 5 and s1["misses"] == s0["misses"], (s0, s1)
        for o in again:
            np.testing.assert_array_equal(o["proba"], first["proba"])
        assert s1["entries"] >= 1 and 0 < s1["bytes"] <= s1["max_bytes"] and 0 < s1["hit_rate"] <= 1
        _, _, metrics = node.request("GET", "/metrics")
        text = metrics.decode()
        for name in ("slipstream_cache_hits_total", "slipstream_cache_misses_total", "slipstream_cache_bytes",
                     "slipstream_cache_entries"):
            assert f'{name}{{pipeline="digits_cached",stage="Cached"}}' in text, name
        perm = digits.derangement()
        put_svm(node, "digits_cached", degraded=True)
        try:
            # The cached answer was computed by the old model: no longer served.
            out = c.infer("digits_cached", {"x": x})
            assert int(out["label"][0]) == perm[int(first["label"][0])]
            hits = cache_stats(node)["hits"]
            assert int(c.infer("digits_cached", {"x": x})["label"][0]) == perm[int(first["label"][0])]
            assert cache_stats(node)["hits"] == hits + 1  # the new model's answer is cached in turn
        finally:
            put_svm(node, "digits_cached", degraded=False)
        assert int(c.infer("digits_cached", {"x": x})["label"][0]) == int(first["label"][0])


def test_client_script_reports_accuracy(node: Node) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "clipper_client.py"), "--url", node.url,
                        "-n", "60", "--feedback-batch", "4", "--json"],
                       capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["queries"] == 60 and m["feedback_applied"] == 60 and m["feedback_unknown"] == 0
    assert m["accuracy"] > 0.6 and m["single_accuracy"]["svm"] > 0.9


def test_straggler_is_cut_off_at_the_bound(nodes: dict[str, Node]) -> None:
    slow = nodes["slow"]
    # Enough requests that KNN's queue grows (each of its batches sleeps
    # SLOW_MS): the ensemble must keep answering at its bound, and
    # admission must not refuse requests for a backlog it will not wait for.
    x, y = images(8, start=600)
    with ss.Client(slow.url) as c:
        took, outs = [], []
        for i in range(len(y)):
            t0 = time.perf_counter()
            outs.append(c.infer("digits_exp4", {"x": x[i:i + 1]}))
            took.append(time.perf_counter() - t0)
    assert max(took) < SLOW_MS / 1e3 / 2, took  # answered near WAIT_MS, far from KNN's sleep
    assert all(o["contributors"][0] == 3 for o in outs), [o["contributors"] for o in outs]
    assert sum(int(o["label"][0]) == int(y[i]) for i, o in enumerate(outs)) >= len(outs) - 1
    assert all(o["confidence"][0] < 1 for o in outs)  # a missing model lowers it
    state = select(slow, "digits_exp4")
    assert state["cut_short"] >= len(outs), state
