"""The CTR training loss: binary cross-entropy per row, weighted, averaged over the batch's rows.

    weights = row_weights(labels, batch.example_weights, cfg.data)    # float32 [B] or None
    loss = ctr_loss(logits, labels, weights)                           # scalar

    loss = sum_i w_i * BCE(logit_i, y_i) / B

w_i = the row's example weight (`data.example_weight_column`, 1 without one), times 1 / r on a
negative (label 0) when `data.negative_sampling_correction = "weight"` and the data's negatives were
kept with probability r < 1 (a row whose label is above 0 is not a negative: it weighs 1).

The normalization is B, the rows of the batch, not sum(w): the trainer's sync mode scales each
rank's loss by its share of the global batch (`Trainer._batch_share`), which makes W trainers equal
one process on the concatenated batch only for a sum over rows divided by the row count. With no
weights (None) this is `nn.BCEWithLogitsLoss()` exactly, and weights of 1.0 give the same bits
(torch multiplies each row's loss by its weight before the mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from data.config import DataConfig


def negative_weight(data: DataConfig) -> float:
    """The loss weight of a negative row: 1 / r under correction "weight", else 1.0."""
    r = data.negative_sampling_rate
    return 1.0 / r if data.negative_sampling_correction == "weight" and r < 1.0 else 1.0


def row_weights(labels: torch.Tensor, example_weights: torch.Tensor | None, data: DataConfig) -> torch.Tensor | None:
    """float32 [B] loss weight of each row (labels [B], example_weights [B] or None), on labels' device;
    None when every row weighs 1 (no example weights and no negative weighting)."""
    neg = negative_weight(data)
    w = None if example_weights is None else example_weights.to(labels.device, torch.float32)
    if neg == 1.0:
        return w
    scale = torch.where(labels == 0, neg, 1.0).to(torch.float32)      # [B], on labels' device
    return scale if w is None else w * scale


def ctr_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """sum_i w_i * BCE(logits_i, labels_i) / B (logits, labels, weights [B]); the plain mean without weights."""
    return F.binary_cross_entropy_with_logits(logits, labels, weight=weights)


__all__ = ["ctr_loss", "negative_weight", "row_weights"]
