"""Fused pooling of a request over every table of an export: no per-table Python on the hot path.

    fused = FusedPooling(sparse.plans, tables, precision)    # everything precomputed here
    pooled, linear = fused.pool(batch)                        # [B, F, D], [B, F_lin] | None

A "slot" is one (table, sparse feature) pair of the `SparseArch` plans; slots are ordered by
pooling group (dim, pooling mode, linear or not), as `SparseArch` groups them. Per request:

1. ids -> keys -> rows, for all slots at once: the batch's values are gathered into slot order
   (one index op, skipped when that order is the batch's), hashed tables' keys are computed for
   their ids in one vectorized splitmix64, and ONE `torch.ops.fbgemm.pruned_hashmap_lookup` maps
   (slot, key) -> row over per-slot open-addressing hash maps built at load (load factor 0.5;
   a shared table's map is repeated for each slot reading it). A key the table lacks maps to -1.
2. Unknown ids get their table's default row exactly as `export_store.TableView.rows` gives it
   (`init_rows` of the key, or zeros under `unadmitted = "zeros"`): one `init_rows` call per
   class of tables sharing (dim, seed, init, init_scale), not per table.
3. Pooling:
   - fp32 / fp16: every table of one width lives in one float32 matrix (rows back to back, then
     one all-zero row, then scratch rows where a request's unknown ids put their default rows);
     one `F.embedding_bag` per pooling group over it. Each bag sums the same rows in the same
     order as the training path's `SparseArch` (unique rows + inverse), with the same kernel, so
     the results are bit-equal to today's per-table path (tests/unit/recsys/serving/test_fused.py).
   - int8 / int4: one fbgemm `IntNBitTableBatchedEmbeddingBagsCodegen` call over all slots (SUM
     with per-id weights; mean as weights 1 / length), unknown ids pointing at a table's extra
     zero row and their default rows added in float32 afterwards, as `tbe_pool.QuantizedPooling`
     does (bit-equal to it).

`native_fused.NativePooling` (a C kernel, what the Predictor uses when a C compiler is there)
gives the same results; this class is its fallback and the reference its tests compare with.

The key -1 marks an empty slot in fbgemm's hash map, so a table that stores the id -1 keeps its
row aside and ids -1 are patched after the lookup (only when some table stores it).
Not thread-safe (the scratch rows are per instance), like the `Predictor`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
from fbgemm_gpu.tbe.config.embedding_config import BoundsCheckMode, EmbeddingLocation, PoolingMode

from data.batch import Batch
from embedding_ps.init import init_rows
from embedding_ps.wire.sharding import splitmix64_np
from recsys.models.sparse_arch import TablePlan
from recsys.serving.export_store import TableView
from recsys.serving.quantize import QUANTIZED, dequantize, tbe_dim, tbe_rows

_LOAD_FACTOR = 0.5
_MIN_SCRATCH = 1024


def _hash_maps(keys: list[np.ndarray], values: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot hash maps for fbgemm's pruned_hashmap_lookup: (table int64 [C, 2], offsets int64 [S + 1])."""
    caps = [max(32, -(-int(k.shape[0] / _LOAD_FACTOR) // 32) * 32) for k in keys]   # 0 would mean "no map"
    table = torch.full((sum(caps), 2), -1, dtype=torch.int64)
    offsets = torch.tensor([0] + np.cumsum(caps).tolist(), dtype=torch.int64)
    counts = torch.tensor([0] + np.cumsum([k.shape[0] for k in keys]).tolist(), dtype=torch.int64)
    torch.ops.fbgemm.pruned_hashmap_insert(torch.from_numpy(np.concatenate(keys).astype(np.int64)),
                                           torch.from_numpy(np.concatenate(values).astype(np.int64)),
                                           counts, table, offsets)
    return table, offsets


class FusedPooling:
    """Pools a Batch's ids over all of an export's tables at once: [B, F, D] pooled and [B, F_lin] linear."""

    def __init__(self, plans: list[TablePlan], tables: list[TableView], precision: str) -> None:
        """`tables`: the predictor's TableViews indexed like ps.tables (ids sorted, matrix as stored)."""
        slots = self._plan(plans, tables, precision)
        S = self.num_slots
        # -- rows -----------------------------------------------------------------------------------
        if self.quantized:
            self._build_tbe(slots, tables)
        else:
            self._build_matrices(slots, tables)
        keys, vals, self.minus_one = [], [], torch.full((S,), -1, dtype=torch.int64)
        for s, (p, _) in enumerate(slots):
            ids = np.asarray(tables[p.table].ids)
            pos = np.arange(ids.shape[0], dtype=np.int64) + int(self.slot_base[s])
            neg = ids == -1
            if neg.any():                                 # -1 is fbgemm's empty-slot key: kept aside
                self.minus_one[s] = int(pos[neg][0])
                ids, pos = ids[~neg], pos[~neg]
            keys.append(ids)
            vals.append(pos)
        self.any_minus_one = bool((self.minus_one >= 0).any())
        self.hash_table, self.hash_offsets = _hash_maps(keys, vals)
        self._finish_columns(slots)

    def _plan(self, plans: list[TablePlan], tables: list[TableView], precision: str) -> list[tuple[TablePlan, int]]:
        """Slots (grouped as SparseArch groups), hashed tables and classes of default rows; returns the slots."""
        self.precision = precision
        self.quantized = precision in QUANTIZED
        groups: dict[tuple[int, str, bool], list[tuple[TablePlan, int]]] = {}
        for p in plans:                                   # SparseArch's grouping: (dim, pooling, linear)
            for f in p.features:
                groups.setdefault((p.dim, p.pooling, p.linear), []).append((p, f))
        slots = [s for g in groups.values() for s in g]
        S = len(slots)
        self.num_slots = S
        self.slot_feature = torch.tensor([f for _, f in slots], dtype=torch.int64)          # [S]
        self.group_ranges = []                            # (first slot, end slot, pooling, linear, dim)
        s0 = 0
        for (dim, pooling, linear), members in groups.items():
            self.group_ranges.append((s0, s0 + len(members), pooling, linear, dim))
            s0 += len(members)
        self.group_bags = torch.tensor([g[0] for g in self.group_ranges] + [S])      # group bounds at B = 1
        cfgs = [tables[p.table].cfg for p, _ in slots]
        # -- values in slot order: identity when the slots are the batch's features in order -----
        self._feature_order = None                        # set at the first batch (number of keys known then)
        # -- hashed tables: per-slot num_embeddings (0: the id is the key) -----------------------
        self.hashed = torch.tensor([c.num_embeddings if c.kind == "hashed" else 0 for c in cfgs], dtype=torch.int64)
        self.any_hashed = bool((self.hashed > 0).any())
        # -- defaults: per-slot class of (dim, seed, init, scale); -1: zeros ----------------------
        classes: dict[tuple, int] = {}
        cls = []
        for c in cfgs:
            if c.unadmitted == "init" and c.init != "zeros":
                cls.append(classes.setdefault((c.dim, c.seed, c.init, c.init_scale), len(classes)))
            else:
                cls.append(-1)
        self.classes = list(classes)                      # class index -> (dim, seed, init, scale)
        self.slot_class = torch.tensor(cls, dtype=torch.int64)                              # [S]
        self.any_default = bool(classes)
        self.one_class = len(classes) == 1 and bool((self.slot_class == 0).all())
        return slots

    # -- load ---------------------------------------------------------------------------------------

    def _build_matrices(self, slots: list[tuple[TablePlan, int]], tables: list[TableView]) -> None:
        """fp32 / fp16: one float32 matrix per width: [rows of each table | zero row | scratch rows]."""
        dims = sorted({p.dim for p, _ in slots})
        self.dim_index = {d: i for i, d in enumerate(dims)}
        base_of: dict[int, int] = {}
        parts: dict[int, list[torch.Tensor]] = {d: [] for d in dims}
        size = dict.fromkeys(dims, 0)
        for p, _ in slots:
            if p.table in base_of:
                continue
            base_of[p.table] = size[p.dim]
            m = tables[p.table].matrix
            parts[p.dim].append(dequantize(np.asarray(m), self.precision, p.dim) if m.shape[0]
                                else torch.zeros(0, p.dim))
            size[p.dim] += m.shape[0]
        self.zero_row = [size[d] for d in dims]           # per width: the all-zero row, then scratch
        self.weights = []
        for d in dims:
            w = torch.zeros(size[d] + 1 + _MIN_SCRATCH, d)
            if parts[d]:
                torch.cat(parts[d], out=w[:size[d]])
            self.weights.append(w)
        self.slot_base = torch.tensor([base_of[p.table] for p, _ in slots], dtype=torch.int64)
        self.slot_matrix = torch.tensor([self.dim_index[p.dim] for p, _ in slots], dtype=torch.int64)
        self.slot_zero = torch.tensor([self.zero_row[self.dim_index[p.dim]] for p, _ in slots], dtype=torch.int64)

    def _build_tbe(self, slots: list[tuple[TablePlan, int]], tables: list[TableView]) -> None:
        """int8 / int4: one inference TBE, each table with an extra all-zero row (as tbe_pool.py)."""
        used = sorted({p.table for p, _ in slots})
        index = {t: i for i, t in enumerate(used)}
        ty = SparseType.INT8 if self.precision == "int8" else SparseType.INT4
        specs = [(tables[t].cfg.name, tables[t].num_rows + 1, tbe_dim(self.precision, tables[t].cfg.dim), ty,
                  EmbeddingLocation.HOST) for t in used]
        self.tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            specs, feature_table_map=[index[p.table] for p, _ in slots], pooling_mode=PoolingMode.SUM,
            device="cpu", output_dtype=SparseType.FP32, bounds_check_mode=BoundsCheckMode.NONE)
        self.tbe.initialize_weights()
        for t, (w, _) in zip(used, self.tbe.split_embedding_weights(split_scale_shifts=False)):
            n = tables[t].num_rows
            if n:
                w[:n].copy_(torch.from_numpy(tbe_rows(np.asarray(tables[t].matrix), self.precision)))
            w[n:].zero_()                                                 # scale 0, bias 0: pools to 0
        self._lookup_args = self._tbe_args()
        self.slot_base = torch.zeros(len(slots), dtype=torch.int64)      # rows are table-local
        self.slot_zero = torch.tensor([tables[p.table].num_rows for p, _ in slots], dtype=torch.int64)
        self.slot_mean = torch.tensor([p.pooling == "mean" for p, _ in slots])
        self.any_mean = bool(self.slot_mean.any())

    def _tbe_args(self) -> dict | None:
        """The TBE's fixed arguments of its lookup op, to call the op without `forward`'s Python
        (input checks, cache bookkeeping: benchmarks/history/figures-from-the-code.md); what
        `_forward_impl` passes with no
        cache, no bounds check and no pruning (fbgemm-gpu 1.8.0). None (use `forward`) otherwise."""
        t = self.tbe
        try:
            if t.lxu_cache_weights.numel() or t.index_remapping_hash_table.numel() or t.index_remappings_array.numel():
                return None
            return dict(dev_weights=t.weights_host if t.host_size > 0 else t.weights_dev, uvm_weights=t.weights_uvm,
                        weights_placements=t.weights_placements, weights_offsets=t.weights_offsets,
                        weights_tys=t.weights_tys, D_offsets=t.D_offsets, total_D=t.total_D,
                        max_int2_D=t.max_int2_D, max_int4_D=t.max_int4_D, max_int8_D=t.max_int8_D,
                        max_float16_D=t.max_float16_D, max_float32_D=t.max_float32_D,
                        pooling_mode=int(t.pooling_mode), output_dtype=t.output_dtype,
                        lxu_cache_weights=t.lxu_cache_weights,
                        lxu_cache_locations=torch.empty(0, dtype=torch.int32).fill_(-1),
                        row_alignment=t.row_alignment, max_float8_D=t.max_float8_D,
                        fp8_exponent_bits=t.fp8_exponent_bits, fp8_exponent_bias=t.fp8_exponent_bias)
        except AttributeError:
            return None

    def _finish_columns(self, slots: list[tuple[TablePlan, int]]) -> None:
        """Where each slot's pooled columns go in the output (in feature order)."""
        pooled = sorted((f, s) for s, (p, f) in enumerate(slots) if not p.linear)
        linear = sorted((f, s) for s, (p, f) in enumerate(slots) if p.linear)
        self.pooled_slots = torch.tensor([s for _, s in pooled], dtype=torch.int64)
        self.linear_slots = torch.tensor([s for _, s in linear], dtype=torch.int64)
        self.dim = slots[self.pooled_slots[0]][0].dim if pooled else 0
        # positions of the pooled (linear) slots, in feature order, among them in slot order
        rank = lambda x: torch.searchsorted(x.sort().values, x)   # noqa: E731
        self.pooled_order, self.linear_order = rank(self.pooled_slots), rank(self.linear_slots)
        self.pooled_in_order = bool(torch.equal(self.pooled_order, torch.arange(len(pooled))))
        if self.quantized:                                # TBE output columns [B, sum W_s], int4 padded
            widths = [tbe_dim(self.precision, p.dim) for p, _ in slots]
            start = np.concatenate([[0], np.cumsum(widths)])
            self.slot_columns = [torch.arange(int(start[s]), int(start[s]) + p.dim) for s, (p, _) in enumerate(slots)]
            self.pooled_columns = (torch.cat([self.slot_columns[s] for _, s in pooled]) if pooled
                                   else torch.zeros(0, dtype=torch.int64))
            self.linear_columns = torch.tensor([int(start[s]) for _, s in linear], dtype=torch.int64)
            self.pooled_contiguous = bool(torch.equal(self.pooled_columns, torch.arange(int(start[-1]))))
            self.slot_start = torch.from_numpy(start[:-1].astype(np.int64))          # [S] first output column

    # -- per request --------------------------------------------------------------------------------

    def _slot_values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values int64 [N], lengths int64 [S * B], weights [N] | None) in slot order."""
        kj = batch.sparse
        B, F_all = batch.batch_size, len(kj.keys)
        if self._feature_order is None:
            self._feature_order = bool(torch.equal(self.slot_feature, torch.arange(F_all)))
        lengths = kj.lengths.view(F_all, B).to(torch.int64)                          # [F, B]
        if self._feature_order:
            return kj.values, lengths.view(-1), batch.weights
        per_feature = lengths.sum(dim=1)                                               # [F]
        starts = torch.cumsum(per_feature, 0) - per_feature                            # [F]
        counts = per_feature[self.slot_feature]                                        # [S]
        out_starts = torch.cumsum(counts, 0) - counts                                  # [S]
        n = int(counts.sum())
        gather = torch.arange(n) + torch.repeat_interleave(starts[self.slot_feature] - out_starts, counts,
                                                           output_size=n)             # [N]
        weights = batch.weights[gather] if batch.weights is not None else None
        return kj.values[gather], lengths[self.slot_feature].view(-1), weights

    def _keys(self, values: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Raw ids [N] -> keys [N]: hashed tables' ids become `splitmix64(id) % num_embeddings`."""
        n = self.hashed[slot]                                                          # [N], 0: not hashed
        h = n > 0
        if not bool(h.any()):
            return values
        mixed = splitmix64_np(values[h].numpy()) % n[h].numpy().astype(np.uint64)
        keys = values.clone()
        keys[h] = torch.from_numpy(mixed.astype(np.int64))
        return keys

    def _rows(self, values: torch.Tensor, lengths: torch.Tensor, B: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """(keys [N], rows [N] (-1: unknown), bag offsets int64 [S * B + 1])."""
        offsets = torch.zeros(lengths.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        slot = None
        if self.any_hashed or self.any_minus_one:
            slot = torch.repeat_interleave(torch.arange(self.num_slots).repeat_interleave(B), lengths,
                                           output_size=values.shape[0])                # [N]
        keys = self._keys(values, slot) if self.any_hashed else values
        rows = torch.ops.fbgemm.pruned_hashmap_lookup(keys, offsets, self.hash_table, self.hash_offsets)   # [N]
        if self.any_minus_one:
            m = (keys == -1) & (self.minus_one[slot] >= 0)
            rows[m] = self.minus_one[slot[m]]
        return keys, rows, offsets

    def _missing(self, rows: torch.Tensor, offsets: torch.Tensor, B: int) -> tuple[torch.Tensor, ...] | None:
        """(positions [M] of the ids without a row, their slots [M], their bags [M]), or None when
        every id has a row. Bag k is example k % B of slot k // B."""
        where = (rows < 0).nonzero().squeeze(1)                                        # [M]
        if where.numel() == 0:
            return None
        bag = torch.searchsorted(offsets[1:], where, right=True)                       # [M] bag of each
        return where, (bag if B == 1 else bag.div(B, rounding_mode="floor")), bag

    def _default_rows(self, keys: torch.Tensor, where: torch.Tensor, slot: torch.Tensor):
        """Yield (class, positions [M_c], default rows float32 [M_c, D_c]) per class of init default."""
        if self.one_class:                                # every slot in class 0: no selection
            yield 0, where, init_rows(keys[where], *self.classes[0])
            return
        cls = self.slot_class[slot]                                                    # [M]
        for c, (dim, seed, init, scale) in enumerate(self.classes):
            sel = where[cls == c]
            if sel.numel():
                yield c, sel, init_rows(keys[sel], dim, seed, init, scale)

    def pool(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        B = batch.batch_size
        values, lengths, weights = self._slot_values(batch)
        keys, rows, offsets = self._rows(values, lengths, B)
        missing = self._missing(rows, offsets, B)
        if self.quantized:
            return self._pool_tbe(B, keys, rows, missing, offsets, lengths, weights)
        return self._pool_fp(B, keys, rows, missing, offsets, weights)

    def _pool_fp(self, B: int, keys, rows, missing, offsets, weights) -> tuple[torch.Tensor, torch.Tensor | None]:
        if missing is not None:
            where, slot, _ = missing
            if not self.one_class:
                rows[where] = self.slot_zero[slot]
            if self.any_default:
                self._place_defaults(keys, rows, where, slot)
        bounds = offsets[self.group_bags * B].tolist() if B > 1 else offsets[self.group_bags].tolist()
        pooled, linear = [], []
        for (s0, s1, pooling, is_linear, dim), i0, i1 in zip(self.group_ranges, bounds[:-1], bounds[1:]):
            offs = offsets[s0 * B:s1 * B]                                              # [F_g * B]
            if i0:
                offs = offs - i0
            w = weights[i0:i1] if (weights is not None and pooling == "sum") else None
            out = F.embedding_bag(rows[i0:i1], self.weights[self.dim_index[dim]], offs, mode=pooling,
                                  per_sample_weights=w)                                # [F_g * B, D]
            (linear if is_linear else pooled).append(out.view(s1 - s0, B, dim))
        return self._arrange(pooled, linear, B)

    def _place_defaults(self, keys, rows, where, slot) -> None:
        """Point unknown ids of init-default tables at scratch rows holding their default rows."""
        used = [0] * len(self.weights)
        for _, sel, vals in self._default_rows(keys, where, slot):
            m = self.dim_index[vals.shape[1]]
            start = self.zero_row[m] + 1 + used[m]
            end = start + sel.numel()
            if end > self.weights[m].shape[0]:            # grow the scratch (rare: a very large batch)
                grown = torch.zeros(self.zero_row[m] + 1 + 2 * (end - self.zero_row[m]), vals.shape[1])
                grown[:start].copy_(self.weights[m][:start])
                self.weights[m] = grown
            self.weights[m][start:end] = vals
            rows[sel] = torch.arange(start, end)
            used[m] += sel.numel()

    def _arrange(self, pooled: list, linear: list, B: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Group outputs [F_g, B, D] in slot order -> ([B, F, D] in feature order, [B, F_lin] | None)."""
        lin = None
        if linear:
            lin = torch.cat(linear)[:, :, 0].index_select(0, self.linear_order).t().contiguous()   # [B, F_lin]
        stacked = torch.cat(pooled) if len(pooled) > 1 else pooled[0]                  # [F, B, D]
        if not self.pooled_in_order:
            stacked = stacked.index_select(0, self.pooled_order)
        if B == 1:
            return stacked.view(1, -1, stacked.shape[2]), lin
        return stacked.transpose(0, 1).contiguous(), lin

    def _pool_tbe(self, B: int, keys, rows, missing, offsets, lengths, weights) -> tuple[torch.Tensor,
                                                                                          torch.Tensor | None]:
        N = rows.shape[0]
        if missing is not None:
            rows[missing[0]] = self.slot_zero[missing[1]]                                  # the zero rows
        if not self.any_mean:
            w = weights if weights is not None else torch.ones(N)
        else:                                             # mean bags: weights 1 / length (as tbe_pool.py)
            mean_bag = self.slot_mean if B == 1 else self.slot_mean.repeat_interleave(B)   # [S * B]
            if weights is None:                           # 1 / 1 = 1 exactly in the sum bags
                inv = 1.0 / lengths.masked_fill(~mean_bag, 1).clamp_(min=1).float()          # [S * B]
                w = torch.repeat_interleave(inv, lengths, output_size=N)
            else:
                inv = torch.repeat_interleave(1.0 / lengths.clamp(min=1).float(), lengths, output_size=N)
                w = torch.where(torch.repeat_interleave(mean_bag, lengths, output_size=N), inv, weights)
        if self._lookup_args is None:
            out = self.tbe(rows.to(torch.int32), offsets.to(torch.int32), w.float())      # [B, sum W_s]
        else:
            out = torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
                indices=rows.to(torch.int32), offsets=offsets.to(torch.int32), indice_weights=w.float(),
                **self._lookup_args)
        if missing is not None and self.any_default:
            where, slot, bag_of = missing
            for _, sel, vals in self._default_rows(keys, where, slot):
                d = vals.shape[1]
                bag = bag_of if sel is where else torch.searchsorted(offsets[1:], sel, right=True)   # [M_c]
                # per bag with defaults, their weighted sum (in id order, as tbe_pool.py), then one add
                bags, inv = torch.unique(bag, return_inverse=True)                         # [K], [M_c]
                acc = torch.zeros(bags.shape[0], d).index_add_(0, inv, vals * w[sel].unsqueeze(1))   # [K, D_c]
                s, b = bags.div(B, rounding_mode="floor"), bags.remainder(B)              # slot, example
                at = (b * out.shape[1] + self.slot_start[s]).unsqueeze(1) + torch.arange(d)          # [K, D_c]
                out.view(-1).index_add_(0, at.view(-1), acc.view(-1))
        pooled = out if self.pooled_contiguous else out.index_select(1, self.pooled_columns)
        lin = out.index_select(1, self.linear_columns) if self.linear_columns.numel() else None
        return pooled.reshape(B, -1, self.dim), lin
