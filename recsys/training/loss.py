"""The CTR training loss: sum_i w_i * BCE(logit_i, y_i) / B over the batch's B rows (docs/models.md
"Example weights and negative downsampling"); `row_weights` gives w, `ctr_loss` the loss.

The normalization is B, not sum(w): sync mode scales each rank's loss by its share of the global batch
(`Trainer.train_step`), which makes W trainers equal one process on the concatenated batch only for a
sum over rows divided by the row count. Without weights (None) this is `nn.BCEWithLogitsLoss()`
exactly, and weights of 1.0 give the same bits (torch multiplies each row's loss by its weight before the mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from data.config import DataConfig


def negative_weight(data: DataConfig) -> float:
    """The loss weight of a negative (label 0) row: 1 / r under correction "weight" and r < 1, else 1.0."""
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
