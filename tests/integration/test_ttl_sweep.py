"""Tables with ttl_steps get swept during training: rows unseen for ttl_steps are dropped."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.training.launch import launch_train

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def rows_of(run: Path, table: str) -> int:
    stats = json.loads((run / "ps_stats.json").read_text())
    return sum(s["state"][f"{table}/rows"] for s in stats)


def test_ttl_rows_are_swept(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=8000, files=1, seed=6)
    base = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", "data.batch_size=64", "train.log_every=5",
        "train.max_steps=100"])
    results = {}
    for ttl in (0, 3):
        tables = tuple(dataclasses.replace(t, ttl_steps=ttl) if t.name == "C4" else t for t in base.ps.tables)
        cfg = dataclasses.replace(base, ps=dataclasses.replace(base.ps, tables=tables),
                                  train=dataclasses.replace(base.train, run_dir=str(tmp_path / f"ttl{ttl}")))
        launch_train(cfg)
        results[ttl] = rows_of(tmp_path / f"ttl{ttl}", "C4")
    # C4 has 10,000 ids, mostly rare: with ttl 3 only ids seen in the last few steps survive
    assert 0 < results[3] < results[0] / 3, results
