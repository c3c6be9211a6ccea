"""`TableDecoder.decode_rows`: served JSON rows -> the Batch a table of them decodes to, or None (then the table path)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from data.decode import TableDecoder
from recsys.config import load_config
from recsys.serving.rows import Columns, to_table

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def decoder() -> TableDecoder:
    data = load_config(ROOT / "configs" / "quickstart.toml").data          # 13 dense (log1p), 26 one-id, 2 lists
    return TableDecoder(dataclasses.replace(data, on_bad_rows="error", max_ids_per_row=6))


def rows_of(cfg, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        r = {c: (int(rng.integers(0, 1000)) if rng.random() < 0.5 else float(rng.normal() * 50))
             for c in cfg.dense_columns}
        r.update({c: int(rng.integers(0, 2**63 - 1)) for c in cfg.sparse_columns})
        for c in ("M1", "M2"):
            r[c] = [int(x) for x in rng.integers(0, 10**12, size=int(rng.integers(0, 7)))]
        out.append(r)
    return out


def table_batch(decoder: TableDecoder, rows: list[dict]):
    return decoder.decode(to_table(rows, Columns.of(decoder.cfg)), "<rows>")


def assert_same(a, b) -> None:
    assert a.dense.dtype == b.dense.dtype and torch.equal(a.dense, b.dense)
    assert a.labels.dtype == b.labels.dtype and torch.equal(a.labels, b.labels)
    assert a.sparse.keys == b.sparse.keys
    assert a.sparse.values.dtype == b.sparse.values.dtype and torch.equal(a.sparse.values, b.sparse.values)
    assert a.sparse.lengths.dtype == b.sparse.lengths.dtype and torch.equal(a.sparse.lengths, b.sparse.lengths)
    assert a.weights is None and b.weights is None and a.example_weights is None and b.example_weights is None
    assert a.extras == {} and b.extras == {}


@pytest.mark.parametrize("n", [1, 2, 8, 257])
def test_plain_rows_decode_as_their_table(decoder: TableDecoder, n: int) -> None:
    rows = rows_of(decoder.cfg, n, seed=n)
    got = decoder.decode_rows(rows)
    assert got is not None
    assert_same(got, table_batch(decoder, rows))


def changed(base: list[dict], row: int, col: str, value) -> list[dict]:
    rows = [dict(r) for r in base]
    rows[row][col] = value
    return rows


def test_nulls_decode_as_in_their_table(decoder: TableDecoder) -> None:
    base = rows_of(decoder.cfg, 5, seed=1)
    for rows in (changed(base, 2, "I3", None), changed(base, 0, "I3", None), changed(base, 3, "C4", None),
                 changed(base, 0, "C4", None), [dict(r, C9=None) for r in base], changed(base, 1, "M1", None),
                 changed(base, 0, "M1", None), changed(base, 4, "M2", []),
                 [dict(r, C6=[r["C6"], 5], C1=None) for r in base]):          # a list feature among one-id ones
        got = decoder.decode_rows(rows)
        assert got is not None
        assert_same(got, table_batch(decoder, rows))
    filled = TableDecoder(dataclasses.replace(decoder.cfg, dense_fill=2.5, dense_log1p=False))
    rows = changed(base, 2, "I3", None)
    assert filled.decode_rows(rows).dense[2, 2] == 2.5
    assert_same(filled.decode_rows(rows), table_batch(filled, rows))


def test_other_rows_go_to_the_table_path(decoder: TableDecoder) -> None:
    base = rows_of(decoder.cfg, 4, seed=0)
    cases = {
        "string id": changed(base, 1, "C2", "abc"),
        "string id in the first row": changed(base, 0, "C2", "abc"),
        "negative id": changed(base, 2, "C5", -3),
        "id list where the first row has one id": changed(base, 2, "C6", [1, 2]),
        "one id where the first row has a list": changed(base, 2, "M1", 5),
        "null inside a list": changed(base, 1, "M1", [1, None]),
        "string inside a list": changed(base, 1, "M2", [1, "x"]),
        "negative id in a list": changed(base, 1, "M2", [1, -1]),
        "id beyond int64": changed(base, 1, "C3", 2**64),
        "list over data.max_ids_per_row": changed(base, 3, "M1", list(range(7))),
        "dense beyond 2**53": changed(base, 1, "I1", 2**60),
        "dense beyond float32": changed(base, 1, "I2", 1e300),
        "NaN dense": changed(base, 1, "I2", float("nan")),
        "string dense": changed(base, 1, "I2", "3.5"),
        "boolean dense": changed(base, 1, "I2", True),
        "boolean id": changed(base, 1, "C2", True),
        "missing column": [{k: v for k, v in r.items() if k != "C7"} for r in base],
    }
    for what, rows in cases.items():
        assert decoder.decode_rows(rows) is None, what
    assert decoder.decode_rows([]) is None
    weighted = TableDecoder(dataclasses.replace(decoder.cfg, weight_columns={"M1": "W1"}))
    assert weighted.decode_rows(base) is None


def test_rows_of_the_wrong_id_type_are_refused_and_nulls_take_the_trained_type(decoder) -> None:
    from data.parquet import DataError
    cfg = decoder.cfg
    rows = rows_of(cfg, 4, seed=3)
    strings = TableDecoder(dataclasses.replace(cfg, id_types={"C1": "string"}))
    assert strings.decode_rows(rows) is None                  # a string-id model: never the integer fast path
    with pytest.raises(DataError, match="column 'C1': integer ids \\(int64\\), but data.id_types says string"):
        table_batch(strings, rows)
    text = [dict(r, C1=str(r["C1"])) for r in rows]
    want = TableDecoder(dataclasses.replace(cfg, id_types={})).decode(to_table(text, Columns.of(cfg)), "<rows>")
    assert_same(table_batch(strings, text), want)             # strings hashed as in training
    nulls = [dict(r, C1=None) for r in rows]                  # a column of nulls only: a string column
    assert to_table(nulls, Columns.of(strings.cfg)).schema.field("C1").type == "string"
    assert table_batch(strings, nulls).sparse.lengths.view(len(cfg.sparse_columns), -1)[0].sum() == 0
    integers = TableDecoder(dataclasses.replace(cfg, id_types=dict.fromkeys(cfg.sparse_columns, "integer")))
    assert_same(integers.decode_rows(rows), table_batch(decoder, rows))       # the fast path as before
    assert integers.decode_rows(text) is None
    with pytest.raises(DataError, match="column 'C1': string ids \\(string\\), but data.id_types says integer"):
        table_batch(integers, text)
