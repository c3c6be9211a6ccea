"""Synthetic CTR data with a known ground truth, written as Parquet (`recsys gen-data`).

Each row: `label` (float32 0/1), dense counts `I*` (int64, heavy-tailed, with nulls), one-id sparse
columns `C*` (int64 64-bit-looking ids, Zipf-distributed, a few nulls), multi-hot `M*` (list<int64>),
`row_id` (int64, global 0..N-1) and `p_true` (float32, the click probability the label was drawn with).

The hidden model (a factorization machine over chosen feature pairs; a linear model cannot learn it)::

    logit = bias + sum_f w_f(id_f) + sum_{(f,g,s) in pairs} s * <v_f(id_f), v_g(id_g)> / sqrt(K)
                 + sum_d beta_d * log1p(x_d)            (null dense x_d counts as 0, null id as no id)
    label ~ Bernoulli(sigmoid(logit))

`w_f(r)` and `v_f(r)` [K] are functions of (model_seed, feature, rank r) computed by hashing (no
vocabulary-sized tables beyond small ones cached for speed); they shrink with the rank as
1 / (1 + r / head_f) so most of the signal sits on frequent ids, and `v_f` is centered under the
feature's own id distribution so an interaction has no linear part. A multi-hot column contributes
the mean of its items' w and v. The id of rank r is `splitmix64(r ^ salt(feature)) & (2**63 - 1)`.

Determinism: rows are made in fixed chunks of `GEN_CHUNK` rows, chunk c from an RNG seeded by
(seed, c, column), and cut into files afterwards: the same seed gives the same rows whatever the
number of files, row-group size or compression, and the first N rows do not depend on the total.
The hidden model depends on `model_seed` only (not on `seed`), so train and eval sets generated with
different seeds are samples of the same task.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# the generators' shared parts (data/genbase.py), re-exported here
from data.genbase import (GEN_CHUNK, _hash_normals, _mix_scalar, _name_salt, _rng,  # noqa: F401
                          file_rows, ids_of_ranks, iter_chunks, planted_schema, planted_table, splitmix64,
                          write_parts, zipf_pmf, zipf_ranks)
from data.onehot import generate_onehot
from data.retrieval import generate_retrieval

_TABLE_MAX = 1 << 16
"""Features with at most this many ids keep their w/v in a table; larger ones hash per row."""


# ---------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Dense:
    """An int64 count column: floor(exp(mu + sigma z)), zero with prob zero_rate, null with null_rate;
    adds beta * log1p(x) to the logit (null counts as 0)."""

    name: str
    mu: float
    sigma: float
    zero_rate: float
    null_rate: float
    beta: float


@dataclass(frozen=True, slots=True)
class Sparse:
    """An int64 one-id column: rank ~ Zipf(zipf) over `vocab` ids, null with null_rate.
    Effects w ~ w_scale N(0,1) and v ~ N(0,I_K), both times 1 / (1 + rank / head) (head 0: no decay)."""

    name: str
    vocab: int
    zipf: float
    null_rate: float = 0.0
    w_scale: float = 0.0
    head: float = 0.0


@dataclass(frozen=True, slots=True)
class MultiHot:
    """A list<int64> column: Poisson(mean_len) items per row (0 = empty list), each like `Sparse`;
    the row's effect is the mean over its items."""

    name: str
    vocab: int
    zipf: float
    mean_len: float
    w_scale: float = 0.0
    head: float = 0.0


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    bias: float
    dim: int
    """K, the size of the interaction vectors v."""
    dense: tuple[Dense, ...]
    sparse: tuple[Sparse, ...]
    lists: tuple[MultiHot, ...]
    pairs: tuple[tuple[str, str, float], ...]
    """(feature, feature, scale): adds scale * <v_f, v_g> / sqrt(K)."""

    def __post_init__(self) -> None:
        names = {f.name: f for f in (*self.sparse, *self.lists)}
        for a, b, _ in self.pairs:
            for n in (a, b):
                if n not in names or names[n].vocab > _TABLE_MAX:
                    raise ValueError(f"preset {self.name}: pair feature '{n}' must be a sparse or "
                                     f"multi-hot feature with at most {_TABLE_MAX} ids")


