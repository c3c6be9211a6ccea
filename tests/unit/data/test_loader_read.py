"""What the loader yields equals what pyarrow reads, row by row; the string-id hash; path discovery."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.batch import validate_batch
from data.hashing import hash_strings, splitmix64_finalize
from data.loader import ParquetLoader
from data.parquet import DataError, resolve_paths


# -- the hash ------------------------------------------------------------------------------------

# Pinned outputs (from the plain-Python reference in conftest.ref_hash): a change of the function
# changes every string id of every trained table, so it must show up here.
PINNED = {"": 8442584544778250395, "a": 198367012849983736, "abc": 996580060897260808,
          "hello world": 417524495691944273, "ünï": 5241810825877245252}


def test_hash_matches_pinned_values_and_reference(h):
    strings = list(PINNED) + ["x" * 100, "68fd1e64", "a\x00b", "日本語のテキスト"]
    got = hash_strings(pa.array(strings, type=pa.string())).tolist()
    assert got[:len(PINNED)] == list(PINNED.values())
    assert got == [h.ref_hash(s) for s in strings]
    assert all(0 <= v < 2 ** 63 for v in got)


def test_hash_is_vectorized_over_arrow_layouts(h):
    """Sliced, large_string, binary, dictionary and chunked arrays give the same ids as the reference."""
    rng = np.random.default_rng(0)
    strings = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(0, 12))) for _ in range(300)]
    want = np.array([h.ref_hash(s) for s in strings])
    arr = pa.array(strings)
    assert np.array_equal(hash_strings(arr), want)
    assert np.array_equal(hash_strings(arr.slice(17, 100)), want[17:117])
    assert np.array_equal(hash_strings(arr.cast(pa.large_string())), want)
    assert np.array_equal(hash_strings(pa.array([s.encode() for s in strings], pa.binary())), want)
    assert np.array_equal(hash_strings(arr.dictionary_encode()), want)
    assert np.array_equal(hash_strings(pa.chunked_array([arr.slice(0, 5), arr.slice(5)])), want)
    assert hash_strings(pa.array([], pa.string())).shape == (0,)


def test_splitmix64_finalizer_known_value():
    # splitmix64's first output for seed 0 is the finalizer of 0x9e3779b97f4a7c15: 0xe220a8397b1dcdaf
    z = splitmix64_finalize(np.array([0x9E3779B97F4A7C15], dtype=np.uint64))
    assert int(z[0]) == 0xE220A8397B1DCDAF


# -- read back == pyarrow --------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 2])
def test_read_back_equals_pyarrow_row_by_row(h, dataset, prefetch):
    path, table = dataset
    cfg = h.make_cfg(prefetch_batches=prefetch)
    with ParquetLoader(cfg, [path]) as loader:
        got = h.read_all(loader)
    want = h.expected_rows(table, cfg)
    assert [rid for rid, _ in got] == table.column("row_id").to_pylist()      # file order, no shuffle
    for rid, row in got:
        h.assert_rows_equal(row, want[rid])


def test_shuffled_read_is_a_permutation_with_the_same_rows(h, dataset):
    path, table = dataset
    cfg = h.make_cfg(shuffle=True, shuffle_buffer_rows=20, dense_log1p=True, dense_fill=2.5)
    with ParquetLoader(cfg, [path]) as loader:
        got = h.read_all(loader)
    want = h.expected_rows(table, cfg)
    ids = [rid for rid, _ in got]
    assert sorted(ids) == sorted(want) and ids != sorted(ids)
    for rid, row in got:
        h.assert_rows_equal(row, want[rid])


def test_batches_shapes_and_ownership(h, dataset):
    path, table = dataset
    cfg = h.make_cfg(batch_size=32)
    with ParquetLoader(cfg, [path]) as loader:
        batches = list(loader)
        assert loader.num_rows == table.num_rows == 145
        assert loader.num_batches == len(batches) == 5
    assert [b.batch_size for b in batches] == [32, 32, 32, 32, 17]
    b = batches[0]
    assert b.dense.shape == (32, 3) and b.dense.dtype == torch.float32 and b.dense.is_contiguous()
    assert b.sparse.lengths.shape == (5 * 32,) and b.sparse.lengths.dtype == torch.int32
    assert b.sparse.values.dtype == torch.int64 and b.labels.dtype == torch.float32
    assert b.weights is not None and b.weights.shape == b.sparse.values.shape
    assert b.extras["row_id"].dtype == np.int64
    # the batch owns writable memory (no read-only views of Arrow buffers)
    for t in (b.dense, b.labels, b.sparse.values, b.sparse.lengths, b.weights):
        t.add_(0)
    assert b.extras["row_id"].flags.writeable and b.extras["row_id"].flags.owndata


def test_drop_last_and_no_weights(h, dataset):
    path, _ = dataset
    cfg = h.make_cfg(batch_size=32, drop_last=True, weight_columns={})
    with ParquetLoader(cfg, [path]) as loader:
        batches = list(loader)
        assert loader.num_batches == 4
    assert [b.batch_size for b in batches] == [32] * 4
    assert all(b.weights is None for b in batches)


def test_scalar_weight_column_and_type_variety(h, tmp_path):
    """int32 / uint64 / dictionary-string / large_string / list<string> ids, bool and int dense, all-null
    columns, a float weight column for a one-id feature."""
    n = 23
    rng = np.random.default_rng(5)
    words = [f"w{i % 7}" for i in range(n)]
    table = pa.table({
        "row_id": pa.array(np.arange(n), pa.int64()),
        "label": pa.array(rng.integers(0, 2, n), pa.int8()),
        "flag": pa.array(rng.random(n) < 0.5),
        "cnt": pa.array(rng.integers(-5, 9, n).astype(np.int32), mask=rng.random(n) < 0.3),
        "a": pa.array(rng.integers(0, 1 << 31, n).astype(np.int32)),
        "b": pa.array(rng.integers(0, 1 << 62, n).astype(np.uint64)),
        "c": pa.array(words).dictionary_encode(),
        "d": pa.array(words, pa.large_string()),
        "e": pa.array([None if i % 5 == 0 else words[i:i + i % 3] for i in range(n)], pa.list_(pa.string())),
        "wa": pa.array(rng.random(n), pa.float64()),
        "all_null_dense": pa.nulls(n, pa.float64()),
        "all_null_ids": pa.nulls(n, pa.int64()),
    })
    path = h.write(tmp_path / "t.parquet", table, row_group_rows=10)
    cfg = h.make_cfg(dense_columns=("flag", "cnt", "all_null_dense"), sparse_columns=("a", "b", "c", "d", "e",
                     "all_null_ids"), weight_columns={"a": "wa"}, dense_log1p=True, dense_fill=1.5)
    with ParquetLoader(cfg, [path]) as loader:
        got = h.read_all(loader)
    want = h.expected_rows(table, cfg)
    for rid, row in got:
        for k in ("a", "c", "d", "e", "all_null_ids"):
            assert row["ids"][k] == want[rid]["ids"][k]
        assert row["ids"]["all_null_ids"] == []
        assert row["dense"][2] == pytest.approx(np.log1p(1.5))
        assert row["ids"]["b"] == want[rid]["ids"]["b"]
        np.testing.assert_allclose(row["weights"]["a"], [table.column("wa")[rid].as_py()], rtol=1e-6)
        np.testing.assert_allclose(row["dense"], want[rid]["dense"], rtol=1e-6)
        assert row["label"] == want[rid]["label"]
    assert len(got) == n


def test_paths_files_dirs_globs(h, tmp_path):
    for i, sub in enumerate(["x", "x/deeper", "y"]):
        h.write(tmp_path / sub / f"p{i}.parquet", h.make_table(5, i, row0=10 * i))
    (tmp_path / "x" / "_SUCCESS").write_text("")
    (tmp_path / "x" / ".hidden.parquet").write_text("junk")
    files = resolve_paths([str(tmp_path / "x")])
    assert [f.rsplit("/", 1)[1] for f in files] == ["p1.parquet", "p0.parquet"]   # sorted by full path
    assert resolve_paths([str(tmp_path / "*" / "p*.parquet")]) == [str(tmp_path / "x/p0.parquet"),
                                                                   str(tmp_path / "y/p2.parquet")]
    both = resolve_paths([str(tmp_path / "y"), str(tmp_path / "y" / "p2.parquet")])
    assert both == [str(tmp_path / "y/p2.parquet")]                                  # each file once
    with pytest.raises(DataError, match="does not exist"):
        resolve_paths([str(tmp_path / "nope")])
    with pytest.raises(DataError, match="matched no files"):
        resolve_paths([str(tmp_path / "*.csv")])
    with ParquetLoader(h.make_cfg(), [str(tmp_path / "x"), str(tmp_path / "y/*.parquet")]) as loader:
        assert sorted(h.row_ids(loader)) == sorted([*range(0, 5), *range(10, 15), *range(20, 25)])


def test_validate_batches_flag_runs_validate_batch(h, dataset, monkeypatch):
    import data.reader as loader_mod   # the reader validates the batches it cuts
    calls = []
    monkeypatch.setattr(loader_mod, "validate_batch", lambda b: (calls.append(b.batch_size), validate_batch(b)))
    path, _ = dataset
    with ParquetLoader(h.make_cfg(batch_size=64), [path]) as loader:
        list(loader)
    assert calls == [64, 64, 17]
    calls.clear()
    with ParquetLoader(h.make_cfg(batch_size=64, validate_batches=False), [path]) as loader:
        list(loader)
    assert calls == []


def test_gen_data_output_reads_back_equal_to_pyarrow(h, tmp_path):
    synthetic = pytest.importorskip("data.synthetic")
    out = tmp_path / "gen"
    synthetic.generate(preset="tiny", rows=1200, num_files=2, out_dir=str(out), seed=3,
                       row_group_rows=256, compression="zstd")
    table = pq.read_table(str(out))
    names = table.column_names
    cfg = h.make_cfg(dense_columns=tuple(c for c in names if c.startswith("I")),
                     sparse_columns=tuple(c for c in names if c[0] in "CM" and c[1:].isdigit()),
                     weight_columns={}, passthrough_columns=("row_id",), dense_log1p=True, batch_size=100,
                     shuffle=True, shuffle_buffer_rows=300)
    assert cfg.dense_columns and any(c.startswith("M") for c in cfg.sparse_columns)
    with ParquetLoader(cfg, [str(out)]) as loader:
        got = h.read_all(loader)
    want = h.expected_rows(table, cfg)
    assert len(got) == len(want) == 1200
    for rid, row in got:
        h.assert_rows_equal(row, want[rid])
