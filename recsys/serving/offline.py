"""`recsys eval --export` / `recsys predict --export`: the serving model (an export, a directory or a
URI) scores Parquet data, so what is evaluated is what serves (quantized tables included), not the
training run it came from.

Rows are decoded as in training (`data.decode`: the export's data config, one row group at a time)
and scored by `Predictor.predict` (calibrated); the metrics are the trainer's
(`recsys.metrics.eval_metrics`, weighted by `data.example_weight_column` when the files have it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from data.batch import Batch
from data.config import DataConfig
from data.decode import TableDecoder
from data.parquet import resolve_paths, scoring_config
from data.remote import parquet_file
from recsys.config import ConfigError
from recsys.metrics import eval_metrics
from recsys.serving.predictor import Predictor

logger = logging.getLogger(__name__)


def _batches(cfg: DataConfig, data: list[str]) -> Iterator[Batch]:
    decoder = TableDecoder(cfg)
    files = resolve_paths(data)
    if not files:
        raise ConfigError(f"--data {data}: no Parquet files")
    for path in files:
        with parquet_file(path) as pf:
            for rg in range(pf.num_row_groups):
                yield decoder.decode(pf.read_row_group(rg), f"{path} row group {rg}")


def evaluate_export(export: str | Path, data: list[str], out: str | Path | None = None) -> dict[str, float]:
    """auc, logloss, ne, calibration, eval_examples of the export's scores on `data` (also written to
    `out` when given)."""
    p = Predictor(export)
    if p.config.model.arch == "two_tower":
        raise ConfigError(f"--export {export}: a two-tower export ranks items (recsys eval --run scores "
                          f"recall@K); eval --export scores CTR models")
    labels, scores, weights = [], [], []
    for batch in _batches(scoring_config(p.config.data, data), data):
        labels.append(batch.labels)
        scores.append(torch.from_numpy(p.predict(batch)))
        if batch.example_weights is not None:
            weights.append(batch.example_weights)
    if not labels or sum(x.numel() for x in labels) == 0:
        raise ValueError(f"no rows in {data}")
    metrics = eval_metrics(torch.cat(labels), torch.cat(scores).double(), None,
                           exact_auc=p.config.train.eval_auc == "exact",
                           weights=torch.cat(weights) if weights else None)
    if out is not None:
        Path(out).write_text(json.dumps(metrics, indent=1))
    logger.info("eval of export %s on %s: %s", export, data, metrics)
    return metrics


def predict_export(export: str | Path, data: list[str], out: str | Path, keep: tuple[str, ...] = ()) -> int:
    """`score` (calibrated click probabilities) plus data.passthrough_columns and the `keep` columns of
    `data`, by the export, to the Parquet file `out`."""
    if not Path(out).parent.is_dir():
        raise ConfigError(f"--out {out}: the directory {Path(out).parent} does not exist")
    p = Predictor(export)
    cfg = scoring_config(p.config.data, data).with_passthrough(keep)
    scores: list[np.ndarray] = []
    extras: dict[str, list[np.ndarray]] = {name: [] for name in cfg.passthrough_columns}
    for batch in _batches(cfg, data):
        scores.append(p.predict(batch))
        for name in extras:
            if name in batch.extras:
                extras[name].append(batch.extras[name])
    n = write_scores(out, np.concatenate(scores) if scores else np.zeros(0, np.float32),
                     {name: np.concatenate(parts) for name, parts in extras.items() if parts})
    logger.info("wrote %d scores of export %s to %s", n, export, out)
    return n


def write_scores(out: str | Path, scores: np.ndarray, extras: dict[str, np.ndarray]) -> int:
    """The Parquet file `out` (written whole, then renamed): float32 `score` and the data columns `extras`
    beside it (`Batch.extras`: integer columns with nulls come as objects, ints and None, and go back to
    integers); returns the row count."""
    columns = {"score": pa.array(scores.astype(np.float32, copy=False))}
    for name, values in extras.items():
        try:
            columns[name] = pa.array(values)
        except OverflowError:                       # uint64 ids past int64, with nulls
            columns[name] = pa.array(values, pa.uint64())
    tmp = Path(out).with_suffix(".tmp")
    pq.write_table(pa.table(columns), tmp)
    tmp.replace(out)
    return len(scores)


__all__ = ["evaluate_export", "predict_export", "write_scores"]
