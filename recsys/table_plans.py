"""Which features read which table, and how they pool: the plans of a job's sparse arch, computed from
its config alone (no torch), so that `recsys train` checks them before it imports torch (preflight)
and the models build their lookups from the same plans (`recsys.models.build_sparse_arch`)."""

from __future__ import annotations

from dataclasses import dataclass

from embedding_ps.wire.config import TableConfig
from recsys.config import JobConfig
from recsys.config_model import sequence_feature_tables


@dataclass(frozen=True, slots=True)
class TablePlan:
    """One table's part of the batch: which features read it and how they pool."""

    table: int                # index into ps.tables
    name: str
    dim: int
    pooling: str              # "sum" | "mean"
    features: tuple[int, ...]  # indices into the batch's feature keys, in output order
    linear: bool              # dim-1 table feeding the model's first-order (wide) terms
    replicated: bool = False  # placement = "replicated": looked up in the trainer's own copy (replicated.py)


def plan_tables(features: tuple[str, ...], tables: tuple[TableConfig, ...], feature_tables: dict[str, str],
                linear_feature_tables: dict[str, str], table_pooling: dict[str, str]) -> list[TablePlan]:
    """Group features by the table they read. Raises ValueError naming a feature or table."""
    index = {t.name: i for i, t in enumerate(tables)}
    plans: list[TablePlan] = []
    for linear, mapping in ((False, feature_tables), (True, linear_feature_tables)):
        by_table: dict[str, list[int]] = {}
        for f, feature in enumerate(features):
            name = mapping.get(feature, None if linear else feature)
            if name is None:
                continue
            if name not in index:
                raise ValueError(f"feature '{feature}' reads table '{name}', which is not in ps.tables")
            by_table.setdefault(name, []).append(f)
        for name, feats in by_table.items():
            cfg = tables[index[name]]
            if linear and cfg.dim != 1:
                raise ValueError(f"linear table '{name}' must have dim 1, got {cfg.dim}")
            plans.append(TablePlan(index[name], name, cfg.dim, table_pooling.get(name, "sum"),
                                   tuple(feats), linear, cfg.placement == "replicated"))
    return plans


@dataclass(frozen=True, slots=True)
class SequencePlan:
    """One behavior list: its feature index and its candidate's (both index the batch's keys and pooled [B, F, D])."""

    name: str
    feature: int
    candidate: int


def plan_sequences(features: tuple[str, ...], sequence_features: dict[str, str]) -> list[SequencePlan]:
    """The SequencePlans of `model.sequence_features` over the batch's features (in feature order; both
    columns of each are among them, as JobConfig checks)."""
    out = [SequencePlan(seq, features.index(seq), features.index(cand)) for seq, cand in sequence_features.items()]
    return sorted(out, key=lambda s: s.feature)


def table_plans(cfg: JobConfig) -> tuple[list[TablePlan], list[SequencePlan]]:
    """A job's table plans and (din: `model.sequence_features`) sequence plans. Raises ValueError
    naming a feature or table that does not fit."""
    m = cfg.model
    feature_tables = sequence_feature_tables(m.feature_tables, m.sequence_features)   # a list: its candidate's table
    plans = plan_tables(cfg.data.sparse_columns, cfg.ps.tables, feature_tables, m.linear_feature_tables,
                        m.table_pooling)
    return plans, plan_sequences(cfg.data.sparse_columns, m.sequence_features)
