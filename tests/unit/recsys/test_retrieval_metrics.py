"""recall@K / ndcg@K against hand values, and the exact top-K of the retrieval eval against numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from recsys.metrics import retrieval_metrics
from recsys.training.retrieval import top_items


def test_recall_and_ndcg_by_hand() -> None:
    top = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    relevant = [np.array([2, 9]), np.array([4]), np.array([1, 2, 3, 7])]
    m = retrieval_metrics(top, relevant, [1, 2, 3])
    g = [1.0, 1 / math.log2(3), 1 / math.log2(4)]          # gain of ranks 1, 2, 3
    # user 0: hit at rank 2 of {2, 9}; user 1: hit at rank 1 of {4}; user 2: hit at rank 1 of 4 items
    assert m["recall@1"] == pytest.approx((0 + 1 + 1 / 4) / 3)
    assert m["recall@2"] == pytest.approx((1 / 2 + 1 + 1 / 4) / 3)
    assert m["recall@3"] == pytest.approx((1 / 2 + 1 + 1 / 4) / 3)
    assert m["ndcg@1"] == pytest.approx((0 + 1 + 1) / 3)
    assert m["ndcg@2"] == pytest.approx((g[1] / (g[0] + g[1]) + 1 + 1 / (g[0] + g[1])) / 3)
    assert m["ndcg@3"] == pytest.approx((g[1] / (g[0] + g[1]) + 1 + 1 / sum(g)) / 3)


def test_a_perfect_list_scores_one_and_a_short_list_counts_its_misses() -> None:
    relevant = [np.array([5, 6]), np.array([1])]
    m = retrieval_metrics(np.array([[6, 5, 0], [1, 2, 3]]), relevant, [2, 3])
    assert m == {"recall@2": 1.0, "ndcg@2": 1.0, "recall@3": 1.0, "ndcg@3": 1.0}
    short = retrieval_metrics(np.array([[0], [1]]), relevant, [2])   # one item per list
    assert short["recall@2"] == pytest.approx(0.5) and short["ndcg@2"] == pytest.approx(0.5)


def test_mismatched_users_raise() -> None:
    with pytest.raises(ValueError, match="2 ranked lists for 1 users"):
        retrieval_metrics(np.zeros((2, 3), np.int64), [np.array([1])], [1])


def test_top_items_equals_numpy_brute_force() -> None:
    rng = np.random.default_rng(0)
    users, items = rng.normal(size=(37, 8)).astype(np.float32), rng.normal(size=(500, 8)).astype(np.float32)
    ids = rng.permutation(10_000)[:500].astype(np.int64)
    got = top_items(torch.from_numpy(users), torch.from_numpy(items), ids, k=20, block=16)
    scores = users @ items.T
    ref = ids[np.argsort(-scores, axis=1, kind="stable")[:, :20]]
    np.testing.assert_array_equal(got, ref)
