"""Criteo Display Advertising TSV -> Parquet, streaming in bounded memory (`recsys convert-criteo`).

Input lines: `label \\t I1..I13 \\t C1..C26`, 40 tab-separated fields, an empty field is missing.
Output files `out_dir/part-%05d.parquet` of `rows_per_file` rows, columns `CRITEO_SCHEMA` (an empty
field null; `row_id`: the 0-based line index in the input). A C field is hex (8 digits in Criteo, up
to 16 accepted) parsed as uint64 and reinterpreted as int64. pyarrow's streaming CSV reader parses
blocks of `_BLOCK_BYTES` with explicit column types (C as strings), the hex conversion runs
vectorized in numpy, and `PartWriter` writes row groups as they fill: memory holds a block and a
row group, whatever the input size.

A bad line (wrong field count, a non-integer I field, bad hex, a label other than 0/1, an empty
line) raises `CriteoFormatError` naming the file and the 1-based line number. The files written
until then are complete and readable, and hold exactly the lines before the bad one.
"""

from __future__ import annotations

import io
import itertools
import logging
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from data.hashing import string_buffers
from data.writer import PartWriter

logger = logging.getLogger(__name__)

DENSE_COLUMNS = tuple(f"I{i}" for i in range(1, 14))
SPARSE_COLUMNS = tuple(f"C{i}" for i in range(1, 27))
TSV_COLUMNS = ("label", *DENSE_COLUMNS, *SPARSE_COLUMNS)
NUM_FIELDS = len(TSV_COLUMNS)  # 40
_BLOCK_BYTES = 4 << 20
_MAX_HEX = 16

CRITEO_SCHEMA = pa.schema(
    [pa.field("label", pa.float32(), nullable=False)]
    + [pa.field(c, pa.int64()) for c in DENSE_COLUMNS]
    + [pa.field(c, pa.int64()) for c in SPARSE_COLUMNS]
    + [pa.field("row_id", pa.int64(), nullable=False)]
)
_CSV_OPTIONS = (      # pyarrow's read, parse and convert options (C fields as strings)
    pacsv.ReadOptions(column_names=list(TSV_COLUMNS), block_size=_BLOCK_BYTES, use_threads=True),
    pacsv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False,
                       newlines_in_values=False, ignore_empty_lines=False),
    pacsv.ConvertOptions(column_types={"label": pa.int64(), **{c: pa.int64() for c in DENSE_COLUMNS},
                                       **{c: pa.string() for c in SPARSE_COLUMNS}},
                         null_values=[""], strings_can_be_null=False, quoted_strings_can_be_null=False))

_NIBBLE = np.full(256, 255, np.uint8)
_NIBBLE[np.frombuffer(b"0123456789abcdefABCDEF", np.uint8)] = [*range(16), *range(10, 16)]
_INT_RE = re.compile(rb"-?[0-9]+")
_HEX_RE = re.compile(rb"[0-9a-fA-F]{1,16}")


class CriteoFormatError(ValueError):
    """A line of a Criteo TSV that is not `label, 13 integers, 26 hex ids`; names file and line."""


def criteo_data_config_kwargs() -> dict[str, object]:
    """`DataConfig(**criteo_data_config_kwargs(), train_paths=...)` reads converted files."""
    return {"label_column": "label", "dense_columns": DENSE_COLUMNS, "dense_log1p": True,
            "sparse_columns": SPARSE_COLUMNS, "passthrough_columns": ("row_id",)}


def hex_to_int64(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, int]:
    """Hex strings [N] -> (int64 values [N] (0 where null), null mask bool [N], first bad index or -1).

    Empty strings and nulls are null. A string of up to 16 hex digits is read as a uint64 and
    reinterpreted as int64 (two's complement); anything else is bad. Vectorized: the characters
    are scattered right-aligned into an [N, 16] nibble matrix, then shifted and or-ed per column.
    """
    arr = arr.cast(pa.string())
    n = len(arr)
    chars, offsets = string_buffers(arr)
    offsets = offsets.astype(np.int64)
    lengths = np.diff(offsets)
    null = lengths == 0
    if arr.null_count:
        null |= ~arr.is_valid().to_numpy(zero_copy_only=False)
    nib = _NIBBLE[chars[offsets[0]:offsets[-1]]]
    if ((lengths == 8) | null).all() and nib.size and nib.max() < 16:
        # Criteo's case: every id is 8 digits and the non-empty strings lie back to back.
        pairs = nib.reshape(-1, 4, 2)
        packed = np.ascontiguousarray((pairs[:, :, 0] << 4) | pairs[:, :, 1])  # [M, 4] bytes
        value = np.zeros(n, np.int64)
        value[~null] = packed.view(">u4")[:, 0]
        return value, null, -1
    bad = lengths > _MAX_HEX
    row = np.repeat(np.arange(n), lengths)
    bad[row[nib == 255]] = True
    bad &= ~null
    first_bad = int(np.argmax(bad)) if bad.any() else -1
    keep = ~bad[row] & (lengths[row] <= _MAX_HEX)
    # column of each character when the string is right-aligned in 16 slots
    col = _MAX_HEX - lengths[row] + (np.arange(len(row)) - (offsets[row] - offsets[0]))
    mat = np.zeros((n, _MAX_HEX), np.uint8)
    mat[row[keep], col[keep]] = nib[keep]
    value = np.zeros(n, np.uint64)
    for j in range(_MAX_HEX):
        value |= mat[:, j].astype(np.uint64) << np.uint64(4 * (_MAX_HEX - 1 - j))
    return value.view(np.int64), null, first_bad


