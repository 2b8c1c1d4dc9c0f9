"""Clipper's layer on a real node (tests/apps/selection.py): Exp3 learns
from feedback to pick the right model, an Exp4 ensemble answers at its
straggler cutoff without the slow model, contexts learn apart, bad feedback
is refused, and the prediction cache answers repeats without the worker
and forgets a replaced model's answers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import slipstream as ss

from tests.conftest import APPS, Node


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(str(APPS / "selection.py"), "--request-timeout", "30", ready_timeout=120)
    n.wait_ready(120)
    yield n
    n.stop()


def selection(node: Node, pipeline: str, context: str | None = None) -> dict:
    q = "" if context is None else f"?context={context}"
    status, body = node.get(f"/v1/pipelines/{pipeline}/select{q}")
    assert status == 200, body
    return body["selects"][0]


def test_exp3_learns_from_feedback_to_pick_the_right_model(node: Node) -> None:
    rng = np.random.default_rng(0)
    picked: list[str] = []
    with ss.Client(node.url) as c:
        for _ in range(150):
            x = rng.standard_normal((1, 2)).astype(np.float32)
            out = c.infer("pick", {"x": x})
            assert out.request_id is not None
            assert out["contributors"].tolist() == [1]
            picked.append(str(out["model"][0]))
            r = c.feedback("pick", out.request_id, label=[int(x[0, 0] > 0)])
            assert r["applied"] == 1
    s = selection(node, "pick")
    assert s["policy"] == "exp3" and s["candidates"] == ["Right", "Wrong", "Coin"]
    assert s["feedback"] == 150 and sum(s["picks"]) == 150
    p = dict(zip(s["candidates"], s["probabilities"], strict=True))
    assert p["Right"] > 0.8, s
    assert picked[-30:].count("Right") >= 20, picked[-30:]


def test_exp4_answers_at_its_cutoff_without_the_straggler(node: Node) -> None:
    with ss.Client(node.url) as c:
        fast = c.infer("vote", {"x": np.array([[1.0, -1.0]], np.float32)})
        assert fast["label"].tolist() == [1] and fast["contributors"].tolist() == [4]
        assert str(fast["model"][0]) == "ensemble"
        # Slow sleeps 400 ms on x[1] > 0: the ensemble answers at ~80 ms with three.
        t0 = time.perf_counter()
        out = c.infer("vote", {"x": np.array([[1.0, 1.0]], np.float32)})
        took = time.perf_counter() - t0
        assert out["contributors"].tolist() == [3], out
        assert took < 0.35, took
        assert out["label"].tolist() == [1]  # two right of three
        assert 0 < float(out["confidence"][0]) < float(fast["confidence"][0])
        # The straggler's late answer is still held for feedback.
        time.sleep(0.5)
        assert c.feedback("vote", out.request_id, label=[1])["applied"] == 1
    s = selection(node, "vote")
    assert s["cut_short"] >= 1 and s["late"] >= 1


def test_exp4_feedback_moves_weight_off_the_wrong_model(node: Node) -> None:
    rng = np.random.default_rng(1)
    with ss.Client(node.url) as c:
        items = []
        for _ in range(40):
            x = rng.standard_normal((1, 2)).astype(np.float32)
            x[0, 1] = -1.0  # keep Slow fast here
            out = c.infer("vote", {"x": x})
            items.append({"request_id": out.request_id, "label": [int(x[0, 0] > 0)]})
        r = c.feedback("vote", items=items)
        assert r == {"applied": 40, "unknown": 0, "invalid": 0, "errors": []}
    s = selection(node, "vote")
    w = dict(zip(s["candidates"], s["weights"], strict=True))
    assert w["Wrong"] < 0.01 and w["Right"] > 0.3, w


def test_an_ensemble_answers_without_a_failing_model(node: Node) -> None:
    with ss.Client(node.url) as c:
        for _ in range(3):
            out = c.infer("sturdy", {"x": np.array([[-1.0, 0.0]], np.float32)})
            assert out["label"].tolist() == [0] and out["contributors"].tolist() == [2]
        # Feedback still judges the models that answered.
        assert c.feedback("sturdy", out.request_id, label=[0])["applied"] == 1


def test_contexts_learn_apart(node: Node) -> None:
    rng = np.random.default_rng(2)
    with ss.Client(node.url) as c:
        for i in range(40):
            user = "alice" if i % 2 else "bob"
            x = rng.standard_normal((1, 2)).astype(np.float32)
            out = c.infer("per_user", {"x": x, "user": np.array([user], dtype=object)})
            truth = int(x[0, 0] > 0)
            # alice agrees with Right, bob with Wrong.
            c.feedback("per_user", out.request_id, label=[truth if user == "alice" else 1 - truth])
    alice, bob = selection(node, "per_user", "alice"), selection(node, "per_user", "bob")
    assert alice["weights"][0] > 0.9 and bob["weights"][1] > 0.9, (alice, bob)
    assert alice["contexts"] == 2


def test_bad_feedback_is_refused_and_changes_nothing(node: Node) -> None:
    with ss.Client(node.url) as c:
        out = c.infer("vote", {"x": np.array([[1.0, -1.0]], np.float32)})
    before = selection(node, "vote")
    for body, code in [
        ({"request_id": out.request_id}, 400),
        ({"request_id": out.request_id, "label": [1, 0]}, 400),     # one row, two labels
        ({"request_id": out.request_id, "reward": 1.0}, 400),       # exp4 learns from labels
        ({"request_id": out.request_id, "label": -3}, 400),
        ({"request_id": 10**12, "label": 1}, 404),
        ({"request_id": out.request_id, "label": 1, "select": "nope"}, 400),
        ({"feedback": [{"request_id": out.request_id, "label": 1}, {"label": 1}]}, 400),
    ]:
        status, resp = node.post("/v1/pipelines/vote/feedback", body)
        assert status == code, (body, status, resp)
        assert resp["error"], resp
    status, resp = node.post("/v1/pipelines/cached/feedback", {"request_id": 1, "label": 1})
    assert status == 400 and "no model selection" in resp["error"]["message"]
    after = selection(node, "vote")
    assert after["weights"] == before["weights"] and after["feedback"] == before["feedback"]
    assert after["held"] == before["held"]
    status, _ = node.post("/v1/pipelines/vote/feedback", {"request_id": out.request_id, "label": 1})
    assert status == 200


def test_cache_answers_repeats_without_the_worker_and_forgets_a_replaced_model(node: Node) -> None:
    x = {"x": np.array([1.5, 2.0], np.float32)}
    with ss.Client(node.url) as c:
        first = c.infer("cached", x)
        assert first["y"].tolist() == [3.0, 4.0]
        for _ in range(5):
            again = c.infer("cached", x)
            assert again["calls"].tolist() == first["calls"].tolist(), "answered from the cache"
        other = c.infer("cached", {"x": np.array([1.0], np.float32)})
        assert other["calls"][0] > first["calls"][0]
        st = node.stage("cached", "Scale")["cache"]
        assert st["hits"] == 5 and st["misses"] == 2 and st["entries"] == 2 and st["bytes"] > 0
        metrics = node.request("GET", "/metrics")[2].decode()
        assert 'slipstream_cache_hits_total{pipeline="cached",stage="Scale"} 5' in metrics
        # A new model version: once the replica has switched, answers change.
        ss.store.Store(node.url).put("/models/scale", "3")
        deadline = time.time() + 30
        while time.time() < deadline:
            out = c.infer("cached", x)
            if out["y"].tolist() == [4.5, 6.0]:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the cache kept answering with the old model")
        assert node.stage("cached", "Scale")["cache"]["invalidations"] == 1
        hit = c.infer("cached", x)
        assert hit["y"].tolist() == [4.5, 6.0] and hit["calls"].tolist() == out["calls"].tolist()


def test_spec_errors_are_clear() -> None:
    from tests.apps.selection import Coin, Right, Wrong

    with pytest.raises(ss.ConfigError, match="two or more"):
        ss.Select([Right])
    with pytest.raises(ss.ConfigError, match="policy"):
        ss.Select([Right, Wrong], policy="greedy")
    with pytest.raises(ss.ConfigError, match="exp3 runs one model"):
        ss.Select([Right, Wrong], wait_ms=10)
    with pytest.raises(ss.ConfigError, match="string input"):
        ss.Pipeline("p", ss.Select([Right, Coin], policy="exp4", context="user"))
    with pytest.raises(ss.ConfigError, match="cache key"):
        ss.component(type("K", (), {"__call__": lambda self, b: {}}), inputs={"x": ss.Tensor("float32", (-1,))},
                     cache=["nope"])
    p = ss.Pipeline("p", ss.Select([Right, Wrong], policy="exp4", wait_ms=5))
    spec = p.to_spec()
    assert spec["selects"] == [{"name": "select", "candidates": ["Right", "Wrong"], "policy": "exp4",
                                "context": None, "wait_ms": 5, "eta": None, "gamma": None}]
    assert set(p.outputs) == {"label", "confidence", "contributors", "model"}
