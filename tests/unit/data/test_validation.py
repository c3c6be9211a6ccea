"""Bad input raises DataError naming file, row group, column and row - or is skipped and counted."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.loader import ParquetLoader
from data.parquet import DataError

N, RG = 30, 10             # 30 rows in row groups of 10; bad rows are placed at known positions


def with_column(table: pa.Table, name: str, arr: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, name, arr) if i >= 0 else table.append_column(name, arr)


def put(table: pa.Table, name: str, rows: dict[int, object]) -> pa.Table:
    """Column `name` with the values at `rows` replaced (None = null); type kept."""
    values = table.column(name).to_pylist()
    for r, v in rows.items():
        values[r] = v
    return with_column(table, name, pa.array(values, table.schema.field(name).type))


def read(h, path, **kw):
    with ParquetLoader(h.make_cfg(**kw), [path]) as loader:
        ids = h.row_ids(loader)
        return ids, loader.num_bad_rows


# (what, column, rows to spoil -> value, expected message part, config)
ROW_CASES = [
    ("negative scalar id", "s_int", {23: -5}, "negative id at row 3 \\(value -5\\)", {}),
    ("negative id in a list", "s_list", {12: [1, -7, -8], 14: [-1]}, "negative id in a list at row 2 "
     "\\(value -7\\); 2 such rows", {}),
    ("list too long", "s_list", {5: list(range(9))}, "list longer than data.max_ids_per_row = 8 at row 5 "
     "\\(value 9\\)", {"max_ids_per_row": 8}),
    ("NaN dense", "d0", {21: float("nan")}, "NaN or inf at row 1 \\(value nan\\)", {}),
    ("inf dense", "d0", {29: float("inf")}, "NaN or inf at row 9 \\(value inf\\)", {}),
    ("null label", "label", {0: None}, "null label at row 0", {}),
    ("label outside [0, 1]", "label", {11: 2.0}, "label outside \\[0, 1\\] at row 1", {}),
    ("null id inside a list", "s_list", {8: [3, None]}, "null id inside a list at row 8", {}),
    ("weight length mismatch", "w_wlist", {16: [0.5, 0.5, 0.5, 0.5, 0.5]}, "weight list length differs "
     "from the ids of 's_wlist' at row 6", {}),
    ("NaN weight", "w_wlist", {27: [float("nan")]}, "NaN, inf or null weight at row 7", {}),
]


def spoiled(h, tmp_path, column, rows):
    t = h.make_table(N, seed=4)
    if column == "w_wlist":                       # give those rows one id so a 1-weight list fits
        t = put(t, "s_wlist", {r: [1] for r in rows if len(rows[r]) == 1})
    t = put(t, column, rows)
    return h.write(tmp_path / "bad.parquet", t, row_group_rows=RG), t


@pytest.mark.parametrize("what, column, rows, message, kw", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_bad_rows_raise_naming_file_row_group_column(h, tmp_path, what, column, rows, message, kw):
    path, _ = spoiled(h, tmp_path, column, rows)
    first = min(rows)
    with pytest.raises(DataError) as e:
        read(h, path, **kw)
    msg = str(e.value)
    assert msg.startswith(f"{path}: row group {first // RG}, column '{column}': "), msg
    assert re.search(message, msg), msg


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("what, column, rows, message, kw", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_skip_mode_drops_exactly_the_bad_rows_and_counts_them(h, tmp_path, what, column, rows, message, kw,
                                                              prefetch, caplog):
    path, _ = spoiled(h, tmp_path, column, rows)
    ids, bad = read(h, path, on_bad_rows="skip", prefetch_batches=prefetch, **kw)
    assert sorted(ids) == [i for i in range(N) if i not in rows]
    assert bad == len(rows)
    assert f"skipped {len(rows)} bad rows" in caplog.text or "skipped 1 bad rows" in caplog.text


def test_skip_mode_with_shuffle_and_several_problems_in_one_row(h, tmp_path):
    t = h.make_table(N, seed=4)
    t = put(t, "s_int", {4: -1, 25: -2})
    t = put(t, "d0", {4: float("nan"), 6: float("inf")})
    path = h.write(tmp_path / "bad.parquet", t, row_group_rows=RG)
    ids, bad = read(h, path, on_bad_rows="skip", shuffle=True, shuffle_buffer_rows=8, batch_size=4)
    assert sorted(ids) == [i for i in range(N) if i not in (4, 6, 25)]
    assert bad == 3


def test_uint64_ids_past_int64_are_named_as_such_and_shown_unsigned(h, tmp_path):
    """#28: a uint64 id of 2**63 or more was "negative id (value -9223372036854775807)"."""
    t = h.make_table(N, seed=1)
    t = with_column(t, "u", pa.array([5] * 12 + [2 ** 63 + 1] + [6] * 17, pa.uint64()))
    t = with_column(t, "ul", pa.array([[1]] * 20 + [[3, 2 ** 64 - 1]] + [[2]] * 9, pa.list_(pa.uint64())))
    path = h.write(tmp_path / "u.parquet", t, row_group_rows=RG)
    with pytest.raises(DataError, match=re.escape(f"row group 1, column 'u': uint64 id of 2**63 or more (ids are "
                                                  f"int64 in [0, 2**63): hash or remap them) at row 2 (value "
                                                  f"{2 ** 63 + 1})")):
        read(h, path, sparse_columns=("u",), weight_columns={})
    with pytest.raises(DataError, match=re.escape(f"column 'ul': uint64 id of 2**63 or more in a list (ids are "
                                                  f"int64 in [0, 2**63): hash or remap them) at row 0 (value "
                                                  f"{2 ** 64 - 1})")):
        read(h, path, sparse_columns=("ul",), weight_columns={})