_CRITEO_DENSE = tuple(Dense(f"I{i + 1}", *a) for i, a in enumerate([
    # mu, sigma, zero_rate, null_rate, beta
    (0.5, 1.2, 0.30, 0.45, 0.12), (2.0, 2.0, 0.10, 0.00, -0.04), (2.0, 1.5, 0.05, 0.21, 0.04),
    (1.5, 1.0, 0.05, 0.22, 0.04), (7.0, 2.0, 0.02, 0.03, -0.06), (3.0, 1.8, 0.10, 0.22, 0.04),
    (1.5, 1.5, 0.20, 0.04, 0.08), (2.0, 1.2, 0.05, 0.0005, 0.0), (4.0, 1.5, 0.02, 0.04, 0.04),
    (0.0, 0.8, 0.40, 0.45, 0.16), (1.0, 1.2, 0.30, 0.04, 0.12), (0.0, 1.5, 0.50, 0.76, 0.08),
    (1.5, 1.2, 0.10, 0.22, 0.04)]))

_CRITEO_SPARSE = tuple(Sparse(f"C{i + 1}", *a) for i, a in enumerate([
    # vocab, zipf, null_rate, w_scale, head
    (1460, 1.1, 0.0, 0.03, 3), (583, 1.1, 0.0, 0.08, 3), (10_000_000, 1.3, 0.02, 0.015, 3),
    (2_200_000, 1.3, 0.0, 0.015, 3), (305, 1.1, 0.0, 0.08, 3), (24, 1.0, 0.0, 0.7, 0),
    (12_517, 1.2, 0.0, 0.02, 3), (633, 1.1, 0.0, 0.03, 3), (10, 1.0, 0.0, 0.46, 0),
    (93_145, 1.3, 0.0, 0.015, 3), (5683, 1.2, 0.0, 0.03, 3), (8_350_000, 1.3, 0.02, 0.015, 3),
    (3194, 1.2, 0.0, 0.03, 3), (27, 1.0, 0.0, 0.58, 0), (14_992, 1.2, 0.0, 0.02, 3),
    (5_460_000, 1.3, 0.0, 0.015, 3), (10, 1.0, 0.0, 0.46, 0), (5652, 1.2, 0.0, 0.03, 3),
    (2173, 1.2, 0.2, 0.03, 3), (10, 1.0, 0.2, 0.46, 0), (7_050_000, 1.3, 0.0, 0.015, 3),
    (18, 1.0, 0.5, 0.46, 0), (15, 1.0, 0.0, 0.58, 0), (286_181, 1.3, 0.0, 0.015, 3),
    (105, 1.1, 0.2, 0.08, 3), (142_572, 1.3, 0.2, 0.015, 3)]))

# criteo-like tuning: the signal sits on the seven 10-27-id features, their pairs and the dense
# columns; the bigger vocabularies carry little (signal spread over 300-1500-id or 10^5+-id columns
# could not be learned from 300k rows). The CTR, oracle AUC and the AUC a DLRM and a logistic
# regression reach on it: benchmarks/history/figures-from-the-code.md.
PRESETS: dict[str, Preset] = {
    "criteo-like": Preset(
        name="criteo-like", bias=-2.0, dim=2, dense=_CRITEO_DENSE, sparse=_CRITEO_SPARSE,
        lists=(MultiHot("M1", 10_000, 1.1, 6.0, 0.12, 3), MultiHot("M2", 50_000, 1.2, 9.0, 0.06, 3)),
        pairs=(("C6", "C14", 0.38), ("C9", "C23", 0.38), ("C17", "C22", 0.38), ("C20", "C6", 0.32),
               ("C14", "C23", 0.32), ("C5", "C25", 0.26), ("C9", "C17", 0.32)),
    ),
    "tiny": Preset(
        name="tiny", bias=-1.5, dim=2,
        dense=(Dense("I1", 1.0, 1.2, 0.2, 0.1, 0.2), Dense("I2", 3.0, 1.5, 0.05, 0.0, -0.1)),
        sparse=(Sparse("C1", 10, 1.0, 0.0, 0.8), Sparse("C2", 100, 1.1, 0.0, 0.8, 10),
                Sparse("C3", 1000, 1.1, 0.0, 0.5, 5), Sparse("C4", 10_000, 1.2, 0.1, 0.2, 5)),
        lists=(MultiHot("M1", 50, 1.0, 3.0, 0.8),),
        pairs=(("C1", "C2", 1.1), ("C2", "M1", 0.7)),
    ),
    # built to overfit (sparse regularization and early-stopping tests): three small-vocabulary
    # fields carry strong effects; five fields of 2k-16k ids on a flat power law carry weak per-id
    # effects (w ~ 0.4 N(0, 1), no decay), so in a few thousand rows most of their ids are seen a
    # handful of times (in train and in eval): fitting their rows freely memorizes label noise, and
    # shrinking them (L2) is what pays. No dense or multi-hot columns.
    "longtail": Preset(
        name="longtail", bias=-0.8, dim=2, dense=(),
        sparse=(Sparse("C1", 20, 1.0, 0.0, 0.6), Sparse("C2", 50, 1.0, 0.0, 0.5),
                Sparse("C3", 300, 1.0, 0.0, 0.4, 30), Sparse("C4", 2000, 0.5, 0.0, 0.4),
                Sparse("C5", 4000, 0.4, 0.0, 0.4), Sparse("C6", 8000, 0.3, 0.0, 0.4),
                Sparse("C7", 8000, 0.3, 0.0, 0.4), Sparse("C8", 16000, 0.2, 0.0, 0.4)),
        lists=(),
        pairs=(("C1", "C2", 1.0), ("C2", "C3", 0.6)),
    ),
}


