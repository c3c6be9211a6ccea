"""DIN (Zhou et al., 2018): the candidate item attends over the user's behavior list.

::

    q = pooled[:, candidate]                          [B, D]     the candidate item's row
    k = behaviors[:, s]                               [B, L, D]  the list's rows (item table), mask [B, L]
    a = AttentionUnit([q, k, q - k, q * k]) * mask    [B, L]     one weight per position; no softmax by default
    interest_s = sum_l a_l k_l                        [B, D]
    logit = MLP([dense | interest_1..S | pooled of the other features, candidate included]) -> Linear -> [B]

The weights (raw by default, as in the paper; `model.attention_softmax`), padding and the MLPs' norm /
dropout: docs/models.md, "Behavior sequences: DIN". The activation unit's MLP uses ReLU (the paper:
PReLU / Dice). The pooled bags of the behavior lists (the sparse arch pools every feature) are left out.
"""

from __future__ import annotations

import torch
from torch import nn

from recsys.config import ModelConfig
from recsys.models.mlp import MLP
from recsys.models.base import CTRModel


class AttentionUnit(nn.Module):
    """DIN's activation unit: MLP([q, k, q - k, q * k]) -> a weight per position, then the weighted sum.

    Args:
        dim: D, the width of query and keys.
        hidden: the MLP's hidden widths (a final Linear down to one weight is added).
        softmax: normalize the weights over the real positions (default: raw weights, masked).

    Example::

        unit = AttentionUnit(16, (36,))
        interest, weights = unit(torch.rand(4, 16), torch.rand(4, 20, 16), torch.ones(4, 20, dtype=torch.bool))
        # [4, 16], [4, 20]
    """

    def __init__(self, dim: int, hidden: tuple[int, ...], softmax: bool = False) -> None:
        super().__init__()
        self.mlp = MLP(4 * dim, hidden)
        self.out = nn.Linear(self.mlp.out_features, 1)
        self.softmax = softmax

    def forward(self, query: torch.Tensor, keys: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query [B, D], keys [B, L, D], mask bool [B, L] -> interest [B, D], weights [B, L]."""
        q = query.unsqueeze(1).expand_as(keys)                               # [B, L, D]
        x = torch.cat([q, keys, q - keys, q * keys], dim=2)                  # [B, L, 4D]
        score = self.out(self.mlp(x)).squeeze(2)                             # [B, L]
        if self.softmax:   # a large negative, not -inf: an all-padding row stays finite (then zeroed)
            score = torch.softmax(score.masked_fill(~mask, -1e9), dim=1)     # [B, L]
        weights = score * mask.to(score.dtype)                               # [B, L], 0 at padding
        interest = torch.bmm(weights.unsqueeze(1), keys).squeeze(1)          # [B, D]
        return interest, weights


class DIN(CTRModel):
    """DIN's dense part: one AttentionUnit per behavior list, then an MLP down to one logit.

    Args:
        config: `model.attention_mlp`, `model.attention_softmax`, `model.top_mlp` (the MLP's hidden
            widths), `model.dropout`, `model.norm`.
        num_sparse: F, every sparse feature the sparse arch pools (the behavior lists included).
        sequences: (behavior list feature, candidate feature) index pairs into the F pooled features.

    Example::

        cfg = ModelConfig(arch="din", sequence_features={"hist": "item"}, top_mlp=(64, 32))
        model = DIN(cfg, num_dense=1, num_sparse=3, embedding_dim=8, sequences=((2, 1),))
        logits = model(torch.rand(4, 1), torch.rand(4, 3, 8), None,
                       torch.rand(4, 1, 20, 8), torch.ones(4, 1, 20, dtype=torch.bool))   # [4]
    """

    needs_sequences = True

    def extra_inputs(self, sparse, lookup, batch, train):
        """(behaviors [B, S, L, D], mask [B, S, L]) of its lists: `SequenceSparseArch.behaviors`."""
        return sparse.behaviors(lookup), {}

    def __init__(self, config: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int,
                 sequences: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__()
        if not sequences:
            raise ValueError("model.arch = 'din' needs model.sequence_features (no behavior list given)")
        lists = {s for s, _ in sequences}
        for s, c in sequences:
            if not (0 <= s < num_sparse and 0 <= c < num_sparse) or c in lists:
                raise ValueError(f"din: bad (sequence, candidate) feature pair {(s, c)} of F = {num_sparse}")
        self.candidates = [c for _, c in sequences]
        self.register_buffer("keep", torch.tensor([f for f in range(num_sparse) if f not in lists],
                                                  dtype=torch.int64), persistent=False)
        self.attention = nn.ModuleList(AttentionUnit(embedding_dim, config.attention_mlp, config.attention_softmax)
                                       for _ in sequences)
        width = num_dense + (len(sequences) + len(self.keep)) * embedding_dim
        self.mlp = MLP(width, config.top_mlp, config.dropout, config.norm)
        self.mlp_out = nn.Linear(self.mlp.out_features, 1)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, pooled_linear: torch.Tensor | None = None,
                behaviors: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """dense [B, Dn], pooled [B, F, D], (unused), behaviors [B, S, L, D], mask bool [B, S, L] -> logits [B]."""
        if behaviors is None or mask is None:
            raise ValueError("DIN needs the behavior rows and mask (SequenceSparseArch.behaviors)")
        interests = [unit(pooled[:, c], behaviors[:, s], mask[:, s])[0]         # [B, D] each
                     for s, (unit, c) in enumerate(zip(self.attention, self.candidates))]
        others = pooled.index_select(1, self.keep).flatten(1)                    # [B, (F - S) * D]
        x = torch.cat([dense, *interests, others], dim=1)                        # [B, Dn + F * D]
        return self.mlp_out(self.mlp(x)).squeeze(1)                              # [B]
