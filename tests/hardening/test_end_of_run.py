"""The end of a run loses nothing (#27): the final model is written before the final eval, a failing
eval is one `error:` line (exit 2) with model/ intact, `--resume latest` over corrupt checkpoints only is
an error listing them (nothing overwritten), and train.max_steps past the data says "end of data".

Real jobs through the CLI entry (`recsys.cli.main`: 1 PS shard process + 1 trainer on 127.0.0.1).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys import cli

from .conftest import file_hashes, one_error_line

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tiny_dataset) -> Path:
    return tiny_dataset(rows=2000, files=2, seed=13)


def _train(tmp: Path, data: Path, *sets: str, config: str | None = None) -> int:
    argv = ["train", "--config", config or str(ROOT / "configs" / "tiny.toml"),
            "--set", f"data.train_paths=['{data}/part-00000.parquet']",
            "--set", f"data.eval_paths=['{data}/part-00001.parquet']", "--set", "data.batch_size=128",
            "--set", f"train.run_dir='{tmp / 'run'}'", "--set", "train.num_threads=1"]
    for s in sets:
        argv += ["--set", s]
    return cli.main(argv)


def test_a_failing_final_eval_keeps_the_trained_model(tmp_path: Path, data: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """The eval file's footer is fine (preflight passes), a label in its rows is not: the trainer stops
    at the final eval with one error line, and RUN_DIR/model holds the trained model."""
    table = pq.read_table(data / "part-00001.parquet")
    labels = table.column("label").to_numpy().astype("float32")
    labels[500] = 7.0
    bad = tmp_path / "eval_bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels)), bad)
    rc = _train(tmp_path, data, f"data.eval_paths=['{bad}']")
    assert rc == 2
    line = one_error_line(capsys)
    assert "eval_bad.parquet" in line and "label" in line
    model = tmp_path / "run" / "model"
    assert (model / "dense.pt").is_file() and (model / "ps" / "shard0").is_dir()
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_resume_latest_with_only_corrupt_checkpoints_is_an_error_that_touches_nothing(
        tmp_path: Path, data: Path, capsys: pytest.CaptureFixture) -> None:
    assert _train(tmp_path, data, "train.checkpoint_every=4", "train.max_steps=8", "data.eval_paths=[]") == 0
    ckpts = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step-0000000004", "step-0000000008"]
    for c in ckpts:                                 # damage both
        dense = c / "model" / "dense.pt"
        raw = bytearray(dense.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        dense.write_bytes(bytes(raw))
    capsys.readouterr()
    before = file_hashes(tmp_path / "run")
    argv_resume = ["--resume", "latest"]
    rc = cli.main(["train", "--config", str(ROOT / "configs" / "tiny.toml"), *argv_resume,
                   "--set", f"data.train_paths=['{data}/part-00000.parquet']", "--set", "data.eval_paths=[]",
                   "--set", f"train.run_dir='{tmp_path / 'run'}'", "--set", "train.checkpoint_every=4"])
    assert rc == 2
    line = one_error_line(capsys)
    assert "none of the 2 checkpoints" in line and "step-0000000004" in line and "step-0000000008" in line
    assert file_hashes(tmp_path / "run") == before


def test_max_steps_past_the_data_says_end_of_data(tmp_path: Path, data: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert _train(tmp_path, data, "train.max_steps=600", "train.epochs=1", "data.eval_paths=[]") == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["stopped"] == "end of data" and metrics["steps"] < 600
    shutil.rmtree(tmp_path / "run")
    assert _train(tmp_path, data, "train.max_steps=3", "data.eval_paths=[]") == 0
    assert "stopped" not in json.loads((tmp_path / "run" / "metrics.json").read_text())