# ---------------------------------------------------------------------------------------------
# the hidden model
# ---------------------------------------------------------------------------------------------
class GroundTruth:
    """w_f(rank) [N] and v_f(rank) [N, K] of every sparse and multi-hot feature of a preset."""

    def __init__(self, preset: Preset, model_seed: int = 0) -> None:
        self.preset = preset
        self._specs = {f.name: f for f in (*preset.sparse, *preset.lists)}
        self._salt = {name: _mix_scalar(model_seed, _name_salt(name)) for name in self._specs}
        self._has_v = {name for a, b, _ in preset.pairs for name in (a, b)}
        self._tables: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}    # (w [V], v [V, K] with E[v_f] = 0)
        for name, spec in self._specs.items():
            if spec.vocab <= _TABLE_MAX:
                w, v = self._compute(name, np.arange(spec.vocab, dtype=np.int64))
                self._tables[name] = w, (None if v is None else v - zipf_pmf(spec.vocab, spec.zipf) @ v)

    def _compute(self, name: str, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        spec = self._specs[name]
        salt = self._salt[name]
        decay = 1.0 / (1.0 + ranks / spec.head) if spec.head else np.ones(len(ranks))
        w = spec.w_scale * decay * _hash_normals(ranks, _mix_scalar(salt, 0))
        if name not in self._has_v:
            return w, None
        v = np.stack([_hash_normals(ranks, _mix_scalar(salt, 1 + j)) for j in range(self.preset.dim)], 1)
        return w, v * decay[:, None]

    def effects(self, name: str, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(w [N], centered v [N, K] or None) of ranks [N] of feature `name`."""
        if name not in self._tables:         # no table: not a pair feature (Preset checks it), so no v
            return self._compute(name, ranks)
        w, v = self._tables[name]
        return w[ranks], (None if v is None else v[ranks])


# ---------------------------------------------------------------------------------------------
# one chunk of rows
# ---------------------------------------------------------------------------------------------
def _chunk(gt: GroundTruth, seed: int, chunk: int) -> pa.Table:
    """Rows [chunk * GEN_CHUNK, (chunk + 1) * GEN_CHUNK) as a table of the preset's schema."""
    p, n, col = gt.preset, GEN_CHUNK, 0
    cols: dict[str, pa.Array] = {}
    logit = np.full(n, p.bias)
    vecs: dict[str, np.ndarray] = {}
    for d in p.dense:
        rng, col = _rng(seed, chunk, col), col + 1
        x = np.floor(np.exp(d.mu + d.sigma * rng.standard_normal(n))).astype(np.int64)
        x[rng.random(n) < d.zero_rate] = 0
        null = rng.random(n) < d.null_rate
        logit += d.beta * np.log1p(np.where(null, 0, x))
        cols[d.name] = pa.array(x, mask=null)
    for f in p.sparse:
        rng, col = _rng(seed, chunk, col), col + 1
        ranks = zipf_ranks(rng.random(n), f.vocab, f.zipf)
        null = rng.random(n) < f.null_rate
        w, v = gt.effects(f.name, ranks)
        logit += np.where(null, 0.0, w)
        if v is not None:
            vecs[f.name] = np.where(null[:, None], 0.0, v)
        cols[f.name] = pa.array(ids_of_ranks(f.name, ranks), mask=null if f.null_rate > 0 else None)
    for f in p.lists:
        rng, col = _rng(seed, chunk, col), col + 1
        lengths = rng.poisson(f.mean_len, n)
        ranks = zipf_ranks(rng.random(int(lengths.sum())), f.vocab, f.zipf)
        row = np.repeat(np.arange(n), lengths)
        denom = np.maximum(lengths, 1)
        w, v = gt.effects(f.name, ranks)
        logit += np.bincount(row, w, minlength=n) / denom
        if v is not None:
            vecs[f.name] = np.stack([np.bincount(row, v[:, j], minlength=n) for j in range(p.dim)],
                                    1) / denom[:, None]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        cols[f.name] = pa.ListArray.from_arrays(offsets, pa.array(ids_of_ranks(f.name, ranks)))
    for a, b, scale in p.pairs:
        logit += scale / math.sqrt(p.dim) * np.einsum("nk,nk->n", vecs[a], vecs[b])
    return planted_table(preset_arrow_schema(p), chunk, cols, logit, _rng(seed, chunk, col))


def iter_rows(preset: Preset, rows: int, seed: int, model_seed: int = 0) -> Iterator[pa.Table]:
    """Tables of at most GEN_CHUNK rows, rows 0..rows-1 in order. Memory: one chunk."""
    gt = GroundTruth(preset, model_seed)
    return iter_chunks(lambda c: _chunk(gt, seed, c), rows)


# ---------------------------------------------------------------------------------------------
# schema
# ---------------------------------------------------------------------------------------------
def get_preset(preset: str) -> Preset:
    if preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset '{preset}'; valid: {', '.join(sorted(PRESETS))}")
    return PRESETS[preset]


def preset_arrow_schema(p: Preset) -> pa.Schema:
    return planted_schema(*(pa.field(d.name, pa.int64()) for d in p.dense),
                          *(pa.field(f.name, pa.int64(), nullable=f.null_rate > 0) for f in p.sparse),
                          *(pa.field(f.name, pa.list_(pa.int64()), nullable=False) for f in p.lists))


def preset_schema(preset: str) -> dict[str, object]:
    """Column names of a preset: label, dense, sparse (one id), list (multi-hot), row_id, p_true."""
    p = get_preset(preset)
    return {"label": "label", "dense": tuple(d.name for d in p.dense),
            "sparse": tuple(f.name for f in p.sparse), "list": tuple(f.name for f in p.lists),
            "row_id": "row_id", "p_true": "p_true"}


def data_config_kwargs(preset: str) -> dict[str, object]:
    """`DataConfig(**data_config_kwargs(preset), train_paths=...)` reads a preset's files."""
    s = preset_schema(preset)
    return {"label_column": "label", "dense_columns": s["dense"], "dense_log1p": True,
            "sparse_columns": (*s["sparse"], *s["list"]), "passthrough_columns": ("row_id", "p_true")}


def generate(*, preset: str, rows: int, num_files: int, out_dir: str, seed: int,
             row_group_rows: int = 65536, compression: str = "zstd", model_seed: int = 0,
             rows_per_file: Sequence[int] | None = None) -> dict:
    """Writes `rows` rows of `preset` into `num_files` files `out_dir/part-%05d.parquet`.

    File i holds rows [i * rows // num_files, (i + 1) * rows // num_files), or, with `rows_per_file`
    (e.g. a train / validation / test split; its sum must be `rows`), the next rows_per_file[i] rows.
    `compression` is a Parquet codec name or "none". Returns a summary: rows, files, CTR, mean
    p_true, oracle AUC (AUC of p_true against the labels, from a 2^20-bin histogram), seconds.
    Presets with their own generator: `retrieval` (data.retrieval), `onehot` (data.onehot).
    """
    if preset == "onehot":               # ten one-hot fields, its own generator (data/onehot.py)
        return generate_onehot(out_dir=out_dir, seed=seed, split=file_rows(rows, num_files, rows_per_file),
                               row_group_rows=row_group_rows, compression=compression, model_seed=model_seed)
    if preset == "retrieval":            # its own generator and files (data/retrieval.py)
        if rows_per_file is not None:
            raise ValueError("preset 'retrieval' writes files of equal rows: rows_per_file is not supported")
        return generate_retrieval(rows=rows, num_files=num_files, out_dir=out_dir, seed=seed,
                                  row_group_rows=row_group_rows, compression=compression, model_seed=model_seed)
    p = get_preset(preset)
    return write_parts(preset, preset_arrow_schema(p), lambda: iter_rows(p, rows, seed, model_seed), rows=rows,
                       num_files=num_files, out_dir=out_dir, seed=seed, row_group_rows=row_group_rows,
                       compression=compression, model_seed=model_seed, rows_per_file=rows_per_file)

