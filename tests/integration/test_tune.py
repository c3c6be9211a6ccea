"""`recsys tune` for real: Ray Tune on 127.0.0.1 running 4 trials of configs/tiny.toml, 2 at a time,
ASHA on: the CSV, best.toml, the plot, a trial stopped by ASHA recorded as
stopped, a failing trial recorded as an error while the others go on, and a resume of the finished
search (tests/unit/recsys/training/test_tune.py: the same without Ray); then README.md's two commands as written
(8 trials of configs/tune_deepfm.toml, its best.toml trained)."""

from __future__ import annotations

import csv
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.config import load_config

pytestmark = pytest.mark.integration
pytest.importorskip("ray.tune")

ROOT = Path(__file__).resolve().parents[2]
TUNE_TIMEOUT_S = 240


def recsys(cwd: Path, *args: str, timeout: float = TUNE_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",     # cwd is the test's directory:
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))   # this checkout
    return subprocess.run([sys.executable, "-m", "recsys.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def tiny_args(data: Path) -> list[str]:
    """configs/tiny.toml on `data`, its tables from [ps.table_defaults] (which the space searches), 2 epochs."""
    sets = [f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
            "ps.tables=[]", "ps.table_defaults.dim=8", "train.epochs=2", "train.num_threads=1"]
    return ["--config", str(ROOT / "configs" / "tiny.toml"), *(x for s in sets for x in ("--set", s))]


def our_processes(marker: str) -> list[str]:
    """Command lines of live processes that name `marker` (a test's directory)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if pid.isdigit() and int(pid) != os.getpid() and marker in cmd:
            found.append(cmd)
    return found


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_tune_four_trials_asha_results_and_a_best_config_that_trains(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=4000, files=2, seed=5)
    # two good dense learning rates first, then one that learns nothing (it reaches ASHA's first rung after
    # both good ones and trails them there, so ASHA stops it) and one whose loss is not finite (its job fails)
    (tmp_path / "space.toml").write_text('"train.dense_lr" = { grid = [0.01, 0.01, 1e-7, 1e30] }\n'
                                         '"ps.table_defaults.lr" = { loguniform = [0.04, 0.08] }\n')
    cmd = ["tune", *tiny_args(data), "--space", "space.toml", "--trials", "1", "--max-concurrent", "2",
           "--out", "tune"]
    try:
        run = recsys(tmp_path, *cmd)
        assert run.returncode == 0, run.stderr[-3000:]
        rows = read_csv(tmp_path / "tune" / "results.csv")
        assert len(rows) == 4 and [float(r["train.dense_lr"]) for r in rows] == [0.01, 0.01, 1e-7, 1e30]
        assert all(0.04 <= float(r["ps.table_defaults.lr"]) <= 0.08 for r in rows)
        assert all(Path(r["run_dir"]).parent == tmp_path / "tune" / "trials" for r in rows)
        good, bad, failed = rows[:2], rows[2], rows[3]
        assert bad["status"] == "stopped" and bad["error"] == "", rows
        assert "terminated" in [r["status"] for r in good] and all(r["error"] == "" for r in good), rows
        assert float(bad["best_val/logloss"]) > max(float(r["best_val/logloss"]) for r in good) + 0.05, rows
        assert failed["status"] == "error" and failed["best_val/logloss"] == "", rows
        assert f"trial {failed['trial_id']}: job exited 2: error:" in failed["error"], failed["error"]
        best = min(good, key=lambda r: float(r["best_val/logloss"]))
        assert f"best: trial {best['trial_id']}" in run.stdout
        assert (tmp_path / "tune" / "trials.png").stat().st_size > 1000
        # best.toml: complete (no base config, no overrides); that it trains as written: the README test below
        cfg = load_config(tmp_path / "tune" / "best.toml")
        assert cfg.train.dense_lr == 0.01 and cfg.train.run_dir == "tune/best-run"
        assert {t.lr for t in cfg.ps.tables} == {float(best["ps.table_defaults.lr"])}
        # the same command again resumes the search: nothing left to run, the same results
        again = recsys(tmp_path, *cmd)
        assert again.returncode == 0 and "resuming the search" in again.stderr, again.stderr[-3000:]
        assert read_csv(tmp_path / "tune" / "results.csv") == rows
        assert our_processes(str(tmp_path)) == []          # no job, shard or trainer left behind
    finally:
        for cmdline in our_processes(str(tmp_path)):
            print("left behind:", cmdline)


def readme_commands(prefix: str) -> list[list[str]]:
    """README.md's `recsys tune` / `recsys train` lines of its "Hyperparameter search" block, as argv."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Hyperparameter search"):]
    block = block[block.index("```bash"):]
    block = block[:block.index("```", 7)]
    return [shlex.split(line)[1:] for line in block.splitlines() if line.startswith(prefix)]


def test_the_readmes_tune_commands_run_as_written(tmp_path: Path, tiny_dataset) -> None:
    """README.md's two commands, verbatim, in a directory whose `demo/data` is criteo-like data of the demo's
    shape (4 files, as `recsys demo` writes) but 2,048 rows a file: 8 trials of configs/tune_deepfm.toml, then
    its best.toml trained as written."""
    tune, train = readme_commands("recsys tune ") + readme_commands("recsys train ")
    assert tune[0] == "tune" and train == ["train", "--config", "runs/tune-deepfm/best.toml"], (tune, train)
    data = tiny_dataset(rows=8192, files=4, seed=0, preset="criteo-like")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "data").symlink_to(data, target_is_directory=True)
    # the README's paths are relative to the checkout (configs/...): here they are given from the test's directory
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    try:
        run = recsys(tmp_path, *tune, timeout=420)
        assert run.returncode == 0, run.stderr[-3000:]
        rows = read_csv(tmp_path / "runs" / "tune-deepfm" / "results.csv")
        assert len(rows) == 8 and {r["status"] for r in rows} <= {"terminated", "stopped"}, rows
        assert all(r["error"] == "" and float(r["best_val/auc"]) > 0.5 for r in rows), rows
        done = recsys(tmp_path, *train, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / "runs" / "tune-deepfm" / "best-run" / "metrics.json").exists()
    finally:
        for cmdline in our_processes(str(tmp_path)):
            print("left behind:", cmdline)


def test_a_space_of_discrete_keys_runs_each_combination_once(tmp_path: Path, tiny_dataset) -> None:
    """2 x 2 choices and --trials 6: four trials, one per combination (drawn independently, as Ray Tune
    samples, some would repeat), and a line saying so."""
    data = tiny_dataset(rows=4000, files=2, seed=5)
    (tmp_path / "space.toml").write_text('"model.dropout" = { choice = [0.0, 0.2] }\n'
                                         '"train.seed" = { choice = [1, 2] }\n')
    try:
        run = recsys(tmp_path, "tune", *tiny_args(data), "--space", "space.toml", "--trials", "6",
                     "--max-concurrent", "2", "--out", "tune")
        assert run.returncode == 0, run.stderr[-3000:]
        assert "the space has 4 distinct trials: each runs once (--trials 6)" in run.stderr
        rows = read_csv(tmp_path / "tune" / "results.csv")
        assert sorted((float(r["model.dropout"]), int(r["train.seed"])) for r in rows) == \
            [(0.0, 1), (0.0, 2), (0.2, 1), (0.2, 2)], rows
    finally:
        for cmdline in our_processes(str(tmp_path)):
            print("left behind:", cmdline)