def test_missing_column_names_file_and_column(h, tmp_path):
    path = h.write(tmp_path / "m.parquet", h.make_table(N).drop_columns(["d1"]), row_group_rows=RG)
    with pytest.raises(DataError, match=re.escape(f"{path} (schema of all 3 row groups), column 'd1': "
                                                  "missing (dense column)")):
        read(h, path)
    # schema errors are not row errors: skip mode raises too
    with pytest.raises(DataError, match="column 'd1': missing"):
        read(h, path, on_bad_rows="skip")


@pytest.mark.parametrize("column, arr, role", [
    ("d0", pa.array(["x"] * N), "dense"),
    ("s_int", pa.array(np.ones(N)), "sparse"),
    ("s_list", pa.array([[1.5]] * N), "sparse"),
    ("label", pa.array([[1]] * N), "label"),
    ("s_str", pa.array([True] * N), "sparse"),
    ("w_wlist", pa.array(np.ones(N)), "weights of the list column 's_wlist'"),
])
def test_wrong_type_names_file_and_column(h, tmp_path, column, arr, role):
    path = h.write(tmp_path / "w.parquet", with_column(h.make_table(N), column, arr), row_group_rows=RG)
    stored = pq.read_schema(path).field(column).type                  # Parquet renames list items
    with pytest.raises(DataError, match=re.escape(f"{path} (schema of all 3 row groups), column '{column}': "
                                                  f"wrong type {stored}")) as e:
        read(h, path)
    assert role in str(e.value)


def test_list_in_one_file_and_scalar_in_another(h, tmp_path):
    h.write(tmp_path / "ds" / "a.parquet", h.make_table(5))
    t = with_column(h.make_table(5), "s_int", pa.array([[1]] * 5, pa.list_(pa.int64())))
    b = h.write(tmp_path / "ds" / "b.parquet", t)
    with pytest.raises(DataError, match=re.escape(f"{b} (schema), column 's_int': wrong type list<element: int64>: "
                                                         "it is a one-id column in")):
        read(h, str(tmp_path / "ds"))


ALL_TYPES = {"s_int": "integer", "s_list": "integer", "s_str": "string", "s_i32": "integer", "s_wlist": "integer"}


@pytest.mark.parametrize("column, arr, got, want", [
    ("s_int", pa.array([str(i) for i in range(N)]), "string ids (string)", "integer"),
    ("s_list", pa.array([[str(i)] for i in range(N)]), "string ids (list<element: string>)", "integer"),
    ("s_str", pa.array(range(N), pa.int32()), "integer ids (int32)", "string"),
    ("s_str", pa.array(range(N), pa.uint64()), "integer ids (uint64)", "string"),
])
def test_ids_of_another_type_than_data_id_types_are_refused(h, tmp_path, column, arr, got, want):
    # the id 7 and the string "7" hash to different rows: a model trained on one type would take the
    # other's ids as unseen, silently
    path = h.write(tmp_path / "t.parquet", with_column(h.make_table(N), column, arr), row_group_rows=RG)
    with pytest.raises(DataError, match=re.escape(f"{path} (schema of all 3 row groups), column '{column}': {got}")
                       ) as e:
        read(h, path, id_types=ALL_TYPES)
    assert f"but data.id_types says {want}" in str(e.value)
    read(h, path)                                             # without id_types: read as it is


