"""Validation during training, early stopping, the best model and test scoring, for real: shard
processes and trainers (sync and async, 2 x 2), and across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.rundir import best_dir, has_best
from recsys.training.checkpoint import list_checkpoints, read_manifest
from recsys.training.evaluate import evaluate_run
from recsys.training.launch import launch_train

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def job(tmp_path: Path, data: Path, *extra: str):
    return load_config(ROOT / "tests" / "fixtures" / "deepfm_onehot_lazy_decay.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"data.test_paths=['{data}/part-00002.parquet']", "data.batch_size=128",
        f"train.run_dir='{tmp_path / 'run'}'", "train.num_threads=1", "train.log_every=10", *extra])


def val_lines(run: Path) -> list[dict]:
    return [x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val/logloss" in x]


@pytest.mark.parametrize("mode", ["sync", "async", "async_cache"])
def test_early_stopping_keeps_the_best_model_and_scores_the_test_set(tmp_path: Path, tiny_dataset, mode: str) -> None:
    data = tiny_dataset(rows=6000, files=3, seed=1, preset="longtail")
    # async_cache: a trainer-side row cache serving rows up to 3 steps old; validation scores the
    # shards' rows (Trainer.scoring_store), the ones RUN_DIR/best saves, not the cache's
    cache = ("ps.table_defaults.cache_rows=64", "ps.max_staleness=4") if mode == "async_cache" else ()
    cfg = job(tmp_path, data, f"ps.mode='{mode.split('_')[0]}'", "ps.num_shards=2", "train.num_trainers=2",
              "ps.table_defaults.weight_decay=0.0", "train.epochs=12", "train.validate_every=4",
              "train.early_stop_patience=2", *cache)
    launch_train(cfg)
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    vals = val_lines(run)
    losses = [v["val/logloss"] for v in vals]
    best = min(range(len(losses)), key=losses.__getitem__)
    # stopped early: two passes after the best one, long before 12 epochs
    assert metrics["early_stopped"] == 1.0 and len(losses) == best + 3
    assert metrics["best_step"] == vals[best]["step"] and metrics["best_val_logloss"] == pytest.approx(losses[best])
    # RUN_DIR/best is the best pass's model: eval on the validation data gives that pass's logloss
    assert has_best(run) and read_manifest(best_dir(run))["step"] == vals[best]["step"]
    again = evaluate_run(run, [f"{data}/part-00001.parquet"], out=str(tmp_path / "eval.json"))
    assert again["logloss"] == pytest.approx(losses[best], abs=1e-6)
    last = evaluate_run(run, [f"{data}/part-00001.parquet"], out=str(tmp_path / "eval_last.json"), last=True)
    assert last["logloss"] != pytest.approx(losses[best], abs=1e-6)
    test = metrics["test"]
    assert test["model"] == "best" and test["step"] == vals[best]["step"] and test["examples"] == 2000
    assert 0.5 < test["auc"] < 1.0 and set(test) >= {"auc", "logloss", "ne", "calibration"}


def test_best_so_far_and_patience_survive_a_resume(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=6000, files=3, seed=1, preset="longtail")
    common = ("ps.table_defaults.weight_decay=0.0", "train.validate_every=16", "train.early_stop_patience=50",
              "train.checkpoint_every=16", "train.checkpoint_background=false")
    launch_train(job(tmp_path, data, *common, "train.max_steps=48"))
    run = tmp_path / "run"
    first = val_lines(run)
    assert [v["step"] for v in first] == [16, 32, 48]
    resumed = launch_train(job(tmp_path, data, *common, "train.max_steps=96"), resume="latest")
    vals = val_lines(run)
    assert [v["step"] for v in vals] == [16, 32, 48, 64, 80, 96]
    losses = [v["val/logloss"] for v in vals]
    # the resumed run's record counts the first run's passes: its best is over all six
    assert resumed["val_passes"] == 6.0
    assert resumed["best_val_logloss"] == pytest.approx(min(losses))
    assert read_manifest(best_dir(run))["step"] == vals[losses.index(min(losses))]["step"]
    assert list_checkpoints(run)
