"""Two-tower retrieval (Yi et al., RecSys 2019, "Sampling-bias-corrected neural modeling"): a user
and an item tower, trained on positive (user, item) rows with in-batch negatives and the log-Q
correction (the negatives, log q and its buffers: docs/models.md, "Two-tower retrieval")::

    u = normalize(Linear(MLP([dense_user | flatten(pooled_user)])))     # [B, d]
    v = normalize(Linear(MLP([dense_item | flatten(pooled_item)])))     # [B, d]
    training:  logits[i, j] = <u_i, v_j> / temperature - log q(item_j)   # [B, B_g]; positive at j = i
               loss = mean_i cross_entropy(logits[i], i)
    eval:      score[i] = <u_i, v_i> / temperature                       # [B]: the row's own pair

B_g = W * B under DDP (`gather_items`, on gloo too): every rank must have the same B. Another row
holding the same item stays a negative of row i (no masking of "accidental hits", as in Yi et al.);
log-Q, which lowers exactly the frequent items' logits, offsets most of it. `FrequencyEstimator` is
Yi et al.'s count-sketch with one hash and counts instead of their step gaps; q = count[bucket] / total.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from data.config import DataConfig
from data.loader import ParquetLoader
from embedding_ps.store import EmbeddingStore
from recsys.config import JobConfig, ModelConfig
from recsys.dist import is_distributed
from recsys.models.mlp import MLP
from recsys.models.sparse_arch import SparseArch, plan_tables
from recsys.models.base import CTRModel


class FrequencyEstimator(nn.Module):
    """Streaming item-frequency estimate: counts [H] float64 of hashed ids, and their total.

    Example::

        est = FrequencyEstimator(1 << 10)
        est.update(torch.tensor([7, 7, 9]))
        est.log_prob(torch.tensor([7, 9]))     # log([2/3, 1/3])
    """

    def __init__(self, num_buckets: int) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.register_buffer("counts", torch.zeros(num_buckets, dtype=torch.float64))
        self.register_buffer("total", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, ids: torch.Tensor) -> None:
        """Count the item ids [N] of one (global) batch."""
        self.counts.index_add_(0, torch.remainder(ids, self.num_buckets), torch.ones(ids.numel(), dtype=torch.float64))
        self.total += ids.numel()

    def log_prob(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [N]: log of the estimated sampling probability of each id (count / total)."""
        counts = self.counts[torch.remainder(ids, self.num_buckets)].clamp_min(1.0)   # an unseen id counts as one
        return (counts.log() - self.total.clamp_min(1.0).log()).float()


class Tower(nn.Module):
    """[dense | flatten(pooled)] -> MLP(model.top_mlp) -> Linear(tower_dim) -> L2 normalize.

    Example::

        tower = Tower(in_features=2 + 3 * 16, hidden=(64,), out_dim=32)
        v = tower(torch.rand(4, 2), torch.rand(4, 3, 16))    # [4, 32], unit rows
    """

    def __init__(self, in_features: int, hidden: tuple[int, ...], out_dim: int, dropout: float = 0.0,
                 norm: str = "none") -> None:
        super().__init__()
        self.mlp = MLP(in_features, hidden, dropout, norm)
        self.out = nn.Linear(self.mlp.out_features, out_dim)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """dense [B, Dn_t], pooled [B, F_t, D] -> [B, d] with unit L2 norm."""
        x = torch.cat([dense, pooled.flatten(1)], dim=1)                 # [B, Dn_t + F_t * D]
        return F.normalize(self.out(self.mlp(x)), dim=1)                 # [B, d]


