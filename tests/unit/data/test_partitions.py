"""Date-partitioned input: `{date±N}` placeholders (data/paths.py) and hive partitions (`day=YYYY-MM-DD/`)
resolved by `resolve_paths` on local paths and file:// URIs (the S3 case: tests/integration/test_remote_storage.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig
from data.parquet import DataError, resolve_paths
from data.paths import fill_date, glob_match, parse_date

DAYS = ("2026-11-19", "2026-11-20", "2026-11-25", "2026-11-26", "2026-11-30")


@pytest.mark.parametrize("path, date, want", [
    ("s3://b/ctr/day={date}/", "2026-11-26", "s3://b/ctr/day=2026-11-26/"),
    ("day={date-1}/", "2026-03-01", "day=2026-02-28/"),               # month end
    ("day={date-1}/", "2024-03-01", "day=2024-02-29/"),               # leap year
    ("day={date-1}/", "2027-01-01", "day=2026-12-31/"),               # year end
    ("day={date+1}/", "2026-12-31", "day=2027-01-01/"),
    ("day={date-7}/x{date+0}", "2026-11-03", "day=2026-10-27/x2026-11-03"),
    ("{date-30}..{date}", "2026-03-15", "2026-02-13..2026-03-15"),
    ("y={date-1:%Y}/m={date-1:%m}/d={date-1:%d}", "2026-01-01", "y=2025/m=12/d=31"),
    ("/data/{date:%Y%m%d}/{day}/{0}", "2026-11-26", "/data/20261126/{day}/{0}"),   # other braces: left alone
    ("/no/placeholder/*.parquet", "", "/no/placeholder/*.parquet"),
])
def test_fill_date(path: str, date: str, want: str) -> None:
    assert fill_date(path, date) == want


@pytest.mark.parametrize("path, date, match", [
    ("day={date}/", "", r"has a \{date\} placeholder but no date is set"),
    ("day={date-1}/", "", "no date is set"),
    ("day={date+x}/", "2026-11-26", r"\{date\+x\} is not a date placeholder"),
    ("day={Date}/", "2026-11-26", r"\{Date\} is not a date placeholder"),
    ("day={date:}/", "2026-11-26", r"\{date:\} is not a date placeholder"),
    ("day={date-9999999}/", "2026-11-26", "outside the calendar"),
    ("day={date}/", "2026-11-31", r"expected a date YYYY-MM-DD, got '2026-11-31' \(no such day\)"),
])
def test_fill_date_errors(path: str, date: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fill_date(path, date)


@pytest.mark.parametrize("text", ["26-11-2026", "2026-1-5", "2026/11/26", "20261126", " 2026-11-26", "2026-02-29"])
def test_parse_date_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="expected a date YYYY-MM-DD"):
        parse_date(text)


def test_data_config_date_and_unfilled_paths() -> None:
    assert DataConfig(date="2026-11-26", train_paths=("d/day=2026-11-26",)).date == "2026-11-26"
    with pytest.raises(ValueError, match=r"data\.date: expected a date YYYY-MM-DD, got '2026-13-01'"):
        DataConfig(date="2026-13-01")
    with pytest.raises(ValueError, match=r"data\.eval_paths: 'd/day=\{date\}' holds a date placeholder"):
        DataConfig(date="2026-11-26", eval_paths=("d/day={date}",))


def test_glob_match_is_name_by_name_and_skips_hidden_names() -> None:
    assert glob_match("r/day=2026-11-2*/part-*.parquet", "r/day=2026-11-26/part-0.parquet")
    assert not glob_match("r/day=2026-11-2*/part-*.parquet", "r/day=2026-11-26/sub/p.parquet")   # * stays in a name
    assert not glob_match("r/*.parquet", "r/a/b.parquet")
    assert glob_match("r/**/*.parquet", "r/a/b/c.parquet") and glob_match("r/**/*.parquet", "r/c.parquet")
    assert not glob_match("r/*/*", "r/day=1/_SUCCESS") and not glob_match("r/*/*", "r/_temporary/x")
    assert not glob_match("r/**/*.parquet", "r/_temporary/0/x.parquet")
    assert not glob_match("r/*", "r/.x.crc")
    assert glob_match("r/*/_SUCCESS", "r/day=1/_SUCCESS") and glob_match("r/_tmp/*", "r/_tmp/x")    # asked for by name


def _partitions(root: Path) -> list[str]:
    """root/day=D/part-{0,1}.parquet for each of DAYS, plus what Spark leaves beside them."""
    for day in DAYS:
        for k in range(2):
            (root / f"day={day}").mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"x": np.arange(3)}), root / f"day={day}" / f"part-{k}.parquet")
        (root / f"day={day}" / "_SUCCESS").write_text("")
        (root / f"day={day}" / ".part-0.parquet.crc").write_text("")
    (root / "_temporary" / "0").mkdir(parents=True)
    (root / "_temporary" / "0" / "part-9.parquet").write_text("partial")
    return [f"day={day}/part-{k}.parquet" for day in DAYS for k in range(2)]


@pytest.mark.parametrize("kind", ["path", "uri"])
def test_hive_partitions(tmp_path: Path, kind: str) -> None:
    files = _partitions(tmp_path / "root")
    base = str(tmp_path / "root") if kind == "path" else f"file://{tmp_path}/root"

    def rel(got: list[str]) -> list[str]:
        return [g[len(base) + 1:] for g in got]

    assert rel(resolve_paths([base])) == files                                  # date order, no _SUCCESS / _temporary
    assert rel(resolve_paths([f"{base}/"])) == files
    assert rel(resolve_paths([f"{base}/day=2026-11-26/"])) == files[6:8]        # one partition directory
    assert rel(resolve_paths([f"{base}/day=2026-11-2*/part-*.parquet"])) == files[2:8]   # a glob over partitions
    assert rel(resolve_paths([f"{base}/day=2026-11-2*"])) == files[2:8]         # partition directories by glob
    assert rel(resolve_paths([f"{base}/day=2026-11-*/*"])) == files
    assert rel(resolve_paths([f"{base}/*/part-1.parquet"])) == files[1::2]
    assert rel(resolve_paths([f"{base}/**/*.parquet"])) == files
    assert rel(resolve_paths([f"{base}/day=2026-11-30/", f"{base}/day=2026-11-19/"])) == files[8:] + files[:2]
    assert rel(resolve_paths([f"{base}/day={d}/" for d in (fill_date("{date-1}", "2026-11-27"),)])) == files[6:8]
    with pytest.raises(DataError, match="matched no files"):
        resolve_paths([f"{base}/day=2026-12-*/part-*.parquet"])
    with pytest.raises(DataError, match="does not exist"):
        resolve_paths([f"{base}/day=2026-12-01/"])


def test_uri_glob_stays_in_one_directory_level(tmp_path: Path) -> None:
    files = _partitions(tmp_path / "root")
    with pytest.raises(DataError, match="matched no files"):                   # as a local glob: * is one name
        resolve_paths([f"file://{tmp_path}/root/*.parquet"])
    with pytest.raises(DataError, match="matched no files"):
        resolve_paths([str(tmp_path / "root" / "*.parquet")])
    assert resolve_paths([f"file://{tmp_path}/*/day=2026-11-19/*.parquet"]) == \
        [f"file://{tmp_path}/root/{f}" for f in files[:2]]
