"""Retrieval export of a two-tower run: item vectors + user tower, and `Predictor.topk` equal to a
brute-force numpy top-k over the trained model's own vectors (computed with the training code)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data.loader import ParquetLoader
from recsys.models.two_tower import item_vectors, tower_data, tower_sparse_arch
from recsys.serving.delta import apply_delta
from recsys.serving.export import export_model
from recsys.serving.predictor import Predictor
from recsys.serving.source import resolve_source
from recsys.serving.errors import ExportError

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, two_tower_trainer):
    """A two-tower run trained for a few steps in this process (LocalStore), saved as `recsys train` saves."""
    tmp = tmp_path_factory.mktemp("tt")
    cfg, store, trainer, train, save = two_tower_trainer(tmp, rows=2048)
    train(range(6))
    run = save(tmp / "run")
    # 3 more steps, saved as a second run (a delta export of it since step 6 updates the first)
    train(range(6, 9))
    save(tmp / "later")
    trainer.close()
    return cfg, run, store, trainer.model, tmp


def test_topk_equals_numpy_brute_force(trained) -> None:
    cfg, run, store, model, tmp = trained
    run = tmp / "later"                     # the model of `store` and `model` (step 9)
    export_model(resolve_source(run=run), tmp / "export")
    items = pq.read_table(tmp / "export" / "items.parquet")
    assert items.num_rows == 4000 and items.schema.field("vector").type.list_size == cfg.model.tower_dim
    p = Predictor(tmp / "export")
    queries = pq.read_table(f"{tmp}/data/part-00001.parquet").slice(0, 300)
    ids, scores = p.topk(queries, k=50)
    assert ids.shape == scores.shape == (300, 50)
    # the reference: the training model's vectors (rows from the live store), numpy argsort
    item_ids, item_vecs = item_vectors(cfg, store, model)
    user_data = dataclasses.replace(tower_data(cfg, cfg.model.user_features), batch_size=300)
    with ParquetLoader(user_data, [f"{tmp}/data/part-00001.parquet"]) as loader:
        batch = next(iter(loader))
    sparse = tower_sparse_arch(cfg, cfg.model.user_features)
    with torch.no_grad():
        pooled, _ = sparse.lookup(batch, store).wait()
        users = model.user_tower(batch.dense, pooled)[:300].numpy()
    full = users @ item_vecs.numpy().T                                     # [300, I]
    order = np.argsort(-full, axis=1, kind="stable")[:, :50]
    np.testing.assert_array_equal(ids, item_ids[order])
    np.testing.assert_allclose(scores, np.take_along_axis(full, order, axis=1), rtol=0, atol=1e-5)


def test_a_delta_export_brings_its_item_vectors_and_user_tower(trained) -> None:
    cfg, run, store, model, tmp = trained
    export_model(resolve_source(run=run), tmp / "base")                            # step 6
    export_model(resolve_source(run=tmp / "later"), tmp / "delta", since=6)        # steps 6..8
    export_model(resolve_source(run=tmp / "later"), tmp / "full9")
    queries = pq.read_table(f"{tmp}/data/part-00001.parquet").slice(0, 64)
    base = Predictor(tmp / "base")
    before, _ = base.topk(queries, k=20)
    base.apply_delta(tmp / "delta")
    after, scores = base.topk(queries, k=20)
    want, want_scores = Predictor(tmp / "full9").topk(queries, k=20)
    np.testing.assert_array_equal(after, want)
    np.testing.assert_allclose(scores, want_scores, atol=1e-6, rtol=0)
    assert (before != after).any()                                                 # the model moved
    # `recsys export-apply`: the full export it writes keeps the delta's item vectors and user tower
    apply_delta(tmp / "base", tmp / "delta", tmp / "applied")
    applied, applied_scores = Predictor(tmp / "applied").topk(queries, k=20)
    np.testing.assert_array_equal(applied, want)
    np.testing.assert_allclose(applied_scores, want_scores, atol=1e-6, rtol=0)


def test_a_ctr_export_has_no_topk(tmp_path: Path) -> None:
    class _P(Predictor):        # no files: only the guard
        def __init__(self) -> None:
            self.index, self.root = None, tmp_path

    with pytest.raises(ExportError, match="not a two_tower export"):
        _P().topk(None, 5)


@pytest.mark.parametrize("item_block, query_block", [(1 << 16, 1024), (64, 7), (1000, 50)])
def test_exact_index_blocks_equal_numpy(item_block: int, query_block: int) -> None:
    """Several item blocks (per-block topk, then a topk of the candidates) and query blocks."""
    from recsys.serving.retrieval import ExactIndex

    rng = np.random.default_rng(4)
    items, queries = rng.normal(size=(1000, 16)).astype(np.float32), rng.normal(size=(30, 16)).astype(np.float32)
    ids = rng.permutation(1 << 20)[:1000].astype(np.int64)
    got_ids, got_scores = ExactIndex(ids, torch.from_numpy(items), item_block, query_block).search(
        torch.from_numpy(queries), 25)
    full = queries @ items.T
    order = np.argsort(-full, axis=1, kind="stable")[:, :25]
    np.testing.assert_array_equal(got_ids, ids[order])
    np.testing.assert_allclose(got_scores, np.take_along_axis(full, order, axis=1), atol=1e-5, rtol=0)


def test_an_ann_export_round_trips_and_exact_stays_exact(trained) -> None:
    """`recsys export --index ann`: items.faiss beside items.parquet, its parameters in the manifest,
    loaded and searched by topk; index="exact" / exact=True give ExactIndex's answer (recall 1.0)."""
    from recsys.cli import main
    from recsys.serving.ann import AnnIndex
    from recsys.serving.export import read_manifest
    from recsys.serving.retrieval import ExactIndex

    cfg, run, store, model, tmp = trained
    out = tmp / "ann"
    assert main(["export", "--run", str(tmp / "later"), "--out", str(out), "--index", "ann"]) == 0
    m = read_manifest(out)
    section = m["retrieval"]["index"]
    assert section["kind"] == "faiss_hnsw_flat_ip" and section["num_items"] == 4000 and section["M"] == 32
    assert (out / "items.faiss").is_file() and "items.faiss" in m["files"]
    queries = pq.read_table(f"{tmp}/data/part-00001.parquet").slice(0, 100)
    ann, exact = Predictor(out), Predictor(out, index="exact")
    assert isinstance(ann.index, AnnIndex) and isinstance(exact.index, ExactIndex)
    want, want_scores = exact.topk(queries, k=100)
    got, got_scores = ann.topk(queries, k=100)
    # a model of 9 steps: its item vectors are nearly the random init, the hard case for a graph
    # (0.89 at the default ef_search 100; test_ann_index.py holds the recall on structured vectors)
    assert np.mean([np.intersect1d(a, b).size / 100 for a, b in zip(got, want)]) >= 0.8
    users = ann.user_vectors(queries)
    np.testing.assert_array_equal((got, got_scores), ann.index.search(users, 100))
    assert not np.array_equal(got, want)                                       # approximate indeed
    export_model(resolve_source(run=tmp / "later"), tmp / "exact-only")
    for ids, scores in (ann.topk(queries, k=100, exact=True), Predictor(tmp / "exact-only").topk(queries, k=100)):
        np.testing.assert_array_equal(ids, want)                               # recall 1.0
        np.testing.assert_array_equal(scores, want_scores)
    built = Predictor(tmp / "exact-only", index="ann")              # an export without one: built at load
    assert isinstance(built.index, AnnIndex)
    np.testing.assert_array_equal(built.topk(queries, k=100, exact=True)[0], want)
    with pytest.raises(ExportError, match="two_tower model only"):
        export_model(resolve_source(run=run), tmp / "bad", index="annoy")