def gather_items(v: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every rank's item vectors [B, d] and ids [B] -> ([W * B, d], [W * B], this rank's first
    column). The vectors keep their gradient (`torch.distributed.nn.all_gather`); one process: as is."""
    if not is_distributed():
        return v, ids, 0
    import torch.distributed as dist
    import torch.distributed.nn as dist_nn

    with warnings.catch_warnings():     # deprecated for _functional_collectives (private) in 2.13
        warnings.simplefilter("ignore", FutureWarning)
        vs = dist_nn.all_gather(v)                                       # W x [B, d], differentiable
    id_parts = [torch.empty_like(ids) for _ in vs]
    dist.all_gather(id_parts, ids)
    return torch.cat(vs), torch.cat(id_parts), dist.get_rank() * v.shape[0]


def in_batch_logits(u: torch.Tensor, v: torch.Tensor, log_q: torch.Tensor | None, temperature: float,
                    first: int = 0) -> torch.Tensor:
    """u [B, d], v [B_g, d], log_q [B_g] | None -> logits [B, B_g] whose column i is row i's positive.

    `first`: the column of row 0's positive in v (this rank's block of the gathered batch); the
    columns are rolled so that it comes first (softmax is unchanged by a column permutation).
    """
    logits = u @ v.t() / temperature                                     # [B, B_g]
    if log_q is not None:
        logits = logits - log_q.unsqueeze(0)                             # log-Q correction per column
    return logits.roll(-first, dims=1) if first else logits


def in_batch_loss(logits: torch.Tensor) -> torch.Tensor:
    """Sampled softmax loss of `in_batch_logits` [B, B_g]: mean cross entropy with target column i
    (no labels: every row is a positive)."""
    return F.cross_entropy(logits, torch.arange(logits.shape[0], device=logits.device))


class TwoTower(CTRModel):
    """The two towers and the in-batch softmax; called like every model, plus `item_ids` in training.

    Args:
        config: model.top_mlp (hidden widths of each tower), tower_dim, temperature, logq_correction,
            num_freq_buckets, dropout, norm.
        user: (dense column indices [Dn_u], pooled feature indices [F_u]) of the user tower.
        item: the same for the item tower.
        embedding_dim: D.

    Example::

        model = TwoTower(ModelConfig(arch="two_tower"), user=([0], [0, 1]), item=([1], [2]), embedding_dim=8)
        scores = model(torch.rand(4, 2), torch.rand(4, 3, 8))                           # [4] (eval)
        logits = model(torch.rand(4, 2), torch.rand(4, 3, 8), item_ids=torch.arange(4))  # [4, 4] (train)
    """

    in_batch_softmax = True

    def __init__(self, config: ModelConfig, *, user: tuple[list[int], list[int]],
                 item: tuple[list[int], list[int]], embedding_dim: int) -> None:
        super().__init__()
        self.user_dense, self.user_sparse = list(user[0]), list(user[1])
        self.item_dense, self.item_sparse = list(item[0]), list(item[1])
        self.item_id_feature = config.item_id_feature
        self.temperature = config.temperature
        self.logq = config.logq_correction
        self.user_tower, self.item_tower = (      # user first: the init draws' order
            Tower(len(d) + len(f) * embedding_dim, config.top_mlp, config.tower_dim, config.dropout, config.norm)
            for d, f in (user, item))
        self.freq = FrequencyEstimator(config.num_freq_buckets)
        # equal on every rank by construction (global ids): not broadcast by DDP each step
        self._ddp_params_and_buffers_to_ignore = ["freq.counts", "freq.total"]

    def extra_inputs(self, sparse, lookup, batch, train):
        """Training: the item id of every row, int64 [B] from `model.item_id_feature` (exactly one id
        a row), for log-Q and the targets."""
        if not train:
            return (), {}
        jag = batch.sparse[self.item_id_feature]
        if jag.values.numel() != batch.batch_size or bool((jag.lengths != 1).any()):
            raise ValueError(f"model.item_id_feature {self.item_id_feature!r} must hold exactly one id per row "
                             f"(got {jag.values.numel()} ids for {batch.batch_size} rows)")
        return (), {"item_ids": jag.values}

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return in_batch_loss(logits)

    def user_vectors(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The batch's dense [B, Dn] and pooled [B, F, D] (every column) -> user vectors [B, d]."""
        return self.user_tower(dense[:, self.user_dense], pooled[:, self.user_sparse])

    def item_vectors(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """The batch's dense [B, Dn] and pooled [B, F, D] (every column) -> item vectors [B, d]."""
        return self.item_tower(dense[:, self.item_dense], pooled[:, self.item_sparse])

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, pooled_linear: torch.Tensor | None = None,
                item_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Without item_ids: scores [B] of each row's (user, item) pair. With item_ids int64 [B]
        (training): in-batch softmax logits [B, B_g] (see `in_batch_logits`); in training mode
        the global batch's ids are counted into the frequency estimate first."""
        u = self.user_vectors(dense, pooled)                             # [B, d]
        v = self.item_vectors(dense, pooled)                             # [B, d]
        if item_ids is None:
            return (u * v).sum(dim=1) / self.temperature                 # [B]
        v_all, ids_all, first = gather_items(v, item_ids)                # [B_g, d], [B_g]
        if self.training:
            self.freq.update(ids_all)
        log_q = self.freq.log_prob(ids_all) if self.logq else None       # [B_g]
        return in_batch_logits(u, v_all, log_q, self.temperature, first)  # [B, B_g]


# ---------------------------------------------------------------------------------------------
# one tower over Parquet data (retrieval eval and export)


def tower_data(cfg: JobConfig, columns: tuple[str, ...]) -> DataConfig:
    """The DataConfig reading only `columns` (in the data's own column order), in file order."""
    d = cfg.data
    return dataclasses.replace(
        d, dense_columns=tuple(c for c in d.dense_columns if c in columns),
        sparse_columns=tuple(c for c in d.sparse_columns if c in columns),
        weight_columns={k: v for k, v in d.weight_columns.items() if k in columns},
        id_types={k: v for k, v in d.id_types.items() if k in columns}, passthrough_columns=(), shuffle=False,
        drop_last=False)


def tower_sparse_arch(cfg: JobConfig, columns: tuple[str, ...]) -> SparseArch:
    """The sparse arch of one tower's sparse columns (same tables and pooling as in training)."""
    features = tower_data(cfg, columns).sparse_columns
    return SparseArch(plan_tables(features, cfg.ps.tables, cfg.model.feature_tables, {}, cfg.model.table_pooling))


@torch.no_grad()
def item_vectors(cfg: JobConfig, store: EmbeddingStore, model: TwoTower) -> tuple[np.ndarray, torch.Tensor]:
    """Item ids int64 [I] and vectors float32 [I, d] of every row of data.item_paths."""
    if not cfg.data.item_paths:
        raise ValueError("two_tower: set data.item_paths (the item corpus, one row per item)")
    data_cfg = tower_data(cfg, cfg.model.item_features)
    arch = tower_sparse_arch(cfg, cfg.model.item_features)
    ids, vecs = [], []
    model.eval()
    with ParquetLoader(data_cfg, cfg.data.item_paths, rank=0, world_size=1) as loader:
        for batch in loader:
            pooled, _ = arch.lookup(batch, store).wait()                     # [B, F_i, D]
            vecs.append(model.item_tower(batch.dense, pooled))               # [B, d]
            ids.append(batch.sparse[cfg.model.item_id_feature].values.numpy())
    return np.concatenate(ids), torch.cat(vecs)


__all__ = ["FrequencyEstimator", "Tower", "TwoTower", "gather_items", "in_batch_logits", "in_batch_loss",
           "item_vectors", "tower_data", "tower_sparse_arch"]
