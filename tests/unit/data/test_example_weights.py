"""data.example_weight_column: per-row loss weights carried into Batch.example_weights, checked like labels."""

import re

import numpy as np
import pyarrow as pa
import pytest
import torch

from data.batch import validate_batch
from data.config import DataConfig
from data.decode import decode_table
from data.loader import ParquetLoader
from data.parquet import DataError, check_example_weights

N, RG = 30, 10


def weighted_table(h, n: int = N, seed: int = 3, values=None) -> pa.Table:
    t = h.make_table(n, seed=seed)
    w = np.random.default_rng(seed).random(n) * 3 if values is None else values
    return t.append_column("ew", pa.array(w, pa.float64()))


@pytest.mark.parametrize("shuffle", [False, True])
def test_weights_follow_their_rows_into_batches(h, tmp_path, shuffle):
    t = weighted_table(h)
    path = h.write(tmp_path / "w.parquet", t, row_group_rows=RG)
    want = dict(zip(t.column("row_id").to_pylist(), np.float32(t.column("ew").to_numpy())))
    got = {}
    cfg = h.make_cfg(example_weight_column="ew", shuffle=shuffle, shuffle_buffer_rows=8, batch_size=4)
    with ParquetLoader(cfg, [path]) as loader:
        for batch in loader:
            assert batch.example_weights.dtype == torch.float32 and batch.example_weights.shape == (batch.batch_size,)
            got.update(zip(batch.extras["row_id"].tolist(), batch.example_weights.tolist()))
    assert got == want                                        # float32 of the column, bit for bit


def test_no_column_no_weights(h, tmp_path):
    path = h.write(tmp_path / "w.parquet", weighted_table(h), row_group_rows=RG)
    with ParquetLoader(h.make_cfg(), [path]) as loader:
        assert all(b.example_weights is None for b in loader)


def test_integer_and_bool_weights_are_numbers(h, tmp_path):
    t = h.make_table(N).append_column("ew", pa.array(np.arange(N) % 3, pa.int32()))
    path = h.write(tmp_path / "w.parquet", t, row_group_rows=RG)
    with ParquetLoader(h.make_cfg(example_weight_column="ew", batch_size=N), [path]) as loader:
        assert next(iter(loader)).example_weights.tolist() == [float(i % 3) for i in range(N)]


@pytest.mark.parametrize("value, what", [
    (-0.5, "negative example weight at row 3 \\(value -0.5\\)"),
    (float("nan"), "NaN or inf example weight at row 3 \\(value nan\\)"),
    (float("inf"), "NaN or inf example weight at row 3 \\(value inf\\)"),
    (1e300, "NaN or inf example weight at row 3 \\(value inf\\)"),       # past float32
    (None, "null example weight at row 3"),
])
def test_bad_weight_names_file_row_group_column_and_row(h, tmp_path, value, what):
    w = (np.random.default_rng(0).random(N)).tolist()
    w[13] = value
    path = h.write(tmp_path / "bad.parquet", weighted_table(h, values=pa.array(w, pa.float64())), row_group_rows=RG)
    with pytest.raises(DataError) as e:
        with ParquetLoader(h.make_cfg(example_weight_column="ew"), [path]) as loader:
            list(loader)
    msg = str(e.value)
    assert msg.startswith(f"{path}: row group 1, column 'ew': "), msg
    assert re.search(what, msg), msg
    with pytest.raises(DataError) as e:            # the pre-flight check (recsys.preflight): the reader's rule
        check_example_weights("ew", [path])
    assert str(e.value) == msg
    with ParquetLoader(h.make_cfg(example_weight_column="ew", on_bad_rows="skip"), [path]) as loader:
        ids = h.row_ids(loader)
    assert sorted(ids) == [i for i in range(N) if i != 13]


