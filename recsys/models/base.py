"""What the trainer asks of every model: its extra inputs and its loss (the model hooks), so that it
names no architecture (the predictor runs the exported dense program, `recsys/serving/dense_export.py`).

    args, kwargs = model.extra_inputs(sparse, lookup, batch, train)    # after lookup.wait()
    logits = model(dense, pooled, linear, *args, **kwargs)   # [B, Dn], [B, F, D], [B, F_lin] | None -> [B]
    loss = model.loss(logits, labels) if model.in_batch_softmax else <the trainer's weighted BCE>

The defaults are a CTR model's: called with (dense, pooled, linear) alone (`linear`: see
`needs_linear_terms`), one logit a row, trained on BCE. DIN adds the behavior rows of its lists;
two-tower adds the batch's item ids in training and trains with its in-batch softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from data.batch import Batch
    from recsys.models.sparse_arch import SparseArch, SparseLookup


class CTRModel(nn.Module):
    """The base of every architecture in `recsys.models.ARCHS` (and two-tower). `build_model` builds an
    ARCHS class as `cls(config, *, num_dense=Dn, num_sparse=F, embedding_dim=D)`: Dn dense features (0
    allowed), F pooled embeddings of dim D a row; each class's Args name the config fields it reads."""

    needs_linear_terms = False
    """Pull the dim-1 rows of model.linear_feature_tables and pass them as `linear` (deepfm, wide_deep)."""
    needs_sequences = False
    """Takes the behavior rows of sequence features (din): the sparse arch is a SequenceSparseArch."""
    in_batch_softmax = False
    """Training logits are [B, B_g] over the global batch's items, trained with `loss`; evaluation
    ranks items (recall@K) instead of scoring rows."""

    def extra_inputs(self, sparse: SparseArch, lookup: SparseLookup, batch: Batch, train: bool
                     ) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """The inputs `forward` takes after (dense, pooled, linear): positional and keyword tensors
        (on the CPU; the caller moves them). Called after `lookup.wait()`."""
        return (), {}

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The training loss of an `in_batch_softmax` model (the others train on the trainer's BCE)."""
        raise NotImplementedError(f"{type(self).__name__} trains on the trainer's BCE, not its own loss")