def _convert(batch: pa.RecordBatch, first_line: int) -> tuple[pa.Table, tuple[int, str] | None]:
    """A parsed batch -> a table of CRITEO_SCHEMA; also (batch index, reason) of its first bad row.

    Rows from the bad one on are dropped, so the table holds only rows before it.
    """
    label_np = batch.column("label").fill_null(-1).to_numpy(zero_copy_only=False)
    bad_label = (label_np != 0) & (label_np != 1)
    bad: tuple[int, str] | None = None
    if bad_label.any():
        i = int(np.argmax(bad_label))
        bad = (i, "empty line or empty label" if label_np[i] == -1 else f"label must be 0 or 1, got {label_np[i]}")
    cols = {"label": pa.array(label_np.astype(np.float32)), **{c: batch.column(c) for c in DENSE_COLUMNS}}
    for c in SPARSE_COLUMNS:
        raw = batch.column(c)
        values, null, first_bad = hex_to_int64(raw)
        if first_bad >= 0 and (bad is None or first_bad < bad[0]):
            bad = (first_bad, f"column {c}: '{raw[first_bad].as_py()[:40]}' is not a hex id of 1-{_MAX_HEX} digits")
        cols[c] = pa.array(values, mask=null)
    cols["row_id"] = pa.array(np.arange(first_line - 1, first_line - 1 + batch.num_rows, dtype=np.int64))
    table = pa.table(cols, schema=CRITEO_SCHEMA)
    return (table.slice(0, bad[0]) if bad else table), bad


def _line_problem(line: bytes) -> str | None:
    """Why one raw line (without newline) is not a Criteo line, or None."""
    fields = line.split(b"\t")
    if len(fields) != NUM_FIELDS:
        return f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}"
    if fields[0] not in (b"0", b"1"):
        return f"label must be 0 or 1, got '{fields[0][:40].decode(errors='replace')}'"
    for name, f in zip(TSV_COLUMNS[1:], fields[1:]):
        pattern, kind = (_INT_RE, "an integer") if name.startswith("I") else (_HEX_RE, "a hex id")
        if f and not (pattern.fullmatch(f) and (pattern is _HEX_RE or -(2**63) <= int(f) < 2**63)):
            return f"column {name}: '{f[:40].decode(errors='replace')}' is not {kind}"
    return None


def convert_criteo(input_path: str, out_dir: str, *, rows_per_file: int = 4_000_000,
                   row_group_rows: int = 131072, compression: str = "zstd") -> dict:
    """Converts a Criteo TSV into `out_dir/part-%05d.parquet` files of `rows_per_file` rows.

    Returns {input, rows, files, rows_per_file, seconds, rows_per_s}; a bad line: see the module docstring.
    """
    if rows_per_file < 1:
        raise ValueError(f"rows_per_file must be >= 1, got {rows_per_file}")
    path = str(input_path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"Criteo TSV not found: {path}")
    t0 = time.perf_counter()
    writer = PartWriter(out_dir, CRITEO_SCHEMA, lambda i: rows_per_file,
                        row_group_rows=row_group_rows, compression=compression)
    rows = 0
    try:
        with pacsv.open_csv(path, *_CSV_OPTIONS) as reader:
            for batch in reader:
                table, bad = _convert(batch, rows + 1)
                writer.write(table)
                rows += table.num_rows
                if bad is not None:
                    raise CriteoFormatError(f"{path}: line {rows + 1}: {bad[1]} "
                                            f"({rows} lines before it were written)")
    except pa.ArrowInvalid as e:           # its errors carry no line number: find the bad line after line `rows`
        good, why = [], None
        with open(path, "rb") as f:
            for line, raw in enumerate(itertools.islice(f, rows, None), rows + 1):
                why = _line_problem(raw.rstrip(b"\n").rstrip(b"\r"))
                if why is not None:
                    break
                good.append(raw if raw.endswith(b"\n") else raw + b"\n")
        if why is None:
            raise CriteoFormatError(f"{path}: after line {rows}: {e}") from e
        if good:                                       # the lines `_line_problem` passed, before the bad one
            batch = pacsv.read_csv(io.BytesIO(b"".join(good)), *_CSV_OPTIONS)
            table, _ = _convert(batch.combine_chunks().to_batches()[0], rows + 1)
            writer.write(table)
            rows += table.num_rows
        raise CriteoFormatError(f"{path}: line {line}: {why} ({rows} lines before it were written)") from e
    finally:
        files = writer.close()
    secs = time.perf_counter() - t0
    summary = {"input": path, "rows": rows, "files": [f for f, _ in files],
               "rows_per_file": [r for _, r in files], "seconds": round(secs, 3),
               "rows_per_s": round(rows / max(secs, 1e-9))}
    logger.info("convert-criteo %s: %d rows -> %d files in %.1f s (%.0f rows/s)", path, rows,
                len(files), secs, summary["rows_per_s"])
    return summary
