"""Run directories that cannot be mixed up (#27 item 5): a run id everywhere, one launcher per run
directory, a reused directory refused (or moved aside with --overwrite), exports and deltas of another
run refused. Each refusal: exit 2, one `error:` line naming the file or holder, every pre-existing file
unchanged (sha256).

Real jobs through the CLI entry (`recsys.cli.main`: 1 PS shard process + 1 trainer on 127.0.0.1).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsys import cli

from .conftest import file_hashes, one_error_line

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _argv(run: Path, data: Path, *extra: str) -> list[str]:
    argv = ["train", "--config", str(ROOT / "configs" / "tiny.toml"),
            "--set", f"data.train_paths=['{data}/part-00000.parquet']", "--set", "data.eval_paths=[]",
            "--set", "data.batch_size=128", "--set", f"train.run_dir='{run}'", "--set", "train.num_threads=1",
            "--set", "train.checkpoint_every=4"]
    return argv + list(extra)


@pytest.fixture(scope="module")
def data(tiny_dataset) -> Path:
    return tiny_dataset(rows=2000, files=2, seed=17)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory, data: Path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    for name in ("a", "b"):
        assert cli.main(_argv(root / name, data, "--set", "train.max_steps=8")) == 0
    return root / "a", root / "b"


def test_a_run_id_in_config_checkpoints_metrics_and_exports(two_runs, tmp_path: Path) -> None:
    a, b = two_runs
    run_id = json.loads((a / "metrics.json").read_text())["run_id"]
    assert len(run_id) == 16 and run_id != json.loads((b / "metrics.json").read_text())["run_id"]
    assert f'run_id = "{run_id}"' in (a / "config.toml").read_text()
    for ckpt in (a / "checkpoints").iterdir():
        assert json.loads((ckpt / "manifest.json").read_text())["run_id"] == run_id
    assert cli.main(["export", "--run", str(a), "--out", str(tmp_path / "ea")]) == 0
    assert json.loads((tmp_path / "ea" / "manifest.json").read_text())["run_id"] == run_id


def test_reusing_a_run_dir_is_refused_and_overwrite_moves_it_aside(two_runs, data: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    a, _ = two_runs
    run = tmp_path / "run"
    assert cli.main(_argv(run, data, "--set", "train.max_steps=4")) == 0
    before = file_hashes(run)
    capsys.readouterr()
    assert cli.main(_argv(run, data, "--set", "train.max_steps=4")) == 2
    line = one_error_line(capsys)
    assert str(run) in line and "--resume" in line and "--overwrite" in line
    assert file_hashes(run) == before
    old_id = json.loads((run / "metrics.json").read_text())["run_id"]
    assert cli.main(_argv(run, data, "--set", "train.max_steps=4", "--overwrite")) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and file_hashes(aside[0]) == {k: v for k, v in before.items() if k != ".lock"}
    new_id = json.loads((run / "metrics.json").read_text())["run_id"]
    assert new_id != old_id
    # --resume continues the same run (same id) in the same directory
    assert cli.main(_argv(run, data, "--set", "train.max_steps=8", "--resume", "latest")) == 0
    resumed = json.loads((run / "metrics.json").read_text())
    assert resumed["steps"] == 8 and resumed["run_id"] == new_id
    assert f'run_id = "{new_id}"' in (run / "config.toml").read_text()


def test_a_second_launcher_is_refused_naming_the_holder(tmp_path: Path, data: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "recsys.cli", *_argv(run, data, "--set", "train.epochs=200")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (run / "ps-0.ready").exists():          # the first launcher holds the lock and runs
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        before = file_hashes(run)
        capsys.readouterr()
        assert cli.main(_argv(run, data, "--resume", "latest")) == 2
        line = one_error_line(capsys)
        assert f"pid {first.pid}" in line and "host" in line and ".lock" in line
        after = file_hashes(run)
        # the first job keeps writing its own files; none of the refused launcher's appeared or changed
        assert after[".lock"] == before[".lock"] and after["config.toml"] == before["config.toml"]
    finally:
        first.terminate()
        first.wait(timeout=60)


def test_foreign_deltas_and_exports_of_another_run_are_refused(two_runs, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    a, b = two_runs
    for run, name in ((a, "base_a"), (b, "base_b")):
        assert cli.main(["export", "--run", str(run), "--out", str(tmp_path / name)]) == 0
    assert cli.main(["export", "--run", str(b), "--out", str(tmp_path / "delta_b"), "--since", "4"]) == 0
    before = file_hashes(tmp_path)
    capsys.readouterr()
    # b's delta onto a's base
    assert cli.main(["export-apply", str(tmp_path / "base_a"), str(tmp_path / "delta_b"),
                     "--out", str(tmp_path / "merged")]) == 2
    line = one_error_line(capsys)
    assert "delta_b" in line and "base_a" in line and "run" in line
    # b's export over a's
    assert cli.main(["export", "--run", str(b), "--out", str(tmp_path / "base_a")]) == 2
    assert "base_a" in one_error_line(capsys)
    assert file_hashes(tmp_path) == before
    from recsys.serving.predictor import Predictor
    from recsys.serving.errors import ExportError

    with pytest.raises(ExportError, match="delta of run"):
        Predictor(tmp_path / "base_a", deltas=[tmp_path / "delta_b"])
    Predictor(tmp_path / "base_b", deltas=[tmp_path / "delta_b"])          # its own run's delta applies
    assert cli.main(["export", "--run", str(b), "--out", str(tmp_path / "base_a"), "--overwrite"]) == 0
