"""The late-interaction RAG example (examples/rag_late.py) served by a real
node: MiniLM token embeddings, a faiss IVF index read into numpy probes,
token embeddings read with O_DIRECT from the slice's token file, MaxSim
re-ranking, on a small slice of the Debian corpus.

The slice (RAG_SLICE_TEST passages, the one tests/integration/test_rag.py
uses) and its token file are built in the data directory on first run
(~20 s on two busy cores) and reused after.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, Node

sys.path.insert(0, str(ROOT / "examples"))

from models import late, minilm, vindex  # noqa: E402

minilm.model_dir()  # `make setup` installs the model; without it these tests fail with its message

RAG_SLICE_TEST = 300
ENV = {"RAG_INDEX": "small", "RAG_SLICE": str(RAG_SLICE_TEST), "RAG_SLO_MS": "5000",
       "RAG_LATE_STORAGE": "ssd", "RAG_LATE_BUDGET_MS": "2000", "RAG_LATE_LOG_S": "0"}


def built_slice() -> Path:
    """The test slice with its token file (built once, under a lock)."""
    d = vindex.prepare(small=RAG_SLICE_TEST, threads=2)
    late.ensure_tokens(d, threads=2)
    return d


@pytest.fixture(scope="module")
def slice_dir() -> Path:
    return built_slice()


def served(env: dict[str, str]) -> Iterator[Node]:
    """examples/rag_late.py served with `env`, until the generator is closed."""
    node = Node(str(ROOT / "examples" / "rag_late.py"), env=env)
    try:
        node.wait_ready(120)
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def late_node(slice_dir: Path) -> Iterator[Node]:
    yield from served(ENV)


def slice_queries(slice_dir: Path) -> list[dict]:
    return vindex.held_queries(slice_dir)


def test_known_queries_find_their_passages_reranked(late_node: Node, slice_dir: Path) -> None:
    qs = slice_queries(slice_dir)[:12]
    found = 0
    for i in range(0, len(qs), 4):  # 4 rows per request
        status, body = late_node.infer("rag_late", query=[q["query"] for q in qs[i:i + 4]])
        assert status == 200, body
        out = body["outputs"]
        assert set(out) == {"ids", "maxsim", "cosine", "reranked", "target", "prefetch_hits", "package", "title",
                            "passage"}
        assert np.array(out["ids"]).shape == (4, 10) and np.array(out["passage"]).shape == (4, 10)
        for j, q in enumerate(qs[i:i + 4]):
            ids = out["ids"][j]
            # a generous budget on a 300-passage slice: every candidate is re-ranked
            assert out["reranked"][j] == out["target"][j] >= 10, out["reranked"]
            assert 0 <= out["prefetch_hits"][j] <= out["target"][j]
            ms = out["maxsim"][j]
            assert all(a >= b - 1e-4 for a, b in zip(ms, ms[1:], strict=False)), ms  # MaxSim order
            assert ms[0] > 1.0  # a sum over the query's tokens of cosines, well above one token's
            if q["passage_id"] in ids:
                found += 1
                k = ids.index(q["passage_id"])
                assert out["package"][j][k] == q["package"] and out["title"][j][k] == q["query"]
    assert found >= 10, f"{found} of {len(qs)} queries found their passage in the top 10"


def test_served_answers_equal_the_searcher_in_process(late_node: Node, slice_dir: Path) -> None:
    """The served stage answers what the library answers for the same query
    (same token graph, same index, same re-rank), in RAM here."""
    q = slice_queries(slice_dir)[20]["query"]
    status, body = late_node.infer("rag_late", query=[q])
    assert status == 200, body
    enc = minilm.TokenEncoder(threads=1)
    vec, toks, lens = enc.encode_tokens([q], max_tokens=32)
    searcher = late.open_index(slice_dir, "ram", late.LateConfig(candidates=100))
    r = searcher.search(vec, toks.astype(np.float16), lens)
    assert body["outputs"]["ids"][0] == r.ids[0].tolist()
    assert body["outputs"]["reranked"][0] == int(r.reranked[0])

