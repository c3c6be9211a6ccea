"""DCN-v2 (Wang et al., 2021): explicit feature crosses beside or before a deep MLP.

::

    x0 = [dense | flatten(pooled)]                     [B, Dn + F*D]
    stacked:  x0 --CrossNet--> --MLP(top_mlp)--> --Linear--> logits [B]
    parallel: x0 --CrossNet--> ─┐
              x0 --MLP(top_mlp)-┴─ concat --Linear--> logits [B]
"""

from __future__ import annotations

import torch
from torch import nn

from recsys.config import ModelConfig
from recsys.models.mlp import MLP
from recsys.models.base import CTRModel


class CrossNet(nn.Module):
    """`num_layers` full-rank cross layers: x_{l+1} = x0 * (W_l x_l + b_l) + x_l.

    Each layer raises the polynomial degree of the features by one, and the residual `+ x_l`
    keeps the lower degrees, so L layers hold all crosses up to degree L + 1. With 0 layers the
    net is the identity.

    Args:
        in_features: width d of x0.
        num_layers: number of cross layers L.

    Example::

        net = CrossNet(in_features=8, num_layers=3)
        out = net(torch.rand(4, 8))   # [4, 8]
    """

    def __init__(self, in_features: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(in_features, in_features) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        """[B, d] -> [B, d]."""
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x                                            # [B, d]
        return x


class DCN(CTRModel):
    """DCN-v2 on the concatenation of the dense features and the flattened embeddings.

    Args:
        config: `model.num_cross_layers`, `model.dcn_structure` (`stacked` | `parallel`), `model.top_mlp`
            (the deep part's widths), `model.dropout`, `model.norm` (in the deep MLP; the cross net has
            none). `model.bottom_mlp` is not used: the dense features enter the cross net as they are, as in the paper.

    Example::

        cfg = ModelConfig(arch="dcn", num_cross_layers=2, dcn_structure="parallel")
        model = DCN(cfg, num_dense=13, num_sparse=26, embedding_dim=16)
        logits = model(torch.rand(4, 13), torch.rand(4, 26, 16))   # [4]

    No `needs_linear_terms`: the cross net's degree-1 terms already are the first-order part.
    """

    def __init__(self, config: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> None:
        super().__init__()
        in_features = num_dense + num_sparse * embedding_dim                  # d
        self.structure = config.dcn_structure
        self.cross = CrossNet(in_features, config.num_cross_layers)
        self.deep = MLP(in_features, config.top_mlp, config.dropout, config.norm)
        head_in = (0 if self.structure == "stacked" else in_features) + self.deep.out_features   # [cross |] deep
        self.final = nn.Linear(head_in, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor,
                pooled_linear: torch.Tensor | None = None) -> torch.Tensor:
        """dense [B, Dn], pooled [B, F, D] -> logits [B]. `pooled_linear` is unused (see DLRM)."""
        x0 = torch.cat([dense, pooled.flatten(1)], dim=1)                    # [B, Dn + F*D]
        if self.structure == "stacked":
            h = self.deep(self.cross(x0))                                     # [B, H]
        else:
            h = torch.cat([self.cross(x0), self.deep(x0)], dim=1)             # [B, d + H]
        return self.final(h).squeeze(1)                                       # [B]
