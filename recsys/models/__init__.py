"""CTR model architectures (the dense part; sparse rows come from the parameter server).

Every model is a `CTRModel`, called the same way (base.py). What training and serving both assemble::

    model = build_model(cfg.model, num_dense=13, num_sparse=26, embedding_dim=16)
    sparse, dense = build_job_model(cfg)           # SparseArch (jagged ids -> rows -> pooled), dense model
    sparse = build_sparse_arch(cfg)                # the sparse arch alone (export, predictor)

One file per architecture: dlrm.py, dcn.py, deepfm.py, wide_deep.py, din.py; shared blocks in mlp.py; the
sparse arch (lookups in an `embedding_ps.store.EmbeddingStore` and pooling) in sparse_arch.py, and its
unpooled per-position lookups of behavior lists (din) in sequence.py.
"""

from __future__ import annotations

import logging

import torch

from recsys.config import JobConfig, ModelConfig
from recsys.models.base import CTRModel
from recsys.models.dcn import DCN, CrossNet
from recsys.models.deepfm import DeepFM, FactorizationMachine, FieldWeightedFM
from recsys.models.din import DIN, AttentionUnit
from recsys.models.dlrm import DLRM, DenseArch, InteractionArch, OverArch
from recsys.models.mlp import MLP, LinearTerms
from recsys.models.sequence import SequenceSparseArch
from recsys.models.sparse_arch import SparseArch, SparseLookup, TablePlan, plan_tables
from recsys.table_plans import SequencePlan, plan_sequences, table_plans
from recsys.models.two_tower import TwoTower
from recsys.models.wide_deep import WideDeep

logger = logging.getLogger(__name__)

ARCHS: dict[str, type[CTRModel]] = {"dlrm": DLRM, "dcn": DCN, "deepfm": DeepFM, "wide_deep": WideDeep, "din": DIN}
"""`model.arch` -> model class."""


def build_model(model_cfg: ModelConfig, *, num_dense: int, num_sparse: int, embedding_dim: int,
                sequences: tuple[tuple[int, int], ...] = ()) -> CTRModel:
    """The dense model of `model_cfg.arch` for Dn dense features and F pooled embeddings of dim D.

    Parameters are drawn from torch's global RNG: call `torch.manual_seed` first for a
    reproducible init. Raises ValueError when the sizes do not fit the arch, naming the field.
    `sequences` (din only): (behavior list, candidate) feature index pairs into the F features.
    """
    if num_sparse < 1:
        raise ValueError(f"model.arch = {model_cfg.arch!r} needs at least one sparse feature, "
                         f"got num_sparse={num_sparse}")
    if model_cfg.arch == "two_tower":
        raise ValueError("model.arch = 'two_tower' splits the columns into towers: "
                         "build it with build_dense_model(cfg)")
    cls = ARCHS[model_cfg.arch]   # the config loader already checked the Literal
    if model_cfg.linear_feature_tables and not cls.needs_linear_terms:
        # Otherwise the trainer would pull and push dim-1 rows that never reach the loss.
        users = sorted(name for name, c in ARCHS.items() if c.needs_linear_terms)
        raise ValueError(f"model.linear_feature_tables is set, but model.arch = {model_cfg.arch!r} has no "
                         f"first-order terms (only {', '.join(users)} use them)")
    extra = {"sequences": sequences} if model_cfg.arch == "din" else {}
    model = cls(model_cfg, num_dense=num_dense, num_sparse=num_sparse, embedding_dim=embedding_dim, **extra)
    if cls.needs_linear_terms and not model_cfg.linear_feature_tables:
        logger.info("%s: model.linear_feature_tables is empty, so the sparse first-order terms are left out",
                    model_cfg.arch)
    logger.info("built %s: Dn=%d F=%d D=%d, %d dense parameters", model_cfg.arch, num_dense, num_sparse,
                embedding_dim, sum(p.numel() for p in model.parameters()))
    return model


def build_sparse_arch(cfg: JobConfig) -> SparseArch:
    """The sparse arch of a job: which features read which table, and how they pool."""
    plans, sequences = table_plans(cfg)
    if sequences:    # din: the behavior lists also come back per position (sequence.py)
        return SequenceSparseArch(plans, sequences, cfg.model.max_seq_len)
    return SparseArch(plans)


def build_dense_model(cfg: JobConfig, sparse: SparseArch) -> CTRModel:
    """The dense model for the pooled features `sparse` produces (one dim D: JobConfig checks it),
    initialised from `train.seed`. Two-tower's towers take their columns by name (model.user_features /
    item_features), each in the order of data.dense_columns / data.sparse_columns."""
    plans = [p for p in sparse.plans if not p.linear]
    if not plans:
        raise ValueError("data.sparse_columns maps no feature to an embedding table: the model has no input")
    torch.manual_seed(cfg.train.seed)
    if cfg.model.arch == "two_tower":
        split = lambda names: ([i for i, c in enumerate(cfg.data.dense_columns) if c in names],  # noqa: E731
                               [i for i, c in enumerate(cfg.data.sparse_columns) if c in names])
        return TwoTower(cfg.model, user=split(cfg.model.user_features), item=split(cfg.model.item_features),
                        embedding_dim=plans[0].dim)
    return build_model(cfg.model, num_dense=len(cfg.data.dense_columns),
                       num_sparse=sum(len(p.features) for p in plans), embedding_dim=plans[0].dim,
                       sequences=tuple((s.feature, s.candidate) for s in sparse.sequences))


def build_job_model(cfg: JobConfig) -> tuple[SparseArch, CTRModel]:
    """The sparse arch and the dense model of a job (what the trainer trains and the export saves)."""
    sparse = build_sparse_arch(cfg)
    return sparse, build_dense_model(cfg, sparse)


__all__ = ["ARCHS", "CTRModel", "build_model", "build_sparse_arch", "build_dense_model", "build_job_model",
           "SparseArch", "SparseLookup", "TablePlan", "plan_tables", "DLRM", "DenseArch", "InteractionArch", "OverArch",
           "DCN", "CrossNet", "DeepFM", "FactorizationMachine", "FieldWeightedFM", "WideDeep", "MLP", "LinearTerms",
           "TwoTower", "DIN", "AttentionUnit", "SequencePlan", "SequenceSparseArch", "plan_sequences"]
