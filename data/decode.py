"""One in-memory `pa.Table` -> `Batch`, with the loader's own checks and decoding (serving).

    batch = decode_table(cfg.data, table)      # B = table.num_rows, rows in table order
    decoder = TableDecoder(cfg.data)           # the same, for many tables: the schema checked once per schema
    batch = decoder.decode(table)

The same `Decoder` and `gather` the `ParquetLoader` uses, so a served row becomes exactly the
`Batch` training and eval made of it. A table without the label column is scored with labels 0
(serving data has none); passthrough columns the table lacks are left out of `Batch.extras`, and
without `data.example_weight_column` the batch's `example_weights` is None.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from data.batch import Batch
from data.config import DataConfig
from data.parquet import ColumnPlan, DataError, Decoder, _check_schema, read_columns
from data.rows import BatchLayout, gather

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
        self._plans: dict[pa.Schema, tuple[ColumnPlan, Decoder, BatchLayout]] = {}

    def _plan(self, schema: pa.Schema, where: str) -> tuple[ColumnPlan, Decoder, BatchLayout]:
        cfg = self.cfg
        keep = tuple(c for c in cfg.passthrough_columns if c in schema.names)
        if keep != cfg.passthrough_columns:
            cfg = dataclasses.replace(cfg, passthrough_columns=keep)
        if cfg.example_weight_column and cfg.example_weight_column not in schema.names:
            cfg = dataclasses.replace(cfg, example_weight_column="")
        is_list = _check_schema(where, schema, cfg, 1)
        plan = ColumnPlan(read_columns(cfg), is_list)
        layout = BatchLayout(tuple(cfg.sparse_columns), plan.layout, bool(cfg.weight_columns))
        if len(self._plans) >= self._MAX_SCHEMAS:
            self._plans.clear()
        self._plans[schema] = entry = (plan, Decoder(cfg, plan), layout)
        return entry

    def decode(self, table: pa.Table, where: str = "<table>") -> Batch:
        if self.cfg.label_column not in table.column_names:
            table = table.append_column(self.cfg.label_column, pa.array(np.zeros(table.num_rows, np.float32)))
        entry = self._plans.get(table.schema)
        plan, decoder, layout = entry if entry is not None else self._plan(table.schema, where)
        rows, _, _ = decoder.decode(table.select(list(plan.columns)), where, 0)
        return gather([(rows, slice(0, len(rows)))], layout)
