"""`ann.AnnIndex` (faiss HNSW, inner product) against `ExactIndex` on small item sets (fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recsys.serving.ann import ANN_FILE, AnnIndex
from recsys.serving.errors import ExportError
from recsys.serving.retrieval import ExactIndex


def clustered(n: int, d: int, queries: int, seed: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Item ids, item vectors [n, d] (norms 0.5..1.5: inner product and L2 rank them differently)
    and unit queries, around 100 shared centers."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(100, d, generator=g)

    def around(m: int) -> torch.Tensor:
        x = centers[torch.randint(100, (m,), generator=g)] + 0.5 * torch.randn(m, d, generator=g)
        return torch.nn.functional.normalize(x, dim=1)

    ids = np.random.default_rng(seed).permutation(n).astype(np.int64) * 7919 + 11
    return ids, around(n) * (0.5 + torch.rand(n, 1, generator=g)), around(queries)


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([np.intersect1d(a, b).size / b.size for a, b in zip(found, exact)]))


def test_recall_at_100_on_5k_items() -> None:
    ids, items, queries = clustered(5000, 32, 200, seed=3)
    exact = ExactIndex(ids, items)
    want, _ = exact.search(queries, 100)
    ann = AnnIndex.build(ids, items, M=16, ef_construction=100, ef_search=128)
    got, scores = ann.search(queries, 100)
    assert got.shape == scores.shape == (200, 100) and got.dtype == np.int64 and scores.dtype == np.float32
    assert recall(got, want) >= 0.97
    # the scores are the exact inner products of the ids found, best first
    rows = {int(i): r for r, i in enumerate(ids)}
    vecs = items.numpy()[np.vectorize(rows.get)(got)]                               # [200, 100, d]
    np.testing.assert_allclose(scores, np.einsum("bkd,bd->bk", vecs, queries.numpy()), atol=1e-5, rtol=0)
    assert (np.diff(scores, axis=1) <= 1e-6).all()


def test_saved_and_loaded_index_searches_the_same(tmp_path) -> None:
    ids, items, queries = clustered(2000, 16, 50, seed=5)
    ann = AnnIndex.build(ids, items, M=8, ef_construction=40, ef_search=64)
    section = ann.save(tmp_path)
    assert (tmp_path / ANN_FILE).is_file() and section["file"] == ANN_FILE
    assert {k: section[k] for k in ("M", "ef_construction", "ef_search", "num_items")} == \
        {"M": 8, "ef_construction": 40, "ef_search": 64, "num_items": 2000}
    loaded = AnnIndex.load(tmp_path, section, ids)
    for a, b in zip(loaded.search(queries, 30), ann.search(queries, 30)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ExportError, match="2000 items, the export has 1999"):
        AnnIndex.load(tmp_path, section, ids[:-1])
    (tmp_path / ANN_FILE).write_bytes(b"not an index")
    with pytest.raises(ExportError, match=f"{ANN_FILE}: not a readable faiss index"):
        AnnIndex.load(tmp_path, section, ids)


def test_k_of_every_item_returns_them_all() -> None:
    ids, items, queries = clustered(60, 8, 5, seed=1)
    exact = ExactIndex(ids, items)
    got, scores = AnnIndex.build(ids, items, exact, M=4, ef_construction=8, ef_search=4).search(queries, 100)
    want, want_scores = exact.search(queries, 100)
    assert got.shape == (5, 60)
    assert all(set(a) == set(ids) for a in got)
    np.testing.assert_allclose(np.sort(scores, axis=1), np.sort(want_scores, axis=1), atol=1e-5, rtol=0)
    empty = AnnIndex.build(ids, items).search(queries[:0], 10)
    assert empty[0].shape == (0, 10)
