"""The CTR loss (recsys/training/loss.py): weighted BCE over the batch's rows, normalized by B."""

import math

import pytest
import torch
from torch import nn

from data.config import DataConfig
from recsys.training.loss import ctr_loss, negative_weight, row_weights

WEIGHT = DataConfig(negative_sampling_rate=0.25, negative_sampling_correction="weight")


def bce(x: float, y: float) -> float:
    """-(y log sigmoid(x) + (1 - y) log(1 - sigmoid(x))) in float64."""
    return y * math.log1p(math.exp(-x)) + (1 - y) * math.log1p(math.exp(x))


def test_weighted_loss_equals_hand_computed():
    logits = torch.tensor([0.5, -1.0, 2.0, -0.3])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    example = torch.tensor([2.0, 0.5, 1.0, 0.0])
    w = row_weights(labels, example, WEIGHT)                       # negatives times 1 / 0.25
    assert w.tolist() == [2.0, 2.0, 4.0, 0.0]
    want = (2 * bce(0.5, 1) + 2 * bce(-1.0, 0) + 4 * bce(2.0, 0) + 0 * bce(-0.3, 1)) / 4   # / B, not / sum(w)
    assert ctr_loss(logits, labels, w).item() == pytest.approx(want, rel=1e-6)
    # no example weights: only the negatives' 1 / r
    assert row_weights(labels, None, WEIGHT).tolist() == [1.0, 4.0, 4.0, 1.0]
    # "calibrate" (the default) leaves the loss alone: the scores are corrected instead
    assert row_weights(labels, None, DataConfig(negative_sampling_rate=0.25)) is None
    assert row_weights(labels, example, DataConfig(negative_sampling_rate=0.25)) is example


def test_a_soft_label_is_not_a_negative():
    labels = torch.tensor([0.0, 0.3, 1.0])
    assert row_weights(labels, None, WEIGHT).tolist() == [4.0, 1.0, 1.0]
    assert negative_weight(WEIGHT) == 4.0 and negative_weight(DataConfig()) == 1.0


@pytest.mark.parametrize("B", [1, 7, 256, 4096, 100_003])
def test_all_ones_weights_are_todays_loss_bit_for_bit(B):
    g = torch.Generator().manual_seed(B)
    x = torch.randn(B, generator=g, requires_grad=True)
    y = (torch.rand(B, generator=g) < 0.3).float()
    today = nn.BCEWithLogitsLoss()(x, y)
    (g_today,) = torch.autograd.grad(today, x)
    for w in (torch.ones(B), row_weights(y, torch.ones(B), DataConfig()), row_weights(y, None, DataConfig())):
        loss = ctr_loss(x, y, w)
        (g_loss,) = torch.autograd.grad(loss, x)
        assert loss.item() == today.item()                 # the same bits, not approximately
        assert torch.equal(g_loss, g_today)


def test_rank_shares_of_a_weighted_loss_add_up_to_the_whole_batch():
    """Sync mode: each rank's loss times its share W * B_r / B, averaged over the W ranks (DDP), is the
    loss of one process on the concatenated batch; that holds for a sum over rows / B, not / sum(w)."""
    g = torch.Generator().manual_seed(0)
    B = 50
    x, y = torch.randn(B, generator=g, dtype=torch.float64), (torch.rand(B, generator=g) < 0.4).double()
    w = torch.rand(B, generator=g, dtype=torch.float64) * 3
    whole = ctr_loss(x, y, w)
    for cut in ((50,), (20, 30), (7, 13, 30), (1, 1, 48)):
        W, parts, at = len(cut), [], 0
        for b in cut:
            parts.append(ctr_loss(x[at:at + b], y[at:at + b], w[at:at + b]) * (W * b / B))
            at += b
        assert (sum(parts) / W).item() == pytest.approx(whole.item(), rel=1e-12)
    # the other normalization, sum(w * l) / sum(w), does not split this way
    by_weight = lambda a, b: (w[a:b] * nn.functional.binary_cross_entropy_with_logits(   # noqa: E731
        x[a:b], y[a:b], reduction="none")).sum() / w[a:b].sum()
    split = (by_weight(0, 20) * (2 * 20 / B) + by_weight(20, 50) * (2 * 30 / B)) / 2
    assert abs(split.item() - by_weight(0, 50).item()) > 1e-4
