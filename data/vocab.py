"""Distinct ids of id columns over Parquet files: the vocabulary of a table kept on the trainers.

    ids = distinct_ids(cfg, cfg.train_paths, ("user", "item"))   # {"user": int64 [R] sorted, ...}

The ids are decoded exactly as the loader decodes them (`data.arrays._ids`: integers as int64,
uint64 reinterpreted, strings and string dictionaries hashed), so an id the loader yields is found
in the vocabulary of the files it read. Nulls are left out (the loader refuses or skips them). One
pass over the named columns only, one row group at a time; every process that reads the same files
gets the same sorted arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from data.config import DataConfig
from data.arrays import _ids, _list_parts, _valid
from data.parquet import DataError, _is_list, read_row_group, resolve_paths, scan_files
from data.remote import parquet_file

__all__ = ["distinct_ids"]


def distinct_ids(cfg: DataConfig, paths: Sequence[str], columns: Sequence[str]) -> dict[str, np.ndarray]:
    """Column -> sorted distinct int64 ids [R] of that column over every file of `paths`.

    Raises DataError naming the file (unreadable, or a column that is missing)."""
    columns = tuple(dict.fromkeys(columns))
    if not columns:
        return {}
    files = resolve_paths(tuple(paths))
    if not files:
        raise DataError(f"no Parquet files in {list(paths)} to build a vocabulary from")
    sources, _, _ = scan_files(cfg, files)
    seen: dict[str, list[np.ndarray]] = {c: [] for c in columns}
    for source in sources:
        with parquet_file(source.path, source.metadata) as pf:
            for rg in range(len(source.row_group_rows)):
                table = read_row_group(source, pf, rg, columns)
                for col in columns:
                    for arr in table.column(col).chunks:
                        if _is_list(arr.type):
                            _, arr = _list_parts(arr)                 # lists: their values
                        ids, _ = _ids(arr)
                        seen[col].append(np.unique(ids[_valid(arr)] if arr.null_count else ids))
                    if len(seen[col]) > 64:          # bound the memory of the partial uniques
                        seen[col] = [np.unique(np.concatenate(seen[col]))]
    return {c: np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64) for c, parts in seen.items()}

