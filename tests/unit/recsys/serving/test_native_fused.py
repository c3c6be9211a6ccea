"""NativePooling (one or two calls of the C kernel over all tables, embedding_ps/csrc/pool.c)
against the per-table serving paths.

fp32 / fp16 must be bit-equal to the training path (SparseArch over the ExportStore), int8 / int4
bit-equal to tbe_pool.QuantizedPooling, on random batches with unseen ids, multi-hot bags, empty
bags, per-id weights, mean pooling, hashed tables, tables of zeros defaults, a table shared by two
features, linear (dim 1) tables, and the ids -1 and -2**63.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from data.batch import Batch, KeyedJagged
from embedding_ps import native as ps_native
from embedding_ps.wire.config import TableConfig
from recsys.models.sparse_arch import SparseArch, TablePlan, plan_tables
from recsys.serving.export_store import ExportStore, TableView
from recsys.serving.native_fused import NativePooling
from recsys.serving.quantize import quantize
from recsys.serving.tbe_pool import QuantizedPooling

PRECISIONS = ("fp32", "fp16", "int8", "int4")
# "m" (mean) sits between sum-pooled features, so slot order (by pooling group) != feature order
FEATURES = ("a", "m", "h", "z", "d", "n")
TABLES = (
    TableConfig(name="a", dim=8, init_scale=0.5, seed=3),                      # sum, weighted; "d" reads it too
    TableConfig(name="m", dim=8, init_scale=0.2),                              # mean
    TableConfig(name="h", dim=8, kind="hashed", num_embeddings=13),            # hashed ids
    TableConfig(name="z", dim=8, unadmitted="zeros"),                          # unknown ids pull zeros
    TableConfig(name="n", dim=8, init="normal", init_scale=0.3, seed=5),       # another class of default
    TableConfig(name="lin", dim=1, init="normal", init_scale=0.3),             # linear terms, odd width
)
FEATURE_TABLES = {"d": "a"}
LINEAR = {"a": "lin", "h": "lin", "n": "lin"}
POOLING = {"m": "mean"}
# every default uniform or zeros: NativePooling computes them all in C and looks ids up inside its
# pooling call (with a normal default, Python computes those rows between two calls)
UNIFORM_TABLES = tuple(dataclasses.replace(c, init="uniform") if c.init == "normal" else c for c in TABLES)


def make_views(precision: str, seed: int = 0, tables: tuple = TABLES) -> list[TableView]:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    views = []
    for cfg in tables:
        if cfg.kind == "hashed":
            ids = np.arange(0, 13, 2, dtype=np.int64)                             # some hashed rows missing
        else:
            ids = np.unique(np.concatenate([np.arange(-3, 60, 3), rng.integers(-2**62, 2**62, 20)]))  # holds -1? no
            if cfg.name == "a":                           # a table storing the ids -1 and -2**63
                ids = np.unique(np.concatenate([ids, [-1, np.iinfo(np.int64).min]]))
        rows = torch.randn(ids.shape[0], cfg.dim, generator=g)
        views.append(TableView(cfg, ids.astype(np.int64), quantize(rows, precision), precision))
    return views


def make_batch(views: list[TableView], B: int, seed: int, weighted: bool) -> Batch:
    """Ids: half stored ids of the feature's table, half unseen (small, -1, huge); 0..3 per bag."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=(len(FEATURES), B))
    table_of = {f: FEATURE_TABLES.get(f, f) for f in FEATURES}
    names = [v.cfg.name for v in views]
    values = []
    for f, n in zip(FEATURES, lengths.sum(axis=1)):
        stored = views[names.index(table_of[f])].ids
        pick = stored[rng.integers(0, stored.shape[0], n)]
        unseen = rng.choice(np.array([-1, 1, 2, 100, 2**62 + 7, -(2**62) - 1], dtype=np.int64), n)
        values.append(np.where(rng.random(n) < 0.5, pick, unseen))
    values = np.concatenate(values).astype(np.int64)
    weights = torch.from_numpy(rng.uniform(0.1, 2.0, size=values.size).astype(np.float32)) if weighted else None
    kj = KeyedJagged(FEATURES, torch.from_numpy(values), torch.from_numpy(lengths.reshape(-1).astype(np.int32)))
    return Batch(dense=torch.zeros(B, 0), labels=torch.zeros(B), sparse=kj, weights=weights)


def build(plans, views, precision: str) -> NativePooling:
    if not ps_native.available():
        pytest.skip("no C compiler: the native serving kernel cannot build")
    return NativePooling(plans, views, precision)


