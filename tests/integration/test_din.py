"""#17's DIN target, for real (`recsys train`'s launcher: a shard process and a trainer process): on the
`sequence` preset, DIN (configs/din.toml as it is, on 100k training rows) reaches an eval AUC of at
least 0.98x the planted oracle's, and beats DeepFM without the behavior list by at least 0.10 AUC.

Measured while writing this (shared 2-core machine; same data, seed 0; eval AUC / oracle 0.8275):
DIN 0.8146 (0.984x oracle), 3 epochs; DeepFM on (ctx, item, I1) 0.6199: DIN ahead by 0.19.
(Export and Predictor of DIN: tests/unit/recsys/serving/test_export_din.py.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.sequence import generate_sequence
from recsys.config import JobConfig, load_config
from recsys.training.launch import launch_train

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)

ORACLE_RATIO = 0.98
MARGIN = 0.10          # measured 0.19


def job(run: Path, data: Path, *extra: str) -> JobConfig:
    return load_config(ROOT / "configs" / "din.toml", [
        f"data.train_paths=['{data}/part-00000.parquet', '{data}/part-00001.parquet']",
        f"data.eval_paths=['{data}/part-00002.parquet']", f"train.run_dir='{run}'", "train.num_threads=1",
        "train.log_every=100", *extra])


def test_din_reaches_the_oracle_and_beats_deepfm_without_the_sequence(tmp_path: Path) -> None:
    data = tmp_path / "data"
    summary = generate_sequence(rows=150000, num_files=3, out_dir=str(data), seed=0)   # the config's header command
    din = launch_train(job(tmp_path / "din", data))
    deepfm = launch_train(job(tmp_path / "deepfm", data, "model.arch=deepfm", "model.sequence_features={}",
                              "data.sparse_columns=['ctx', 'item']"))
    logger.info("oracle %.4f (all rows %.4f), DIN %.4f, DeepFM without hist %.4f", din["oracle_auc"],
                summary["oracle_auc"], din["auc"], deepfm["auc"])
    assert din["oracle_auc"] == pytest.approx(deepfm["oracle_auc"])          # the same eval rows
    assert din["auc"] >= ORACLE_RATIO * din["oracle_auc"], (din, deepfm)
    assert din["auc"] >= deepfm["auc"] + MARGIN, (din, deepfm)
