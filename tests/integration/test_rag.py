"""The RAG example (examples/rag.py) end to end, on a small slice of the
corpus: a real node, real MiniLM embeddings, a real faiss IVF index over
Debian package descriptions. Also the corpus parser and the index helpers of
examples/models/ on their own.

The slice (RAG_SLICE_TEST passages) is built in the data directory on first
run (embedding it takes ~10-20 s on two busy cores; rows come from the full
embeddings if those were built) and reused after.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, Node, wait_for

sys.path.insert(0, str(ROOT / "examples"))

from models import corpus, minilm, vindex  # noqa: E402

# `make setup` installs the model; without it these tests fail with its message.
minilm.model_dir()

RAG_SLICE_TEST = 300


# ------------------------------------------------------------ corpus parser

def test_debian_description_parsing() -> None:
    text = (
        "Package: foo\nDescription-en: frobnicate files quickly\n first paragraph line one\n"
        " line two\n .\n second paragraph\n   * verbatim item\n\nPackage: bar\nDescription-en: short only\n"
    )
    st = list(corpus._stanzas(text))
    assert [s["Package"] for s in st] == ["foo", "bar"]
    short, long = corpus._split_description(st[0]["Description-en"])
    assert short == "frobnicate files quickly"
    assert long == "first paragraph line one line two\nsecond paragraph * verbatim item"
    assert corpus._split_description(st[1]["Description-en"]) == ("short only", "")


# ------------------------------------------------------------ index helpers

def test_retrieval_metrics() -> None:
    ranked = np.array([[5, 1, 2], [3, 4, 5], [9, 8, 7], [1, -1, -1]])
    m = vindex.retrieval_metrics(ranked, [5, 4, 1, 1], k=3)
    assert m["recall@3"] == pytest.approx(3 / 4)
    assert m["mrr@3"] == pytest.approx((1 + 1 / 2 + 0 + 1) / 4)
    assert vindex.retrieval_metrics(ranked, [1, 4, 8, 5], k=1)["recall@1"] == 0.0
    assert vindex.retrieval_metrics(ranked, [1, 3, 9, 2], k=1)["recall@1"] == 0.5


def test_ivf_index_build_tune_save_load(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(20, 32))
    x = centers[rng.integers(0, 20, 2000)] + 0.3 * rng.normal(size=(2000, 32))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    ids = np.arange(2000, dtype=np.int64) * 3 + 7  # ids are carried, not positions
    vindex.configure_faiss(1)
    index = vindex.VectorIndex.build(x, ids)
    assert index.ntotal == 2000 and index.index.nlist == vindex.default_nlist(2000)
    q = x[:100] + 0.01 * rng.normal(size=(100, 32)).astype(np.float32)
    nprobe = index.tune_nprobe(q, k=10, target=0.95)
    assert 1 <= nprobe <= index.index.nlist
    scores, got = index.search(q, 10)
    assert got.dtype == np.int64 and scores.dtype == np.float32 and got.shape == (100, 10)
    assert (got[:, 0] == ids[:100]).mean() > 0.95  # each query's own vector is its nearest
    assert (np.diff(scores, axis=1) <= 1e-6).all()  # best first
    index.save(tmp_path)
    loaded = vindex.VectorIndex.load(tmp_path)
    assert loaded.nprobe == nprobe and loaded.ntotal == 2000
    np.testing.assert_array_equal(loaded.search(q, 10)[1], got)
    with pytest.raises(FileNotFoundError):
        vindex.VectorIndex.load(tmp_path / "nowhere")


def test_live_index_delta_fold_delete_and_rebuild() -> None:
    from models.live import LIVE_BASE, LiveIndex, ivf_contents

    rng = np.random.default_rng(1)

    def unit(n: int) -> np.ndarray:
        x = rng.normal(size=(n, 16))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    vindex.configure_faiss(1)
    base = vindex.VectorIndex.build(unit(400), nlist=8)
    base.nprobe = 8  # every list: exact, so what is found is what the index holds
    live = LiveIndex(base, 16, fold_at=50, rebuild_at=0.5)
    rows = unit(260)
    ids = [live.upsert(f"d{i}", rows[i], f"doc {i}") for i in range(260)]
    assert ids[0] == LIVE_BASE and live.folds == 5, "260 rows: five folds of 50, 10 in the delta"
    t = live._rebuilding
    if t is not None:
        t.join(30)
    assert live.rebuilds == 1, "200 rows folded onto 400 trained: half, so the index was retrained"
    held, _ = ivf_contents(base.index)
    assert len(held) == 400 + 250 and base.index.nprobe == 8
    for i in (0, 120, 220, 255, 259):  # folded before the rebuild, folded during it (replayed), in the delta
        assert live.search(rows[i:i + 1], 3)[1][0, 0] == ids[i]
    assert live.delete("d0") and live.delete("d259") and not live.delete("d0")
    assert ids[0] not in live.search(rows[0:1], 10)[1][0]
    assert ids[259] not in live.search(rows[259:260], 10)[1][0]
    # Replacing a document keeps one row for its name.
    new = live.upsert("d120", rows[121], "doc 120, rewritten")
    got = live.search(rows[121:122], 3)[1][0]
    assert new in got and ids[120] not in got and live.describe(new) == ("d120", "doc 120, rewritten")


class FakeEncoder:
    """Deterministic 'embeddings'; fails on purpose after `fail_after` calls."""

    dim = 4

    def __init__(self, fail_after: int | None = None):
        self.calls = 0
        self.fail_after = fail_after

    def encode(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise KeyboardInterrupt
        return np.array([[len(t), t.count("a"), 1.0, self.calls] for t in texts], dtype=np.float32)


def test_embed_texts_is_cached_and_resumes(tmp_path: Path) -> None:
    texts = [("a" * (i % 7)) + "x" * i for i in range(50)]
    out = tmp_path / "emb.npy"
    with pytest.raises(KeyboardInterrupt):
        vindex.embed_texts(texts, out, FakeEncoder(fail_after=3), chunk=8, key="m", progress=False)
    assert not out.exists() and json.loads((tmp_path / "emb.partial.json").read_text())["done_chunks"] == 3
    enc = FakeEncoder()
    e = np.asarray(vindex.embed_texts(texts, out, enc, chunk=8, key="m", progress=False))
    assert enc.calls == 7 - 3  # resumed: only the chunks that were not done
    np.testing.assert_array_equal(e[:, 0], [len(t) for t in texts])  # rows in input order
    np.testing.assert_array_equal(e[:, 1], [t.count("a") for t in texts])
    enc2 = FakeEncoder()
    vindex.embed_texts(texts, out, enc2, chunk=8, key="m", progress=False)
    assert enc2.calls == 0  # cached
    vindex.embed_texts(texts, out, enc2, chunk=8, key="other model", progress=False)
    assert enc2.calls == 7  # a different model invalidates the cache


# ------------------------------------------------------------ served pipeline

@pytest.fixture(scope="module")
def slice_dir() -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAG_INDEX", "small")
        mp.setenv("RAG_SLICE", str(RAG_SLICE_TEST))
        yield vindex.prepare(small=RAG_SLICE_TEST, threads=2)


@pytest.fixture(scope="module")
def rag_node(slice_dir: Path) -> Iterator[Node]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAG_INDEX", "small")
        mp.setenv("RAG_SLICE", str(RAG_SLICE_TEST))
        mp.setenv("RAG_SLO_MS", "5000")  # correctness here, not latency: a busy CI machine must not drop requests
        node = Node(str(ROOT / "examples" / "rag.py"))
        try:
            node.wait_ready(120)
            yield node
        finally:
            node.stop()


def slice_queries(slice_dir: Path) -> list[dict]:
    qs = vindex.held_queries(slice_dir)
    assert len(qs) >= RAG_SLICE_TEST // 2
    return qs


def test_known_query_finds_its_own_passage(rag_node: Node, slice_dir: Path) -> None:
    q = slice_queries(slice_dir)[0]
    status, body = rag_node.infer("rag", query=[q["query"]])
    assert status == 200, body
    out = body["outputs"]
    assert set(out) == {"ids", "scores", "package", "title", "passage"}
    ids = out["ids"][0]
    assert len(ids) == 10 and q["passage_id"] in ids, (q, out["package"][0])
    j = ids.index(q["passage_id"])
    assert out["package"][0][j] == q["package"]
    assert out["title"][0][j] == q["query"]  # the package's summary, for people
    assert isinstance(out["passage"][0][j], str) and len(out["passage"][0][j]) > 40
    scores = out["scores"][0]
    assert all(a >= b - 1e-6 for a, b in zip(scores, scores[1:], strict=False)) and 0 < scores[0] <= 1.0001


def test_several_rows_per_request_and_recall(rag_node: Node, slice_dir: Path) -> None:
    qs = slice_queries(slice_dir)[:40]
    ids = []
    for i in range(0, len(qs), 4):  # 4 rows per request
        status, body = rag_node.infer("rag", query=[q["query"] for q in qs[i:i + 4]])
        assert status == 200, body
        assert np.array(body["outputs"]["ids"]).shape == (4, 10)
        assert np.array(body["outputs"]["passage"]).shape == (4, 10)
        ids += body["outputs"]["ids"]
    m = vindex.retrieval_metrics(np.array(ids), [q["passage_id"] for q in qs], 10)
    assert m["recall@10"] >= 0.85, m  # 300 passages: the right one is almost always found
    assert m["mrr@10"] >= 0.6, m
    # each row answered for its own query, not a neighbour's
    one = rag_node.infer("rag", query=[qs[6]["query"]])[1]["outputs"]["ids"][0]
    assert one == ids[6]


def test_rag_client_reports_metrics(rag_node: Node, slice_dir: Path) -> None:
    import subprocess

    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "rag_client.py"), "--url", rag_node.url, "-n", "20",
         "--concurrency", "2", "--show", "1", "--json", "--index-dir", str(slice_dir)],
        capture_output=True, text=True, timeout=120, env=os.environ | {"RAG_INDEX": "small"},
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["queries"] == 20 and m["recall@10"] >= 0.8
    assert "query:" in r.stdout  # a real answer is shown


def packages_for(node: Node, text: str) -> list[str]:
    status, out = node.infer("rag", query=[text])
    assert status == 200, out
    return list(out["outputs"]["package"][0])


def test_live_document_is_found_then_deleted(rag_node: Node) -> None:
    import slipstream as ss

    store = ss.store.Store(rag_node.url)
    text = ("glimmerquill\nGlimmerquill renders handwritten musical notation from photographs into "
            "engraved sheet music and MIDI files.")
    question = "turn photos of handwritten music notation into sheet music and midi"
    store.put("/docs/test/glimmerquill", text)
    wait_for(lambda: "glimmerquill" in packages_for(rag_node, question)[:3], timeout=30)
    assert store.get("/index/live/test/glimmerquill").tensors()["embedding"].shape == (1, 384)
    store.delete("/docs/test/glimmerquill")
    wait_for(lambda: "glimmerquill" not in packages_for(rag_node, question), timeout=30)


def test_index_hot_swap_keeps_answering(rag_node: Node, slice_dir: Path) -> None:
    """A new version of the IVF index (here the same bytes) replaces each
    Search replica's instance between batches: no request fails, and the
    live documents are reloaded into the new instance."""
    import slipstream as ss

    store = ss.store.Store(rag_node.url)
    store.put("/docs/test/swapcheck", "swapcheck\nSwapcheck verifies zebra stripe alignment in barcode printers.")
    question = "verify zebra stripe alignment of barcode printers"
    wait_for(lambda: "swapcheck" in packages_for(rag_node, question)[:3], timeout=30)
    old = store.get("/index/debian/ivf")
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            statuses.append(rag_node.infer("rag", query=[question])[0])

    t = threading.Thread(target=client)
    t.start()
    new = store.put("/index/debian/ivf", (slice_dir / vindex.INDEX_FILE).read_bytes())
    assert new.version == old.version + 1
    wait_for(lambda: f"/index/debian/ivf v{old.version} -> v{new.version}" in rag_node.log(), timeout=60)
    time.sleep(0.5)
    stop.set()
    t.join()
    assert statuses and all(s == 200 for s in statuses), [s for s in statuses if s != 200]
    assert "swapcheck" in packages_for(rag_node, question)[:3], "live rows reloaded into the new instance"