def reference(precision: str, plans, views, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    if precision in ("int8", "int4"):
        return QuantizedPooling(plans, views, precision).pool(batch)
    pooled, linear = SparseArch(plans).lookup(batch, ExportStore(views)).wait()
    return pooled.detach(), None if linear is None else linear.detach()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("tables", ["normal", "uniform"])
def test_fused_equals_per_table_path(precision: str, weighted: bool, tables: str) -> None:
    configs = TABLES if tables == "normal" else UNIFORM_TABLES
    plans = plan_tables(FEATURES, configs, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views(precision, tables=configs)
    native = build(plans, views, precision)
    for seed, B in enumerate((1, 1, 2, 7, 64, 300)):
        batch = make_batch(views, B, seed, weighted)
        want_pooled, want_linear = reference(precision, plans, views, batch)
        got_pooled, got_linear = native.pool(batch)
        assert got_pooled.shape == want_pooled.shape == (B, len(FEATURES), 8)
        assert got_linear.shape == want_linear.shape == (B, 3)
        assert torch.equal(got_pooled, want_pooled), f"B={B} seed={seed}"
        assert torch.equal(got_linear, want_linear), f"B={B} seed={seed}"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_id_per_feature_in_feature_order(precision: str) -> None:
    """The quickstart's shape: every feature its own table, sum tables first, mean ones last, no linear."""
    features = ("c1", "c2", "c3", "m1")
    tables = tuple(TableConfig(name=f, dim=4, seed=i) for i, f in enumerate(features))
    plans = plan_tables(features, tables, {}, {}, {"m1": "mean"})
    g = torch.Generator().manual_seed(1)
    views = [TableView(c, np.arange(0, 50, 5, dtype=np.int64), quantize(torch.randn(10, 4, generator=g), precision),
                       precision) for c in tables]
    native = build(plans, views, precision)
    rng = np.random.default_rng(2)
    for B in (1, 5, 33):
        lengths = np.ones((4, B), np.int32)
        lengths[3] = rng.integers(0, 5, B)                                         # multi-hot mean feature
        values = rng.integers(0, 60, int(lengths.sum())).astype(np.int64)         # about 80% unseen
        batch = Batch(dense=torch.zeros(B, 0), labels=torch.zeros(B),
                      sparse=KeyedJagged(features, torch.from_numpy(values), torch.from_numpy(lengths.reshape(-1))))
        want, want_lin = reference(precision, plans, views, batch)
        got, got_lin = native.pool(batch)
        assert want_lin is None and got_lin is None
        assert torch.equal(got, want)


def test_many_unseen_ids() -> None:
    """Thousands of unknown ids in one request (their default rows computed in Python): still equal (fp32)."""
    features = ("a",)
    tables = (TableConfig(name="a", dim=4),)
    plans = plan_tables(features, tables, {}, {}, {})
    views = [TableView(tables[0], np.arange(10, dtype=np.int64), torch.randn(10, 4).numpy(), "fp32")]
    native = build(plans, views, "fp32")
    values = torch.arange(5000, dtype=torch.int64)                                 # 4990 unseen
    batch = Batch(dense=torch.zeros(2500, 0), labels=torch.zeros(2500),
                  sparse=KeyedJagged(features, values, torch.full((2500,), 2, dtype=torch.int32)))
    want, _ = reference("fp32", plans, views, batch)
    assert torch.equal(native.pool(batch)[0], want)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_empty_table_and_unused_feature(precision: str) -> None:
    """A table with no rows yet (every id gets its default) and a batch feature no table reads."""
    features = ("a", "skip", "e")
    tables = (TableConfig(name="a", dim=4), TableConfig(name="e", dim=4, seed=9))
    plans = [TablePlan(0, "a", 4, "sum", (0,), False), TablePlan(1, "e", 4, "sum", (2,), False)]   # "skip": no table
    g = torch.Generator().manual_seed(3)
    views = [TableView(tables[0], np.arange(0, 30, 3, dtype=np.int64),
                       quantize(torch.randn(10, 4, generator=g), precision), precision),
             TableView(tables[1], np.zeros(0, np.int64), quantize(torch.zeros(0, 4), precision), precision)]
    native = build(plans, views, precision)
    rng = np.random.default_rng(4)
    for B in (1, 6):
        lengths = rng.integers(1, 3, size=(3, B)).astype(np.int32)
        values = rng.integers(0, 40, int(lengths.sum())).astype(np.int64)
        batch = Batch(dense=torch.zeros(B, 0), labels=torch.zeros(B),
                      sparse=KeyedJagged(features, torch.from_numpy(values), torch.from_numpy(lengths.reshape(-1))))
        want, _ = reference(precision, plans, views, batch)
        got, _ = native.pool(batch)
        assert got.shape == (B, 2, 4)
        assert torch.equal(got, want)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tables", ["normal", "uniform"])
def test_native_equals_reference_at_batch_4096_any_thread_count(precision: str, tables: str) -> None:
    """B = 4096 (the benchmark's batch) and B = 1, weighted or not: NativePooling == the per-table
    path bit for bit, with 1 and 3 kernel threads (the C side splits ids and bags between them), with
    some default rows from Python (two calls) or all from C (one call)."""
    configs = TABLES if tables == "normal" else UNIFORM_TABLES
    plans = plan_tables(FEATURES, configs, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views(precision, seed=5, tables=configs)
    native = build(plans, views, precision)
    assert native.caller_defaults == (tables == "normal")
    threads = torch.get_num_threads()
    try:
        for seed, (B, weighted) in enumerate([(4096, True), (4096, False), (1, True), (1, False)]):
            batch = make_batch(views, B, 100 + seed, weighted)
            want, want_lin = reference(precision, plans, views, batch)
            for t in (1, 3):
                torch.set_num_threads(t)
                got, got_lin = native.pool(batch)
                assert torch.equal(got, want), f"B={B} weighted={weighted} threads={t}"
                assert torch.equal(got_lin, want_lin), f"B={B} weighted={weighted} threads={t}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_native_all_bags_empty(precision: str) -> None:
    """A batch without a single id: zeros everywhere (mean bags of no id included)."""
    plans = plan_tables(FEATURES, TABLES, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views(precision)
    native = build(plans, views, precision)
    B = 3
    kj = KeyedJagged(FEATURES, torch.zeros(0, dtype=torch.int64), torch.zeros(len(FEATURES) * B, dtype=torch.int32))
    batch = Batch(dense=torch.zeros(B, 0), labels=torch.zeros(B), sparse=kj)
    got, got_lin = native.pool(batch)
    want, want_lin = reference(precision, plans, views, batch)
    assert torch.equal(got, want) and torch.equal(got_lin, want_lin)
    assert not got.any() and not got_lin.any()


def test_native_output_buffer_reused_only_when_free() -> None:
    """NativePooling writes a request into the previous request's output buffer only when no tensor
    views it any more: results the caller keeps are never overwritten."""
    plans = plan_tables(FEATURES, TABLES, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views("fp32")
    native = build(plans, views, "fp32")
    b1, b2 = make_batch(views, 64, 1, True), make_batch(views, 64, 2, True)
    kept, kept_lin = native.pool(b1)
    want, want_lin = kept.clone(), kept_lin.clone()
    other, other_lin = native.pool(b2)                               # b1's results still referenced
    assert torch.equal(kept, want) and torch.equal(kept_lin, want_lin)
    assert kept.data_ptr() != other.data_ptr()
    ptr = other.data_ptr()
    del kept, kept_lin, other, other_lin
    again, again_lin = native.pool(b1)                                # nothing references the buffer: reused
    assert torch.equal(again, want) and torch.equal(again_lin, want_lin)
    assert again.data_ptr() == ptr


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("dim", [16, 20, 40, 128, 136])
def test_native_equals_reference_at_wider_rows(precision: str, dim: int) -> None:
    """Widths where the kernel's AVX2 row ops run (8 floats / 16 int4 codes a step) with and without
    a scalar tail, at compile-time widths (16, 128) and runtime ones (20, 40, 136): bit-equal to
    the per-table paths, weighted or not, defaults from C or from Python."""
    for configs in (TABLES, UNIFORM_TABLES):
        wide = tuple(c if c.name == "lin" else dataclasses.replace(c, dim=dim) for c in configs)
        plans = plan_tables(FEATURES, wide, FEATURE_TABLES, LINEAR, POOLING)
        views = make_views(precision, seed=dim, tables=wide)
        native = build(plans, views, precision)
        for seed, weighted in enumerate((True, False)):
            batch = make_batch(views, 97, 7 + seed, weighted)
            want, want_lin = reference(precision, plans, views, batch)
            got, got_lin = native.pool(batch)
            assert torch.equal(got, want), f"{precision} dim={dim} weighted={weighted}"
            assert torch.equal(got_lin, want_lin), f"{precision} dim={dim} weighted={weighted}"
