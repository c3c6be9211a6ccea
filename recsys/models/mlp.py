"""Blocks shared by the CTR architectures: the MLP tower and the first-order (linear) term (how every
model is called: `recsys.models.base`)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Linear (-> Norm) -> ReLU (-> Dropout) for each size in `layer_sizes`.

    Every layer, the last included, ends in a ReLU, as in torchrec's `MLP`: the callers add their
    own final `nn.Linear(..., 1)` where they need an unbounded logit. With norm "none" the layers
    (and so the state dict keys and the init draws) are those of a plain MLP.

    Args:
        in_features: width of the input, Din.
        layer_sizes: output width of each layer; the last one is the output width H.
        dropout: dropout probability after each ReLU (0 disables it).
        norm: "none", "batch" (BatchNorm1d) or "layer" (LayerNorm) after each Linear (`model.norm`).

    Example::

        mlp = MLP(13, (64, 16), norm="layer")
        out = mlp(torch.rand(4, 13))   # [4, 16]
    """

    def __init__(self, in_features: int, layer_sizes: tuple[int, ...], dropout: float = 0.0,
                 norm: str = "none") -> None:
        super().__init__()
        if norm not in ("none", "batch", "layer"):
            raise ValueError(f"model.norm must be one of 'none', 'batch', 'layer', got {norm!r}")
        layers: list[nn.Module] = []
        for size in layer_sizes:
            layers.append(nn.Linear(in_features, size))
            if norm != "none":
                layers.append(nn.BatchNorm1d(size) if norm == "batch" else nn.LayerNorm(size))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            in_features = size
        self.layers = nn.Sequential(*layers)
        self.out_features = in_features  # Din when layer_sizes is empty: the MLP is the identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Din] -> [B, H]."""
        return self.layers(x)


class LinearTerms(nn.Module):
    """First-order part of a logit: bias + w . dense + the sum of the features' dim-1 PS rows.

    The sparse weights are not parameters of this module: they live in dim-1 tables on the PS
    (`model.linear_feature_tables`, trained by the PS's optimizer, e.g. FTRL) and arrive already pooled
    as `pooled_linear` [B, F_lin], so summing them is the whole "wide" sparse term (a one-hot linear
    model, written as lookups).

    Args:
        num_dense: number of dense features, Dn (0 leaves only the bias and the sparse terms).

    Example::

        wide = LinearTerms(13)
        out = wide(torch.rand(4, 13), torch.rand(4, 26))   # [4]
        out = wide(torch.rand(4, 13), None)                # [4], no sparse first-order terms
    """

    def __init__(self, num_dense: int) -> None:
        super().__init__()
        # nn.Linear(0, 1) would warn about initializing a zero-element weight: keep the bias apart.
        self.dense = nn.Linear(num_dense, 1, bias=False) if num_dense > 0 else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense: torch.Tensor, pooled_linear: torch.Tensor | None) -> torch.Tensor:
        """dense [B, Dn], pooled_linear [B, F_lin] or None -> [B]."""
        out = self.bias.expand(dense.shape[0])                  # [B]
        if self.dense is not None:
            out = out + self.dense(dense).squeeze(1)             # [B]
        if pooled_linear is not None:
            out = out + pooled_linear.sum(dim=1)                 # [B]
        return out
