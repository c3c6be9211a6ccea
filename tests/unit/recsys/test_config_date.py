"""One config for every day: data.date / `--date` fill the `{date±N}` placeholders of the data paths and
train.run_dir when the config is loaded (print-config, and so the run's config.toml, show the day's paths)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recsys.cli import main
from recsys.config import ConfigError, load_config, load_ps_config, to_toml

JOB = """
[data]
train_paths = ["s3://bucket/ctr/day={date-1}/", "/data/ctr/day={date-2}/part-*.parquet"]
eval_paths = ["s3://bucket/ctr/day={date}/?endpoint_override=h:1&scheme=http"]
test_paths = ["/data/y={date+1:%Y}/m={date+1:%m}/d={date+1:%d}/"]
[train]
run_dir = "runs/ctr/{date}"
"""


@pytest.fixture
def job(tmp_path: Path) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(JOB)
    return p


def test_load_config_fills_dates(job: Path, tmp_path: Path) -> None:
    cfg = load_config(job, ["data.date='2027-01-01'"])
    assert cfg.data.date == "2027-01-01"
    assert cfg.data.train_paths == ("s3://bucket/ctr/day=2026-12-31/", "/data/ctr/day=2026-12-30/part-*.parquet")
    assert cfg.data.eval_paths == ("s3://bucket/ctr/day=2027-01-01/?endpoint_override=h:1&scheme=http",)
    assert cfg.data.test_paths == ("/data/y=2027/m=01/d=02/",)
    assert cfg.train.run_dir == "runs/ctr/2027-01-01"
    again = tmp_path / "again.toml"              # the run dir's config.toml: resolved, loads back the same
    again.write_text(to_toml(cfg))
    assert load_config(again) == cfg
    toml_date = load_config(job, ["data.date=2026-03-01"])            # unquoted: a TOML date
    assert toml_date.data.date == "2026-03-01" and toml_date.data.train_paths[0] == "s3://bucket/ctr/day=2026-02-28/"
    assert load_ps_config(job, ["data.date='2026-03-01'"]).storage_root == "runs/ctr/2026-03-01"


def test_date_in_the_file(tmp_path: Path) -> None:
    p = tmp_path / "job.toml"
    p.write_text('[data]\ndate = "2024-03-01"\ntrain_paths = ["d/day={date-1}/"]\n')
    assert load_config(p).data.train_paths == ("d/day=2024-02-29/",)
    assert load_config(p, ["data.date='2024-03-02'"]).data.train_paths == ("d/day=2024-03-01/",)   # --set wins
    assert load_config(None).data.date == ""


@pytest.mark.parametrize("overrides, match", [
    ((), r"job\.toml: data\.train_paths\[0\] = 's3://bucket/ctr/day=\{date-1\}/': has a \{date\} placeholder "
         r"but no date is set; pass --date YYYY-MM-DD or set data\.date"),
    (("data.train_paths=[]", "data.eval_paths=[]", "data.test_paths=[]"),
     r"train\.run_dir = 'runs/ctr/\{date\}': .*no date is set; pass --date"),
    (("data.date='2026-13-01'",), r"data\.date \(--date\): expected a date YYYY-MM-DD, got '2026-13-01' \(no such day\)"),
    (("data.date='26-11-2026'",), r"data\.date \(--date\): expected a date YYYY-MM-DD, got '26-11-2026'"),
    (("data.date=20261126",), r"data\.date must be a string, got 20261126"),
    (("data.date='2026-11-26'", "data.item_paths=['x/{date+1d}']"), r"data\.item_paths\[0\] = 'x/\{date\+1d\}': "
                                                                     r"\{date\+1d\} is not a date placeholder"),
])
def test_date_errors(job: Path, overrides: tuple[str, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(job, overrides)


def test_print_config_date(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["print-config", "--config", str(job), "--date", "2026-11-27"]) == 0
    out = capsys.readouterr().out
    assert 'date = "2026-11-27"' in out and 'run_dir = "runs/ctr/2026-11-27"' in out
    assert '"s3://bucket/ctr/day=2026-11-26/"' in out and "/data/ctr/day=2026-11-25/part-*.parquet" in out
    assert "{date" not in out
    assert main(["print-config", "--config", str(job), "--set", "data.date='2026-01-01'", "--date", "2026-11-27"]) == 0
    assert 'date = "2026-11-27"' in capsys.readouterr().out                       # the later one wins


@pytest.mark.parametrize("argv", [
    ["print-config", "--config", "JOB", "--date", "2026-13-01"],
    ["train", "--config", "JOB", "--date", "2026/11/26"],
    ["eval", "--run", "r", "--data", "d", "--date", "yesterday"],
    ["predict", "--run", "r", "--data", "d", "--out", "o", "--date", "2026-02-30"],
])
def test_bad_date_flag_is_one_error_line(job: Path, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(job) if a == "JOB" else a for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: argument --date: expected a date YYYY-MM-DD")


def test_missing_date_is_one_error_line(job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["print-config", "--config", str(job)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.train_paths[0]" in err and "pass --date YYYY-MM-DD or set data.date" in err
    assert main(["eval", "--run", str(tmp_path / "runs/{date-1}"), "--data", "d/day={date}/"]) == 2   # --run, --data
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--run" in err and "{date-1}" in err and "pass --date" in err
    assert main(["eval", "--run", str(tmp_path / "nope-{date-1}"), "--data", "d", "--date", "2026-11-27"]) == 2
    assert "nope-2026-11-26" in capsys.readouterr().err                               # filled, then looked up
