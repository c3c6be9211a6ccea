"""Small pyarrow-written fixtures for the data pipeline tests, and plain-Python references.

The reference side uses `to_pylist()` (slow, obviously right) so the loader's vectorized code is
checked against something that shares none of it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.config import DataConfig

MASK63 = (1 << 63) - 1


def ref_hash(s: str | bytes) -> int:
    """The project's string-id hash, one byte at a time: FNV-1a 64, splitmix64 finalizer, top bit cleared."""
    data = s.encode("utf-8") if isinstance(s, str) else s
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % (1 << 64)
    z = h
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    z ^= z >> 31
    return z & MASK63


def make_table(n: int, seed: int = 0, row0: int = 0) -> pa.Table:
    """n rows with every column kind the loader reads (row_id = row0 .. row0 + n - 1)."""
    rng = np.random.default_rng(seed)
    nulls = lambda p: rng.random(n) < p                                      # noqa: E731
    d0 = rng.normal(size=n)
    d1 = rng.integers(0, 1000, n)
    s_int = rng.integers(0, 1 << 62, n)
    lens = rng.integers(0, 5, n)
    list_null = nulls(0.15)
    lists = [None if list_null[i] else rng.integers(0, 50, lens[i]).tolist() for i in range(n)]
    wlens = rng.integers(0, 4, n)
    wlist = [rng.integers(0, 1 << 40, wlens[i]).tolist() for i in range(n)]
    weights = [rng.random(wlens[i]).astype(np.float32).tolist() for i in range(n)]
    strs = [None if b else f"u{rng.integers(0, 30)}-é" for b in nulls(0.2)]
    return pa.table({
        "row_id": pa.array(np.arange(row0, row0 + n), pa.int64()),
        "label": pa.array((rng.random(n) < 0.3).astype(np.float32)),
        "d0": pa.array(d0, mask=nulls(0.2)),
        "d1": pa.array(d1, pa.int64(), mask=nulls(0.3)),
        "d2": pa.array(rng.random(n).astype(np.float32)),
        "s_int": pa.array(s_int, pa.int64(), mask=nulls(0.25)),
        "s_i32": pa.array(rng.integers(0, 100, n).astype(np.int32)),
        "s_str": pa.array(strs, pa.string()),
        "s_list": pa.array(lists, pa.list_(pa.int64())),
        "s_wlist": pa.array(wlist, pa.list_(pa.int64())),
        "w_wlist": pa.array(weights, pa.list_(pa.float32())),
    })


FULL = dict(dense_columns=("d0", "d1", "d2"), sparse_columns=("s_int", "s_list", "s_str", "s_i32", "s_wlist"),
            weight_columns={"s_wlist": "w_wlist"}, passthrough_columns=("row_id",))


def make_cfg(**kw) -> DataConfig:
    """A DataConfig over make_table's columns; shuffle and prefetch off unless asked for."""
    base = dict(FULL, batch_size=7, shuffle=False, prefetch_batches=0, validate_batches=True)
    base.update(kw)
    return DataConfig(**base)


def write(path: Path, table: pa.Table, row_group_rows: int = 1 << 20) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_rows)
    return str(path)


def expected_rows(table: pa.Table, cfg: DataConfig) -> dict[int, dict]:
    """row_id -> {label, dense, ids per feature, weights per feature}, computed row by row."""
    cols = table.to_pydict()
    out = {}
    for i, rid in enumerate(cols["row_id"]):
        dense = []
        for c in cfg.dense_columns:
            v = cols[c][i]
            v = cfg.dense_fill if v is None else float(v)
            dense.append(math.log1p(max(v, 0.0)) if cfg.dense_log1p else v)
        ids, wts = {}, {}
        for c in cfg.sparse_columns:
            v = cols[c][i]
            v = [] if v is None else v if isinstance(v, list) else [v]
            ids[c] = [ref_hash(x) if isinstance(x, str) else int(x) for x in v]
            w = cfg.weight_columns.get(c)
            wv = cols[w][i] if w else None
            wts[c] = ([float(x) for x in wv] if isinstance(wv, list) else [float(wv)] * len(v) if w
                      else [1.0] * len(v))
        out[rid] = {"label": float(cols[cfg.label_column][i]), "dense": dense, "ids": ids, "weights": wts}
    return out


def batch_rows(batch, keys) -> list[tuple[int, dict]]:
    """[(row_id, row)] of a Batch, in batch order, in expected_rows' form."""
    B = batch.batch_size
    offsets = batch.sparse.offsets().tolist()
    values = batch.sparse.values.tolist()
    weights = batch.weights.tolist() if batch.weights is not None else None
    out = []
    for b in range(B):
        ids, wts = {}, {}
        for f, k in enumerate(keys):
            a, e = offsets[f * B + b], offsets[f * B + b + 1]
            ids[k] = values[a:e]
            wts[k] = weights[a:e] if weights is not None else [1.0] * (e - a)
        out.append((int(batch.extras["row_id"][b]), {
            "label": float(batch.labels[b]), "dense": batch.dense[b].tolist(), "ids": ids, "weights": wts}))
    return out


def read_all(loader) -> list[tuple[int, dict]]:
    keys = loader.config.sparse_columns
    return [r for batch in loader for r in batch_rows(batch, keys)]


def row_ids(loader) -> list[int]:
    return [int(x) for batch in loader for x in batch.extras["row_id"]]


def assert_rows_equal(got: dict, want: dict) -> None:
    assert got["label"] == want["label"]
    np.testing.assert_allclose(got["dense"], want["dense"], rtol=1e-6, atol=1e-6)
    assert got["ids"] == want["ids"]
    for k in want["weights"]:
        np.testing.assert_allclose(got["weights"][k], want["weights"][k], rtol=1e-6)


@pytest.fixture
def dataset(tmp_path):
    """3 files (50, 31, 64 rows) in tmp_path/ds, row groups of 16 rows: (dir, concatenated table)."""
    tables, row0 = [], 0
    for i, n in enumerate((50, 31, 64)):
        t = make_table(n, seed=i, row0=row0)
        write(tmp_path / "ds" / f"part-{i}.parquet", t, row_group_rows=16)
        tables.append(t)
        row0 += n
    return str(tmp_path / "ds"), pa.concat_tables(tables)


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(1)


@pytest.fixture
def h():
    """The helpers above, as one namespace (test modules cannot import conftest under importlib mode)."""
    import types
    return types.SimpleNamespace(
        ref_hash=ref_hash, make_table=make_table, make_cfg=make_cfg, write=write, FULL=FULL,
        expected_rows=expected_rows, batch_rows=batch_rows, read_all=read_all, row_ids=row_ids,
        assert_rows_equal=assert_rows_equal)


@pytest.fixture
def uneven_files(h, tmp_path):
    """4 files of 37, 50, 21, 44 rows (row ids 0..151) in row groups of 16: uneven, so windows and
    files cut batches and resume positions fall inside windows."""
    row0 = 0
    for i, n in enumerate((37, 50, 21, 44)):
        h.write(tmp_path / "ds" / f"part-{i}.parquet", h.make_table(n, seed=i, row0=row0), row_group_rows=16)
        row0 += n
    return str(tmp_path / "ds")
