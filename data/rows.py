"""`Rows`: decoded examples held as numpy columns between Parquet and `Batch`.

Shapes: n rows, Dn dense columns, N_f ids of list feature f, B rows of a batch.

Every column is kept on its own, so the id columns can stay zero-copy views of the Arrow buffers
of the row group being read (read-only; they keep that row group's buffers alive for as long as
the window that holds them, no longer). `gather()` is the only way out: it copies the selected
rows into new arrays, so a `Batch` owns its memory, is writable, and pins no Arrow buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from data.batch import Batch

Index = np.ndarray | slice
"""Rows to take: an int64 index array (any order) or a slice."""


@dataclass(slots=True)
class ScalarColumn:
    """One one-id feature of n rows."""

    ids: np.ndarray
    """int64 [n] (any value where not valid)"""
    valid: np.ndarray | None = None
    """bool [n] whether the row has its id (a null id has none); None: all rows have one"""
    weights: np.ndarray | None = None
    """float32 [n] per-id weights, or None"""


@dataclass(slots=True)
class ListColumn:
    """One list feature of n rows: row i owns values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray
    """int64 [N_f]"""
    offsets: np.ndarray
    """int64 [n + 1], offsets[0] = 0"""
    weights: np.ndarray | None = None
    """float32 [N_f] per-id weights, or None"""


def take_jagged(offsets: np.ndarray, idx: Index) -> tuple[np.ndarray, Index]:
    """(lengths int64 [m], value selector) of rows `idx` of a jagged column with offsets [n + 1].

    The selector (an index array or a slice) picks the selected rows' values in their new order,
    so the values and the weights of a column are gathered with the same selector.
    """
    if isinstance(idx, slice):
        a, b, _ = idx.indices(offsets.size - 1)
        b = max(a, b)
        return np.diff(offsets[a:b + 1]), slice(int(offsets[a]), int(offsets[b]))
    starts = offsets.take(idx)                                   # [m]
    lens = offsets.take(idx + 1)                                 # [m]
    lens -= starts
    ends = np.cumsum(lens)
    gather = np.repeat(starts - (ends - lens), lens)             # [N_sel] start shift of each value
    gather += np.arange(gather.size, dtype=np.int64)
    return lens, gather


def _pick(a: np.ndarray, idx: Index) -> np.ndarray:
    """a[idx] along the first axis (a view for a slice, a new array for an index array)."""
    return a[idx] if isinstance(idx, slice) else a.take(idx, axis=0)


@dataclass(slots=True)
class Rows:
    """n decoded examples in numpy columns (see the module docstring on ownership)."""

    labels: np.ndarray
    """float32 [n]"""
    dense: np.ndarray
    """float32 [n, Dn]"""
    scalars: list[ScalarColumn]
    """the one-id features"""
    lists: list[ListColumn]
    """the list features"""
    extras: dict[str, np.ndarray]
    """passthrough columns, each [n]"""
    example_weights: np.ndarray | None = None
    """float32 [n] per-row loss weights (`data.example_weight_column`), or None"""

    def __len__(self) -> int:
        return self.labels.shape[0]

    def keep(self, mask: np.ndarray) -> Rows:
        """The rows where `mask` (bool [n]) is True, as new arrays."""
        idx = np.flatnonzero(mask)
        scalars = [ScalarColumn(c.ids.take(idx), None if c.valid is None else c.valid.take(idx),
                                None if c.weights is None else c.weights.take(idx)) for c in self.scalars]
        lists = []
        for c in self.lists:
            lens, sel = take_jagged(c.offsets, idx)
            offsets = np.concatenate(([0], np.cumsum(lens)))
            lists.append(ListColumn(c.values.take(sel), offsets, None if c.weights is None else c.weights.take(sel)))
        return Rows(self.labels.take(idx), self.dense.take(idx, axis=0), scalars, lists,
                    {k: v.take(idx, axis=0) for k, v in self.extras.items()},
                    None if self.example_weights is None else self.example_weights.take(idx))

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        """The rows of `parts` one after the other (new arrays; a single part is returned as is)."""
        if len(parts) == 1:
            return parts[0]
        p0 = parts[0]
        cat = np.concatenate
        scalars = []
        for j, c in enumerate(p0.scalars):
            cols = [p.scalars[j] for p in parts]
            valid = None if all(x.valid is None for x in cols) else cat(
                [x.valid if x.valid is not None else np.ones(x.ids.size, bool) for x in cols])
            scalars.append(ScalarColumn(cat([x.ids for x in cols]), valid,
                                        None if c.weights is None else cat([x.weights for x in cols])))
        lists = []
        for j, c in enumerate(p0.lists):
            cols = [p.lists[j] for p in parts]
            shift = np.cumsum([0] + [x.values.size for x in cols[:-1]])
            offsets = cat([cols[0].offsets[:1]] + [x.offsets[1:] + s for x, s in zip(cols, shift)])
            lists.append(ListColumn(cat([x.values for x in cols]), offsets,
                                    None if c.weights is None else cat([x.weights for x in cols])))
        return Rows(cat([p.labels for p in parts]), cat([p.dense for p in parts]), scalars, lists,
                    {k: cat([p.extras[k] for p in parts]) for k in p0.extras},
                    None if p0.example_weights is None else cat([p.example_weights for p in parts]))


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """How the sparse features of `Rows` line up in a `KeyedJagged`."""

    keys: tuple[str, ...]
    """F feature names, in `data.sparse_columns` order"""
    where: tuple[tuple[bool, int], ...]
    """per feature: (is a list feature, index into Rows.lists or Rows.scalars)"""
    weighted: bool
    """whether batches carry per-id weights (1.0 for features without a weight column)"""


