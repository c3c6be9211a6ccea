"""Pre-flight's example-weight check is the reader's: refused where the reader would refuse the row
(on_bad_rows = "error", incl. a weight past float32), left to the reader where it would drop it ("skip")."""

from __future__ import annotations

import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig
from data.parquet import DataError, check_example_weights
from recsys.preflight import PreflightError, preflight_data


def _file(tmp_path, weight: float) -> str:
    n = 8
    w = np.ones(n)
    w[5] = weight
    table = pa.table({"y": pa.array(np.arange(n) % 2, pa.float32()), "x": pa.array(np.zeros(n), pa.float32()),
                      "c": pa.array(np.arange(n), pa.int64()), "w": pa.array(w, pa.float64())})
    path = str(tmp_path / "part.parquet")
    pq.write_table(table, path)
    return path


def _cfg(on_bad_rows: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(data=DataConfig(label_column="y", dense_columns=("x",), sparse_columns=("c",),
                                                 example_weight_column="w", on_bad_rows=on_bad_rows))


@pytest.mark.parametrize("weight, what", [(-1.0, "negative example weight"), (1e300, "NaN or inf example weight")])
def test_bad_weight_refused_in_error_mode_left_to_the_reader_in_skip_mode(tmp_path, weight: float, what: str) -> None:
    path = _file(tmp_path, weight)
    with pytest.raises(PreflightError, match=f"{path}: row group 0, column 'w': {what} at row 5"):
        preflight_data(_cfg("error"), [path], "data.train_paths", scoring=False)
    preflight_data(_cfg("skip"), [path], "data.train_paths", scoring=False)      # the reader drops row 5


def test_good_weights_pass(tmp_path) -> None:
    path = _file(tmp_path, 0.0)
    check_example_weights("w", [path])
    preflight_data(_cfg("error"), [path], "data.train_paths", scoring=False)
    with pytest.raises(DataError):
        check_example_weights("w", [_file(tmp_path, float("nan"))])
