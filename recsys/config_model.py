"""The `[model]` section of a job config: `ModelConfig` (architecture, feature -> table map, tower
sizes and the per-architecture options). Loaded and checked by `recsys.config`, which re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from embedding_ps.wire.config import at_least


def default_bottom_mlp(embedding_dim: int) -> tuple[int, int]:
    """DLRM's bottom MLP when `model.bottom_mlp` is not given: one hidden layer, then the tables' dim D
    (the bottom output is dotted with the embeddings, so it must end in D)."""
    return (max(64, 2 * embedding_dim), embedding_dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The CTR model: architecture, feature -> table map and dense tower sizes."""

    arch: Literal["dlrm", "dcn", "deepfm", "wide_deep", "two_tower", "din"] = "dlrm"
    """Model architecture."""
    feature_tables: dict[str, str] = field(default_factory=dict)
    """Sparse feature -> PS table name; a feature missing here uses the table of its own name."""
    linear_feature_tables: dict[str, str] = field(default_factory=dict)
    """Sparse feature -> dim-1 PS table of first-order (wide / FM linear) terms (wide_deep, deepfm)."""
    linear_tables: bool = False
    """deepfm / wide_deep: give every sparse feature without one a dim-1 linear table `<feature>_linear`,
    made from `[ps.table_defaults]` (the loader writes them into ps.tables and linear_feature_tables)."""
    table_pooling: dict[str, str] = field(default_factory=dict)
    """PS table name -> `sum` or `mean` (default `sum`)."""
    bottom_mlp: tuple[int, ...] = ()
    """DLRM only: every layer width of the bottom (dense-feature) MLP; the last must equal the tables' dim.
    Empty (the default): derived from the tables' dim D, `default_bottom_mlp(D)` = [max(64, 2 D), D]
    ([64, 16] at D = 16), so any dim works without it."""
    top_mlp: tuple[int, ...] = (64, 32)
    """Hidden widths of the top MLP (DLRM) or of the deep tower (DCN, DeepFM, Wide&Deep); the final
    layer down to one logit is added."""
    num_cross_layers: int = 3
    """DCN-v2: cross layers."""
    dcn_structure: Literal["stacked", "parallel"] = "stacked"
    """DCN-v2: cross network before the deep part, or beside it."""
    dropout: float = 0.0
    """Dropout in the MLPs."""
    fm_interaction: Literal["fm", "fwfm"] = "fm"
    """deepfm: the second-order term. "fm": sum_{i<j} <v_i, v_j>, every pair of fields weighted 1; "fwfm"
    (Pan et al. 2018, field-weighted FM): sum_{i<j} r_ij <v_i, v_j>, one learned weight per pair of fields
    (F (F - 1) / 2 dense parameters, starting at 1), so the pairs of a noisy many-id field can be turned
    down. configs/deepfm.toml uses "fwfm" (its test AUC against "fm": BENCHMARKS.md, "benchmarks/quality.py")."""
    norm: Literal["none", "batch", "layer"] = "none"
    """Normalization after each Linear of the MLPs (DLRM bottom and top, DCN deep, DeepFM DNN,
    Wide&Deep deep), before its ReLU: "batch" (BatchNorm1d; running statistics in eval and export;
    under DDP each rank normalizes over its own rows, so sync mode is no longer exactly one process
    on the concatenated batch) or "layer" (LayerNorm per row). "none" keeps the plain MLP."""
    user_features: tuple[str, ...] = ()
    """two_tower: the sparse and dense columns the user tower reads (each column in one tower)."""
    item_features: tuple[str, ...] = ()
    """two_tower: the sparse and dense columns the item tower reads (also the columns of data.item_paths)."""
    user_id_feature: str = "user_id"
    """two_tower: the sparse column identifying a user; retrieval eval groups the eval rows by it
    (a user's relevant items: the items of its rows; its query: the user features of its first row)."""
    item_id_feature: str = "item_id"
    """two_tower: the sparse column holding the item id (log-Q frequencies, eval, the export's item ids)."""
    tower_dim: int = 32
    """two_tower: width of the L2-normalized user and item vectors (each tower: model.top_mlp hidden
    layers, then a Linear to tower_dim)."""
    temperature: float = 0.05
    """two_tower: the sampled softmax's logits are cosine / temperature."""
    logq_correction: bool = True
    """two_tower: subtract log(estimated sampling probability) of each in-batch negative (Yi et al. 2019)."""
    num_freq_buckets: int = 1 << 18
    """two_tower: hashed buckets of the streamed item-frequency estimate (for log-Q)."""
    sequence_features: dict[str, str] = field(default_factory=dict)
    """din: behavior list column -> the candidate feature whose table it shares (e.g. `{hist = "item"}`):
    the list's ids are looked up in that feature's table, one row per position, and attended by the
    candidate's embedding. Both must be in data.sparse_columns."""
    max_seq_len: int = 50
    """din: positions L kept of each behavior list, the most recent (the list's last ids) first kept."""
    attention_mlp: tuple[int, ...] = (36,)
    """din: hidden widths of the activation unit, an MLP over [q, k, q - k, q * k] -> one weight."""
    attention_softmax: bool = False
    """din: normalize the attention weights with a softmax over the real positions (False, as in Zhou
    et al. 2018: raw weights, so the pooled interest keeps the intensity of the matching behaviors)."""

    def __post_init__(self) -> None:
        for key in ("bottom_mlp", "top_mlp", "attention_mlp"):
            if any(h < 1 for h in getattr(self, key)):
                raise ValueError(f"model.{key} sizes must be >= 1, got {list(getattr(self, key))}")
        for table, pooling in self.table_pooling.items():
            if pooling not in ("sum", "mean"):
                raise ValueError(f"model.table_pooling.{table} must be 'sum' or 'mean', got {pooling!r}")
        at_least("model", self, 0, "num_cross_layers")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.linear_tables and self.arch not in ("deepfm", "wide_deep"):
            raise ValueError(f"model.linear_tables is only used by deepfm and wide_deep, not {self.arch!r}")
        if self.fm_interaction != "fm" and self.arch != "deepfm":
            raise ValueError(f"model.fm_interaction is only used by deepfm, not {self.arch!r}")
        at_least("model", self, 1, "tower_dim", "num_freq_buckets", "max_seq_len")
        if self.temperature <= 0:
            raise ValueError(f"model.temperature must be > 0, got {self.temperature}")
        if self.arch == "din" and not self.sequence_features:
            raise ValueError("model.arch = 'din' needs model.sequence_features (behavior list column -> "
                             "candidate feature), e.g. {hist = \"item\"}")
        if self.sequence_features and self.arch != "din":
            raise ValueError(f"model.sequence_features is only used by din, not {self.arch!r}")
        for seq, cand in self.sequence_features.items():
            if cand == seq or cand in self.sequence_features:
                raise ValueError(f"model.sequence_features.{seq} = {cand!r} must name a candidate feature, "
                                 f"not a sequence feature")


def sequence_feature_tables(feature_tables: dict, sequence_features: dict) -> dict[str, str]:
    """`model.feature_tables` with every behavior list mapped to its candidate's table (din: a behavior
    list reads its candidate's table; raw config values that are not names are left out)."""
    return {**{s: feature_tables.get(c, c) for s, c in sequence_features.items() if isinstance(c, str)},
            **feature_tables}