def _stack(segments: list[tuple[Rows, Index]], get) -> np.ndarray:
    """The selected rows of one field of each segment, one after the other, as a new array."""
    if len(segments) == 1:
        rows, idx = segments[0]
        return get(rows)[idx].copy() if isinstance(idx, slice) else get(rows).take(idx, axis=0)
    return np.concatenate([_pick(get(r), idx) for r, idx in segments])


def gather(segments: list[tuple[Rows, Index]], layout: BatchLayout) -> Batch:
    """A `Batch` of the rows `idx` of each (rows, idx) segment, one after the other (new arrays).

    B = the total number of rows selected. First the lengths [F, B] and, per (feature, segment),
    which values to copy; then each is copied once, straight into its place in the values [N].
    """
    import torch                     # here, so that reading Parquet footers (preflight) needs no torch

    from data.batch import Batch, KeyedJagged

    sizes = [len(range(*idx.indices(len(r)))) if isinstance(idx, slice) else idx.size for r, idx in segments]
    B = sum(sizes)
    lengths = np.empty((len(layout.keys), B), dtype=np.int32)                 # [F, B]
    copies: list[tuple[np.ndarray, Index, np.ndarray | None, int]] = []        # (source, selector, weights, count)
    for f, (is_list, i) in enumerate(layout.where):
        at = 0
        for (rows, idx), n in zip(segments, sizes):
            if is_list:
                col = rows.lists[i]
                lens, sel = take_jagged(col.offsets, idx)
                lengths[f, at:at + n] = lens
                m = sel.stop - sel.start if isinstance(sel, slice) else sel.size
                copies.append((col.values, sel, col.weights, m))
            else:
                col = rows.scalars[i]
                sel = idx
                if col.valid is None:
                    lengths[f, at:at + n] = 1
                else:
                    v = _pick(col.valid, idx)
                    lengths[f, at:at + n] = v
                    sel = idx[v] if not isinstance(idx, slice) else np.flatnonzero(v) + idx.indices(len(rows))[0]
                m = n if sel is idx else sel.size
                copies.append((col.ids, sel, col.weights, m))
            at += n
    total = sum(c[3] for c in copies)
    values = np.empty(total, dtype=np.int64)                                    # [N]
    weights = np.empty(total, dtype=np.float32) if layout.weighted else None   # [N]
    pos = 0
    for src, sel, w, m in copies:
        for a, out in ((src, values), (w, weights)):
            if out is None:
                continue
            if a is None:
                out[pos:pos + m] = 1.0
            elif isinstance(sel, slice):
                out[pos:pos + m] = a[sel]
            else:
                np.take(a, sel, out=out[pos:pos + m])
        pos += m
    return Batch(
        dense=torch.from_numpy(_stack(segments, lambda r: r.dense)),
        sparse=KeyedJagged(layout.keys, torch.from_numpy(values), torch.from_numpy(lengths.reshape(-1))),
        labels=torch.from_numpy(_stack(segments, lambda r: r.labels)),
        weights=None if weights is None else torch.from_numpy(weights),
        extras={k: _stack(segments, lambda r, k=k: r.extras[k]) for k in segments[0][0].extras},
        example_weights=None if segments[0][0].example_weights is None
        else torch.from_numpy(_stack(segments, lambda r: r.example_weights)),
    )
