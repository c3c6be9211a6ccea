"""Synthetic behavior-sequence CTR data (`recsys gen-data --preset sequence`), for DIN.

Items fall into latent categories (the data does not say which). Each row is a user with a
behavior list `hist` (list<int64> of item ids, oldest first, most recent last) and a candidate
`item`; the click probability rises with how many of the user's recent behaviors share the
candidate's category::

    favorites: `num_favorites` categories of the user now; `old`: as many others, of the user before
    hist:      n ~ U{0..max_hist} items; the last min(n, window) from a favorite w.p. favorite_rate
               (else any category), the older ones from an old category w.p. favorite_rate
    item:      from a favorite category w.p. candidate_favorite_rate, else any category
    m = #{recent behaviors (the last `window`) in the candidate's category}
    logit = bias + affinity * tanh(m / 3) + item_w * w(item) + ctx_w * w(ctx) + dense_beta * log1p(I1)
    label ~ Bernoulli(sigmoid(logit)), p_true = sigmoid(logit)

Within a category an item's rank is Zipf(item_zipf); item index = perm[category * per_category + rank]
with a permutation of `model_seed`, and the id is `data.genbase.ids_of_ranks("item", index)`, the
same for the candidate and the list. Only the last `window` behaviors count, so a model reading
older ones (no `model.max_seq_len` cut) is misled by the old categories. A model without `hist`
knows only the candidate's average appeal.

Columns: `SEQUENCE_SCHEMA`. Determinism as in `data.synthetic`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from data.genbase import (GEN_CHUNK, _hash_normals, _mix_scalar, _name_salt, _rng, ids_of_ranks, iter_chunks,
                          planted_schema, planted_table, write_parts, zipf_ranks)


@dataclass(frozen=True, slots=True)
class SequencePreset:
    """The planted model of the `sequence` preset (see the module docstring)."""

    num_items: int = 200
    num_categories: int = 10
    item_zipf: float = 0.6
    num_favorites: int = 2
    max_hist: int = 40
    window: int = 20
    favorite_rate: float = 0.8
    candidate_favorite_rate: float = 0.5
    bias: float = -2.0
    affinity: float = 3.0
    item_w: float = 0.4
    ctx_vocab: int = 10
    ctx_w: float = 0.5
    dense_beta: float = 0.15


SEQUENCE = SequencePreset()
SEQUENCE_SCHEMA = planted_schema(pa.field("I1", pa.int64()), pa.field("ctx", pa.int64()), pa.field("item", pa.int64()),
                                 pa.field("hist", pa.list_(pa.int64()), nullable=False))


class SequenceTruth:
    """The hidden model's tables: item -> category, item and ctx effects (functions of model_seed)."""

    def __init__(self, p: SequencePreset, model_seed: int = 0) -> None:
        self.p = p
        rng = np.random.default_rng(np.random.SeedSequence([model_seed, _name_salt("sequence")]))
        self.perm = rng.permutation(p.num_items)                          # [I]: slot -> item index
        self.category = np.empty(p.num_items, np.int64)                   # [I]: item index -> category
        self.category[self.perm] = np.arange(p.num_items) // (p.num_items // p.num_categories)
        self.w_item = _hash_normals(np.arange(p.num_items), _mix_scalar(model_seed, _name_salt("item")))
        self.w_ctx = _hash_normals(np.arange(p.ctx_vocab), _mix_scalar(model_seed, _name_salt("ctx")))

    def items(self, categories: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Item indices [N] in categories [N], by a Zipf rank of uniforms u [N]."""
        per = self.p.num_items // self.p.num_categories
        return self.perm[categories * per + zipf_ranks(u, per, self.p.item_zipf)]


def _chunk(t: SequenceTruth, seed: int, chunk: int) -> pa.Table:
    """Rows [chunk * GEN_CHUNK, (chunk + 1) * GEN_CHUNK)."""
    p, n = t.p, GEN_CHUNK
    r = [_rng(seed, chunk, c) for c in range(8)]
    order = r[0].random((n, p.num_categories)).argsort(axis=1)            # [n, C] a shuffle per user
    fav, old = order[:, :p.num_favorites], order[:, p.num_favorites:2 * p.num_favorites]   # [n, k] each
    lengths = r[1].integers(0, p.max_hist + 1, n)                         # [n]
    N = int(lengths.sum())
    row = np.repeat(np.arange(n), lengths)                                # [N]
    pos = np.arange(N) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # [N] 0 = oldest
    recent = pos >= lengths[row] - p.window                               # [N]
    pick = r[2].integers(0, p.num_favorites, N)                           # [N]
    cat = np.where(recent, fav[row, pick], old[row, pick])
    cat = np.where(r[3].random(N) < p.favorite_rate, cat, r[4].integers(0, p.num_categories, N))
    hist = t.items(cat, r[5].random(N))                                   # [N] item indices
    u = r[6].random((4, n))
    cand_cat = np.where(u[0] < p.candidate_favorite_rate, fav[np.arange(n), (u[1] * p.num_favorites).astype(np.int64)],
                        (u[2] * p.num_categories).astype(np.int64))
    item = t.items(cand_cat, u[3])                                        # [n]
    m = np.bincount(row, recent & (cat == cand_cat[row]), minlength=n)    # [n] recent matches
    ctx = r[7].integers(0, p.ctx_vocab, n)
    dense = np.floor(np.exp(1.0 + 1.2 * r[7].standard_normal(n))).astype(np.int64)
    logit = (p.bias + p.affinity * np.tanh(m / 3.0) + p.item_w * t.w_item[item] + p.ctx_w * t.w_ctx[ctx]
             + p.dense_beta * np.log1p(dense))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cols = {"I1": pa.array(dense), "ctx": pa.array(ids_of_ranks("ctx", ctx)),
            "item": pa.array(ids_of_ranks("item", item)),
            "hist": pa.ListArray.from_arrays(offsets, pa.array(ids_of_ranks("item", hist)))}
    return planted_table(SEQUENCE_SCHEMA, chunk, cols, logit, r[7])


def iter_sequence_rows(rows: int, seed: int, model_seed: int = 0) -> Iterator[pa.Table]:
    """Tables of at most GEN_CHUNK rows, rows 0..rows-1 in order. Memory: one chunk."""
    truth = SequenceTruth(SEQUENCE, model_seed)
    return iter_chunks(lambda c: _chunk(truth, seed, c), rows)


def generate_sequence(*, rows: int, num_files: int, out_dir: str, seed: int, row_group_rows: int = 65536,
                      compression: str = "zstd", model_seed: int = 0) -> dict:
    """Writes `rows` rows of the sequence preset into `out_dir/part-%05d.parquet` (as
    `data.synthetic.generate` does); returns rows, files, CTR, mean p_true, oracle AUC, seconds."""
    return write_parts("sequence", SEQUENCE_SCHEMA, lambda: iter_sequence_rows(rows, seed, model_seed),
                       rows=rows, num_files=num_files, out_dir=out_dir, seed=seed, row_group_rows=row_group_rows,
                       compression=compression, model_seed=model_seed)
