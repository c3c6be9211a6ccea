"""Sparse arch: a batch's jagged ids -> unique ids per table -> rows pulled from the PS -> pooled.

For one step::

    lookup = sparse_arch.lookup(batch, store)   # issues the pulls (async, all in flight)
    pooled, linear = lookup.wait()              # [B, F, D] and [B, F_lin] (or None)
    ... forward, loss.backward() ...
    lookup.push(scale)                          # row gradients [U, D] of every table -> store

The rows of each group of tables sharing (dim, pooling mode) come back as one leaf tensor [U_g, D]
with requires_grad (the tables' unique rows back to back: one multi-table pull, one request per
shard), so autograd gives their gradient directly; no embedding table lives in the trainer. Pooling
is one `F.embedding_bag` per group (`SparseLookup._pool_group`; sum pooling's backward: `_SumPool`),
not one per feature.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
import torch
import torch.nn.functional as F

from data.batch import Batch
from embedding_ps import native
from embedding_ps.store import EmbeddingStore, cat
from recsys.models.on_device import compute_waits, dedup_tables, on_stream, side_stream, to_device, to_host_async
from recsys.table_plans import TablePlan, plan_tables  # noqa: F401  (the plans, torch-free)


@dataclass
class SparseLookup:
    """One step's pulled rows: per group of tables pooled together (`_groups`), one pull, one leaf
    [U_g, D] (module docstring) and one `push_many_async` of its gradient back to the store."""

    store: EmbeddingStore
    plans: list[TablePlan]
    groups: list[list[int]]               # plan indices pooled by one embedding_bag
    ids: list[torch.Tensor]               # per plan: unique ids [U]
    inverse: list[torch.Tensor]           # per plan: [N_t] index into the unique ids
    offsets: list[torch.Tensor]           # per plan: [len(features) * B] bag starts
    lengths: list[torch.Tensor]           # per plan: [len(features) * B] bag lengths (int64)
    weights: list[torch.Tensor | None]    # per plan: [N_t] per-id weights or None
    batch_size: int
    futures: list[Future] = field(default_factory=list)         # per group: its pull_many_async
    rows: list[torch.Tensor] = field(default_factory=list)      # per group: leaf [U_g, D]
    counts: list[torch.Tensor] | None = None   # per plan: [U] occurrences of each unique id (a row cache's stats)
    local: dict[int, tuple] = field(default_factory=dict)   # group -> replicated (weight [R, D], [E, D] | None)
    pull_s: float = 0.0
    wait_s: float = 0.0                   # of pull_s: blocked on the replies in `wait`
    pulled_rows: int = 0                  # rows asked of the store (replicated tables' rows not counted)
    device: torch.device | None = None    # pool here (rows moved on arrival); None: where the rows come
    stream: torch.cuda.Stream | None = None   # ids on the GPU: the side stream that made them (on_device)
    single: list[bool] = field(default_factory=list)   # per plan: one id per bag (known on the host)
    feature_ids: list[int] = field(default_factory=list)   # per batch feature: its ids in the batch (host)

    def issue(self, step: int | None) -> None:
        """Start every group's pull (one multi-table request per shard each)."""
        self.pulled_rows = sum(u.numel() for u in self.ids)
        for g, group in enumerate(self.groups):
            if g in self.local:            # a replicated table: no pull
                self.futures.append(None)
                continue
            extra = {} if self.counts is None else {"counts": [self.counts[p] for p in group]}
            self.futures.append(self.store.pull_many_async([self.plans[p].table for p in group],
                                                           [self.ids[p] for p in group], step, **extra))

    def wait(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pooled embeddings [B, F, D] and first-order terms [B, F_lin] (None without linear tables)."""
        t0 = time.perf_counter()
        compute_waits(self.stream, [*self.inverse, *self.offsets, *self.lengths, *self.weights,
                                    *(extra for _, extra in self.local.values())])
        for g, fut in enumerate(self.futures):
            if fut is None:     # a replicated table's parameter (as the last optimizer step left it): DDP's gradient
                weight, extra = self.local[g]
                self.rows.append(weight if extra is None else torch.cat([weight, extra]))   # [R(+E), D]
                continue
            rows = fut.result()                                               # [U_g, D]
            if self.device is not None and self.device.type != "cpu" and rows.device.type == "cpu":
                # train.device = "cuda": pool on the GPU, push grads [U_g, D] back (pinned, non-blocking)
                with on_stream(self.stream):
                    rows = to_device(rows, self.device)
                compute_waits(self.stream, [rows])
            self.rows.append(rows.requires_grad_(True))
        self.wait_s = time.perf_counter() - t0
        self.pull_s += self.wait_s
        B = self.batch_size
        feats_of = [[f for p in group for f in self.plans[p].features] for group in self.groups]
        dense_groups = [g for g, group in enumerate(self.groups) if not self.plans[group[0]].linear]
        stacked = None
        if len(dense_groups) == 1 and feats_of[dense_groups[0]] == sorted(feats_of[dense_groups[0]]):
            # the usual case: one group holds every embedded feature, in order; pooled straight
            # into [B, F, D] (bags example-major), with no stack and no copy of its gradient
            g = dense_groups[0]
            stacked = self._pool_group(g, example_major=True).view(B, len(feats_of[g]), -1)
        pooled: dict[int, torch.Tensor] = {}   # feature index -> [B, D]
        linear: dict[int, torch.Tensor] = {}   # feature index -> [B, 1]
        for g, group in enumerate(self.groups):
            if stacked is not None and g in dense_groups:
                continue
            out = self._pool_group(g)                       # [sum(F_t) * B, D]
            # one view + unbind ([B, D] each): its backward is one stack, where B-row slices would each
            # allocate and add a full-size zero gradient (quadratic in the number of features)
            into = linear if self.plans[group[0]].linear else pooled
            into.update(zip(feats_of[g], out.view(len(feats_of[g]), B, -1).unbind(0)))
        if stacked is None:
            stacked = torch.stack([pooled[f] for f in sorted(pooled)], dim=1)  # [B, F, D]
        lin = torch.cat([linear[f] for f in sorted(linear)], dim=1) if linear else None  # [B, F_lin]
        return stacked, lin

    def _pool_group(self, g: int, example_major: bool = False) -> torch.Tensor:
        """embedding_bag over group g's rows [U_g, D] (tables sharing dim and pooling mode).

        Bags are feature-major ([F_g * B, D]: feature after feature), or with `example_major`
        example-major ([B * F_g, D], i.e. [B, F_g, D]): the ids are permuted into that order first.
        """
        group, base, num_ids = self.groups[g], 0, 0
        indices, offsets = [], []
        for p in group:
            indices.append(self.inverse[p] + base if base else self.inverse[p])
            offsets.append(self.offsets[p] + num_ids if num_ids else self.offsets[p])
            base += self.ids[p].numel()
            num_ids += self.inverse[p].numel()
        mode = self.plans[group[0]].pooling
        # batch.weights covers every feature (1.0 where a feature has no weight column): every plan has
        # weights or none does; only sum pooling takes them (JobConfig rejects them on mean-pooled tables)
        idx, offs, lens = cat(indices), cat(offsets), cat([self.lengths[p] for p in group])
        w = cat([self.weights[p] for p in group]) if mode == "sum" and self.weights[group[0]] is not None else None
        single = all(self.single[p] for p in group)                   # one id per bag (from the host lengths)
        if example_major:
            idx, offs, lens, w = _to_example_major(idx, lens, self.batch_size, w, single)
        dev = self.rows[g].device
        if dev.type != "cpu":         # a row cache on the GPU (embedding_ps.client.cache): pool there
            idx, offs, lens = idx.to(dev), offs.to(dev), lens.to(dev)
            w = None if w is None else w.to(dev)
        if mode == "sum":
            return _SumPool.apply(self.rows[g], idx, offs, lens, w, single)
        return F.embedding_bag(idx, self.rows[g], offs, mode=mode, per_sample_weights=w)

    def push(self, scale: float = 1.0) -> list[Future]:
        """Send every table's row gradient, multiplied by `scale`, to the store."""
        return self.push_start(scale).send()

    def push_start(self, scale: float = 1.0) -> PendingPush:
        """Start sending every table's row gradient times `scale`: host gradients go to the store now;
        GPU ones are copied to pinned host memory on the side stream (`on_device.to_host_async`) and
        go when `send()` has seen their copy finish, so the caller can queue more GPU work (the
        optimizer steps) before the host waits for backward's end."""
        pending = PendingPush(self.store)
        for g, (group, rows) in enumerate(zip(self.groups, self.rows)):
            if g in self.local:            # replicated: DDP all-reduces, the table optimizer applies
                continue
            grad = rows.grad
            if grad is None:       # the group's output did not reach the loss
                grad = torch.zeros_like(rows)
            if scale != 1.0:
                grad = grad * scale
            host, event = to_host_async(grad.detach())
            call = ([self.plans[p].table for p in group], [self.ids[p] for p in group], host)
            if event is None:
                pending.futures.append(self.store.push_many_async(*call))
            else:
                pending.copies.append((event, call))
        return pending


@dataclass
class PendingPush:
    """A step's pushes (`SparseLookup.push_start`): `send()` gives their Futures."""

    store: EmbeddingStore
    futures: list[Future] = field(default_factory=list)      # sent already (host gradients)
    copies: list = field(default_factory=list)               # (CUDA event, push arguments): copy in flight

    def send(self) -> list[Future]:
        """Send the pushes whose gradients were still being copied (each once its copy is done)."""
        for event, call in self.copies:
            event.synchronize()
            self.futures.append(self.store.push_many_async(*call))
        self.copies = []
        return self.futures


_NO_IDS = torch.zeros(0, dtype=torch.int64)
"""A replicated plan's `ids` / `counts`: nothing pulled or pushed (one plan per group: no offset needed)."""


def _to_example_major(indices: torch.Tensor, lengths: torch.Tensor, B: int, weights: torch.Tensor | None,
                      single: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Bags feature-major -> example-major: indices [N] and lengths [F * B] of bag (f, b) at f * B + b
    -> (indices [N], offsets [B * F], lengths [B * F], weights [N] | None) of bag (f, b) at b * F + f.
    `single`: whether every bag holds one id, when the caller knows (None: asked of `lengths`)."""
    F_ = lengths.numel() // B
    N = indices.numel()
    if _one_id_per_bag(N, lengths, single):   # a transpose
        em_offsets = torch.arange(N, dtype=lengths.dtype, device=lengths.device)          # [B * F]
        out = indices.view(F_, B).t().reshape(-1)                                          # [N]
        if weights is not None:
            weights = weights.view(F_, B).t().reshape(-1)
        return out, em_offsets, lengths, weights
    return native.to_example_major(indices, lengths, B, weights)


class _SumPool(torch.autograd.Function):
    """embedding_bag(mode="sum") whose backward is one more embedding_bag, over the bags' gradients.

    rows [U, D], indices [N], offsets / lengths [bags], weights [N] | None -> [bags, D]. The
    gradient of row u is the sum of grad[bag of id n] * weight[n] over the ids n with indices[n] = u:
    an embedding_bag over grad [bags, D] whose bag u holds those ids' bags (ids grouped by row
    with one stable argsort of `indices`). It reads each id's gradient once and writes each row
    once, in parallel over rows (zeros [U, D] + index_add_ runs on one thread: BENCHMARKS.md,
    "benchmarks/sparse_step_cpu.py").
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                weights: torch.Tensor | None, single: bool | None = None) -> torch.Tensor:
        ctx.save_for_backward(indices, lengths, weights)
        ctx.num_rows = rows.shape[0]
        ctx.single = single
        return F.embedding_bag(indices, rows, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        indices, lengths, weights = ctx.saved_tensors
        U, N = ctx.num_rows, indices.numel()
        order = torch.argsort(indices, stable=True)                               # [N] ids grouped by row
        if indices.device.type == "cpu":                                          # [U] ids of each row
            counts = torch.bincount(indices, minlength=U)
        else:                                                                     # (bincount syncs on a GPU)
            counts = torch.zeros(U, dtype=torch.int64, device=indices.device).index_add_(
                0, indices, torch.ones_like(indices))
        row_starts = torch.cumsum(counts, 0) - counts                             # [U]
        if _one_id_per_bag(N, lengths, ctx.single):   # bag i holds id i
            bag_of = order
        else:
            bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                          output_size=N)                          # [N] bag of each id
            bag_of = bag.index_select(0, order)
        w = None if weights is None else weights.index_select(0, order)
        grad = F.embedding_bag(bag_of, grad_out.contiguous(), row_starts, mode="sum", per_sample_weights=w)  # [U, D]
        return grad, None, None, None, None, None


