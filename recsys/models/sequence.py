"""Unpooled sequence lookups (DIN's behavior lists): per-position rows [B, L, D] and a mask [B, L].

A behavior list column reads its candidate's table, in the candidate's `TablePlan` (one unique set,
pull and push for both: docs/models.md, "Behavior sequences: DIN"). The sparse arch pools it like any
feature (DIN leaves that bag out); `SequenceSparseArch.behaviors` gathers the same leaf [U_g, D] again,
one row per position, so the rows' gradient is the sum of both uses::

    arch = SequenceSparseArch(plans, plan_sequences(features, {"hist": "item"}), max_len=50)
    lookup = arch.lookup(batch, store)                   # the lists cut to their last 50 ids first
    pooled, linear = lookup.wait()                       # [B, F, D], as for every arch
    behaviors, mask = arch.behaviors(lookup)             # [B, S, L, D] f32, [B, S, L] bool
    logits = din(dense, pooled, linear, behaviors, mask)

Position l < length holds the list's l-th kept id (the column's order, most recent last); positions
from the length on are padding (zeros, mask False).
"""

from __future__ import annotations

import dataclasses

import torch

from data.batch import Batch, KeyedJagged
from embedding_ps.store import EmbeddingStore
from recsys.models.sparse_arch import SparseArch, SparseLookup, TablePlan
from recsys.table_plans import SequencePlan


def truncate_lists(kj: KeyedJagged, features: list[int], max_len: int) -> KeyedJagged:
    """`kj` with the bags of `features` cut to their last `max_len` ids (ids [N] -> [N'], lengths [F * B])."""
    cut = _cut(kj, features, max_len)
    return kj if cut is None else KeyedJagged(kj.keys, kj.values[cut[0]], cut[1])


def _cut(kj: KeyedJagged, features: list[int], max_len: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keep bool [N], new lengths [F * B]) of `truncate_lists`; None when no bag is longer than `max_len`."""
    B = kj.stride
    lengths = kj.lengths.view(len(kj.keys), B).to(torch.int64)            # [F, B]
    if not features or B == 0 or int(lengths[features].max()) <= max_len:
        return None
    N = kj.values.numel()
    flat = lengths.reshape(-1)                                             # [F * B]
    starts = torch.cumsum(flat, 0) - flat                                  # [F * B]
    bag = torch.repeat_interleave(torch.arange(flat.numel()), flat, output_size=N)   # [N]
    pos = torch.arange(N) - starts[bag]                                    # [N] position within its bag
    cut = torch.zeros(len(kj.keys), dtype=torch.bool)
    cut[features] = True
    cut_bag = cut.repeat_interleave(B)                                     # [F * B]
    keep = ~cut_bag[bag] | (pos >= flat[bag] - max_len)                    # [N]: the last max_len of a cut bag
    new_len = torch.where(cut_bag, flat.clamp(max=max_len), flat)          # [F * B]
    return keep, new_len.to(kj.lengths.dtype)


def truncate_batch(batch: Batch, features: list[int], max_len: int) -> Batch:
    """`batch` with its behavior lists cut to their most recent `max_len` ids (per-id weights alike)."""
    kj = batch.sparse
    cut = _cut(kj, features, max_len)
    if cut is None:
        return batch
    keep, lengths = cut
    weights = None if batch.weights is None else batch.weights[keep]      # aligned with the ids
    return dataclasses.replace(batch, sparse=KeyedJagged(kj.keys, kj.values[keep], lengths), weights=weights)


def sequence_rows(lookup: SparseLookup, feature: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, L, D] (L = max_len, zeros at padding) and mask bool [B, L] of feature `feature`'s
    bags, gathered from the leaf its table's group pulled (call after `lookup.wait()`).

    The bags must already be at most `max_len` long (`SequenceSparseArch.lookup` cuts them).
    """
    p = next(i for i, plan in enumerate(lookup.plans) if not plan.linear and feature in plan.features)
    plan: TablePlan = lookup.plans[p]
    g = next(i for i, group in enumerate(lookup.groups) if p in group)
    base = sum(lookup.ids[q].numel() for q in lookup.groups[g][:lookup.groups[g].index(p)])  # plan p's rows in the leaf
    B, k = lookup.batch_size, plan.features.index(feature)
    start = sum(lookup.feature_ids[f] for f in plan.features[:k])          # the plan's ids before feature's
    n = lookup.feature_ids[feature]                                          # feature's ids (host counts)
    inv = lookup.inverse[p][start:start + n]                                 # [n] into the plan's unique ids
    lens = lookup.lengths[p].view(len(plan.features), B)[k]                  # [B]
    dev = lens.device
    mask = torch.arange(max_len, device=dev).unsqueeze(0) < lens.unsqueeze(1)   # [B, L]
    rows = lookup.rows[g]                                                    # [U_g, D] leaf
    if rows.shape[0] == 0:
        return rows.new_zeros(B, max_len, rows.shape[1]), mask.to(rows.device)
    # bag b's ids in order at [b, 0 .. len_b): flat positions from the lengths (no boolean-mask write,
    # which reads the mask's count back from a GPU)
    bag = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=n)          # [n]
    within = torch.arange(n, device=dev) - (torch.cumsum(lens, 0) - lens).index_select(0, bag)
    idx = torch.zeros(B * max_len, dtype=torch.int64, device=dev).index_copy_(
        0, bag * max_len + within, inv + base).view(B, max_len)
    idx, mask = idx.to(rows.device), mask.to(rows.device)                    # rows on the GPU: a row cache there
    seq = rows.index_select(0, idx.view(-1)).view(B, max_len, -1)            # [B, L, D]
    return seq * mask.unsqueeze(2).to(seq.dtype), mask                       # padding: zeros, no gradient


class SequenceSparseArch(SparseArch):
    """A SparseArch that also serves per-position rows of its behavior lists (DIN): the module docstring's example."""

    def __init__(self, plans: list[TablePlan], sequences: list[SequencePlan], max_len: int) -> None:
        super().__init__(plans)
        self.sequences = sequences
        self.max_len = max_len

    def lookup(self, batch: Batch, store: EmbeddingStore, step: int | None = None, counts: bool = False
               ) -> SparseLookup:
        """SparseArch.lookup of the batch with its behavior lists cut to their last `max_len` ids."""
        cut = truncate_batch(batch, [s.feature for s in self.sequences], self.max_len)
        return super().lookup(cut, store, step, counts)

    def behaviors(self, lookup: SparseLookup) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [B, S, L, D] and mask [B, S, L] of the S behavior lists (after `lookup.wait()`)."""
        parts = [sequence_rows(lookup, s.feature, self.max_len) for s in self.sequences]
        return torch.stack([r for r, _ in parts], dim=1), torch.stack([m for _, m in parts], dim=1)

