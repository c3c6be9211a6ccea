"""NativePooling: a request pooled over every table of an export in one call of a C kernel (`embedding_ps/csrc/pool.c`).

    pooling = make_pooling(plans, tables, precision)   # NativePooling, or None without a compiler
    pooled, linear = pooling.pool(batch)                # [B, F, D], [B, F_lin] | None

A "slot" is one (table, sparse feature) pair of the `SparseArch` plans, ordered by pooling group
(dim, pooling mode, linear or not) as `SparseArch` groups them; the batch's values are gathered into
slot order when that order is not the batch's. The kernel's side (hash maps, slot descriptor, the float
math that makes the outputs bit-equal to the per-table path, threads) is `embedding_ps/csrc/pool.c`'s
header; this module builds what it indexes: one hash map per table, the row matrices, and the outputs,
pooled [B, F, D] (feature order) and linear [B, F_lin] in one buffer.

An unknown id gets its slot's code (pool.c's field 12): -1 zeros, -2 uniform (in the kernel), -3 other
defaults (e.g. normal): `init_rows` in Python once per class of tables sharing (dim, seed, init,
init_scale). When no slot has code -3 (the usual case), one call (`sv_pool`) looks up and pools,
block by block; otherwise `sv_lookup` first, `sv_misses` lists the -3 ids, Python computes their rows
into one float32 buffer and points them there (-4 - offset), then `sv_pool` (pool.c's `sv_bag`).

The per-table path (predictor.py: where the kernel does not build or handle a layout) is the reference
(tests/unit/recsys/serving/test_native_fused.py, test_native_half.py). Work is split over
`torch.get_num_threads()` threads; not thread-safe (scratch buffers per instance). Figures:
BENCHMARKS.md, "benchmarks/serving.py".
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from embedding_ps import native as ps_native
from embedding_ps.init import init_rows
from embedding_ps.store import cat
from embedding_ps.wire.sharding import splitmix64_np
from recsys.models.sparse_arch import TablePlan, _groups
from recsys.serving.export_store import TableView
from recsys.serving.quantize import QUANTIZED, tbe_rows

logger = logging.getLogger(__name__)

_KIND = {"fp32": 0, "fp16": 1, "int8": 2, "int4": 3}
_SMALL_MAP = 1 << 16        # buckets (16 B each) up to which a map gets 4 buckets per row rather than 2


def _use_count(t: torch.Tensor) -> int:
    """References to t's storage (every tensor viewing it, plus the temporary storage object)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class Unsupported(ValueError):
    """A layout the kernel does not handle (pooled slots of mixed widths, linear slots wider than 1)."""


def make_pooling(plans: list[TablePlan], tables: list[TableView], precision: str) -> NativePooling | None:
    """NativePooling when the kernel builds and handles the layout, else None (the per-table path)."""
    if ps_native.available():
        try:
            return NativePooling(plans, tables, precision)
        except Unsupported as e:
            logger.info("serving: the per-table path instead of the native kernel (%s)", e)
    return None


