"""One in-memory `pa.Table` -> `Batch`, with the loader's own checks and decoding (serving).

    batch = decode_table(cfg.data, table)      # B = table.num_rows, rows in table order
    decoder = TableDecoder(cfg.data)           # the same, for many tables: the schema checked once per schema
    batch = decoder.decode(table)
    batch = decoder.decode_rows(rows)          # JSON rows (dicts column -> value); None: decode a table of them

The same `Decoder` and `gather` the `ParquetLoader` uses, so a served row becomes exactly the
`Batch` training and eval made of it. A table without the label column is scored with labels 0
(serving data has none); passthrough columns the table lacks are left out of `Batch.extras`, and
without `data.example_weight_column` the batch's `example_weights` is None.

`decode_rows` is the same decoding for the common served rows (every dense value a finite number,
every id a non-negative integer, no column of string ids in `data.id_types`, list ids within
`data.max_ids_per_row`, no weight columns), made from the rows' values in a few numpy calls instead
of one Arrow column (and its checks) per feature (several times faster for a few rows:
benchmarks/history/figures-from-the-code.md). Any other row (a
null, a string id, a bad value) makes it return None: the caller then decodes a table of the rows,
which hashes strings, fills nulls and names what is wrong exactly as for a Parquet file.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import torch

from data.batch import Batch, KeyedJagged
from data.config import DataConfig
from data.parquet import DataError, Decoder, _check_schema
from data.rows import gather

__all__ = ["DataError", "TableDecoder", "decode_table"]


def decode_table(cfg: DataConfig, table: pa.Table, where: str = "<table>") -> Batch:
    """Rows of `table` as one Batch; bad values raise DataError naming `where`, the column and
    row (or drop the row under `on_bad_rows = "skip"`)."""
    return TableDecoder(cfg).decode(table, where)


class TableDecoder:
    """`decode_table` for many tables: the schema check and column plan are made once per schema
    (a server decodes every request's rows; for one row they were most of the time)."""

    _MAX_SCHEMAS = 64

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self._plans: dict[pa.Schema, Decoder] = {}
        self._shapes: dict[tuple[type, ...], tuple] = {}       # decode_rows: per kinds of the sparse values

    def _plan(self, schema: pa.Schema, where: str) -> Decoder:
        cfg = self.cfg
        keep = tuple(c for c in cfg.passthrough_columns if c in schema.names)
        if keep != cfg.passthrough_columns:
            cfg = dataclasses.replace(cfg, passthrough_columns=keep)
        if cfg.example_weight_column and cfg.example_weight_column not in schema.names:
            cfg = dataclasses.replace(cfg, example_weight_column="")
        is_list = _check_schema(where, schema, cfg, 1)
        if len(self._plans) >= self._MAX_SCHEMAS:
            self._plans.clear()
        self._plans[schema] = decoder = Decoder(cfg, is_list)
        return decoder

    def decode(self, table: pa.Table, where: str = "<table>") -> Batch:
        if self.cfg.label_column not in table.column_names:
            table = table.append_column(self.cfg.label_column, pa.array(np.zeros(table.num_rows, np.float32)))
        decoder = self._plans.get(table.schema) or self._plan(table.schema, where)
        rows, _, _ = decoder.decode(table.select(list(decoder.columns)), where, 0)
        return gather([(rows, slice(0, len(rows)))], decoder.layout)

    def decode_rows(self, rows: list[dict]) -> Batch | None:
        """The Batch `decode` makes of a table of `rows` (dicts column -> JSON value: numbers, integer or
        string ids, lists of ids, nulls), when every row is plain (see the module docstring); else None."""
        cfg = self.cfg
        if not rows or cfg.weight_columns or "string" in cfg.id_types.values():    # strings: hashed by the table path
            return None
        shape = self._row_shape(rows)
        if shape is None:
            return None
        one, lists, one_at, runs = shape
        try:
            dense = _json_numbers([r[c] for r in rows for c in cfg.dense_columns], cfg.dense_fill)
            ids = _json_ids([r[c] for r in rows for c in one])
            jagged = [_json_list_ids([r[c] for r in rows], cfg.max_ids_per_row) for c in lists]
        except (KeyError, OverflowError):                     # a missing column, an id beyond int64: the table
            return None                                       # path names it
        if dense is None or ids is None or None in jagged:
            return None
        B = len(rows)
        dense = dense.reshape(B, len(cfg.dense_columns))                                       # [B, Dn]
        if cfg.dense_log1p:
            np.maximum(dense, 0, out=dense)
            np.log1p(dense, out=dense)
        values = ids[0].reshape(B, len(one)).T                                                 # [F1, B]
        valid = ids[1].reshape(B, len(one)).T
        lengths = np.empty((len(cfg.sparse_columns), B), np.int32)                             # [F, B]
        lengths[one_at] = valid
        one_values = values[valid]                            # feature-major: the one-id features' ids
        ends = np.zeros(len(one) + 1, np.int64)
        np.cumsum(valid.sum(axis=1), out=ends[1:])
        parts = []
        for f, a, b in runs:                                  # a run of one-id features, or one list feature
            if b < 0:
                parts.append(jagged[a][0])
                lengths[f] = jagged[a][1]
            else:
                parts.append(one_values[ends[a]:ends[b]])
        return Batch(dense=torch.from_numpy(dense), labels=torch.zeros(B),
                     sparse=KeyedJagged(tuple(cfg.sparse_columns), torch.from_numpy(np.concatenate(parts)),
                                        torch.from_numpy(lengths.reshape(-1))))

    def _row_shape(self, rows: list[dict]) -> tuple | None:
        """(one-id columns, list columns, the one-id features' indices, runs) of rows whose sparse values are
        integers, lists or nulls (by each column's first non-null value), or None. A run is (feature, one-id
        index from, to) of consecutive one-id features, or (list feature, list index, -1)."""
        cols = self.cfg.sparse_columns
        first = rows[0]
        kinds = [type(first.get(c)) for c in cols]
        if _NONE in kinds:                                    # a null: the column's kind is its first value's
            for i, k in enumerate(kinds):
                if k is _NONE:
                    kinds[i] = type(next((v for r in rows if (v := r.get(cols[i])) is not None), None))
        kinds = tuple(kinds)
        shape = self._shapes.get(kinds)
        if shape is None:
            if not set(kinds) <= {int, list, _NONE}:          # string ids are hashed by the table path
                return None
            one = [c for c, k in zip(cols, kinds) if k is not list]
            lists = [c for c, k in zip(cols, kinds) if k is list]
            runs: list[tuple[int, int, int]] = []
            j = 0
            for f, k in enumerate(kinds):
                if k is list:
                    runs.append((f, lists.index(cols[f]), -1))
                elif runs and runs[-1][2] == j:
                    runs[-1] = (runs[-1][0], runs[-1][1], j + 1)
                    j += 1
                else:
                    runs.append((f, j, j + 1))
                    j += 1
            shape = (one, lists, np.array([f for f, k in enumerate(kinds) if k is not list], np.int64), runs)
            if len(self._shapes) < self._MAX_SCHEMAS:
                self._shapes[kinds] = shape
        return shape


_NONE = type(None)


def _json_numbers(flat: list, fill: float) -> np.ndarray | None:
    """float32 [n] of JSON numbers (a null -> fill), or None where a table would refuse a value (not a number,
    NaN or inf, beyond float32, an integer float64 cannot hold exactly)."""
    kinds = set(map(type, flat))
    if not kinds <= {float, int, _NONE}:
        return None
    x = np.array(flat, np.float64)                    # a null becomes NaN
    if _NONE in kinds:
        x[np.array([v is None for v in flat])] = fill
    if int in kinds and not (np.abs(x) <= 2.0 ** 53).all():
        return None
    x = x.astype(np.float32)
    return x if np.isfinite(x).all() else None


def _json_ids(flat: list) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids int64 [n], valid bool [n]) of JSON integers or nulls, or None (another value, a negative id)."""
    kinds = set(map(type, flat))
    if kinds <= {int}:
        x, valid = np.array(flat, np.int64), np.ones(len(flat), bool)
    elif kinds <= {int, _NONE}:
        valid = np.array([v is not None for v in flat])
        x = np.array([0 if v is None else v for v in flat], np.int64)
    else:
        return None
    return (x, valid) if not (x < 0).any() else None


def _json_list_ids(column: list, max_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids int64 [N], lengths [B]) of one list column's values (a null list: no ids), or None unless every
    value is a list (or null) of non-negative integers no longer than `max_len`."""
    if not set(map(type, column)) <= {list, _NONE}:
        return None
    lens = np.array([0 if v is None else len(v) for v in column])
    flat = [x for v in column if v is not None for x in v]
    if not set(map(type, flat)) <= {int} or (lens > max_len).any():
        return None
    values = np.array(flat, np.int64)
    return (values, lens) if not (values < 0).any() else None
