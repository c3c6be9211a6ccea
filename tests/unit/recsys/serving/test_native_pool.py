"""The native serving kernel's pieces: its hash map against a dict, and the fallback to the per-table path.

NativePooling's pooled results against the per-table paths: test_native_fused.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from embedding_ps import native as ps_native
from embedding_ps import native_build
from embedding_ps.wire.config import TableConfig
from recsys.models.sparse_arch import plan_tables
from recsys.serving.export_store import TableView
from recsys.serving.native_fused import NativePooling, make_pooling

I64 = np.iinfo(np.int64)


@pytest.fixture
def native() -> None:
    if not ps_native.available():
        pytest.skip("no C compiler: the native serving kernel cannot build")


def one_slot(bits: int, hashed: int = 0, miss: int = -3) -> torch.Tensor:
    """A slot descriptor reading map 0 (the other fields do not matter to lookups)."""
    desc = torch.zeros(1, ps_native.SV_SLOT_FIELDS, dtype=torch.int64)
    desc[0, 1], desc[0, 2], desc[0, 3], desc[0, 12] = bits, hashed, 10, miss     # row base 10
    return desc


def test_map_lookup_equals_a_dict(native) -> None:
    """Random int64 keys incl. -1, 0 and the extremes; queries half stored, half not, any thread count."""
    rng = np.random.default_rng(0)
    keys = np.unique(np.concatenate([rng.integers(I64.min, I64.max, 3000, dtype=np.int64),
                                     rng.integers(-50, 50, 60), [-1, 0, I64.min, I64.max]])).astype(np.int64)
    rng.shuffle(keys)
    bits = (2 * keys.size - 1).bit_length()
    buckets = torch.full((1 << bits, 2), -1, dtype=torch.int64)
    ps_native.sv_map_build(buckets, torch.from_numpy(keys))
    index = {int(k): i for i, k in enumerate(keys)}
    queries = np.concatenate([keys, rng.integers(I64.min, I64.max, 20000, dtype=np.int64), np.arange(-60, 60)])
    rng.shuffle(queries)
    found = np.array([index.get(int(q), -1) for q in queries])
    offsets = torch.tensor([0, queries.size], dtype=torch.int64)
    for threads, miss in [(1, -3), (4, -3), (1, -1), (4, -2)]:
        rows = torch.empty(queries.size, dtype=torch.int32)
        misses = ps_native.sv_lookup(buckets, one_slot(bits, miss=miss), 1, torch.from_numpy(queries),
                                     offsets, rows, threads)
        assert np.array_equal(rows.numpy(), np.where(found >= 0, found + 10, miss))   # the slot's code when absent
        assert misses == (int((found < 0).sum()) if miss == -3 else 0)                # only -3 is the caller's


def test_map_hashed_keys(native) -> None:
    """A hashed table: the key of id x is splitmix64(x) % num_embeddings (as TableView.keys)."""
    from embedding_ps.wire.sharding import splitmix64_np
    stored = np.arange(0, 13, 2, dtype=np.int64)                        # keys 0, 2, ..., 12 of 13
    buckets = torch.full((16, 2), -1, dtype=torch.int64)
    ps_native.sv_map_build(buckets, torch.from_numpy(stored))
    ids = np.random.default_rng(1).integers(I64.min, I64.max, 500, dtype=np.int64)
    keys = (splitmix64_np(ids) % np.uint64(13)).astype(np.int64)
    want = np.where(keys % 2 == 0, keys // 2 + 10, -3)
    rows = torch.empty(500, dtype=torch.int32)
    ps_native.sv_lookup(buckets, one_slot(4, hashed=13), 1, torch.from_numpy(ids), torch.tensor([0, 500]), rows, 1)
    assert np.array_equal(rows.numpy(), want)


def test_map_refuses_duplicates_and_small_maps(native) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        ps_native.sv_map_build(torch.full((8, 2), -1, dtype=torch.int64), torch.tensor([5, 7, 5]))
    with pytest.raises(ValueError, match="power of two"):
        ps_native.sv_map_build(torch.full((4, 2), -1, dtype=torch.int64), torch.tensor([1, 2, 3]))


def _plans_views():
    tables = (TableConfig(name="a", dim=4), TableConfig(name="b", dim=4, seed=2))
    plans = plan_tables(("a", "b"), tables, {}, {}, {})
    views = [TableView(c, np.arange(0, 20, 2, dtype=np.int64), torch.randn(10, 4).numpy(), "fp32") for c in tables]
    return plans, views


def test_make_pooling_native_or_disabled(native) -> None:
    plans, views = _plans_views()
    assert type(make_pooling(plans, views, "fp32")) is NativePooling
    prev = ps_native.set_enabled(False)                               # EMBEDDING_PS_NATIVE=0 turns it off
    try:
        assert make_pooling(plans, views, "fp32") is None
    finally:
        ps_native.set_enabled(prev)


def test_no_compiler_falls_back_with_one_warning(monkeypatch, tmp_path, caplog) -> None:
    """No cached library and no compiler: one warning, then the per-table path (make_pooling gives None)."""
    monkeypatch.setattr(native_build, "_compiler", lambda: None)
    monkeypatch.setattr(native_build, "_cache_dirs", lambda: [tmp_path])
    monkeypatch.setitem(ps_native._state, "loaded", False)
    monkeypatch.setitem(ps_native._state, "lib", None)
    plans, views = _plans_views()
    with caplog.at_level(logging.WARNING, logger="embedding_ps.native"):
        first = make_pooling(plans, views, "fp32")
        second = make_pooling(plans, views, "fp32")
    assert first is None and second is None
    warnings = [r for r in caplog.records if "native library unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no C compiler" in warnings[0].getMessage()


def test_map_sizes(native) -> None:
    """Maps of up to 2**16 buckets hold >= 4 buckets per row (load <= 0.25), larger ones >= 2 (<= 0.5);
    every stored id still finds its row."""
    tables = (TableConfig(name="s", dim=4), TableConfig(name="m", dim=4, seed=2), TableConfig(name="l", dim=4, seed=3))
    plans = plan_tables(("s", "m", "l"), tables, {}, {}, {})
    sizes = (10, 16384, 40000)                      # 64 buckets; 2**16 (the largest small map); 2**17
    views = [TableView(c, np.arange(n, dtype=np.int64) * 7, np.zeros((n, 4), np.float32), "fp32")
             for c, n in zip(tables, sizes)]
    pooling = NativePooling(plans, views, "fp32")
    assert [pooling.map_at[t][1] for t in range(3)] == [6, 16, 17]
    assert pooling.buckets.shape[0] == 64 + 2**16 + 2**17
    for t, n in enumerate(sizes):
        at, bits = pooling.map_at[t]
        keys = pooling.buckets[at:at + (1 << bits), 0]
        rows = pooling.buckets[at:at + (1 << bits), 1]
        assert int((rows >= 0).sum()) == n
        assert torch.equal(keys[rows >= 0].sort().values, torch.arange(n, dtype=torch.int64) * 7)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_portable_build_equals_the_reference(native, precision: str) -> None:
    """The kernel built without its AVX2 / F16C path (-DSV_PORTABLE, as on a CPU other than x86)
    pools every precision like the per-table paths, bit for bit (B = 300: several blocks)."""
    from tests.unit.recsys.serving.test_native_fused import (FEATURE_TABLES, FEATURES, LINEAR, POOLING, UNIFORM_TABLES,
                                                      make_batch, make_views, reference)
    portable = ps_native.build(("-DSV_PORTABLE",))
    plans = plan_tables(FEATURES, UNIFORM_TABLES, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views(precision, seed=3, tables=UNIFORM_TABLES)
    pooling = NativePooling(plans, views, precision, portable)
    for seed, weighted in enumerate((True, False)):
        batch = make_batch(views, 300, 20 + seed, weighted)
        want, want_lin = reference(precision, plans, views, batch)
        got, got_lin = pooling.pool(batch)
        assert torch.equal(got, want) and torch.equal(got_lin, want_lin), f"{precision} weighted={weighted}"
