"""`TableDecoder`: many tables decoded with one schema check per schema, each equal to `decode_table`'s."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.decode import TableDecoder, decode_table
from data.parquet import DataError
from recsys.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def same(a, b) -> None:
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert a.sparse.keys == b.sparse.keys
    assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.sparse.lengths, b.sparse.lengths)


def test_table_decoder_equals_decode_table(tiny_dataset) -> None:
    data = tiny_dataset(rows=2000, files=1, seed=3)
    cfg = load_config(ROOT / "configs" / "tiny.toml").data
    table = pq.read_table(data / "part-00000.parquet")
    decoder = TableDecoder(cfg)
    for lo, n in ((0, 1), (1, 7), (100, 300)):
        part = table.slice(lo, n)
        same(decoder.decode(part), decode_table(cfg, part))
    assert len(decoder._plans) == 1                             # one schema, planned once
    # another schema (no label, no passthrough columns, C1 as strings): its own plan, same decoding rules
    other = table.slice(0, 5).drop_columns(["label", "row_id", "p_true"])
    other = other.set_column(other.schema.get_field_index("C1"), "C1", pa.array([str(v) for v in other["C1"].to_pylist()]))
    same(decoder.decode(other), decode_table(cfg, other))
    assert len(decoder._plans) == 2
    bad = other.set_column(other.schema.get_field_index("I1"), "I1", pa.array(["x"] * 5))
    with pytest.raises(DataError, match="column 'I1': wrong type"):
        decoder.decode(bad)
