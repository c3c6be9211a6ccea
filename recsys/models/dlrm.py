"""DLRM (Naumov et al., 2019), laid out as torchrec's `torchrec/models/dlrm.py`.

::

    dense [B, Dn] --DenseArch (bottom MLP)--> [B, D] ─┐
    pooled [B, F, D] ─────────────────────────────────┴─> InteractionArch --> [B, D + F(F+1)/2]
                                                                              --OverArch--> logits [B]

With no dense columns (Dn = 0) there is no bottom MLP: the interaction runs over the F embeddings
alone (F(F-1)/2 dot products), and the mean of the embeddings [B, D] takes the bottom output's
place in front, so the top MLP still sees first-order terms (and F = 1 still has an input).
"""

from __future__ import annotations

import torch
from torch import nn

from recsys.config import ModelConfig
from recsys.config_model import default_bottom_mlp
from recsys.models.mlp import MLP
from recsys.models.base import CTRModel


class DenseArch(nn.Module):
    """Bottom MLP (args as `MLP`'s, the last width the embedding dim D): the dense features [B, Dn]
    become one more D-dim vector beside the F embeddings.

    Example::

        arch = DenseArch(13, (64, 16))
        out = arch(torch.rand(4, 13))   # [4, 16]
    """

    def __init__(self, in_features: int, layer_sizes: tuple[int, ...], dropout: float = 0.0,
                 norm: str = "none") -> None:
        super().__init__()
        self.mlp = MLP(in_features, layer_sizes, dropout, norm)

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        """[B, Dn] -> [B, D]."""
        return self.mlp(dense)


class InteractionArch(nn.Module):
    """Pairwise dot products of the F + 1 vectors (bottom output and F embeddings).

    Only the upper triangle without the diagonal is kept: the matrix is symmetric and a vector's
    dot with itself carries no interaction. The bottom output is concatenated in front, so the
    dense features also reach the top MLP unmixed.

    Args:
        num_sparse_features: F.

    Example::

        arch = InteractionArch(num_sparse_features=3)
        out = arch(torch.rand(4, 16), torch.rand(4, 3, 16))   # [4, 16 + 6]
    """

    def __init__(self, num_sparse_features: int, with_dense: bool = True) -> None:
        super().__init__()
        self.with_dense = with_dense
        n = num_sparse_features + 1 if with_dense else num_sparse_features  # vectors that interact
        rows, cols = torch.triu_indices(n, n, offset=1)                      # [n(n-1)/2] each
        # Buffers follow .to(device); not persistent, so they never enter the saved state dict.
        self.register_buffer("triu_rows", rows, persistent=False)
        self.register_buffer("triu_cols", cols, persistent=False)
        self.out_features_extra = rows.numel()
        """Number of dot products appended after the D front features: F(F+1)/2 (F(F-1)/2 without dense)."""

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """dense [B, D] (the bottom output; without dense columns the embeddings' mean), pooled
        [B, F, D] -> [B, D + F(F+1)/2] (F(F-1)/2 dot products without dense columns)."""
        combined = torch.cat([dense.unsqueeze(1), pooled], dim=1) if self.with_dense else pooled
        gram = torch.bmm(combined, combined.transpose(1, 2))                 # [B, F+1, F+1]
        pairs = gram[:, self.triu_rows, self.triu_cols]                       # [B, F(F+1)/2]
        return torch.cat([dense, pairs], dim=1)                              # [B, D + F(F+1)/2]


class OverArch(nn.Module):
    """Top MLP over the interaction output (args as `MLP`'s), then one linear layer without norm or
    activation down to the logit.

    Example::

        arch = OverArch(22, (64, 32))
        logits = arch(torch.rand(4, 22))   # [4]
    """

    def __init__(self, in_features: int, layer_sizes: tuple[int, ...], dropout: float = 0.0,
                 norm: str = "none") -> None:
        super().__init__()
        self.mlp = MLP(in_features, layer_sizes, dropout, norm)
        self.final = nn.Linear(self.mlp.out_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Din] -> logits [B]."""
        return self.final(self.mlp(x)).squeeze(1)                            # [B]


class DLRM(CTRModel):
    """The dense part of DLRM: DenseArch, InteractionArch and OverArch put together.

    Args:
        config: `model.bottom_mlp` (its last width must equal `embedding_dim`; empty: derived from it,
            `default_bottom_mlp`), `model.top_mlp`, `model.dropout`, `model.norm` (in both MLPs).
        num_dense: Dn; 0: no bottom MLP, the embeddings interact among themselves (module docstring).

    Example::

        cfg = ModelConfig(arch="dlrm", bottom_mlp=(32, 16), top_mlp=(64, 32))
        model = DLRM(cfg, num_dense=13, num_sparse=26, embedding_dim=16)
        logits = model(torch.rand(4, 13), torch.rand(4, 26, 16))   # [4]
    """

    def __init__(self, config: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int) -> None:
        super().__init__()
        bottom = config.bottom_mlp or default_bottom_mlp(embedding_dim)     # not given: [max(64, 2D), D]
        if num_dense > 0 and bottom[-1] != embedding_dim:
            raise ValueError(f"model.bottom_mlp must end in the embedding dim {embedding_dim} (the bottom output is "
                             f"dotted with the embeddings), got {list(config.bottom_mlp)}")
        self.dense_arch = DenseArch(num_dense, bottom, config.dropout, config.norm) if num_dense > 0 else None
        self.inter_arch = InteractionArch(num_sparse, with_dense=num_dense > 0)
        self.over_arch = OverArch(embedding_dim + self.inter_arch.out_features_extra, config.top_mlp,
                                  config.dropout, config.norm)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor,
                pooled_linear: torch.Tensor | None = None) -> torch.Tensor:
        """dense [B, Dn], pooled [B, F, D] -> logits [B] (`pooled_linear`: None, `build_model` refuses linear
        tables for DLRM)."""
        x = self.dense_arch(dense) if self.dense_arch is not None else pooled.mean(dim=1)   # [B, D]
        x = self.inter_arch(x, pooled)                                       # [B, D + F(F+1)/2]
        return self.over_arch(x)                                             # [B]
