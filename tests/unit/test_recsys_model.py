"""The DLRM-style ranker and the candidate generator of examples/recsys.py."""

from __future__ import annotations

import numpy as np
import pytest

from examples.models.recsys_model import (
    DLRM,
    HISTORY,
    N_CANDIDATES,
    CandidateGenerator,
    Catalog,
    RecsysConfig,
    top_k,
)


@pytest.fixture(scope="module")
def parts() -> tuple[Catalog, CandidateGenerator, DLRM]:
    catalog = Catalog()
    return catalog, CandidateGenerator(catalog), DLRM(catalog=catalog)


def requests(n: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 10**7, size=n)
    history = rng.integers(0, RecsysConfig().n_items, size=(n, HISTORY))
    lengths = rng.integers(0, HISTORY + 1, size=n)
    history[np.arange(HISTORY)[None, :] >= lengths[:, None]] = -1  # padded tails
    return users, history


def test_batched_scores_equal_one_by_one(parts: tuple[Catalog, CandidateGenerator, DLRM]) -> None:
    _, gen, model = parts
    users, history = requests(21)  # more than DLRM.CHUNK, and not a multiple of it
    ids, dense = gen.generate(users, history)
    batched = model.score(users, ids, dense, history)
    assert batched.shape == (21, N_CANDIDATES) and batched.dtype == np.float32
    alone = np.concatenate([model.score(users[i:i + 1], ids[i:i + 1], dense[i:i + 1], history[i:i + 1])
                            for i in range(21)])
    np.testing.assert_allclose(batched, alone, rtol=1e-5, atol=1e-6)
    assert ((batched > 0) & (batched < 1)).all()
    # Scores differ between candidates and users: the model is not constant.
    assert batched.std(axis=1).min() > 1e-3
    assert np.abs(batched[0] - batched[1]).max() > 1e-3


def test_model_is_deterministic_from_its_seed(parts: tuple[Catalog, CandidateGenerator, DLRM]) -> None:
    catalog, gen, model = parts
    users, history = requests(4)
    ids, dense = gen.generate(users, history)
    again = DLRM(catalog=catalog).score(users, ids, dense, history)
    np.testing.assert_array_equal(model.score(users, ids, dense, history), again)
    other = DLRM(RecsysConfig(seed=1)).score(users, ids, dense, history)
    assert not np.allclose(other, again)


def test_candidates_are_distinct_new_items_and_batch_independent(
    parts: tuple[Catalog, CandidateGenerator, DLRM],
) -> None:
    catalog, gen, _ = parts
    users, history = requests(40, seed=5)
    history[0] = -1  # a user with no history
    history[1] = [7, 7, 7, 7, 7, 7, 7, int(catalog.popular[0])]  # repeats, and a popular item
    ids, dense = gen.generate(users, history)
    assert ids.shape == (40, N_CANDIDATES) and ids.dtype == np.int64
    assert dense.shape == (40, N_CANDIDATES, RecsysConfig().n_dense) and dense.dtype == np.float32
    for i in range(40):
        assert len(set(ids[i].tolist())) == N_CANDIDATES
        assert not set(ids[i].tolist()) & {int(h) for h in history[i] if h >= 0}
        assert ids[i].min() >= 0 and ids[i].max() < catalog.config.n_items
        one_ids, one_dense = gen.generate(users[i:i + 1], history[i:i + 1])
        np.testing.assert_array_equal(one_ids[0], ids[i])
        np.testing.assert_array_equal(one_dense[0], dense[i])
    # Source one-hot: no history -> no co-visit candidates; popular items fill 24 slots.
    source = dense[:, :, -3:]
    np.testing.assert_array_equal(source.sum(axis=2), 1)
    assert source[0, :, 0].sum() == 0 and source[0, :, 1].sum() == 24
    assert source[1, :, 0].sum() == 8  # two distinct history items, 4 neighbours each
    assert int(catalog.popular[0]) not in ids[1]


def test_top_k_sorts_best_first() -> None:
    items = np.array([[10, 11, 12, 13], [5, 6, 7, 8]], dtype=np.int64)
    scores = np.array([[0.1, 0.9, 0.5, 0.9], [0.3, 0.2, 0.1, 0.4]], dtype=np.float32)
    top, best = top_k(items, scores, 3)
    np.testing.assert_array_equal(top, [[11, 13, 12], [8, 5, 6]])  # a tie: the lower id first
    np.testing.assert_array_equal(best, np.array([[0.9, 0.9, 0.5], [0.4, 0.3, 0.2]], dtype=np.float32))


def test_score_rejects_mismatched_features(parts: tuple[Catalog, CandidateGenerator, DLRM]) -> None:
    _, gen, model = parts
    users, history = requests(2)
    ids, dense = gen.generate(users, history)
    with pytest.raises(ValueError, match="dense features must have shape"):
        model.score(users, ids, dense[:, :, :5], history)
