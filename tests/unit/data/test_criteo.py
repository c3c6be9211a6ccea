"""data.criteo: Criteo TSV -> Parquet round trip, file splitting, bad lines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import criteo
from data.config import DataConfig
from data.criteo import CriteoFormatError, convert_criteo, criteo_data_config_kwargs, hex_to_int64


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Known rows: labels, ints (negatives, large, missing), 8-digit hex ids (some missing)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ints = [None if rng.random() < 0.2 else int(rng.integers(-3, 10**int(rng.integers(1, 10))))
                for _ in range(13)]
        cats = [None if rng.random() < 0.15 else int(rng.integers(0, 2**32)) for _ in range(26)]
        rows.append({"label": int(rng.integers(0, 2)), "ints": ints, "cats": cats})
    rows[0]["cats"][0] = 0xFFFFFFFF
    rows[0]["cats"][1] = 0
    rows[1]["ints"] = [None] * 13
    rows[1]["cats"] = [None] * 26
    return rows


def line_of(row: dict, upper: bool = False) -> str:
    ints = ["" if v is None else str(v) for v in row["ints"]]
    cats = ["" if v is None else format(v, "08X" if upper else "08x") for v in row["cats"]]
    return "\t".join([str(row["label"]), *ints, *cats])


def write_tsv(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def read_back(out: Path) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in sorted(out.glob("part-*.parquet"))])


def check_equal(table: pa.Table, rows: list[dict], first_row_id: int = 0) -> None:
    assert table.num_rows == len(rows)
    d = table.to_pydict()
    assert d["label"] == [float(r["label"]) for r in rows]
    assert d["row_id"] == list(range(first_row_id, first_row_id + len(rows)))
    for j in range(13):
        assert d[f"I{j + 1}"] == [r["ints"][j] for r in rows], f"I{j + 1}"
    for j in range(26):
        assert d[f"C{j + 1}"] == [r["cats"][j] for r in rows], f"C{j + 1}"


def test_round_trip_values_nulls_and_files(tmp_path: Path) -> None:
    rows = make_rows(23)
    tsv = write_tsv(tmp_path / "day_0.tsv", [line_of(r, upper=(i % 2 == 1)) for i, r in enumerate(rows)])
    out = tmp_path / "out"
    summary = convert_criteo(str(tsv), str(out), rows_per_file=10, row_group_rows=4, compression="none")
    assert summary["rows"] == 23 and summary["rows_per_file"] == [10, 10, 3]
    assert [Path(f).name for f in summary["files"]] == ["part-00000.parquet", "part-00001.parquet",
                                                         "part-00002.parquet"]
    md = pq.ParquetFile(summary["files"][0]).metadata
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [4, 4, 2]
    table = read_back(out)
    assert table.schema.equals(criteo.CRITEO_SCHEMA)
    assert table.column("C1")[0].as_py() == 0xFFFFFFFF and table.column("C2")[0].as_py() == 0
    assert table.column("I5").null_count == sum(r["ints"][4] is None for r in rows)
    check_equal(table, rows)


def test_many_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(criteo, "_BLOCK_BYTES", 2048)  # ~10 lines per block
    rows = make_rows(300, seed=1)
    tsv = write_tsv(tmp_path / "x.tsv", [line_of(r) for r in rows])
    summary = convert_criteo(str(tsv), str(tmp_path / "out"), rows_per_file=128, row_group_rows=50)
    assert summary["rows_per_file"] == [128, 128, 44]
    check_equal(read_back(tmp_path / "out"), rows)


@pytest.mark.parametrize("bad_line, why", [
    ("1\t2\t3", "expected 40 tab-separated fields, got 3"),
    ("", "empty line"),
    ("2" + "\t" * 39, "label must be 0 or 1, got 2"),
    ("0\t1x" + "\t" * 38, "column I1: '1x' is not an integer"),
    ("0" + "\t" * 14 + "abcdefgz" + "\t" * 25, "column C1: 'abcdefgz' is not a hex id"),
    ("0" + "\t" * 14 + "1" * 17 + "\t" * 25, "column C1: '11111111111111111' is not a hex id"),
])
@pytest.mark.parametrize("small_blocks", [False, True])
def test_bad_line_names_file_and_line_and_keeps_what_came_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad_line: str, why: str, small_blocks: bool) -> None:
    if small_blocks:
        monkeypatch.setattr(criteo, "_BLOCK_BYTES", 1024)
    rows = make_rows(60, seed=2)
    lines = [line_of(r) for r in rows]
    lines.insert(41, bad_line)  # line 42, 1-based
    tsv = write_tsv(tmp_path / "day_1.tsv", lines)
    out = tmp_path / "out"
    with pytest.raises(CriteoFormatError, match=rf"day_1\.tsv: line 42: {why}") as info:
        convert_criteo(str(tsv), str(out), rows_per_file=16, row_group_rows=5)
    assert "41 lines before it were written" in str(info.value)
    assert not list(out.glob("*.tmp"))
    check_equal(read_back(out), rows[:41])  # every file is complete and readable


def test_hex_to_int64_mixed_lengths() -> None:
    texts = ["ff", "", "0123456789abcdef", "FFFFFFFFFFFFFFFF", "1", "8000000000000000", "deadBEEF"]
    values, null, bad = hex_to_int64(pa.array(texts))
    ref = [0 if s == "" else int(s, 16) for s in texts]
    assert values.tolist() == np.array(ref, dtype=np.uint64).view(np.int64).tolist()
    assert null.tolist() == [s == "" for s in texts] and bad == -1
    assert values[3] == -1 and values[5] == -(2**63)
    _, _, bad = hex_to_int64(pa.array(["00000000", "", "0000000g", "zz"]))
    assert bad == 2
    values, null, bad = hex_to_int64(pa.array(["00000001", "", "ffffffff"]).slice(1))
    assert values.tolist() == [0, 0xFFFFFFFF] and null.tolist() == [True, False] and bad == -1


def test_existing_output_and_missing_input(tmp_path: Path) -> None:
    tsv = write_tsv(tmp_path / "a.tsv", [line_of(r) for r in make_rows(3)])
    convert_criteo(str(tsv), str(tmp_path / "out"))
    with pytest.raises(FileExistsError, match="part-00000.parquet"):
        convert_criteo(str(tsv), str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        convert_criteo(str(tmp_path / "nope.tsv"), str(tmp_path / "out2"))


def test_data_config_kwargs() -> None:
    cfg = DataConfig(train_paths=("x",), **criteo_data_config_kwargs())
    assert cfg.dense_columns == tuple(f"I{i}" for i in range(1, 14)) and len(cfg.sparse_columns) == 26
