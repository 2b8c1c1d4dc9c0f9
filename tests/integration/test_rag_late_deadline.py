"""examples/rag_late.py answers within its deadline when the disk is slow:
the re-rank's budget is each request's time left (``batch.time_left()``),
so reads that cannot finish in time give a partial re-rank, not a late
answer. (Its own module, so that its node starts beside test_rag_late's on
another test worker; the slice is built once, under a lock.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Node
from tests.integration.test_rag_late import ENV, built_slice, served, slice_queries

#: A disk slowed to 40 ms a read with 2 readers: the 100 candidates of a
#: query take ~2 s to read, the deadline (SLO 800 ms) comes first.
SLOW_DISK = ENV | {"RAG_SLO_MS": "800", "RAG_LATE_BUDGET_MS": "60000", "RAG_LATE_READ_DELAY_MS": "40",
                   "RAG_LATE_IO_THREADS": "2"}


@pytest.fixture(scope="module")
def slice_dir() -> Path:
    return built_slice()


@pytest.fixture(scope="module")
def slow_disk_node(slice_dir: Path) -> Iterator[Node]:
    yield from served(SLOW_DISK)


def test_a_slow_disk_gets_a_partial_rerank_within_the_deadline(slow_disk_node: Node, slice_dir: Path) -> None:
    """The re-rank's budget is the request's time left (batch.time_left()),
    not a fixed one: with reads that cannot finish before the deadline, the
    answer comes in time, re-ranking what has arrived."""
    q = slice_queries(slice_dir)[3]["query"]
    for _ in range(2):  # the first also warms the encoder's path
        t0 = time.monotonic()
        status, body = slow_disk_node.infer("rag_late", query=[q])
        took_ms = (time.monotonic() - t0) * 1e3
        assert status == 200, body
    out = body["outputs"]
    assert took_ms < 800, f"answered after {took_ms:.0f} ms, past the 800 ms SLO"
    assert 0 <= out["reranked"][0] < out["target"][0], (out["reranked"], out["target"])
    assert len(out["ids"][0]) == 10 and out["ids"][0][0] >= 0, out["ids"]
