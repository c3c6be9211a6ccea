"""The `daily` preset (data/daily.py): day partitions whose items are born and retired over the days."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from data.daily import generate_daily
from recsys import cli


def _items(root: Path, day: str) -> set[int]:
    return set(pq.read_table(root / f"day={day}").column("item").to_numpy().tolist())


def test_gen_data_daily_writes_day_partitions_with_ids_that_come_and_go(tmp_path: Path) -> None:
    out = tmp_path / "d"
    assert cli.main(["gen-data", "--preset", "daily", "--days", "4", "--rows", "3000", "--out", str(out),
                     "--start", "2026-02-27", "--seed", "5"]) == 0
    days = ["2026-02-27", "2026-02-28", "2026-03-01", "2026-03-02"]
    assert sorted(p.name for p in out.iterdir()) == [f"day={d}" for d in days]
    t = pq.read_table(out / f"day={days[0]}")
    assert t.num_rows == 3000 and {"label", "p_true", "I1", "I2", "user", "item", "item_cat", "ctx"} <= set(t.column_names)
    p = t.column("p_true").to_numpy()
    assert ((p > 0) & (p < 1)).all() and set(np.unique(t.column("label").to_numpy())) <= {0.0, 1.0}
    first, last = _items(out, days[0]), _items(out, days[-1])
    assert last - first and first - last                       # new ids arrive, old ones stop
    # a day's file does not depend on how many days are generated
    again = tmp_path / "again"
    generate_daily(days=2, rows=3000, out_dir=str(again), seed=5, start=days[0])
    assert pq.read_table(again / f"day={days[1]}").equals(pq.read_table(out / f"day={days[1]}"))


def test_gen_data_onehot_through_the_cli(tmp_path: Path) -> None:
    """The README's `recsys gen-data --preset onehot --out DIR [--split A,B,C]`."""
    assert cli.main(["gen-data", "--preset", "onehot", "--out", str(tmp_path / "o"), "--split", "300,100,200"]) == 0
    rows = [pq.read_metadata(tmp_path / "o" / f"part-0000{i}.parquet").num_rows for i in range(3)]
    assert rows == [300, 100, 200]
    names = pq.read_schema(tmp_path / "o" / "part-00000.parquet").names
    assert {"label", "p_true", "user", "item", "item_category"} <= set(names)
