"""Offline evaluation of a run (`recsys eval`, `recsys predict`): the saved model scores Parquet data.

The saved PS shards are loaded into in-process shard states (same sharding as in training), the
dense state into the model, and the trainer's own forward path scores the data, so offline
scores are the training job's scores, not a re-implementation of them (calibrated as `Trainer.score`,
weighted as `recsys.metrics` says; docs/models.md "Example weights and negative downsampling").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path

import torch

from embedding_ps.local import LocalStore
from recsys.config import ConfigError, JobConfig, load_config
from recsys.rundir import model_root
from recsys.serving.offline import write_scores
from recsys.training.trainer import Trainer
from recsys.training.worker import saved_replicated

logger = logging.getLogger(__name__)


def open_run(run_dir: str | Path, last: bool = False, keep: tuple[str, ...] = ()) -> tuple[JobConfig, Trainer]:
    """The run's resolved config and a trainer holding its model (no processes started): the best
    validation pass's (RUN_DIR/best) when the run kept one and not `last`, else the last model.
    `keep`: columns added to data.passthrough_columns (carried beside the scores)."""
    run = model_root(run_dir, last)
    model_dir = run / "model"
    for needed in (run / "config.toml", model_dir / "dense.pt", model_dir / "ps"):
        if not needed.exists():
            raise ConfigError(f"{run}: not a finished run, {needed} is missing")
    logger.info("using the %s model of %s", "best" if run != Path(run_dir) else "last", run_dir)
    cfg = load_config(run / "config.toml")
    if keep:
        cfg = dataclasses.replace(cfg, data=cfg.data.with_passthrough(keep))
    store = LocalStore.from_dir(cfg.ps, model_dir / "ps")
    trainer = Trainer(cfg, store, replicated_state=saved_replicated(model_dir), scoring_only=True)
    trainer.model.load_state_dict(torch.load(model_dir / "dense.pt", weights_only=True))
    return cfg, trainer


def evaluate_run(run_dir: str | Path, data: list[str], out: str | None = None,
                 last: bool = False) -> dict[str, float]:
    _, trainer = open_run(run_dir, last)
    with contextlib.closing(trainer):    # two_tower: recall@K / ndcg@K over data.item_paths (training/retrieval.py)
        metrics = trainer.evaluate(tuple(data))      # ValueError "no rows in [...]" before anything is written
    path = Path(out) if out else Path(run_dir) / "eval_metrics.json"
    path.write_text(json.dumps(metrics, indent=1))
    logger.info("eval on %s: %s (written to %s)", data, metrics, path)
    return metrics


def predict_run(run_dir: str | Path, data: list[str], out: str, last: bool = False, keep: tuple[str, ...] = ()) -> int:
    """Write `score` (click probabilities, calibrated for data.negative_sampling_rate) plus the
    configured passthrough columns and the `keep` columns to the Parquet file `out`."""
    if not Path(out).parent.is_dir():        # before any work, and naming --out (not the .tmp written first)
        raise ConfigError(f"--out {out}: the directory {Path(out).parent} does not exist")
    cfg, trainer = open_run(run_dir, last, keep)
    with contextlib.closing(trainer):
        _, scores, extras = trainer.predict(tuple(data))
    n = write_scores(out, scores.numpy(), {c: extras[c] for c in cfg.data.passthrough_columns if c in extras})
    logger.info("wrote %d scores to %s", n, out)
    return n
