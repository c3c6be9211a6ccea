"""JSON rows of a `recsys serve` request -> checked rows -> `Predictor.predict(rows)`.

    cols = Columns.of(predictor.config.data)        # the columns a request must give, with their kinds
    rows = check_rows(json_body, cols, max_rows)    # RequestError (4xx, naming the field) on a bad body
    probs = predictor.predict(rows_of_many_requests)  # decoded as training did (straight to a Batch where
                                                    # `TableDecoder.decode_rows` can, else through to_table)

What a row may hold: docs/serving.md, "Rows:". Checks here are the ones JSON needs (types, presence,
64-bit range); value checks (negative ids, over-long lists, ...) are the data decoder's, which raises
`DataError` naming the column, as for a Parquet file.
"""

from __future__ import annotations

import dataclasses
import re

import pyarrow as pa

from data.config import DataConfig

_LO, _HI = -(1 << 63), (1 << 63) - 1          # int64
_COLUMN_IN_MESSAGE = re.compile(r"column '([^']+)'")


class RequestError(ValueError):
    """A bad request: HTTP `status` with `{"error": message, "field": field}`."""

    def __init__(self, message: str, field: str, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


def field_of(message: str, default: str = "rows") -> str:
    """The column a data error names (`... column 'C1': ...`), else `default`."""
    m = _COLUMN_IN_MESSAGE.search(message)
    return m.group(1) if m else default


@dataclasses.dataclass(frozen=True)
class Columns:
    """The columns a request's rows must hold, by kind."""

    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    weights: tuple[str, ...]
    id_types: dict[str, str] = dataclasses.field(default_factory=dict)    # data.id_types: "integer" / "string"

    @classmethod
    def of(cls, data: DataConfig) -> Columns:
        return cls(tuple(data.dense_columns), tuple(data.sparse_columns), tuple(data.weight_columns.values()),
                   dict(data.id_types))

    def describe(self) -> dict:
        return {"dense": list(self.dense), "sparse": list(self.sparse), "weights": list(self.weights),
                "id_types": dict(self.id_types)}


def _is_number(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (not isinstance(v, int) or _LO <= v <= _HI))


def _is_id(v: object) -> bool:
    return isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool) and _LO <= v <= _HI)


def json_type(v: object) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer" + ("" if _LO <= v <= _HI else " outside int64")
    return {str: "a string", float: "a number", list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def check_rows(body: object, cols: Columns, max_rows: int) -> list[dict]:
    """The body's "rows", checked: every row an object holding every column of `cols` with a value of its kind."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object with \"rows\", got {json_type(body)}", "body")
    rows = body.get("rows")
    if not isinstance(rows, list) or not rows:
        got = "missing" if rows is None else f"{json_type(rows)}" + (" (empty)" if rows == [] else "")
        raise RequestError(f"\"rows\" must be a non-empty list of objects (column: value), got {got}", "rows")
    if len(rows) > max_rows:
        raise RequestError(f"\"rows\": {len(rows)} rows, at most {max_rows} a request", "rows", 413)
    for i, row in enumerate(rows):
        if type(row) is dict and _plain(row, cols):
            continue
        if not isinstance(row, dict):
            raise RequestError(f"rows[{i}]: {json_type(row)}, expected an object of column: value", "rows")
        for kind, names, one, what in (("dense", cols.dense, _is_number, "a number"),
                                       ("sparse", cols.sparse, _is_id, "an id (integer or string)"),
                                       ("weight", cols.weights, _is_number, "a number")):
            lists = kind != "dense"                # ids and weights may come as lists (multi-hot)
            for c in names:
                v = row.get(c, _MISSING)
                if v is _MISSING:
                    raise RequestError(f"rows[{i}]: missing column '{c}' ({kind}); a row needs "
                                       f"{len(cols.dense)} dense, {len(cols.sparse)} sparse"
                                       f"{f', {len(cols.weights)} weight' if cols.weights else ''} columns", c)
                if v is None or one(v) or (lists and isinstance(v, list) and all(x is None or one(x) for x in v)):
                    continue
                raise RequestError(f"rows[{i}], column '{c}': {json_type(v)} is not {what} "
                                   f"({'or a list of them, or null' if lists else 'or null'})", c)
    return rows


_MISSING = object()


def _plain(row: dict, cols: Columns) -> bool:
    """The common row, checked fast: every column there, numbers, int64 / string ids (lists of them), no
    nulls inside lists. False: the full check (`check_rows`) finds what is wrong, if anything."""
    try:
        for c in cols.dense:
            v = row[c]
            t = type(v)
            if not (t is float or (t is int and _LO <= v <= _HI) or v is None):
                return False
        for c in cols.sparse:
            v = row[c]
            t = type(v)
            if t is int:
                if not _LO <= v <= _HI:
                    return False
            elif not (t is str or v is None or (t is list and all(
                    (type(x) is int and _LO <= x <= _HI) or type(x) is str for x in v))):
                return False
        for c in cols.weights:
            v = row[c]
            t = type(v)
            if not (t is float or t is int or v is None or (t is list and all(
                    type(x) is float or type(x) is int for x in v))):
                return False
    except KeyError:
        return False
    return True


def _type_of(values: list, empty: pa.DataType) -> pa.DataType:
    """The Arrow type of a checked id or weight column: int64 / string ids or float64 weights, or a list of
    those, from its first non-null value (nulls and empty lists only: `empty`, or a list of it). Values of
    another type then fail to convert."""
    number = pa.int64() if pa.types.is_string(empty) else empty
    listed = False
    for v in values:
        if v is None:
            continue
        if not isinstance(v, list):
            return pa.string() if isinstance(v, str) else number
        listed = True
        for x in v:
            if x is not None:
                return pa.list_(pa.string() if isinstance(x, str) else number)
    return pa.list_(empty) if listed else empty


def to_table(rows: list[dict], cols: Columns) -> pa.Table:
    """One Arrow table of checked rows: dense float64, ids int64 or string (lists of them for multi-hot; a
    column of nulls only: the type of `data.id_types`), weights float64 (the types training data may have)."""
    arrays, names = [], []
    for names_of, number in ((cols.dense, True), (cols.sparse, False), (cols.weights, True)):
        for c in names_of:
            values = [r[c] for r in rows]
            empty = pa.float64() if number else pa.string() if cols.id_types.get(c) == "string" else pa.int64()
            try:
                arrays.append(pa.array(values, empty if names_of is cols.dense else _type_of(values, empty)))
            except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
                raise RequestError(f"column '{c}': values of mixed types ({e})", c) from None
            names.append(c)
    return pa.Table.from_arrays(arrays, names=names)


__all__ = ["Columns", "RequestError", "check_rows", "field_of", "json_type", "to_table"]
