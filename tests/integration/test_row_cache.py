"""The row cache through the launcher: 2 trainers, 2 shards, async, prefetch depth 2, validation with
a best model that the test scoring LOADs (the trainers' caches are dropped then)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.training.launch import launch_train

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_cached_async_training_learns_and_logs_hit_rates(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=60000, files=3, seed=1)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"data.test_paths=['{data}/part-00002.parquet']", "train.validate_every=20",
        f"train.run_dir='{tmp_path / 'run'}'", "ps.mode='async'", "ps.max_staleness=3",
        "train.pull_ahead_batches=2", "ps.table_defaults.cache_rows=64", "train.num_trainers=2",
        "ps.num_shards=2", "train.epochs=2", "train.log_every=5",
    ])
    assert all(t.cache_rows == 64 for t in cfg.ps.tables)
    metrics = launch_train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "loss/train" in x]
    assert len(train_lines) >= 10
    losses = [x["loss/train"] for x in train_lines]
    assert sum(losses[-3:]) / 3 < sum(losses[:2]) / 2 - 0.1, f"loss did not go down: {losses}"
    assert metrics["auc"] > 0.72 and metrics["test"]["auc"] > 0.72, metrics
    for x in train_lines:
        assert {"cache/hit_rate", "cache/C1/hit_rate", "cache/M1/hit_rate", "time/data_wait_ms",
                "time/ps_wait_ms"} <= x.keys()
    # C1 has a few hundred Zipf ids: with rows serving 1 later step the cache hits often
    assert max(x["cache/C1/hit_rate"] for x in train_lines) > 0.2
    for shard in json.loads((tmp_path / "run" / "ps_stats.json").read_text()):
        assert 0 <= shard["max_pull_lead"] <= cfg.ps.max_staleness, shard
