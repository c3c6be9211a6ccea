"""Parquet files -> `Rows`: path discovery, the footer scan, schema checks and vectorized decoding.

A file is scanned once (footer only) when the loader is built: row counts per row group for the
sharding plan, and the schema, checked against `DataConfig` (missing column, wrong type). Decoding
one row group (or a row range of one) turns Arrow columns into numpy without a Python loop over
rows, and checks the values (null label, NaN/inf, negative id, over-long list, weight/id length
mismatch, null id inside a list, a null, negative or non-finite example weight). A bad value raises
`DataError` naming the file, row group, column and row, or, with `on_bad_rows = "skip"`, the row is
dropped and counted.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.arrays import (_column, _ids, _list_parts, _negative_id, _numbers, _owned, _raw, _row_of_value,
                         _rows_with, _valid)
from data.config import DataConfig
from data.paths import HIDDEN, glob_match
from data.remote import is_uri, list_files, parquet_file
from data.rows import BatchLayout, ListColumn, Rows, ScalarColumn

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """Bad input data; the message names the file, row group, column and row where they apply."""


# ---------------------------------------------------------------------------------------------
# discovery and footer scan
# ---------------------------------------------------------------------------------------------
def _dir_files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(HIDDEN))
        out += [os.path.join(dirpath, f) for f in filenames if not f.startswith(HIDDEN)]
    return sorted(out)


def resolve_paths(paths: str | Sequence[str]) -> list[str]:
    """Files named by `paths` (files, directories - recursively, skipping names that start with
    `.` or `_` - and glob patterns, which skip such names too (see `data.paths`); local paths or
    URIs, see `data.remote`), in a deterministic order (sorted by path within each entry, so the
    hive partitions `day=YYYY-MM-DD/` of a directory come in date order), each file once."""
    if isinstance(paths, str):
        paths = [paths]
    files: list[str] = []
    for p in paths:
        if is_uri(p):
            try:
                found = list_files(p)
            except OSError as e:
                raise DataError(str(e)) from e
        elif os.path.isdir(p):
            found = _dir_files(p)
        elif os.path.isfile(p):
            found = [p]
        elif glob.has_magic(p):
            pattern = os.path.normpath(p)              # glob_match leaves out `_SUCCESS`, `_temporary/`
            found = [f for m in sorted(glob.glob(p, recursive=True)) if glob_match(pattern, os.path.normpath(m))
                     for f in (_dir_files(m) if os.path.isdir(m) else [m])]
        else:
            raise DataError(f"data path '{p}' does not exist")
        if not found:
            raise DataError(f"data path '{p}' matched no files")
        files += found
    unique = list(dict.fromkeys(f if is_uri(f) else os.path.normpath(f) for f in files))
    if len(unique) < len(files):
        logger.warning("data paths name %d files more than once; each is read once", len(files) - len(unique))
    return unique


@dataclass(frozen=True, slots=True)
class ParquetSource:
    """One scanned file: its footer and rows per row group."""

    path: str
    metadata: pq.FileMetaData
    row_group_rows: tuple[int, ...]


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_id(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string_view(t))


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def id_type(t: pa.DataType) -> str:
    """"integer" or "string" (strings and binaries: hashed to int64): the ids of a sparse column of type `t`."""
    if _is_list(t):
        t = t.value_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    return "integer" if pa.types.is_integer(t) else "string"


def with_id_types(cfg: DataConfig, known: dict[str, str] | None = None, read_footer: bool = True) -> DataConfig:
    """`cfg` with data.id_types for every sparse column: as `cfg` gives them, else as `known` (the run a
    job warm-starts from), else (`read_footer`) as the first training file's footer holds them (why
    training fills them in: `DataConfig.id_types`)."""
    types = {c: t for c, t in {**(known or {}), **cfg.id_types}.items() if c in cfg.sparse_columns}
    if len(types) < len(cfg.sparse_columns) and cfg.train_paths and read_footer:
        with parquet_file(resolve_paths(cfg.train_paths)[0]) as pf:
            schema = pf.schema_arrow
        types.update((c, id_type(schema.field(c).type)) for c in cfg.sparse_columns
                     if c not in types and schema.get_field_index(c) >= 0)
    types = {c: types[c] for c in cfg.sparse_columns if c in types}
    return cfg if types == cfg.id_types else dataclasses.replace(cfg, id_types=types)


def _check_schema(path: str, schema: pa.Schema, cfg: DataConfig, n_rg: int) -> tuple[bool, ...]:
    """Raises DataError for a missing or wrongly typed column; returns the per-feature is_list."""
    where = f"{path} (schema of all {n_rg} row groups)"
    want = {cfg.label_column: "label", **{c: "dense" for c in cfg.dense_columns},
            **{c: "sparse" for c in cfg.sparse_columns},
            **{w: "weight" for w in cfg.weight_columns.values()},
            **{c: "passthrough" for c in cfg.passthrough_columns}}
    if cfg.example_weight_column:            # after passthrough: its number check wins
        want[cfg.example_weight_column] = "per-row weight"
    for col, role in want.items():
        if schema.get_field_index(col) < 0:
            raise DataError(f"{where}, column '{col}': missing ({role} column); the file has "
                            f"{schema.names}")
        t = schema.field(col).type
        ok, expect = {"label": (_is_number(t), "a number"), "dense": (_is_number(t), "a number"),
                      "sparse": (_is_id(t) or (_is_list(t) and _is_id(t.value_type)),
                                 "an integer, a string or a list of those"),
                      "weight": (_is_number(t) or (_is_list(t) and _is_number(t.value_type)),
                                 "a number or a list of numbers"),
                      "per-row weight": (_is_number(t), "a number"), "passthrough": (True, "")}[role]
        if not ok:
            raise DataError(f"{where}, column '{col}': wrong type {t} for a {role} column, expected {expect}")
        if role == "sparse" and cfg.id_types.get(col, id_type(t)) != id_type(t):
            want = cfg.id_types[col]
            raise DataError(f"{where}, column '{col}': {id_type(t)} ids ({t}), but data.id_types says {want} "
                            f"(the model was trained on {want} ids: the id 123 and the string \"123\" are different "
                            f"rows; convert the column to {want}s)")
    for col, wcol in cfg.weight_columns.items():
        if _is_list(schema.field(col).type) and not _is_list(schema.field(wcol).type):
            raise DataError(f"{where}, column '{wcol}': wrong type {schema.field(wcol).type} for the weights "
                            f"of the list column '{col}', expected a list of numbers")
    return tuple(_is_list(schema.field(c).type) for c in cfg.sparse_columns)


def scan_files(cfg: DataConfig, files: list[str]) -> tuple[list[ParquetSource], tuple[bool, ...], list[str]]:
    """Reads every footer: (sources, per `cfg.sparse_columns` whether it is a list column, skipped files).

    An unreadable or empty file raises DataError, or is skipped (and listed) under on_bad_rows="skip".
    Schema errors always raise: no row of such a file could be read.
    """
    sources, skipped = [], []
    first, want = "", ()                             # the first file and its (is_list, id type) per column
    for path in files:
        bad, cause = "", None                        # bad: why the file is skipped (or raises)
        try:
            with parquet_file(path) as pf:
                md, schema = pf.metadata, pf.schema_arrow
        except Exception as e:                       # pyarrow raises ArrowInvalid, OSError, ...
            bad, cause = f"{path}: unreadable Parquet file ({type(e).__name__}: {e})", e
        else:
            if md.num_rows == 0:
                bad = f"{path}: empty file (0 rows in {md.num_row_groups} row groups)"
        if bad:
            if cfg.on_bad_rows == "error":
                raise DataError(bad) from cause
            logger.warning("skipping %s", bad)
            skipped.append(path)
            continue
        kinds = tuple(zip(_check_schema(path, schema, cfg, md.num_row_groups),
                          (id_type(schema.field(c).type) for c in cfg.sparse_columns)))
        if not first:
            first, want = path, kinds
        elif kinds != want:
            f = next(i for i, k in enumerate(kinds) if k != want[i])
            col, (lists, ids) = cfg.sparse_columns[f], want[f]
            was = f"{'a list' if lists else 'a one-id'} column" if kinds[f][0] != lists else f"a column of {ids} ids"
            raise DataError(f"{path} (schema), column '{col}': wrong type {schema.field(col).type}: it is {was} "
                            f"in {first}")
        sources.append(ParquetSource(path, md, tuple(md.row_group(i).num_rows for i in range(md.num_row_groups))))
    if not sources:
        raise DataError(f"no readable rows in {len(files)} files (skipped: {skipped})")
    return sources, tuple(is_list for is_list, _ in want), skipped


def scoring_config(cfg: DataConfig, paths: tuple[str, ...] | list[str]) -> DataConfig:
    """`cfg` for scoring `paths` (eval, validation, predict): as it is when every file has
    data.example_weight_column; without example weights when no file has it (every row weighs 1:
    unweighted metrics); DataError naming a file without it when only some have it."""
    col = cfg.example_weight_column
    if not col:
        return cfg
    lacking, having = [], 0
    for path in resolve_paths(tuple(paths)):
        try:
            with parquet_file(path) as pf:
                names = pf.schema_arrow.names
        except Exception:                      # unreadable: scan_files names it (or skips it)
            continue
        if col in names:
            having += 1
        else:
            lacking.append(path)
    if not lacking:
        return cfg
    if not having:
        return dataclasses.replace(cfg, example_weight_column="")
    raise DataError(f"{lacking[0]} (schema), column '{col}': missing (per-row weight column), which {having} "
                    f"other files of the same data have (give every file the column, or none for unweighted metrics)")


def read_row_group(source: ParquetSource, pf: pq.ParquetFile, rg: int, columns: Sequence[str]) -> pa.Table:
    """`columns` of one row group; an I/O or decoding failure becomes a DataError."""
    try:
        return pf.read_row_group(rg, columns=list(columns))
    except Exception as e:
        raise DataError(f"{source.path}: row group {rg}: unreadable ({type(e).__name__}: {e})") from e


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
class _Checker:
    """Collects bad rows of one decoded range, or raises on the first in error mode."""

    def __init__(self, where: str, n: int, row0: int, skip: bool) -> None:
        self.where, self.n, self.row0, self.skip = where, n, row0, skip
        self.bad = np.zeros(n, dtype=bool)
        self.counts: Counter[str] = Counter()

    def flag(self, column: str, mask: np.ndarray, what: str, values: np.ndarray | None = None) -> None:
        """mask: bool [n] rows with the problem; values: [n] what to show for the first one."""
        count = int(np.count_nonzero(mask))
        if not count:
            return
        if not self.skip:
            i = int(np.argmax(mask))
            shown = "" if values is None else f" (value {values[i].item()})"
            raise DataError(f"{self.where}, column '{column}': {what} at row {self.row0 + i}{shown}; "
                            f"{count} such rows in rows {self.row0}..{self.row0 + self.n - 1}")
        self.bad |= mask
        self.counts[f"{column}: {what}"] += count


def example_weights(table: pa.Table, col: str, chk: _Checker) -> np.ndarray:
    """float32 [n] per-row loss weights of column `col` (data.example_weight_column): a null, NaN,
    infinite or negative weight is a bad row."""
    arr = _column(table, col)
    chk.flag(col, ~_valid(arr), "null example weight")
    with np.errstate(over="ignore"):                                        # a float64 > 3.4e38 becomes inf
        w = np.array(_numbers(arr, 1.0), dtype=np.float32)                 # [n], owned
    chk.flag(col, ~np.isfinite(w), "NaN or inf example weight", w)
    chk.flag(col, w < 0, "negative example weight", w)
    return w


def check_example_weights(column: str, files: list[str]) -> None:
    """Every example weight of `files` as the reader checks it (`example_weights`), one column read per
    row group: DataError naming file, row group, column and row at the first bad one. Files without
    the column are left alone (scoring data: unweighted metrics)."""
    for path in files:
        with parquet_file(path) as pf:
            if column not in pf.schema_arrow.names:
                continue
            for rg in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(rg, columns=[column])
                example_weights(table, column, _Checker(f"{path}: row group {rg}", table.num_rows, 0, skip=False))


class Decoder:
    """Turns a row range of a `pa.Table` (one row group) into checked `Rows`; `layout` gathers them into batches.
    kinds: per `cfg.sparse_columns`, a list column (True) or a one-id column (False), as `scan_files` found."""

    def __init__(self, cfg: DataConfig, kinds: tuple[bool, ...]) -> None:
        self.cfg = cfg
        self.columns = tuple(dict.fromkeys((cfg.label_column, *cfg.dense_columns, *cfg.sparse_columns,
                                            *cfg.weight_columns.values(), *cfg.passthrough_columns,
                                            *((cfg.example_weight_column,) if cfg.example_weight_column else ()))))
        """every column a batch is made of, each once, in a fixed order"""
        where = tuple((k, kinds[:f].count(k)) for f, k in enumerate(kinds))    # (is_list, index among its kind)
        self.layout = BatchLayout(tuple(cfg.sparse_columns), where, bool(cfg.weight_columns))
        self.list_cols = [c for c, is_list in zip(cfg.sparse_columns, kinds) if is_list]
        self.scalar_cols = [c for c, is_list in zip(cfg.sparse_columns, kinds) if not is_list]

    def decode(self, table: pa.Table, where: str, row0: int) -> tuple[Rows, int, Counter[str]]:
        """(good rows, number of rows dropped, dropped rows by 'column: problem').

        where = "FILE: row group G"; row0 = the table's first row inside the row group (for messages).
        """
        cfg = self.cfg
        chk = _Checker(where, table.num_rows, row0, cfg.on_bad_rows == "skip")
        labels = self._labels(table, chk)
        dense = self._dense(table, chk)
        scalars = [self._scalar(table, col, chk) for col in self.scalar_cols]
        lists = [self._list(table, col, chk) for col in self.list_cols]
        extras = {c: _owned(_column(table, c)) for c in cfg.passthrough_columns}
        weights = example_weights(table, cfg.example_weight_column, chk) if cfg.example_weight_column else None
        rows = Rows(labels, dense, scalars, lists, extras, weights)
        if not chk.counts:
            return rows, 0, chk.counts
        return rows.keep(~chk.bad), int(np.count_nonzero(chk.bad)), chk.counts

    def _scalar(self, table: pa.Table, col: str, chk: _Checker) -> ScalarColumn:
        arr = _column(table, col)
        ids, signed = _ids(arr)                          # [n], a read-only view where possible
        valid = _valid(arr) if arr.null_count else None
        if signed:
            neg = ids < 0
            what, shown = _negative_id(arr, ids)
            chk.flag(col, neg if valid is None else neg & valid, what, shown)
        weights = self._scalar_weights(table, col, valid, chk) if col in self.cfg.weight_columns else None
        return ScalarColumn(ids, valid, weights)

    def _labels(self, table: pa.Table, chk: _Checker) -> np.ndarray:
        col = self.cfg.label_column
        arr = _column(table, col)
        chk.flag(col, ~_valid(arr), "null label")
        labels = np.array(_numbers(arr, 0.0), dtype=np.float32)                # [n], owned
        chk.flag(col, ~((labels >= 0) & (labels <= 1)), "label outside [0, 1]", labels)
        return labels

    def _dense(self, table: pa.Table, chk: _Checker) -> np.ndarray:
        cfg = self.cfg
        dense = np.empty((len(cfg.dense_columns), table.num_rows), dtype=np.float32)   # [Dn, n]
        for j, col in enumerate(cfg.dense_columns):
            arr = _column(table, col)
            if pa.types.is_boolean(arr.type):
                arr = arr.cast(pa.uint8())
            x = _raw(arr)
            dense[j] = x
            if arr.null_count and x.dtype.kind == "f":        # garbage under a null may be NaN
                np.putmask(dense[j], ~_valid(arr), np.float32(cfg.dense_fill))
            elif arr.null_count:                              # finite garbage: x * valid + fill * ~valid
                valid = _valid(arr)
                dense[j] *= valid
                if cfg.dense_fill:
                    dense[j] += np.float32(cfg.dense_fill) * ~valid
            if x.dtype.kind == "f":      # integers are always finite in float32
                chk.flag(col, ~np.isfinite(dense[j]), "NaN or inf", dense[j])
        if cfg.dense_log1p:
            np.maximum(dense, 0, out=dense)
            np.log1p(dense, out=dense)
        return np.ascontiguousarray(dense.T)                                       # [n, Dn]

    def _scalar_weights(self, table: pa.Table, col: str, valid: np.ndarray | None, chk: _Checker) -> np.ndarray:
        """float32 [n] weights of the one-id column `col` (valid: bool [n] its rows with an id; None: all)."""
        wcol = self.cfg.weight_columns[col]
        arr = _column(table, wcol)
        valid = np.ones(len(arr), bool) if valid is None else valid
        out = np.ones(len(arr), np.float32)
        if _is_list(arr.type):
            offsets, child = _list_parts(arr)
            lens = np.diff(offsets)
            chk.flag(wcol, lens != valid, f"weight list length differs from the ids of '{col}'", lens)
            ok = lens == valid
            w = _numbers(child, np.nan).astype(np.float32)
            out[ok & valid] = w[np.repeat(ok, lens)]
        else:
            chk.flag(wcol, valid & ~_valid(arr), f"null weight for an id of '{col}'")
            out[:] = _numbers(arr, 1.0)
            out[~valid] = 1.0
        chk.flag(wcol, ~np.isfinite(out), "NaN or inf weight", out)
        return out

    def _list(self, table: pa.Table, col: str, chk: _Checker) -> ListColumn:
        arr = _column(table, col)
        offsets, child = _list_parts(arr)
        lens = np.diff(offsets)                                               # [n]
        chk.flag(col, lens > self.cfg.max_ids_per_row,
                 f"list longer than data.max_ids_per_row = {self.cfg.max_ids_per_row}", lens)
        values, signed = _ids(child)                                          # [N_f], maybe a view
        if child.null_count:
            chk.flag(col, _rows_with(offsets, ~_valid(child)), "null id inside a list")
        if signed:
            neg = values < 0
            if neg.any():
                first = np.zeros(lens.size, np.int64)          # first negative id of each row
                first[_row_of_value(offsets)[neg][::-1]] = values[neg][::-1]
                what, shown = _negative_id(child, first, in_list=True)
                chk.flag(col, _rows_with(offsets, neg), what, shown)
        weights = self._list_weights(table, col, offsets, chk) if col in self.cfg.weight_columns else None
        return ListColumn(values, offsets, weights)

    def _list_weights(self, table: pa.Table, col: str, offsets: np.ndarray, chk: _Checker) -> np.ndarray:
        """float32 [N_f] weights aligned with the ids of list column `col` (offsets int64 [n + 1])."""
        wcol = self.cfg.weight_columns[col]
        woff, child = _list_parts(_column(table, wcol))
        lens, wlens = np.diff(offsets), np.diff(woff)
        mismatch = wlens != lens
        chk.flag(wcol, mismatch, f"weight list length differs from the ids of '{col}'", wlens)
        w = np.array(_numbers(child, np.nan), np.float32)                      # [N_w], owned
        if mismatch.any():   # skip mode: give the ids' shape; these rows are dropped anyway
            fixed = np.ones(int(offsets[-1]), np.float32)
            fixed[np.repeat(~mismatch, lens)] = w[np.repeat(~mismatch, wlens)]
            w = fixed
        chk.flag(wcol, _rows_with(offsets, ~np.isfinite(w)), "NaN, inf or null weight")
        return w