def _one_id_per_bag(num_ids: int, lengths: torch.Tensor, single: bool | None) -> bool:
    """Whether each of the bags of `lengths` holds one id: `single` when known (no read of a GPU tensor)."""
    if single is not None:
        return single and num_ids == lengths.numel()
    return num_ids == lengths.numel() and bool((lengths == 1).all())


def _groups(plans: list[TablePlan], replicated: bool = False) -> list[list[int]]:
    """Plans pooled by one embedding_bag call: same dim, pooling mode and kind (linear or not); with
    `replicated`, each replicated table's plan alone (its rows are its own parameter)."""
    keys: dict[tuple[int, str, bool, int], list[int]] = {}
    for i, p in enumerate(plans):
        own = p.table if replicated and p.replicated else -1
        keys.setdefault((p.dim, p.pooling, p.linear, own), []).append(i)
    return list(keys.values())


class SparseArch:
    """Turns a Batch's KeyedJagged ids into pulls and, after backward, pushes (`SparseArch(plans)`, then
    the module docstring's step)."""

    sequences: tuple = ()
    """The behavior lists looked up per position (`sequence.SequenceSparseArch`, din); none here."""

    def __init__(self, plans: list[TablePlan]) -> None:
        self.plans = plans
        self.groups = _groups(plans)
        self.replicated = None
        """The trainer's `ReplicatedTables` (`use_replicated`); None: every table comes from the store
        (serving and export read replicated tables from the export like any other)."""
        self.device: torch.device | None = None
        """Where lookups pool (`SparseLookup.device`; the trainer sets its train.device): on a GPU the
        pulled rows [U, D] cross to it, not the pooled [B, F, D] (twice their size with one id per bag)."""
        self.device_ids = False
        """Ids on the device too (the trainer sets it on a GPU: `recsys.models.on_device`, docs/performance.md).
        Off: the host deduplicates (`native.unique`, C). With no `device` (CPU) the same code runs on the host."""

    def use_replicated(self, tables) -> None:
        """Look up the plans of `placement = "replicated"` tables in `tables` (a
        `recsys.models.replicated.ReplicatedTables`), not in the store."""
        self.replicated = tables
        self.groups = _groups(self.plans, replicated=tables is not None)

    def lookup(self, batch: Batch, store: EmbeddingStore, step: int | None = None, counts: bool = False
               ) -> SparseLookup:
        """Issue the pulls of `batch`'s unique ids (async, all in flight). `counts`: pass each unique id's occurrences
        to `store.pull_many_async(counts=)` (a row cache's per-lookup hit rate, `client.cache.CachingStore`)."""
        B = batch.batch_size
        lengths_h = batch.sparse.lengths.view(len(batch.sparse.keys), B).to(torch.int64)   # [F, B] (host)
        per_feature = lengths_h.sum(dim=1)                          # [F]
        starts_l, counts_l = (torch.cumsum(per_feature, 0) - per_feature).tolist(), per_feature.tolist()
        single_f = (lengths_h == 1).all(dim=1).tolist()            # [F] one id per bag (no GPU read later)
        dev = self.device if self.device_ids else None             # ids on the device: moved once
        stream = side_stream(dev)
        look = SparseLookup(store, self.plans, self.groups, [], [], [], [], [], B, device=self.device, stream=stream,
                            counts=[] if counts else None, feature_ids=counts_l)   # counts: a row cache's hit rate
        t0 = time.perf_counter()
        local_of = {} if self.replicated is None else {   # plan index -> its group, for the replicated plans
            group[0]: g for g, group in enumerate(self.groups) if self.plans[group[0]].replicated}
        batched, replicated = {}, {}   # plan index -> ids: deduplicated together (device_ids) / vocabulary searched
        with on_stream(stream):
            all_values = to_device(batch.sparse.values, dev)
            lengths = to_device(lengths_h, dev)
            all_weights = None if batch.weights is None else to_device(batch.weights, dev)
            bag_starts = torch.cumsum(lengths, 1) - lengths             # [F, B] per feature
            of_plan = lambda x, p: cat([x[starts_l[f]:starts_l[f] + counts_l[f]] for f in p.features])  # noqa: E731
            for i, plan in enumerate(self.plans):
                values = of_plan(all_values, plan)                                     # [N_t]
                if len(plan.features) == 1:          # views of the batch-wide [F, B] tensors
                    lens, offsets = lengths[plan.features[0]], bag_starts[plan.features[0]]   # [B]
                else:
                    lens = lengths[list(plan.features)].reshape(-1)                    # [F_t * B]
                    offsets = torch.cumsum(lens, 0) - lens                             # [F_t * B]
                uniq, inverse, occ = _NO_IDS, None, _NO_IDS      # the batched and replicated plans': set below
                if i in local_of:      # a replicated table: the ids' rows in its parameter, no dedup, no pull
                    replicated[i] = values
                elif self.device_ids:
                    batched[i] = values
                else:
                    # one C pass (ids in order of first appearance) or torch.unique's sort; training does not depend
                    # on the order: same pooled bits and (`_SumPool` sums in batch order) sum grads; mean's to rounding
                    uniq, inverse, occ = native.unique(values, look.counts is not None)   # [U], [N_t], [U] | None
                if look.counts is not None:
                    look.counts.append(occ)
                look.weights.append(None if all_weights is None else of_plan(all_weights, plan))
                look.ids.append(uniq)
                look.inverse.append(inverse)
                look.offsets.append(offsets)
                look.lengths.append(lens)
                look.single.append(all(single_f[f] for f in plan.features))
            if batched:        # deduplicated in one batched pass, the unique ids (and counts) to the host in one copy
                uniq, inverse, occ = dedup_tables(list(batched.values()), counts)
                for k, i in enumerate(batched):
                    look.ids[i], look.inverse[i] = uniq[k], inverse[k]
                    if counts:
                        look.counts[i] = occ[k]
            if replicated:     # every vocabulary searched at once: one read-back of the hits with ids on a GPU
                parts = self.replicated.rows_parts_many([(self.plans[i].name, v) for i, v in replicated.items()])
                for i, (weight, extra, inverse) in zip(replicated, parts):
                    look.local[local_of[i]], look.inverse[i] = (weight, extra), inverse
        look.issue(step)
        look.pull_s = time.perf_counter() - t0
        return look
