"""fp16 rows held as float16 by NativePooling (row kind 1 of `embedding_ps/csrc/pool.c`), widened in the kernel.

The reference: the fp32 path over the widened rows (torch's half -> float, or SparseArch over the
ExportStore for the per-table path), bit for bit, with
the F16C build and the portable one (-DSV_PORTABLE: the scalar half -> float of every lane).
The shared model, views and batches are test_native_fused.py's (unseen ids of every default class,
empty bags, per-id weights, mean bags, hashed tables, a linear dim-1 table beside dim-8 ones).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from data.batch import Batch, KeyedJagged
from embedding_ps import native as ps_native
from embedding_ps.wire.config import TableConfig
from recsys.models.sparse_arch import plan_tables
from recsys.serving.export_store import TableView
from recsys.serving.native_fused import NativePooling, make_pooling
from tests.unit.recsys.serving.test_native_fused import (FEATURE_TABLES, FEATURES, LINEAR, POOLING, TABLES, UNIFORM_TABLES,
                                                  make_batch, make_views, reference)


@pytest.fixture(scope="module")
def builds():
    """{"f16c": the process's kernel, "portable": the kernel built with -DSV_PORTABLE}."""
    if not ps_native.available():
        pytest.skip("no C compiler: the native serving kernel cannot build")
    return {"f16c": None, "portable": ps_native.build(("-DSV_PORTABLE",))}


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bits, NaN where NaN (a NaN's payload aside)."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), what
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), what


@pytest.mark.parametrize("build", ["f16c", "portable"])
@pytest.mark.parametrize("dim", [3, 8, 20])
def test_every_half_value_widens_exactly(builds, build: str, dim: int) -> None:
    """Rows holding all 65,536 half bit patterns (normals, subnormals, +-0, +-inf, NaNs), one id per
    bag: the kernel's widening equals torch's half -> float (+ 0.0f, as embedding_bag's sum); widths
    with scalar lanes only (3), whole AVX2 steps (8, a compile-time width) and a tail (20)."""
    bits = np.arange(2**16, dtype=np.uint16)
    pad = -bits.size % dim
    halves = np.concatenate([bits, bits[:pad]]).view(np.float16).reshape(-1, dim)         # [R, dim]
    R = halves.shape[0]
    cfg = TableConfig(name="a", dim=dim, unadmitted="zeros")
    view = TableView(cfg, np.arange(R, dtype=np.int64), halves, "fp16")
    plans = plan_tables(("a",), (cfg,), {}, {}, {})
    native = NativePooling(plans, [view], "fp16", builds[build])
    batch = Batch(dense=torch.zeros(R, 0), labels=torch.zeros(R),
                  sparse=KeyedJagged(("a",), torch.arange(R, dtype=torch.int64), torch.ones(R, dtype=torch.int32)))
    got = native.pool(batch)[0].view(R, dim)
    want = torch.from_numpy(halves).float() + 0.0                                       # -0 + 0 = +0, as a bag sum
    assert_same(got, want, f"{build} dim={dim}")


@pytest.mark.parametrize("build", ["f16c", "portable"])
@pytest.mark.parametrize("dim", [8, 20])
@pytest.mark.parametrize("tables", ["normal", "uniform"])
def test_half_rows_bit_equal_to_the_widened_path(builds, build: str, dim: int, tables: str) -> None:
    """Sum and mean bags, per-id weights or none, unseen ids (uniform defaults from C, normal ones
    from Python, zeros), empty bags, B = 1 and 300, 1 and 3 kernel threads: bit-equal to the
    per-table path."""
    configs = TABLES if tables == "normal" else UNIFORM_TABLES
    configs = tuple(c if c.name == "lin" else dataclasses.replace(c, dim=dim) for c in configs)
    plans = plan_tables(FEATURES, configs, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views("fp16", seed=dim, tables=configs)
    native = NativePooling(plans, views, "fp16", builds[build])
    threads = torch.get_num_threads()
    try:
        for seed, (B, weighted) in enumerate([(1, False), (1, True), (300, False), (300, True)]):
            batch = make_batch(views, B, 40 + seed, weighted)
            assert bool((batch.sparse.lengths == 0).any()) or B == 1            # empty bags at B = 300
            want, want_lin = reference("fp16", plans, views, batch)
            for t in (1, 3):
                torch.set_num_threads(t)
                got, got_lin = native.pool(batch)
                what = f"{build} dim={dim} B={B} weighted={weighted} threads={t}"
                assert torch.equal(got, want), what
                assert torch.equal(got_lin, want_lin), what
    finally:
        torch.set_num_threads(threads)


def test_half_rows_held_as_float16() -> None:
    """NativePooling keeps each table's fp16 rows as float16 (2 bytes an element, no float32 copy)."""
    if not ps_native.available():
        pytest.skip("no C compiler: the native serving kernel cannot build")
    plans = plan_tables(FEATURES, TABLES, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views("fp16")
    native = make_pooling(plans, views, "fp16")
    assert type(native) is NativePooling and not hasattr(native, "weights")
    used = sorted({p.table for p in plans})
    assert sorted(native.table_rows) == used
    for t in used:
        rows = native.table_rows[t]
        assert rows.dtype == torch.float16 and rows.is_contiguous()
        assert rows.data_ptr() % 64 == 0                                # rows of D = 16: one cache line each
        assert rows.nbytes == 2 * views[t].num_rows * views[t].cfg.dim
        assert np.array_equal(rows.numpy().view(np.uint16), np.asarray(views[t].matrix).view(np.uint16))


def test_fallback_pools_half_rows() -> None:
    """With the kernel off (no compiler, EMBEDDING_PS_NATIVE=0), make_pooling gives None: the
    Predictor pools through the per-table path; NativePooling pools fp16 exports (tables of widths 8
    and 1: pooled and linear) like it."""
    plans = plan_tables(FEATURES, TABLES, FEATURE_TABLES, LINEAR, POOLING)
    views = make_views("fp16", seed=11)
    prev = ps_native.set_enabled(False)
    try:
        fallback = make_pooling(plans, views, "fp16")
    finally:
        ps_native.set_enabled(prev)
    assert fallback is None
    native = make_pooling(plans, views, "fp16") if ps_native.available() else None
    for seed, (B, weighted) in enumerate([(1, True), (5, False), (64, True)]):
        batch = make_batch(views, B, 60 + seed, weighted)
        want, want_lin = reference("fp16", plans, views, batch)
        if native is not None:
            assert type(native) is NativePooling
            got, got_lin = native.pool(batch)
            assert torch.equal(got, want) and torch.equal(got_lin, want_lin), f"B={B} native"


def test_held_bytes_fp16_half_of_fp32() -> None:
    """`held_bytes` (what benchmarks/serving.py reports): fp16 rows take half of fp32's rows; the
    maps do not depend on the precision."""
    if not ps_native.available():
        pytest.skip("no C compiler: the native serving kernel cannot build")
    plans = plan_tables(FEATURES, TABLES, FEATURE_TABLES, LINEAR, POOLING)
    half = make_pooling(plans, make_views("fp16"), "fp16").held_bytes()
    full = make_pooling(plans, make_views("fp32"), "fp32")
    rows = sum(v.num_rows * v.cfg.dim for v in make_views("fp32"))                  # every table read
    assert half["rows"] == 2 * rows
    assert full.held_bytes()["rows"] == 4 * rows
    assert half["maps"] == full.held_bytes()["maps"] == full.buckets.nbytes