def test_weight_of_zero_is_allowed(h, tmp_path):
    path = h.write(tmp_path / "z.parquet", weighted_table(h, values=np.zeros(N)), row_group_rows=RG)
    with ParquetLoader(h.make_cfg(example_weight_column="ew"), [path]) as loader:
        assert sum(float(b.example_weights.sum()) for b in loader) == 0.0


@pytest.mark.parametrize("arr, problem", [
    (None, "missing (per-row weight column)"),
    (pa.array(["1.0"] * N), "wrong type string for a per-row weight column, expected a number"),
    (pa.array([[1.0]] * N, pa.list_(pa.float32())), "expected a number"),
])
def test_schema_problems_name_the_column(h, tmp_path, arr, problem):
    t = h.make_table(N) if arr is None else h.make_table(N).append_column("ew", arr)
    path = h.write(tmp_path / "s.parquet", t, row_group_rows=RG)
    with pytest.raises(DataError, match=re.escape(f"{path} (schema of all 3 row groups), column 'ew': ")) as e:
        ParquetLoader(h.make_cfg(example_weight_column="ew"), [path]).close()
    assert problem in str(e.value)


def test_decode_table_carries_weights_and_serving_tables_need_none(h):
    t = weighted_table(h)
    cfg = h.make_cfg(example_weight_column="ew")
    batch = decode_table(cfg, t)
    np.testing.assert_array_equal(batch.example_weights.numpy(), np.float32(t.column("ew").to_numpy()))
    assert decode_table(cfg, t.drop_columns(["ew", "label"])).example_weights is None
    bad = t.set_column(t.schema.get_field_index("ew"), "ew", pa.array([-1.0] * N))
    with pytest.raises(DataError, match="<table>, column 'ew': negative example weight at row 0"):
        decode_table(cfg, bad)


def test_validate_batch_checks_example_weights(h):
    batch = decode_table(h.make_cfg(example_weight_column="ew"), weighted_table(h))
    validate_batch(batch)
    for bad, msg in ((batch.example_weights[:-1], "example_weights has 29 rows, labels has B = 30"),
                     (batch.example_weights.double(), "example_weights must be torch.float32"),
                     (torch.where(torch.arange(N) == 4, -1.0, batch.example_weights),
                      "example_weights\\[4\\] = -1.0 is not a finite number >= 0")):
        broken = type(batch)(batch.dense, batch.sparse, batch.labels, batch.weights, batch.extras, bad)
        with pytest.raises(ValueError, match=msg):
            validate_batch(broken)
    moved = batch.to("cpu")
    assert torch.equal(moved.example_weights, batch.example_weights)


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5, float("nan")])
def test_negative_sampling_rate_outside_0_1(rate):
    with pytest.raises(ValueError, match=re.escape("data.negative_sampling_rate must be in (0, 1], got")):
        DataConfig(negative_sampling_rate=rate)


def test_example_weight_column_is_not_the_label():
    with pytest.raises(ValueError, match="data.example_weight_column = 'label' is the label column"):
        DataConfig(example_weight_column="label")


def test_scoring_data_may_lack_the_column_in_every_file_not_in_some(h, tmp_path):
    from data.parquet import scoring_config

    cfg = h.make_cfg(example_weight_column="ew")
    h.write(tmp_path / "none" / "a.parquet", h.make_table(N))
    h.write(tmp_path / "none" / "b.parquet", h.make_table(N))
    assert scoring_config(cfg, [str(tmp_path / "none")]).example_weight_column == ""     # unweighted
    h.write(tmp_path / "all" / "a.parquet", weighted_table(h))
    assert scoring_config(cfg, [str(tmp_path / "all")]) is cfg
    h.write(tmp_path / "all" / "b.parquet", h.make_table(N))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/all/b.parquet (schema), column 'ew': missing "
                                                  "(per-row weight column), which 1 other files")):
        scoring_config(cfg, [str(tmp_path / "all")])
    assert scoring_config(h.make_cfg(), [str(tmp_path / "all")]) == h.make_cfg()
