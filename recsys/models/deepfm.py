"""DeepFM (Guo et al., 2017): a factorization machine and a DNN share the embeddings.

::

    logit = LinearTerms(dense, pooled_linear)          first order: bias + w.dense + sum of dim-1 rows
          + FactorizationMachine(pooled)               second order: sum_{i<j} <v_i, v_j>
                                                   (FieldWeightedFM: sum_{i<j} r_ij <v_i, v_j>)
          + DNN([dense | flatten(pooled)])             higher order
"""

from __future__ import annotations

import torch
from torch import nn

from recsys.config import ModelConfig
from recsys.models.mlp import MLP, LinearTerms
from recsys.models.base import CTRModel


class FieldWeightedFM(nn.Module):
    """Field-weighted FM (Pan et al., 2018): sum_{i<j} r_ij <v_i, v_j>, one learned weight per field pair.

    The weights start at 1, where it equals `FactorizationMachine`. Costs O(F^2 D) per example (a batched
    Gram matrix; F = 28, D = 16: 12.5k multiply-adds).

    Example::

        fm = FieldWeightedFM(26)
        out = fm(torch.rand(4, 26, 16))   # [4]
    """

    def __init__(self, num_fields: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_fields, num_fields, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.pair_weight = nn.Parameter(torch.ones(rows.numel()))

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, F, D] -> [B]."""
        gram = torch.bmm(pooled, pooled.transpose(1, 2))                     # [B, F, F]
        return gram[:, self.rows, self.cols] @ self.pair_weight              # [B]


class FactorizationMachine(nn.Module):
    """Second-order FM term: the sum of the dot products of every pair of the F embeddings.

    Uses the identity sum_{i<j} <v_i, v_j> = 0.5 * sum_d ((sum_i v_id)^2 - sum_i v_id^2), which
    costs O(F D) instead of the O(F^2 D) of the pairs. No parameters: the factors v_i are the
    embeddings themselves.

    Example::

        fm = FactorizationMachine()
        out = fm(torch.rand(4, 26, 16))   # [4]
    """

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, F, D] -> [B]."""
        square_of_sum = pooled.sum(dim=1).pow(2)                             # [B, D]
        sum_of_square = pooled.pow(2).sum(dim=1)                             # [B, D]
        return 0.5 * (square_of_sum - sum_of_square).sum(dim=1)              # [B]


class DeepFM(CTRModel):
    """DeepFM's dense part: first-order terms + FM + DNN, summed into one logit.

    Args:
        config: `model.top_mlp` (the DNN's hidden widths), `model.dropout`, `model.norm`,
            `model.fm_interaction` ("fm" or "fwfm"). `model.bottom_mlp` is not used.

    Example::

        cfg = ModelConfig(arch="deepfm", top_mlp=(64, 32))
        model = DeepFM(cfg, num_dense=13, num_sparse=26, embedding_dim=16)
        logits = model(torch.rand(4, 13), torch.rand(4, 26, 16), torch.rand(4, 26))   # [4]
    """

    needs_linear_terms = True

    def __init__(self, config: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> None:
        super().__init__()
        self.linear = LinearTerms(num_dense)
        self.fm = FieldWeightedFM(num_sparse) if config.fm_interaction == "fwfm" else FactorizationMachine()
        self.dnn = MLP(num_dense + num_sparse * embedding_dim, config.top_mlp, config.dropout, config.norm)
        self.dnn_out = nn.Linear(self.dnn.out_features, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor,
                pooled_linear: torch.Tensor | None = None) -> torch.Tensor:
        """dense [B, Dn], pooled [B, F, D], pooled_linear [B, F_lin] or None (see `LinearTerms`) -> logits [B]."""
        first = self.linear(dense, pooled_linear)                            # [B]
        second = self.fm(pooled)                                             # [B]
        x = torch.cat([dense, pooled.flatten(1)], dim=1)                     # [B, Dn + F*D]
        deep = self.dnn_out(self.dnn(x)).squeeze(1)                          # [B]
        return first + second + deep                                         # [B]
