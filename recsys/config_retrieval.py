"""Config of retrieval (two-tower) jobs: the `[eval]` section and the cross-section checks of
`model.arch = "two_tower"` (an example: docs/models.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalConfig:
    """Offline evaluation options (retrieval metrics of two-tower runs)."""

    recall_k: tuple[int, ...] = (10, 50, 100)
    """Cut-offs K of `recall@K` and `ndcg@K` (two-tower runs: top-K items over data.item_paths)."""
    batch_users: int = 1024
    """Users scored against the whole item corpus per matmul (bounds the [users, items] score block)."""

    def __post_init__(self) -> None:
        if not self.recall_k or any(k < 1 for k in self.recall_k):
            raise ValueError(f"eval.recall_k must be a non-empty list of K >= 1, got {list(self.recall_k)}")
        if self.batch_users < 1:
            raise ValueError(f"eval.batch_users must be >= 1, got {self.batch_users}")


def check_two_tower(model: Any, data: Any, train: Any) -> None:
    """Cross-section rules of model.arch = "two_tower" (ValueError naming the dotted key)."""
    if model.arch != "two_tower":
        for key in ("user_features", "item_features"):
            if getattr(model, key):
                raise ValueError(f"model.{key} is only used by model.arch = 'two_tower', not {model.arch!r}")
        return
    columns = set(data.sparse_columns) | set(data.dense_columns)
    for key in ("user_features", "item_features"):
        feats = getattr(model, key)
        if not feats:
            raise ValueError(f"model.{key} must name the tower's columns for model.arch = 'two_tower', got []")
        if outside := [f for f in feats if f not in columns]:
            raise ValueError(f"model.{key}: {outside[0]!r} is not in data.sparse_columns or data.dense_columns")
        if not any(f in data.sparse_columns for f in feats):
            raise ValueError(f"model.{key} needs at least one sparse column (an id), got {list(feats)}")
    if both := sorted(set(model.user_features) & set(model.item_features)):
        raise ValueError(f"model.user_features and model.item_features share {both}: a column is in one tower")
    if missing := [c for c in data.sparse_columns if c not in model.user_features and c not in model.item_features]:
        raise ValueError(f"data.sparse_columns {missing} are in neither model.user_features nor model.item_features")
    for side in ("item", "user"):
        feature, feats = getattr(model, f"{side}_id_feature"), getattr(model, f"{side}_features")
        if feature not in feats or feature not in data.sparse_columns:
            raise ValueError(f"model.{side}_id_feature = {feature!r} must be a sparse column of "
                             f"model.{side}_features {list(feats)}")
    if (data.eval_paths or data.test_paths) and not data.item_paths:
        raise ValueError("two_tower: data.eval_paths / data.test_paths are ranked against the item corpus: "
                         "set data.item_paths (one row per item)")
    if data.example_weight_column or data.negative_sampling_rate < 1:
        raise ValueError("data.example_weight_column / data.negative_sampling_rate weigh the binary cross-entropy "
                         "of CTR models; model.arch = 'two_tower' trains an in-batch softmax: leave them unset")
    if train.num_trainers > 1 and not data.drop_last:
        raise ValueError("model.arch = 'two_tower' with train.num_trainers > 1 needs data.drop_last = true "
                         "(the ranks' item vectors are all-gathered as negatives: equal batch sizes)")
    if train.validate_every != 0:
        raise ValueError("train.validate_every is not supported with model.arch = 'two_tower' "
                         "(retrieval metrics come from `recsys eval` and the end of training)")


__all__ = ["EvalConfig", "check_two_tower"]
