"""`PartWriter`: streams Arrow tables into `part-%05d.parquet` files of given row counts (every
synthetic preset's `data.genbase.write_parts`, and `data.criteo.convert_criteo`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class PartWriter:
    """Streams tables into `out_dir/part-%05d.parquet`: file i gets `rows_of_file(i)` (>= 1) rows, in
    row groups of `row_group_rows` (the last of a file may be shorter). Memory: one row group.

    A file is written as `NAME.tmp` and renamed when complete, so every `part-*.parquet` on disk
    is a whole, readable file, also after an error (`close()` finishes the current one).
    """

    def __init__(self, out_dir: str | Path, schema: pa.Schema, rows_of_file: Callable[[int], int],
                 *, row_group_rows: int, compression: str) -> None:
        if row_group_rows < 1:
            raise ValueError(f"row_group_rows must be >= 1, got {row_group_rows}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        existing = sorted(self.out_dir.glob("part-*.parquet"))
        if existing:
            raise FileExistsError(f"{self.out_dir} already holds {len(existing)} part-*.parquet "
                                  f"files (e.g. {existing[0].name}); remove them or pick another dir")
        self.schema, self._rows_of_file = schema, rows_of_file
        self._rg, self._compression = row_group_rows, compression
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._file_left = 0
        self.files: list[tuple[str, int]] = []

    def write(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows > 0:
            if self._file_left == 0:
                self._finish_file()
                self._file_left = self._rows_of_file(len(self.files))
                self.files.append((str(self.out_dir / f"part-{len(self.files):05d}.parquet"), 0))
                self._writer = pq.ParquetWriter(self.files[-1][0] + ".tmp", self.schema, compression=self._compression)
            n = min(self._rg, self._file_left)
            if self._pending_rows < n:
                return
            self._write_group(n)

    def _write_group(self, n: int) -> None:
        """Writes the first n pending rows as one row group of the current file."""
        t = pa.concat_tables(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._writer.write_table(t.slice(0, n), row_group_size=n)
        rest = t.slice(n)
        self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows
        self._file_left -= n
        path, rows = self.files[-1]
        self.files[-1] = (path, rows + n)

    def _finish_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            Path(self.files[-1][0] + ".tmp").rename(self.files[-1][0])

    def close(self) -> list[tuple[str, int]]:
        """Writes what is pending (a short last row group), closes the file; (path, rows) per file."""
        try:
            if self._pending_rows:
                self._write_group(self._pending_rows)
        finally:
            self._finish_file()
        return self.files
