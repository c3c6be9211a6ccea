"""Arrow arrays -> numpy for the decoder (`data.parquet.Decoder`) and the vocabulary pass (`data.vocab`).

Fixed-width numbers are read straight from their value buffers (zero-copy, read-only views where the
callers allow it; slots under nulls hold unspecified values, masked with `_valid`); string ids are
hashed (`data.hashing`). Nothing here goes through Arrow's `to_numpy` for numbers: that imports pandas
(seconds of a process's start: benchmarks/history/figures-from-the-code.md) the first time it runs.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from data.hashing import hash_strings

def _column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.chunk(0) if col.num_chunks == 1 else pa.concat_arrays(col.chunks)


_NUMPY = {getattr(pa, t)(): np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                                  "uint64", "float16", "float32", "float64")}
"""numpy dtypes of Arrow's fixed-width numbers (`DataType.to_pandas_dtype` imports pandas)."""


def _raw(arr: pa.Array) -> np.ndarray:
    """The value buffer of a fixed-width numeric array as numpy [n], zero-copy and read-only.

    Slots under nulls hold unspecified values: callers mask them with `_valid`.
    """
    dtype = _NUMPY[arr.type]
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:                  # e.g. an all-null column may have no values buffer
        return np.zeros(len(arr), dtype=dtype)
    return np.frombuffer(buf, dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _owned(arr: pa.Array) -> np.ndarray:
    """A copy of any column as numpy [n]; fixed-width numbers without nulls straight from their buffer
    (the same array Arrow's to_numpy makes, without its import of pandas); integers or booleans with nulls
    as objects (ints / bools and None)."""
    if arr.type in _NUMPY and not arr.null_count:
        return _raw(arr).copy()
    if arr.null_count and (pa.types.is_integer(arr.type) or pa.types.is_boolean(arr.type)):
        return np.array(arr.to_pylist(), dtype=object)     # ints and None: to_numpy's float64 NaN lost the type
    return np.array(arr.to_numpy(zero_copy_only=False))


def _valid(arr: pa.Array) -> np.ndarray:
    """bool [n]: not null."""
    if not arr.null_count:
        return np.ones(len(arr), dtype=bool)
    bits = np.frombuffer(arr.buffers()[0], dtype=np.uint8)
    return np.unpackbits(bits, count=arr.offset + len(arr), bitorder="little")[arr.offset:].view(bool)


def _numbers(arr: pa.Array, fill: float) -> np.ndarray:
    """float or int [n] with nulls -> fill; a read-only view of Arrow memory where there are no nulls."""
    if pa.types.is_boolean(arr.type):
        arr = arr.cast(pa.uint8())
    x = _raw(arr)
    if arr.null_count:
        x = np.where(_valid(arr), x, np.array(fill, dtype=np.float64 if x.dtype.kind != "f" else x.dtype))
    return x


def _ids(arr: pa.Array) -> tuple[np.ndarray, bool]:
    """(int64 [n] ids (any value at nulls), whether they may be negative) of a flat id array.

    A view of Arrow memory for int64 (read-only); integers are not range-checked here, uint64 ids
    of 2**63 or more come out negative (and are then flagged, shown unsigned: `_negative_id`).
    """
    t = arr.type
    if pa.types.is_dictionary(t):
        if not pa.types.is_integer(t.value_type):
            return hash_strings(arr), False
        arr, t = arr.dictionary_decode(), t.value_type
    if not pa.types.is_integer(t):
        return hash_strings(arr), False
    x = _raw(arr)
    if x.dtype != np.int64:
        x = x.view(np.int64) if x.dtype == np.uint64 else x.astype(np.int64)
    return x, pa.types.is_signed_integer(t) or pa.types.is_uint64(t)


def _negative_id(arr: pa.Array, values: np.ndarray, in_list: bool = False) -> tuple[str, np.ndarray]:
    """(what to call a negative id of `arr`, the values to show): uint64 ids of 2**63 or more, unsigned."""
    where = " in a list" if in_list else ""
    if pa.types.is_uint64(arr.type.value_type if pa.types.is_dictionary(arr.type) else arr.type):
        return f"uint64 id of 2**63 or more{where} (ids are int64 in [0, 2**63): hash or remap them)", \
            values.view(np.uint64)
    return f"negative id{where}", values


def _row_of_value(offsets: np.ndarray) -> np.ndarray:
    """int64 [N]: the row each value of a jagged column belongs to."""
    lens = np.diff(offsets)
    return np.repeat(np.arange(lens.size, dtype=np.int64), lens)


def _rows_with(offsets: np.ndarray, value_mask: np.ndarray) -> np.ndarray:
    """bool [n]: rows of a jagged column (offsets [n + 1]) holding a value where value_mask [N] is True."""
    rows = np.zeros(offsets.size - 1, dtype=bool)
    if value_mask.any():
        rows[_row_of_value(offsets)[value_mask]] = True
    return rows


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(offsets int64 [n + 1] rebased to 0, child values covering exactly those offsets).

    A null list gets length 0 (Arrow allows a null slot to span values; those are dropped).
    """
    offsets = _raw(arr.offsets).astype(np.int64)        # [n + 1] (Arrow's to_numpy would import pandas)
    child = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = offsets - offsets[0]
    if arr.null_count:
        valid = _valid(arr)
        lens = np.diff(offsets)
        if bool((lens[~valid] > 0).any()):
            keep = np.repeat(valid, lens)
            child = child.filter(pa.array(keep))
            lens = np.where(valid, lens, 0)
            offsets = np.concatenate(([0], np.cumsum(lens)))
    return offsets, child
