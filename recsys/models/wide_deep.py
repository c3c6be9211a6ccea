"""Wide & Deep (Cheng et al., 2016): a linear model and an MLP trained jointly.

::

    logit = LinearTerms(dense, pooled_linear)          wide: bias + w.dense + sum of dim-1 PS rows
          + MLP([dense | flatten(pooled)]) -> Linear   deep
"""

from __future__ import annotations

import torch
from torch import nn

from recsys.config import ModelConfig
from recsys.models.mlp import MLP, LinearTerms
from recsys.models.base import CTRModel


class WideDeep(CTRModel):
    """Wide & Deep's dense part: the wide linear logit plus the deep MLP's logit.

    Args: as `DeepFM`'s (`model.top_mlp` are the deep part's widths; `model.fm_interaction` is not read).

    Example::

        cfg = ModelConfig(arch="wide_deep", top_mlp=(64, 32))
        model = WideDeep(cfg, num_dense=13, num_sparse=26, embedding_dim=16)
        logits = model(torch.rand(4, 13), torch.rand(4, 26, 16), torch.rand(4, 26))   # [4]
    """

    needs_linear_terms = True

    def __init__(self, config: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> None:
        super().__init__()
        self.wide = LinearTerms(num_dense)
        self.deep = MLP(num_dense + num_sparse * embedding_dim, config.top_mlp, config.dropout, config.norm)
        self.deep_out = nn.Linear(self.deep.out_features, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor,
                pooled_linear: torch.Tensor | None = None) -> torch.Tensor:
        """dense [B, Dn], pooled [B, F, D], pooled_linear [B, F_lin] or None (see `LinearTerms`) -> logits [B]."""
        wide = self.wide(dense, pooled_linear)                               # [B]
        x = torch.cat([dense, pooled.flatten(1)], dim=1)                     # [B, Dn + F*D]
        deep = self.deep_out(self.deep(x)).squeeze(1)                        # [B]
        return wide + deep                                                   # [B]
