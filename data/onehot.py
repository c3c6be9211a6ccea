"""Synthetic one-hot CTR data shaped like real user x item x context logs (`recsys gen-data --preset onehot`).

Ten one-id columns and nothing else, as in the small public CTR sets (Frappe, MovieLens-tag, Avazu
slices): a user and an item of a few thousand ids each, Zipf-distributed (a few heavy users and
popular items, a long tail seen once or twice), the item's category (a function of the item), and
seven small context fields of 3-50 values. Labels come from the hidden model of `data.synthetic`
without rank decay (w_f, v_f hashed from (model_seed, field, rank), v_f centered; the planted pairs
`ONEHOT.pairs`, the strongest a user's taste for an item_category), its logit clipped to
+-LOGIT_CLIP: a factorization machine (or DeepFM) beats logistic regression, which sees only the
first-order part.

Ranks: `user`, `item` and the Zipf context fields draw rank ~ `data.genbase.zipf_ranks(zipf)`
(zipf 0: uniform); `item_category` is not drawn: it is category(item), a fixed random map of the
items onto its values (`model_seed`), so popular items make popular categories. The id written is
`data.genbase.ids_of_ranks(field, rank)` (64-bit-looking, non-negative).

Columns: label f32, the ten fields (int64, never null) in ONEHOT_FIELDS order, row_id int64, p_true f32.
Rows are i.i.d. from one stream, cut into files by `ONEHOT_SPLIT` by default. Determinism as in
`data.synthetic` (the same seed gives the same rows whatever the split).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from data.genbase import (GEN_CHUNK, _hash_normals, _mix_scalar, _name_salt, _rng, ids_of_ranks, iter_chunks,
                          planted_schema, planted_table, write_parts, zipf_pmf, zipf_ranks)


@dataclass(frozen=True, slots=True)
class Field:
    """One one-id column of `vocab` values: rank ~ Zipf(zipf) (0: uniform), or, with `parent`, a
    fixed random map of the parent's rank; first-order effect w ~ w_scale N(0, 1) per value."""

    name: str
    vocab: int
    zipf: float
    w_scale: float
    parent: str = ""


@dataclass(frozen=True, slots=True)
class OnehotPreset:
    """The planted model of the `onehot` preset (see the module docstring)."""

    bias: float
    dim: int
    """K, the size of the interaction vectors v."""
    fields: tuple[Field, ...]
    pairs: tuple[tuple[str, str, float], ...]
    """(field, field, scale): adds scale * <v_f, v_g> / sqrt(K)."""


ONEHOT = OnehotPreset(
    bias=-1.5, dim=4,
    # name, vocab, zipf (0: uniform), w_scale[, parent]
    fields=(Field("user", 5000, 1.1, 2.0), Field("item", 4000, 1.1, 2.0),
            Field("item_category", 40, 0.0, 0.8, parent="item"),
            Field("hour", 24, 0.0, 0.8), Field("weekday", 7, 0.0, 0.4), Field("device", 4, 1.2, 0.8),
            Field("city", 50, 1.0, 0.8), Field("weather", 9, 1.0, 0.4), Field("slot", 5, 1.0, 1.5),
            Field("network", 3, 1.0, 0.4)),
    pairs=(("user", "item_category", 2.0), ("item", "hour", 1.0), ("device", "item_category", 1.0),
           ("city", "item_category", 0.8)),
)
LOGIT_CLIP = 15.0
"""The logit is clipped to +-15, so p_true stays inside (0, 1) in float32 (a handful of rows reach it)."""
ONEHOT_FIELDS = tuple(f.name for f in ONEHOT.fields)
"""The id columns, in file order."""
ONEHOT_SPLIT = (50_000, 6_000, 30_000)
"""Rows of part-00000 (train), part-00001 (validation), part-00002 (test) by default."""


class OnehotTruth:
    """The hidden model's tables: w [V] and centered v [V, K] per field, and the parent maps."""

    def __init__(self, p: OnehotPreset, model_seed: int = 0) -> None:
        self.p = p
        self.schema = planted_schema(*(pa.field(f.name, pa.int64(), nullable=False) for f in p.fields))
        self.children: dict[str, np.ndarray] = {}                  # child field -> [parent V] child rank
        self.pmf: dict[str, np.ndarray] = {}                       # field -> [V] probability of each rank
        self.w: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        in_pairs = {n for a, b, _ in p.pairs for n in (a, b)}
        for f in p.fields:
            if f.parent:
                rng = np.random.default_rng(np.random.SeedSequence([model_seed, _name_salt(f.name)]))
                parent = next(g for g in p.fields if g.name == f.parent)
                self.children[f.name] = rng.integers(0, f.vocab, parent.vocab)
                self.pmf[f.name] = np.bincount(self.children[f.name], zipf_pmf(parent.vocab, parent.zipf), f.vocab)
            else:
                self.pmf[f.name] = zipf_pmf(f.vocab, f.zipf)
            salt, ranks = _mix_scalar(model_seed, _name_salt(f.name)), np.arange(f.vocab)
            self.w[f.name] = f.w_scale * _hash_normals(ranks, _mix_scalar(salt, 0))
            if f.name in in_pairs:
                v = np.stack([_hash_normals(ranks, _mix_scalar(salt, 1 + j)) for j in range(p.dim)], 1)
                self.v[f.name] = v - self.pmf[f.name] @ v             # [V, K], E[v_f] = 0

    def logit(self, ranks: dict[str, np.ndarray]) -> np.ndarray:
        """float64 [N]: the planted logit of rows given each field's ranks [N]."""
        p = self.p
        out = np.full(len(next(iter(ranks.values()))), p.bias)
        for f in p.fields:
            out += self.w[f.name][ranks[f.name]]
        for a, b, s in p.pairs:
            out += s / math.sqrt(p.dim) * np.einsum("nk,nk->n", self.v[a][ranks[a]], self.v[b][ranks[b]])
        return np.clip(out, -LOGIT_CLIP, LOGIT_CLIP)


def _chunk(t: OnehotTruth, seed: int, chunk: int) -> pa.Table:
    """Rows [chunk * GEN_CHUNK, (chunk + 1) * GEN_CHUNK)."""
    n, ranks = GEN_CHUNK, {}
    for col, f in enumerate(t.p.fields):
        if not f.parent:
            ranks[f.name] = zipf_ranks(_rng(seed, chunk, col).random(n), f.vocab, f.zipf)
    for f in t.p.fields:
        if f.parent:
            ranks[f.name] = t.children[f.name][ranks[f.parent]]
    cols = {f.name: pa.array(ids_of_ranks(f.name, ranks[f.name])) for f in t.p.fields}
    return planted_table(t.schema, chunk, cols, t.logit(ranks), _rng(seed, chunk, len(t.p.fields)))


def generate_onehot(*, out_dir: str, seed: int, split: Sequence[int] = ONEHOT_SPLIT, row_group_rows: int = 65536,
                    compression: str = "zstd", model_seed: int = 0) -> dict:
    """Writes sum(split) rows of the onehot preset, file i (`out_dir/part-%05d.parquet`) holding the
    next split[i] rows (default: train, validation, test); returns `data.synthetic.generate`'s summary."""
    rows, truth = sum(split), OnehotTruth(ONEHOT, model_seed)
    return write_parts("onehot", truth.schema, lambda: iter_chunks(lambda c: _chunk(truth, seed, c), rows),
                       rows=rows, num_files=len(split), out_dir=out_dir, seed=seed, row_group_rows=row_group_rows,
                       compression=compression, model_seed=model_seed, rows_per_file=tuple(split))