def test_dictionary_strings_and_binary_are_string_ids(h, tmp_path):
    t = h.make_table(N)
    t = with_column(t, "s_str", t.column("s_str").combine_chunks().dictionary_encode())
    path = h.write(tmp_path / "d.parquet", with_column(t, "s_i32", pa.array([b"x"] * N, pa.binary())))
    with pytest.raises(DataError, match="column 's_i32': string ids"):
        read(h, path, id_types=ALL_TYPES)
    assert read(h, path, id_types=dict(ALL_TYPES, s_i32="string"))[0]


def test_integer_ids_in_one_file_and_strings_in_another(h, tmp_path):
    h.write(tmp_path / "ds" / "a.parquet", h.make_table(5))
    b = h.write(tmp_path / "ds" / "b.parquet", with_column(h.make_table(5), "s_int", pa.array(["1"] * 5)))
    with pytest.raises(DataError, match=re.escape(f"{b} (schema), column 's_int': wrong type string: it is a column "
                                                  "of integer ids in")):
        read(h, str(tmp_path / "ds"))


def test_id_types_are_filled_in_from_the_first_training_file(h, tmp_path):
    from data.parquet import with_id_types
    path = h.write(tmp_path / "a.parquet", h.make_table(5))
    cfg = h.make_cfg(train_paths=(path,))
    assert with_id_types(cfg).id_types == ALL_TYPES
    assert list(with_id_types(cfg).id_types) == list(cfg.sparse_columns)                 # in the columns' order
    assert with_id_types(cfg, {"s_int": "string"}).id_types == dict(ALL_TYPES, s_int="string")   # the run warm-
    assert with_id_types(h.make_cfg(train_paths=(path,), id_types={"s_int": "integer"}),          # started from;
                         {"s_int": "string"}).id_types["s_int"] == "integer"                     # the config wins
    full = h.make_cfg(train_paths=(str(tmp_path / "missing.parquet"),), id_types=ALL_TYPES)
    assert with_id_types(full) is full                                                   # no file read
    with pytest.raises(ValueError, match="data.id_types.s_int = 'int': expected \"integer\" or \"string\""):
        h.make_cfg(id_types={"s_int": "int"})
    with pytest.raises(ValueError, match="data.id_types.user = 'string': not a column of data.sparse_columns"):
        h.make_cfg(id_types={"user": "string"})


def test_empty_and_unreadable_files(h, tmp_path):
    good = h.write(tmp_path / "ds" / "a.parquet", h.make_table(N), row_group_rows=RG)
    empty = h.write(tmp_path / "ds" / "b.parquet", h.make_table(0))
    junk = tmp_path / "ds" / "c.parquet"
    junk.write_bytes(b"not a parquet file at all")
    zero = tmp_path / "ds" / "d.parquet"
    zero.write_bytes(b"")
    with pytest.raises(DataError, match=re.escape(f"{empty}: empty file (0 rows")):
        read(h, str(tmp_path / "ds"))
    with pytest.raises(DataError, match=re.escape(f"{junk}: unreadable Parquet file")):
        read(h, str(junk))
    with pytest.raises(DataError, match=re.escape(f"{zero}: unreadable Parquet file")):
        read(h, str(zero))
    # skip mode: the bad files are left out, the good one is read whole
    with ParquetLoader(h.make_cfg(on_bad_rows="skip"), [str(tmp_path / "ds")]) as loader:
        assert loader.files == [good]
        assert loader.skipped_files == [empty, str(junk), str(zero)]
        assert sorted(h.row_ids(loader)) == list(range(N))
    with pytest.raises(DataError, match="no readable rows in 3 files"):
        read(h, str(tmp_path / "ds" / "[bcd].parquet"), on_bad_rows="skip")


def test_unreadable_row_group_in_skip_mode_is_counted(h, tmp_path):
    """A row group whose pages are corrupt (found at read time, not in the footer scan)."""
    path = h.write(tmp_path / "c.parquet", h.make_table(N), row_group_rows=RG)
    loader = ParquetLoader(h.make_cfg(on_bad_rows="skip"), [path])
    data = bytearray(open(path, "rb").read())
    data[4:len(data) // 3] = b"\xff" * (len(data) // 3 - 4)             # spoil the first row group(s)
    open(path, "wb").write(bytes(data))
    with loader:
        ids = h.row_ids(loader)
        assert loader.num_bad_rows == N - len(ids) and loader.num_bad_rows >= RG
    with ParquetLoader(h.make_cfg(), [path]) as strict:             # the footer is intact
        with pytest.raises(DataError, match=re.escape(f"{path}: row group 0: unreadable")):
            list(strict)
