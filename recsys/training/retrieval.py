"""Retrieval evaluation of a two-tower model: top-K over the whole item corpus for every eval user.

    metrics = retrieval_metrics_of(cfg, sparse, store, model, cfg.data.eval_paths)
    # {"recall@10": .., "ndcg@10": .., ..., "popular_recall@10": .., ..., "eval_users", "items", "eval_examples"}

Items, users, their queries and relevant items, and the most-popular baseline (by item count in
data.train_paths, the same list for every user): docs/models.md, "Two-tower retrieval". The top-K is
exact (users in blocks of eval.batch_users), scored by `recsys.metrics.retrieval_metrics`. Every rank
computes the same numbers (reads everything; pulls only), so the call is not collective.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from data.batch import Batch
from data.loader import ParquetLoader
from embedding_ps.store import EmbeddingStore
from recsys.config import JobConfig
from recsys.metrics import retrieval_metrics
from recsys.models import SparseArch, TwoTower
from recsys.models.two_tower import item_vectors, tower_data
from recsys.serving.retrieval import ExactIndex

logger = logging.getLogger(__name__)


@torch.no_grad()
def eval_users(cfg: JobConfig, sparse: SparseArch, store: EmbeddingStore, model: TwoTower,
               paths: tuple[str, ...]) -> tuple[torch.Tensor, list[np.ndarray], int]:
    """User vectors [U, d] (first row of each user), each user's relevant item ids, and the row count."""
    data_cfg = dataclasses.replace(cfg.data, shuffle=False, drop_last=False)
    users, items, vecs = [], [], []
    model.eval()
    with ParquetLoader(data_cfg, paths, rank=0, world_size=1) as loader:
        for batch in loader:
            pooled, _ = sparse.lookup(batch, store).wait()                   # [B, F, D]
            vecs.append(model.user_vectors(batch.dense, pooled))             # [B, d]
            users.append(_one_id(batch, cfg.model.user_id_feature))
            items.append(_one_id(batch, cfg.model.item_id_feature))
    user, item = np.concatenate(users), np.concatenate(items)
    uniq, first, inverse = np.unique(user, return_index=True, return_inverse=True)
    order = np.argsort(inverse, kind="stable")                             # rows grouped by user
    bounds = np.cumsum(np.bincount(inverse, minlength=uniq.size))[:-1]
    relevant = [np.unique(g) for g in np.split(item[order], bounds)]
    return torch.cat(vecs)[torch.from_numpy(first)], relevant, int(user.size)


def _one_id(batch: Batch, feature: str) -> np.ndarray:
    jag = batch.sparse[feature]
    if jag.values.numel() != batch.batch_size:
        raise ValueError(f"retrieval eval: column {feature!r} must hold exactly one id per row")
    return jag.values.numpy()


def top_items(users: torch.Tensor, items: torch.Tensor, item_ids: np.ndarray, k: int,
              block: int = 1024) -> np.ndarray:
    """Ids int64 [U, k] of the k items of largest <user, item>, best first: the exact search that
    `/v1/topk` serves (`ExactIndex`, users in blocks), so the eval ranks as serving does."""
    return ExactIndex(item_ids, items, query_block=block).search(users, k)[0]


def popular_items(cfg: JobConfig, k: int) -> np.ndarray:
    """The k item ids most frequent in data.train_paths (ties: smaller id first)."""
    data_cfg = dataclasses.replace(tower_data(cfg, (cfg.model.item_id_feature,)), dense_columns=())
    with ParquetLoader(data_cfg, cfg.data.train_paths, rank=0, world_size=1) as loader:
        parts = [batch.sparse[cfg.model.item_id_feature].values.numpy() for batch in loader]
    ids, counts = np.unique(np.concatenate(parts), return_counts=True)
    order = np.lexsort((ids, -counts))
    return ids[order[:k]]


def retrieval_metrics_of(cfg: JobConfig, sparse: SparseArch, store: EmbeddingStore, model: TwoTower,
                         paths: tuple[str, ...]) -> dict[str, float]:
    """recall@K and ndcg@K (K in eval.recall_k) of the model and of the most-popular baseline."""
    was_training = model.training
    try:
        item_ids, items = item_vectors(cfg, store, model)
        users, relevant, sum_rows = eval_users(cfg, sparse, store, model, paths)
    finally:
        model.train(was_training)
    ks = cfg.eval.recall_k
    top = top_items(users, items, item_ids, max(ks), cfg.eval.batch_users)
    best = popular_items(cfg, max(ks))
    popular = np.broadcast_to(best, (len(relevant), best.size))             # the same list for every user
    out = retrieval_metrics(top, relevant, ks)
    out.update({f"popular_{k}": v for k, v in retrieval_metrics(popular, relevant, ks).items()})
    out.update(eval_users=float(len(relevant)), items=float(item_ids.size), eval_examples=float(sum_rows))
    logger.info("retrieval eval: %s", {k: round(v, 4) for k, v in out.items()})
    return out
