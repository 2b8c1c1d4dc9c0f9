"""examples/recsys.py on a real node: candidates, DLRM scores, top-k, batching."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from examples.models.recsys_model import DLRM, CandidateGenerator, Catalog
from tests.conftest import ROOT, Node

K = 10


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    n = Node(str(ROOT / "examples" / "recsys.py"))
    n.wait_ready()
    yield n
    n.stop()


@pytest.fixture(scope="module")
def reference() -> tuple[CandidateGenerator, DLRM]:
    catalog = Catalog()
    return CandidateGenerator(catalog), DLRM(catalog=catalog)


def ask(node: Node, users: list[int], histories: list[list[int]], tries: int = 5) -> dict:
    """The outputs; a request the node sheds for its 50 ms SLO (429 refused at
    ingress, 504 dropped in a queue: the test machine is shared) is retried."""
    for _ in range(tries):
        status, body = node.infer("recsys", user=[[u] for u in users], history=histories)
        if status not in (429, 504):
            break
        time.sleep(0.05)
    assert status == 200, body
    return body["outputs"]


def test_scores_all_candidates_and_returns_sorted_top_k(node: Node, reference: tuple[CandidateGenerator, DLRM]) -> None:
    history = [17, 99, 3, 150_000, -1, -1, -1, -1]
    out = ask(node, [42], [history])
    cands = np.array(out["candidates"][0])
    scores = np.array(out["candidate_scores"][0], dtype=np.float32)
    items, best = np.array(out["items"][0]), np.array(out["scores"][0], dtype=np.float32)
    assert cands.shape == (32,) and len(set(cands.tolist())) == 32
    assert not set(cands.tolist()) & {17, 99, 3, 150_000}
    assert items.shape == (K,) and best.shape == (K,)
    assert (np.diff(best) <= 0).all()
    assert set(items.tolist()) <= set(cands.tolist())
    # The top k are the k best of the 32 scored candidates, with their scores.
    np.testing.assert_array_equal(np.sort(scores)[::-1][:K], best)
    np.testing.assert_array_equal(best, scores[[cands.tolist().index(i) for i in items]])
    # The same numbers as the model run in this process.
    gen, model = reference
    ids, dense = gen.generate(np.array([42]), np.array([history]))
    np.testing.assert_array_equal(ids[0], cands)
    np.testing.assert_allclose(model.score(np.array([42]), ids, dense, np.array([history]))[0], scores, rtol=1e-5)


def test_answers_are_deterministic_per_user(node: Node) -> None:
    empty = [-1] * 8
    users = [5, 123_456, 5]
    hist = [empty, [1, 2, 3, 4, 5, 6, 7, 8], empty]
    out = ask(node, users, hist)
    assert out["items"][0] == out["items"][2]  # the same user and history in one request
    again = ask(node, [123_456], [hist[1]])
    assert again["items"][0] == out["items"][1] and again["scores"][0] == pytest.approx(out["scores"][1], rel=1e-5)
    # A different history gives different candidates.
    other = ask(node, [123_456], [[9, 8, 7, 6, 5, 4, 3, 2]])
    assert other["candidates"][0] != out["candidates"][1]


@pytest.mark.alone  # a 50 ms SLO: with other tests beside it, the node sheds most of the burst
def test_concurrent_requests_are_ranked_in_batches(node: Node) -> None:
    rng = np.random.default_rng(11)
    users = rng.integers(0, 10**6, size=96).tolist()
    histories = rng.integers(-1, 200_000, size=(96, 8)).tolist()
    alone = {u: ask(node, [u], [h]) for u, h in list(zip(users, histories, strict=True))[:8]}
    before = node.stage("recsys", "Ranker")
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda uh: node.infer("recsys", user=[[uh[0]]], history=[uh[1]]),
                                zip(users, histories, strict=True)))
    after = node.stage("recsys", "Ranker")
    # Under a 50 ms SLO on a shared machine the node may shed some requests; it must answer most.
    statuses = [s for s, _ in answers]
    assert set(statuses) <= {200, 429, 504}, answers
    assert statuses.count(200) >= 48, statuses
    assert after["batches"] - before["batches"] < after["requests"] - before["requests"]  # batches formed
    assert after["batch_size"]["max"] > 1
    for u, (status, body) in zip(users, answers, strict=True):
        if status != 200:
            continue
        out = body["outputs"]
        assert len(out["items"][0]) == K
        if u in alone:  # batched answers equal the answers given alone
            assert out["items"] == alone[u]["items"]
            assert out["scores"][0] == pytest.approx(alone[u]["scores"][0], rel=1e-5)


def test_bad_inputs_are_rejected(node: Node) -> None:
    status, body = node.infer("recsys", user=[[1]], history=[[1, 2, 3]])
    assert status == 400, body
    status, body = node.infer("recsys", user=[[-4]], history=[[-1] * 8])
    assert status == 500 and "user ids must be >= 0" in str(body), body
