"""The daily job end to end (#27): 3 days of `recsys daily` on the `daily` preset (4 day partitions:
the 4th is day 3's next day), then against models trained from scratch.

Asserts: day 3's warm-started next-day AUC is at least that of a model trained from scratch on day 3
alone, and within 0.005 of one trained from scratch on days 1..3; the published full export of day 1
plus the deltas of days 2 and 3 equals day 3's full export bit for bit (ids, rows, tombstones); an id
that aged out (TTL) is gone from the export; the last day run again is refused, then overwritten and
resumed, its publication replaced. The same recipe with 2 trainers + 2 shards in sync mode publishes a
chain that applies exactly too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data.daily import generate_daily
from recsys import cli
from recsys.serving.delta import apply_delta, read_table
from recsys.serving.export import read_manifest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DAYS = ["2026-11-25", "2026-11-26", "2026-11-27"]
ROWS = 20_000
SETS = ["data.batch_size=512", "ps.tables=[{name='item', ttl_steps=50}]", "train.num_threads=1",
        "train.log_every=10"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("daily-data")
    generate_daily(days=4, rows=ROWS, out_dir=str(out), seed=3, start=DAYS[0])
    return out


def _sets(data: Path, *extra: str) -> list[str]:
    out = []
    for s in [f"data.train_paths=['{data}/day={{date}}/']", f"data.eval_paths=['{data}/day={{date+1}}/']",
              *SETS, *extra]:
        out += ["--set", s]
    return out


def _daily(root: Path, data: Path, date: str, *extra: str, flags: tuple[str, ...] = ()) -> dict:
    argv = ["daily", "--config", str(ROOT / "configs" / "daily.toml"), "--date", date, "--root", str(root),
            *flags, *_sets(data, *extra)]
    assert cli.main(argv) == 0
    return json.loads((root / "published" / "published.json").read_text())[-1]


def _scratch(run: Path, data: Path, days: list[str]) -> float:
    paths = ", ".join(f"'{data}/day={d}/'" for d in days)
    argv = ["train", "--config", str(ROOT / "configs" / "daily.toml"), "--date", days[-1],
            *_sets(data, f"data.train_paths=[{paths}]", f"train.run_dir='{run}'")]
    assert cli.main(argv) == 0
    return json.loads((run / "metrics.json").read_text())["auc"]


def _tables(export: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Table name -> (ids, weight) of an export."""
    out = {}
    for entry in read_manifest(export)["tables"]:
        t = read_table(export, entry)
        out[entry["name"]] = (t["ids"], t["weight"])
    return out


def _assert_chain_equals_full(pub: Path, tmp: Path, days: list[str] = DAYS) -> dict:
    """full-day1 + delta-day2 (+ delta-day3) == the last day's full export, table by table, bit for bit."""
    base = pub / f"full-{days[0]}"
    for i, day in enumerate(days[1:]):
        apply_delta(base, pub / f"delta-{day}", tmp / f"applied{i}")
        base = tmp / f"applied{i}"
    got, want = _tables(base), _tables(pub / f"full-{days[-1]}")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name][0], want[name][0], err_msg=name)
        np.testing.assert_array_equal(got[name][1], want[name][1], err_msg=name)
    return want


def test_three_days_warm_started_published_and_aged_out(data: Path, tmp_path: Path, capsys) -> None:
    root = tmp_path / "daily"
    records = [_daily(root, data, d) for d in DAYS]
    assert records[0]["init_from"] is None and "delta" not in records[0]
    assert records[1]["init_from"] == str(root / DAYS[0]) and records[2]["since"] == records[1]["step"]
    assert records[2]["step"] > records[1]["step"] > records[0]["step"]          # the step counter goes on
    day3 = records[2]["next_day_auc"]
    alone = _scratch(tmp_path / "alone", data, DAYS[2:])
    together = _scratch(tmp_path / "together", data, DAYS)
    assert day3 >= alone, (day3, alone)
    assert abs(day3 - together) <= 0.005, (day3, together)
    final = _assert_chain_equals_full(root / "published", tmp_path)
    # an item of day 1 that days 2 and 3 never show aged out (ps.table_defaults.ttl_steps = 50: ~1.2 days)
    import pyarrow.parquet as pq

    def items(day: str) -> set[int]:
        return set(pq.read_table(data / f"day={day}").column("item").to_numpy().tolist())

    gone = items(DAYS[0]) - items(DAYS[1]) - items(DAYS[2])
    day1 = set(_tables(root / "published" / f"full-{DAYS[0]}")["item"][0].tolist())
    assert gone and gone <= day1
    assert not gone & set(final["item"][0].tolist())
    tomb = read_table(root / "published" / f"delta-{DAYS[2]}",
                      next(e for e in read_manifest(root / "published" / f"delta-{DAYS[2]}")["tables"]
                           if e["name"] == "item"))["tombstones"]
    assert gone & set(tomb.tolist())
    # rollback: --keep 3 keeps all three full exports here
    assert all(Path(r["full"]).is_dir() for r in records)
    _day_again(root, data, records, tmp_path, capsys)


def _day_again(root: Path, data: Path, records: list[dict], tmp_path: Path, capsys) -> None:
    """cron ran the last day twice: refused, nothing touched; --overwrite trains it again (the old run
    moved aside) and replaces its publication; --resume continues it and publishes again; the chain of
    deltas still equals the full export."""
    before = (root / "published" / "published.json").read_text()
    argv = ["daily", "--config", str(ROOT / "configs" / "daily.toml"), "--date", DAYS[2], "--root", str(root),
            *_sets(data)]
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "--resume" in err, err
    assert (root / "published" / "published.json").read_text() == before
    again = _daily(root, data, DAYS[2], flags=("--overwrite",))
    log = json.loads((root / "published" / "published.json").read_text())
    assert [e["date"] for e in log] == DAYS and log[-1] == again
    assert again["run_id"] != records[2]["run_id"] and again["since"] == records[1]["step"]
    assert [p.name for p in root.glob(f"{DAYS[2]}.old-*")]                      # the first run, moved aside
    assert read_manifest(root / "published" / f"full-{DAYS[2]}")["run_id"] == again["run_id"]
    resumed = _daily(root, data, DAYS[2], flags=("--resume",))
    assert resumed["run_id"] == again["run_id"]
    assert [e["date"] for e in json.loads((root / "published" / "published.json").read_text())] == DAYS
    _assert_chain_equals_full(root / "published", tmp_path / "again")


def test_three_days_with_two_trainers_and_two_shards_in_sync(data: Path, tmp_path: Path) -> None:
    root = tmp_path / "daily"
    for d in DAYS:
        _daily(root, data, d, "train.num_trainers=2", "ps.num_shards=2", "ps.mode='sync'")
    _assert_chain_equals_full(root / "published", tmp_path)
    m = json.loads((root / DAYS[2] / "metrics.json").read_text())
    assert "next_day" in m and m["next_day"]["auc"] > 0.6
