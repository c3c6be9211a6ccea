"""Click probabilities of a model trained on negatively downsampled data (`data.negative_sampling_rate` r;
its two corrections: docs/models.md, "Example weights and negative downsampling"). Under "calibrate" the
model learns p = p_true / (p_true + (1 - p_true) r), recovered as p' = p / (p + (1 - p) / r) =
sigmoid(logit + log r) (He et al., 2014, "Practical Lessons from Predicting Clicks on Ads at Facebook").

`score_rate` is the r the scores are corrected by (1.0: none). Eval, validation and `recsys predict`
(recsys/training) take it from the job config; the `Predictor` (recsys/serving) from the export
manifest's "calibration" section, which `manifest_section` writes. With r = 1 `probabilities` is
exactly `torch.sigmoid(logits)`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from data.config import DataConfig


def score_rate(rate: float, correction: str) -> float:
    """The r that scores are corrected by: `rate` under "calibrate", 1.0 under "weight"."""
    return rate if correction == "calibrate" else 1.0


def data_score_rate(data: DataConfig) -> float:
    """`score_rate` of a job's data section."""
    return score_rate(data.negative_sampling_rate, data.negative_sampling_correction)


def probabilities(logits: torch.Tensor, rate: float) -> torch.Tensor:
    """Calibrated click probabilities [B] of logits [B]: sigmoid(logit + log rate); sigmoid(logit) at rate 1."""
    return torch.sigmoid(logits if rate == 1.0 else logits + math.log(rate))


def calibrate(p: torch.Tensor, rate: float) -> torch.Tensor:
    """p / (p + (1 - p) / rate): the same correction on probabilities [N] (p itself at rate 1)."""
    return p if rate == 1.0 else p / (p + (1 - p) / rate)


def manifest_section(data: DataConfig) -> dict[str, Any]:
    """The export manifest's "calibration": the training data's negative sampling rate and how it is
    corrected (serving corrects scores by `manifest_score_rate` of it)."""
    return {"negative_sampling_rate": data.negative_sampling_rate,
            "correction": data.negative_sampling_correction}


def manifest_score_rate(manifest: dict[str, Any]) -> float:
    """The r serving corrects scores by, from an export manifest (1.0 for exports made before the
    "calibration" section existed: their models were trained on data as it came)."""
    section = manifest.get("calibration")
    if section is None:
        return 1.0
    return score_rate(float(section["negative_sampling_rate"]), section["correction"])


__all__ = ["score_rate", "data_score_rate", "probabilities", "calibrate", "manifest_section", "manifest_score_rate"]