class NativePooling:
    """Pools a Batch's ids over all tables in one native call (two when some default rows come from
    Python): [B, F, D] pooled and [B, F_lin] linear, bit-equal to the per-table path."""

    def __init__(self, plans: list[TablePlan], tables: list[TableView], precision: str, kernel=None) -> None:
        slots = self._plan(plans, tables, precision)
        self.kernel = kernel                             # a `native.build(...)` of the caller's, else the process's
        pooled = sorted((f, s) for s, (p, f) in enumerate(slots) if not p.linear)
        linear = sorted((f, s) for s, (p, f) in enumerate(slots) if p.linear)
        if not pooled or len({slots[s][0].dim for _, s in pooled}) != 1:
            raise Unsupported("pooled features of mixed widths, or none")
        if any(slots[s][0].dim != 1 for _, s in linear):
            raise Unsupported("linear tables wider than 1")
        if max(p.dim for p, _ in slots) > ps_native.SV_MAX_DIM:
            raise Unsupported(f"tables wider than {ps_native.SV_MAX_DIM}")
        self.dim, self.num_pooled, self.num_linear = slots[pooled[0][1]][0].dim, len(pooled), len(linear)
        self._build_tables(slots, tables)
        # -- slot descriptors (see embedding_ps/csrc/pool.c) --------------------------------------------------------
        desc = torch.zeros(len(slots), ps_native.SV_SLOT_FIELDS, dtype=torch.int64)   # [S, 16]
        for s, (p, _) in enumerate(slots):
            m = self.table_rows[p.table]
            desc[s, 0], desc[s, 1] = self.map_at[p.table]
            desc[s, 2] = self.hashed[s]                  # desc[s, 3], the row base, stays 0: rows are table-local
            desc[s, 4], desc[s, 5] = m.data_ptr(), m.shape[1] * m.element_size()     # the slot's row matrix
            desc[s, 6], desc[s, 7], desc[s, 8] = _KIND[precision], p.dim, int(p.pooling == "mean")
            c = int(self.slot_class[s])                   # unknown ids: -1 zeros, -2 uniform (in C), -3 here
            if c >= 0 and self.classes[c][2] == "uniform":
                _, seed, _, scale = self.classes[c]
                desc[s, 12] = -2
                desc[s, 13] = int(splitmix64_np(np.array([seed & (2**64 - 1)], dtype=np.uint64)).view(np.int64)[0])
                desc[s, 14] = int(np.array([scale], dtype=np.float32).view(np.int32)[0])
            else:
                desc[s, 12] = -1 if c < 0 else -3
        for pos, (_, s) in enumerate(pooled):            # pooled [B, F, D]: column pos * D, stride F * D
            desc[s, 9], desc[s, 10], desc[s, 11] = 0, pos * self.dim, len(pooled) * self.dim
        for pos, (_, s) in enumerate(linear):            # linear [B, F_lin]
            desc[s, 9], desc[s, 10], desc[s, 11] = 1, pos, len(linear)
        self.slots = desc
        self.caller_defaults = bool((desc[:, 12] == -3).any())     # some default rows computed in Python
        self._out: torch.Tensor | None = None             # the last output buffer (see _output)
        self._out_refs = 0
        self._rows = torch.empty(0, dtype=torch.int32)    # scratch (see _scratch)
        self._offsets = torch.zeros(1, dtype=torch.int64)

    # -- load ---------------------------------------------------------------------------------------

    def _plan(self, plans: list[TablePlan], tables: list[TableView], precision: str) -> list[tuple[TablePlan, int]]:
        """Slots (grouped as SparseArch groups), hashed tables and classes of default rows; returns the slots."""
        self.precision = precision
        slots = [(plans[i], f) for g in _groups(plans) for i in g for f in plans[i].features]    # SparseArch's groups
        self.slot_feature = torch.tensor([f for _, f in slots], dtype=torch.int64)          # [S]
        self._feature_order = None                        # set at the first batch (number of keys known then)
        cfgs = [tables[p.table].cfg for p, _ in slots]
        # hashed tables: per-slot num_embeddings (0: the id is the key)
        self.hashed = torch.tensor([c.num_embeddings if c.kind == "hashed" else 0 for c in cfgs], dtype=torch.int64)
        self.any_hashed = bool((self.hashed > 0).any())
        # defaults: per-slot class of (dim, seed, init, scale); -1: zeros
        classes: dict[tuple, int] = {}
        cls = [classes.setdefault((c.dim, c.seed, c.init, c.init_scale), len(classes))
               if tables[p.table].has_default else -1 for (p, _), c in zip(slots, cfgs)]
        self.classes = list(classes)                      # class index -> (dim, seed, init, scale)
        self.slot_class = torch.tensor(cls, dtype=torch.int64)                              # [S]
        return slots

    def _build_tables(self, slots: list[tuple[TablePlan, int]], tables: list[TableView]) -> None:
        """Per table read by some slot, its rows and its hash map.

        Rows: a private copy (the export's matrix may be a read-only memory map of a file a later export
        replaces). int8 / int4: uint8 [R, 8 + codes] = f32 scale | f32 bias | codes (TBE's f16 values).
        fp32 / fp16: [R, D] as stored, allocated by torch: 64-byte aligned, so a 32-byte row (fp16, D = 16)
        never straddles two cache lines (numpy's large arrays start 16 bytes into a page: fewer b4096
        rows/s, benchmarks/serving.py). Map: ids -> local rows, 2**bits >= 4 * rows buckets while that is
        at most _SMALL_MAP buckets, else 2**bits >= 2 * rows (a low load: fewer second probes and
        mispredicted branches)."""
        used = sorted({p.table for p, _ in slots})
        bits = {t: max(1, (2 * len(tables[t].ids) - 1).bit_length()) for t in used}
        bits = {t: b + 1 if 2 << b <= _SMALL_MAP else b for t, b in bits.items()}
        if max(bits.values()) > 32:                                      # the kernel keeps homes as uint32
            raise Unsupported("a table of more than 2**31 rows")
        sizes = [1 << bits[t] for t in used]
        self.map_at = {t: (sum(sizes[:i]), bits[t]) for i, t in enumerate(used)}       # table -> (offset, bits)
        self.buckets = torch.full((sum(sizes), 2), -1, dtype=torch.int64)                # [C, 2] (key, row)
        self.table_rows: dict[int, torch.Tensor] = {}                                    # table -> its rows
        for t in used:
            at, b = self.map_at[t]
            ids = torch.from_numpy(np.array(tables[t].ids, dtype=np.int64))             # a copy: may be read-only
            ps_native.sv_map_build(self.buckets[at:at + (1 << b)], ids, self.kernel)
            m = np.asarray(tables[t].matrix)
            if self.precision in QUANTIZED:
                rows = torch.from_numpy(tbe_rows(m, self.precision, np.float32))
            else:
                rows = torch.empty(m.shape[0], tables[t].cfg.dim,
                                   dtype=torch.float16 if self.precision == "fp16" else torch.float32)
                if m.shape[0]:
                    rows.numpy()[:] = m.view(rows.numpy().dtype)
            self.table_rows[t] = rows

    def held_bytes(self) -> dict[str, int]:
        """Bytes this instance holds for pooling: {"rows": the row matrices, "maps": the hash maps}."""
        return {"rows": sum(m.nbytes for m in self.table_rows.values()), "maps": self.buckets.nbytes}

    # -- per request --------------------------------------------------------------------------------

    def pool(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, kj = batch.batch_size, batch.sparse
        if self._feature_order is None:
            self._feature_order = bool(torch.equal(self.slot_feature, torch.arange(len(kj.keys))))
        if self._feature_order:                           # the batch's order: lengths int32 as they are
            values, lengths, weights = kj.values, kj.lengths, batch.weights
        else:
            values, lengths, weights = self._slot_values(batch)
        values = values.contiguous()
        rows, offsets = self._scratch(values.shape[0], lengths.shape[0])               # [N], [S * B + 1]
        torch.cumsum(lengths, 0, out=offsets[1:])
        threads = torch.get_num_threads()
        defaults, fused = None, not self.caller_defaults  # fused: the pooling call looks the ids up too
        if not fused:
            misses = ps_native.sv_lookup(self.buckets, self.slots, B, values, offsets, rows, threads, self.kernel)
            defaults = self._defaults(rows, values, offsets, misses, B) if misses else None
        if weights is not None:
            weights = weights.to(torch.float32).contiguous()
        F_all, F_lin = B * self.num_pooled * self.dim, B * self.num_linear
        out = self._output(F_all + F_lin)                                                # pooled | linear
        ps_native.sv_pool(rows, self.buckets if fused else None, values, weights, defaults, offsets, self.slots, B,
                          out[:F_all], out[F_all:] if F_lin else None, threads, self.kernel)
        pooled = out[:F_all].view(B, self.num_pooled, self.dim)
        return pooled, (out[F_all:].view(B, self.num_linear) if F_lin else None)

    def _slot_values(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values int64 [N], lengths int64 [S * B], weights [N] | None) in slot order."""
        kj = batch.sparse
        B, F_all = batch.batch_size, len(kj.keys)
        lengths = kj.lengths.view(F_all, B).to(torch.int64)                          # [F, B]
        per_feature = lengths.sum(dim=1)                                               # [F]
        starts = torch.cumsum(per_feature, 0) - per_feature                            # [F]
        counts = per_feature[self.slot_feature]                                        # [S]
        out_starts = torch.cumsum(counts, 0) - counts                                  # [S]
        n = int(counts.sum())
        gather = torch.arange(n) + torch.repeat_interleave(starts[self.slot_feature] - out_starts, counts,
                                                           output_size=n)             # [N]
        weights = batch.weights[gather] if batch.weights is not None else None
        return kj.values[gather], lengths[self.slot_feature].view(-1), weights

    def _scratch(self, n: int, bags: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows int32 [n] and offsets int64 [bags + 1] (offsets[0] = 0), kept between requests: fresh
        multi-100-kB buffers per request cost page faults (see _output)."""
        if self._rows.shape[0] < n:
            self._rows = torch.empty(max(n, 2 * self._rows.shape[0]), dtype=torch.int32)
        if self._offsets.shape[0] < bags + 1:
            self._offsets = torch.zeros(max(bags + 1, 2 * self._offsets.shape[0]), dtype=torch.int64)
        return self._rows[:n], self._offsets[:bags + 1]

    def _output(self, n: int) -> torch.Tensor:
        """A float32 [n] output buffer: the previous request's again when nothing references it any
        more (no view of it alive), else a new one. A fresh multi-MB buffer per request costs page
        faults (glibc returns it to the system on free), benchmarks/serving.py."""
        out = self._out
        if out is not None and out.numel() >= n and _use_count(out) == self._out_refs:
            return out[:n]
        out = torch.empty(n)
        self._out, self._out_refs = out, _use_count(out)
        return out

    def _defaults(self, rows: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, misses: int,
                  B: int) -> torch.Tensor:
        """The default rows of the ids of rows -3 (module docstring), flat float32; points those rows at them."""
        where, bag = ps_native.sv_misses(rows, offsets, misses, self.kernel)          # [M], [M]
        slot = bag if B == 1 else bag.div(B, rounding_mode="floor")                   # [M]
        keys = values[where]                          # [M] (a copy): hashed tables' keys splitmix64(id) % n
        mod = self.hashed[slot] if self.any_hashed else None                          # [M], 0: not hashed
        if mod is not None and bool((h := mod > 0).any()):
            keys[h] = torch.from_numpy((splitmix64_np(keys[h].numpy()) % mod[h].numpy().astype(np.uint64))
                                       .astype(np.int64))
        cls = self.slot_class[slot]                                                    # [M]
        parts, at = [], 0
        for c, (dim, seed, init, scale) in enumerate(self.classes):
            idx = (cls == c).nonzero().squeeze(1)
            n = idx.numel()
            if n == 0:
                continue
            if at + n * dim >= 2**31 - 4:
                raise ValueError(f"serving: {n} default rows of width {dim} in one request: too many for int32 rows")
            rows[where[idx]] = (-4 - at - torch.arange(n, dtype=torch.int64) * dim).to(torch.int32)
            parts.append(init_rows(keys[idx], dim, seed, init, scale).view(-1))          # [M_c * D_c]
            at += n * dim
        return cat(parts)
