"""examples/multimodal.py on a real node: a text encoder and a vision encoder
in parallel, a cross-attention fan-in, a search; planted ground truth."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from slipstream._internal.app import load_module

from tests.conftest import ROOT, Node

APP = ROOT / "examples" / "multimodal.py"


@pytest.fixture(scope="module")
def mm() -> ModuleType:
    """The app module itself (its scenes, captions and planted ids)."""
    return load_module(APP)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    # Correctness here, not latency: a loose SLO, so that a busy machine does not shed the queries.
    n = Node(str(APP), "--request-timeout", "20", env={"MULTIMODAL_SLO_MS": "10000"})
    n.wait_ready(120)
    yield n
    n.stop()


def search(node: Node, text: str, image: np.ndarray, tries: int = 8) -> dict[str, Any]:
    """One query. A request the node sheds all the same (429: predicted to
    miss the SLO, 504: did) is retried, later."""
    for attempt in range(tries):
        status, body = node.infer("multimodal", text=[text], image=image[None].tolist())
        if status not in (429, 504):
            break
        time.sleep(0.25 * (attempt + 1))
    assert status == 200, body
    return body["outputs"]


def test_each_planted_scene_finds_its_item(node: Node, mm: ModuleType) -> None:
    images, texts = mm.planted_queries()
    with ThreadPoolExecutor(3) as pool:  # concurrent: the fan-in must join each request's own halves
        outs = list(pool.map(lambda i: search(node, texts[i], images[i]), range(len(texts))))
    for i, out in enumerate(outs):
        ids, scores = out["ids"][0], out["scores"][0]
        assert len(ids) == mm.TOP_K
        assert ids[0] == mm.PLANTED_IDS[i], (i, texts[i], ids, scores)
        assert scores[0] > 0.99  # the same vector as planted (up to batching's rounding)
        assert scores == sorted(scores, reverse=True)
        assert scores[1] < 0.97  # and nothing else is that close


def test_both_modalities_matter(node: Node, mm: ModuleType) -> None:
    images, texts = mm.planted_queries()
    # Scene 0 is a red circle on white, scene 1 a blue square on black.
    swapped_text = search(node, texts[1], images[0])
    swapped_image = search(node, texts[0], images[1])
    for out in (swapped_text, swapped_image):
        assert out["scores"][0][0] < 0.97, out  # no planted item is this query any more
    # A paraphrased caption with the right picture still finds its scene first
    # (MiniLM is real: paraphrases embed close), but is no longer the planted vector.
    for i, text in ((0, "red circle, white backdrop"), (1, "a dark blue box on a black background")):
        out = search(node, text, images[i])
        assert out["ids"][0][0] == mm.PLANTED_IDS[i] and 0.8 < out["scores"][0][0] < 0.99, (text, out)


def test_vision_tensor_is_written_once_and_handed_over_by_descriptor(node: Node, mm: ModuleType) -> None:
    images, texts = mm.planted_queries()
    kv_bytes = mm.VISION.output_nbytes(1)
    assert 5e6 <= kv_bytes <= 20e6
    names = ("TextEncoder", "VisionEncoder", "CrossAttention", "Search")
    before = node.status()["copies"]
    stages0 = {k: node.stage("multimodal", k) for k in names}
    n = 4
    for i in range(n):  # one at a time: every batch is a batch of one
        search(node, texts[i], images[i])
    after = node.status()["copies"]
    stages1 = {k: node.stage("multimodal", k) for k in names}
    d = {k: after[k] - before[k] for k in ("ingress", "gather", "gather_bytes", "worker", "worker_bytes", "egress")}
    # Requests each stage ran (a request the node shed and the test retried may add some).
    t, v, c, s = (stages1[k]["requests"] - stages0[k]["requests"] for k in names)
    assert v >= n and s >= n
    # Ingress writes each request once (text + image in one block); each stage writes
    # its new outputs once: tokens + mask, kv, query, ids + scores. Nothing else is
    # copied: no gather between stages, no egress copy.
    assert d["ingress"] >= n and d["gather"] == 0 and d["gather_bytes"] == 0 and d["egress"] == 0, d
    assert d["worker"] == 2 * t + v + c + 2 * s, d
    text_bytes, query_bytes, hit_bytes = 32 * 384 * 4 + 32 * 4, 128 * 4, 5 * 8 + 5 * 4
    assert d["worker_bytes"] == t * text_bytes + v * kv_bytes + c * query_bytes + s * hit_bytes, d
    # The hop was measured for every batch on both sides of the handoff.
    for k in ("VisionEncoder", "CrossAttention"):
        hops = stages1[k]["hop_ms"]["count"] - stages0[k]["hop_ms"]["count"]
        assert hops == stages1[k]["batches"] - stages0[k]["batches"] >= n


def test_malformed_image_is_rejected(node: Node) -> None:
    status, body = node.infer("multimodal", text=["x"], image=np.zeros((1, 32, 32, 3), np.uint8).tolist())
    assert status == 400, body
