"""One shard of one embedding table: id -> slot map, rows, optimizer state, counters, admission, eviction.

Storage is slot-major: row `s` of `weights` [C, D], of every optimizer state tensor [C] or
[C, D], and of `meta` [C] belong to the key that the map sends to slot `s` (the map's items
give slot -> key, so no per-slot key array is kept). `meta` packs two int32 counters into one
int64, `count << 32 | last_seen`: one random access per pushed row instead of two, and the
LFU eviction order (count, then last_seen) is simply the order of `meta`. A table with
`row_counters = false` has no `meta` (8 bytes a row less; nothing that reads it is configured).
Capacity C doubles when slots run out; the spare part is allocated with `torch.empty` and never
written until used, so untouched pages cost no resident memory. A `capacity` hint sizes the slot
arrays and the id map for this shard's share up front (`reserve_rows`; docs/performance.md, "Large
tables": no regrow, which holds old and new arrays at once). Evicted slots go on a free stack and are reused first.

Keys are what `sharding.keys_of` returns: the raw id for `dynamic` tables, the hashed row index
for `hashed` ones. Row init is `init.init_rows(key, ...)`, a pure function of (seed, key).

Admission: a key gets a row on the push that brings its sightings to `max(min_count, 1)`; each
push of a missing key is one sighting, counted with probability `admit_probability` (a coin
that is a hash of (seed, key, step), so it does not depend on shards or order). Gradients of
keys that are not admitted are dropped. Sightings of waiting keys live in a `BoundedCounter`
of at most `max_pending` keys.

Eviction: `sweep(step)` drops rows with `step - last_seen >= ttl_steps`; a push that leaves
more than `max_rows` rows evicts the least frequently pushed ones (lowest `count`, then oldest
`last_seen`, then smallest key). Each eviction is logged as (key, step) until truncated.
`last_seen` is the step of the last push that reached the row; a row is updated exactly when
it is pushed, so it is also the row's last-update step (`dump` reports it under both names,
`last_seen` and `last_update`). A pull changes nothing.

Global weight decay (`weight_decay_mode = "global"`): `decay_step` [C] int32 holds each row's
decayed-through step; pulls, pushes, saves and dumps catch rows up as `embedding_ps.shard.decay` says.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch

from embedding_ps import native
from embedding_ps.shard import kernels
from embedding_ps.wire.config import TableConfig
from embedding_ps.shard.decay import CaughtUpRows, GlobalDecay, is_global
from embedding_ps.idmap import BoundedCounter, IdMap
from embedding_ps.init import init_rows
from embedding_ps.shard.optim import apply_update, fill_value, state_specs
from embedding_ps.shard.snapshot import LOW32, LiveRows, unpack_meta
from embedding_ps.reference import has_duplicates, seed_mix
from embedding_ps.wire.sharding import GOLDEN, splitmix64_np

logger = logging.getLogger(__name__)

_ADMIT_SALT = 0x5851F42D4C957F2D
_MAX_SCRATCH = 1 << 24  # floats (64 MB): the largest update buffer a table keeps between pushes
RESERVED_MAP_LOAD = 0.85
"""Load factor of the id map of a table with a `capacity` hint, at the hint (12 / 0.85 = 14.1 bytes a row)."""
_RESERVE_SLACK = 0.01  # a shard's share of `capacity` varies with the id hash: reserve 1% + 1024 more
_COUNTERS = ("meta", "decay_step")  # the slot-major int tensors beside the rows (None where a table has none)


def reserve_rows(cfg: TableConfig, num_shards: int) -> int:
    """Slots one of `num_shards` shards reserves for table `cfg` (0 without a `capacity` hint)."""
    if not cfg.capacity:
        return 0
    share = -(-cfg.capacity // num_shards)
    return share + int(share * _RESERVE_SLACK) + 1024


class TableShard:
    """The rows of one table that one shard owns. Not thread-safe: `ShardState` serializes calls."""

    def __init__(self, cfg: TableConfig, where: str, threads: int, num_shards: int) -> None:
        self.where = where
        self.cfg, why = kernels.resolve(cfg, native.available())
        # the default, native, at debug level: a job or an eval with many tables logs one line each
        logger.log(logging.INFO if self.cfg.kernel == "fbgemm" else logging.DEBUG, "%s: update kernel %s",
                   self.where, why)
        self.threads = threads  # ps.threads: C threads of native lookups, gathers and updates
        self.wdtype = torch.float16 if cfg.dtype == "fp16" else torch.float32
        self.specs = state_specs(cfg)
        self.reserved = reserve_rows(cfg, num_shards)
        self._admit_key = seed_mix(cfg.seed ^ _ADMIT_SALT)
        self._reset()

    def _reset(self) -> None:
        """Empty state: no rows, no counts, no logs (a new table, or before `from_arrays` fills it)."""
        cfg = self.cfg
        self.map = self._new_map(0)
        self.pending = BoundedCounter(cfg.max_pending)
        self.cap = 0
        self.hwm = 0  # slots [0, hwm) have been used at least once
        self.free = np.zeros(0, dtype=np.int32)  # stack of reusable slots, top at [nfree - 1]
        self.nfree = 0
        self.weights = torch.empty(0, cfg.dim, dtype=self.wdtype)
        self.state = {s.name: torch.empty((0, cfg.dim) if s.per_coordinate else (0,), dtype=s.dtype)
                      for s in self.specs}
        # count << 32 | last_seen, or None (row_counters = false)
        self.meta = torch.empty(0, dtype=torch.int64) if cfg.row_counters else None
        # global weight decay: each row's decayed-through step, and the table's clock (else None)
        self.decay = GlobalDecay(cfg) if is_global(cfg) else None
        self.decay_step = torch.empty(0, dtype=torch.int32) if self.decay is not None else None
        # what the torch / fbgemm update runs with: global decay is applied before it (`decay.touch`)
        self.ucfg = dataclasses.replace(self.cfg, weight_decay=0.0) if self.decay is not None else self.cfg
        self._scratch = torch.empty(0)  # reused [U, D] buffer of the update: no fresh large allocation per push
        self._dupbits = np.zeros(0, dtype=np.uint8)  # native duplicate check: one bit per slot, kept all zero
        self.evlog: list[tuple[np.ndarray, int]] = []
        self.evlog_len = 0
        self.evlog_lost_through = -1  # entries with step <= this were dropped unread (log over its bound)
        self.totals = {"admitted": 0, "evicted_ttl": 0, "evicted_lfu": 0, "dropped_grads": 0}
        if self.reserved:
            self._grow(self.reserved)

    def _new_map(self, n: int) -> IdMap:
        """An empty id map with room for n keys (and this shard's reserved share, at RESERVED_MAP_LOAD)."""
        if not self.reserved:
            return IdMap(capacity=n, threads=self.threads)
        m = IdMap(max_load=RESERVED_MAP_LOAD, threads=self.threads)
        m.reserve(max(n, self.reserved))
        return m

    def __len__(self) -> int:
        return len(self.map)

    # ------------------------------------------------------------------ pull / push
    def pull(self, keys: torch.Tensor, step: int, out: torch.Tensor | None) -> torch.Tensor:
        """int64 [N] keys (dups ok) -> float32 [N, D] (written into `out`, contiguous, when given).
        Missing keys get their init row, or zeros. `step`: the request's step (global decay: rows
        caught up through step - 1)."""
        snp = self.map.lookup(keys.numpy())  # int32 [N], -1: no row
        target = self.decay.pull_target(step) if self.decay is not None else None
        if out is None:
            out = torch.empty(keys.shape[0], self.cfg.dim, dtype=torch.float32)
        # one pass copies (widens fp16, catches up global decay) the rows that exist
        decay = (self.decay_step, target, self.decay.factor) if target is not None else (None, 0, 1.0)
        if native.gather(self.weights, snp, out, self.threads, *decay) != 0:   # keys without a row
            cfg, miss = self.cfg, torch.from_numpy(snp < 0)
            out[miss] = 0.0 if cfg.unadmitted == "zeros" else init_rows(keys[miss], cfg.dim, cfg.seed, cfg.init,
                                                                        cfg.init_scale)
        return out

    def push(self, keys: torch.Tensor, grads: torch.Tensor, step: int, slots: np.ndarray | None = None) -> None:
        """Apply grads float32 [N, D] of keys int64 [N] (dups summed) at `step`; `grads` is not modified.
        slots: the int32 [N] slots of `keys`, looked up since the map last changed (taken over), or None."""
        knp = keys.numpy()
        if self.decay is not None:  # an unset clock counts the rows as of before `step`; step's decay is due
            self.decay.advance(self.decay_step, self.hwm, step - 1)
            self.decay.advance(self.decay_step, self.hwm, step)
        slots = self.map.lookup(knp) if slots is None else slots  # int32 [N]
        miss = slots < 0
        if miss.any():
            self._admit_missing(knp, slots, miss, step)
            ok = slots >= 0
            n_ok = int(np.count_nonzero(ok))
            if n_ok < slots.shape[0]:
                self.totals["dropped_grads"] += slots.shape[0] - n_ok
                if n_ok == 0:
                    return
                slots, grads = slots[ok], grads[torch.from_numpy(ok)]
        # each slot once, its grads summed in arrival order (`native.merge_rows`); duplicates (e.g. sync mode: the
        # step's pushes of all trainers) are found with a bitmap over the slots (`_dupbits`)
        if native.has_duplicates(slots, self._dupbits):
            slots, grads = native.merge_rows(slots, grads.contiguous())
        cfg = self.cfg
        # C, if it runs this optimizer: the update, the counters and global decay's catch-up in one pass per row
        if cfg.kernel == "fbgemm" or not native.update(
                cfg.optimizer, self.weights, self.state.get("sum_sq"), slots, grads, cfg.lr, cfg.eps, self.meta, step,
                cfg.weight_decay, cfg.weight_decay_mode, self.threads, decay_steps=self.decay_step):
            if self.decay is not None:  # every row decays every step: catch these up through `step` first
                self.decay.touch(self.weights, self.decay_step, slots, step)
            self._push_torch(torch.from_numpy(slots).long(), grads, step)
        if self.cfg.max_rows and len(self.map) > self.cfg.max_rows:
            self._evict_lfu(len(self.map) - self.cfg.max_rows, step)

    def _push_torch(self, u: torch.Tensor, g: torch.Tensor, step: int) -> None:
        """`optim.apply_update` of unique slots u int64 [U] and the row counters (adam, ftrl, fbgemm)."""
        scratch = self._scratch if self._scratch.numel() >= g.numel() else torch.empty(g.numel())
        if g.numel() <= _MAX_SCRATCH:  # keep it for the next push unless it is huge
            self._scratch = scratch
        apply_update(self.ucfg, self.weights, self.state, u, g, scratch[: g.numel()].view(g.shape))
        if self.meta is None:
            return
        meta, un = self.meta.numpy(), u.numpy()
        m = meta[un]
        m >>= 32
        m += 1
        np.minimum(m, LOW32 >> 1, out=m)  # count saturates at 2**31 - 1: meta stays >= 0
        m <<= 32
        m |= step
        meta[un] = m  # count += 1, last_seen = step (numpy 1-D gather/scatter: faster than torch index
        # ops here, benchmarks/history/figures-from-the-code.md)

    # ------------------------------------------------------------------ admission / allocation
    def _admit_missing(self, knp: np.ndarray, slots: np.ndarray, miss: np.ndarray, step: int) -> None:
        """Give rows to the missing keys that pass admission (the module doc); writes their slots into `slots` [N]."""
        cfg = self.cfg
        mk, inv = knp[miss], None
        if has_duplicates(mk):  # the same new id twice in one push
            mk, inv = np.unique(mk, return_inverse=True)
        admit = np.ones(mk.shape[0], dtype=bool)  # this sighting counts
        if cfg.admit_probability < 1.0:     # the coin of (table seed, key, step): a float64 in [0, 1)
            z = splitmix64_np(mk.view(np.uint64) ^ np.uint64(self._admit_key))
            z += np.uint64((step * GOLDEN) & (2**64 - 1))
            admit = (splitmix64_np(z) >> np.uint64(11)).astype(np.float64) * 2.0**-53 < cfg.admit_probability
        if cfg.min_count > 1:
            counts = np.zeros(mk.shape[0], dtype=np.int32)
            counts[admit] = self.pending.add(mk[admit], step)
            admit = counts >= cfg.min_count
            if admit.any():
                self.pending.remove(mk[admit])
        if admit.any():
            new = np.full(mk.shape[0], -1, dtype=np.int32)
            new[admit] = self._allocate(mk[admit], step)
            slots[miss] = new if inv is None else new[inv]

    def _allocate(self, keys: np.ndarray, step: int) -> np.ndarray:
        """Distinct absent keys int64 [K] -> their new slots int32 [K], rows and state initialised."""
        take = min(keys.shape[0], self.nfree)
        reuse = self.free[self.nfree - take : self.nfree][::-1].copy()
        self.nfree -= take
        lo, hi = self.hwm, self.hwm + keys.shape[0] - take     # fresh slots
        if hi > self.cap:
            self._grow(hi)
        slots = np.concatenate([reuse, np.arange(lo, hi, dtype=np.int32)])
        self.hwm = hi
        cfg = self.cfg
        rows = init_rows(torch.from_numpy(keys), cfg.dim, cfg.seed, cfg.init, cfg.init_scale).to(self.wdtype)
        # reused slots are scattered; fresh ones are the contiguous range [lo, hi): plain slice writes
        r = torch.from_numpy(reuse).long()
        self.weights.index_copy_(0, r, rows[:take])
        self.weights[lo:hi] = rows[take:]
        # meta: count 0, last_seen = step; decay_step: the init value is the one at the start of `step`
        # (step's decay applies to it)
        fills = [(self.state[spec.name], fill_value(cfg, spec)) for spec in self.specs]
        for t, fill in [*fills, (self.meta, step), (self.decay_step, step - 1)]:
            if t is not None:
                t.index_fill_(0, r, fill)
                t[lo:hi] = fill
        self.map.insert(keys, slots)
        self.totals["admitted"] += keys.shape[0]
        return slots

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.cap, 64)
        self.weights = _regrow(self.weights, cap, self.hwm)
        self.meta = None if self.meta is None else _regrow(self.meta, cap, self.hwm)
        self.decay_step = None if self.decay_step is None else _regrow(self.decay_step, cap, self.hwm)
        for name, t in self.state.items():
            self.state[name] = _regrow(t, cap, self.hwm)
        self.cap = cap
        self._dupbits = np.zeros((cap + 7) // 8, dtype=np.uint8)
        logger.debug("%s: capacity %d rows", self.where, cap)

    # ------------------------------------------------------------------ eviction
    def _evict(self, keys: np.ndarray, slots: np.ndarray, step: int, reason: str) -> None:
        if keys.shape[0] == 0:
            return
        order = np.argsort(keys, kind="stable")  # log and free stack in key order: independent of map layout
        keys, slots = keys[order], slots[order]
        self.map.delete(keys)
        n = slots.shape[0]
        if self.nfree + n > self.free.shape[0]:
            grown = np.empty(max(2 * self.free.shape[0], self.nfree + n, 64), dtype=np.int32)
            grown[: self.nfree] = self.free[: self.nfree]
            self.free = grown
        self.free[self.nfree : self.nfree + n] = slots
        self.nfree += n
        self.totals[f"evicted_{reason}"] += n
        self.evlog.append((keys, step))     # keys[order]: a new array
        self.evlog_len += n
        while self.evlog_len > self.cfg.eviction_log_max and self.evlog:
            old_keys, old_step = self.evlog.pop(0)
            self.evlog_len -= old_keys.shape[0]
            self.evlog_lost_through = max(self.evlog_lost_through, old_step)

    def _evict_lfu(self, n: int, step: int) -> None:
        """Evict the n rows with the lowest (count, last_seen, key)."""
        keys, slots = self.map.items()
        n = min(n, keys.shape[0])
        prio = self.meta.numpy()[slots]  # count << 32 | last_seen
        kth = np.partition(prio, n - 1)[n - 1]
        pick = np.flatnonzero(prio < kth)
        ties = np.flatnonzero(prio == kth)
        pick = np.concatenate([pick, ties[np.argsort(keys[ties], kind="stable")[: n - pick.shape[0]]]])
        self._evict(keys[pick], slots[pick], step, "lfu")

    def sweep(self, step: int) -> dict[str, int]:
        """TTL eviction: drop rows (and waiting admission counts) unseen for `ttl_steps` steps."""
        ttl = self.cfg.ttl_steps
        if not ttl:
            return {"evicted_ttl": 0, "pending_dropped": 0}
        keys, slots = self.map.items()
        old = (self.meta.numpy()[slots] & LOW32) <= step - ttl
        self._evict(keys[old], slots[old], step, "ttl")
        stale = self.pending.older_than(step - ttl)
        self.pending.remove(stale)
        return {"evicted_ttl": int(np.count_nonzero(old)), "pending_dropped": int(stale.shape[0])}

    def eviction_log(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys int64 [E], steps int64 [E]) of evictions not truncated yet, oldest first."""
        if not self.evlog:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        keys = np.concatenate([k for k, _ in self.evlog])
        steps = np.concatenate([np.full(k.shape[0], s, dtype=np.int64) for k, s in self.evlog])
        return torch.from_numpy(keys), torch.from_numpy(steps)

    def truncate_eviction_log(self, through_step: int) -> None:
        """Forget eviction records with step <= through_step."""
        self.evlog = [(k, s) for k, s in self.evlog if s > through_step]
        self.evlog_len = sum(k.shape[0] for k, _ in self.evlog)

    # ------------------------------------------------------------------ stats / dump
    def row_bytes(self) -> int:
        """Bytes of one slot across weights, optimizer state and counters (`slot_tensors`)."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.slot_tensors().values())

    def stats(self) -> dict[str, int | float | str]:
        """Counters and sizes, and `kernel`: the update this table runs ("fbgemm" or "native")."""
        used = self.hwm * self.row_bytes()
        aux = self.map.nbytes + self.pending.nbytes + self.free.nbytes + 8 * self.evlog_len
        return {
            "rows": len(self.map),
            "capacity": self.cap,
            "slots_used": self.hwm,
            "free_slots": self.nfree,
            "pending": len(self.pending),
            "pending_dropped": self.pending.dropped,
            "bytes": used + aux,
            "bytes_reserved": self.cap * self.row_bytes() + aux,
            "map_buckets": self.map.num_buckets,
            "eviction_log": self.evlog_len,
            "kernel": self.cfg.kernel,
            **self.totals,
        }

    def dump(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(keys int64 [R] sorted, rows float32 [R, D], {state name / count / last_seen / last_update: [R, ...]});
        global decay: rows caught up through the clock, and their `decay_step`."""
        keys, slots = self.map.items()
        order = np.argsort(keys, kind="stable")
        keys, s = keys[order], torch.from_numpy(slots[order]).long()
        extra = {name: t.index_select(0, s) for name, t in self.state.items()}
        if self.meta is not None:
            count, last_seen = unpack_meta(self.meta.index_select(0, s))
            extra["count"] = count.to(torch.int32)
            extra["last_seen"] = last_seen.to(torch.int32)
            extra["last_update"] = extra["last_seen"].clone()
        rows = self.weights.index_select(0, s).float()
        if self.decay is not None:  # caught up through the clock (copies: the table is not changed)
            extra["decay_step"] = self.decay_step.index_select(0, s)
            self.decay.catch_up_chunk({"weights": rows.numpy(), "decay_step": extra["decay_step"].numpy()},
                                      self.decay.clock)
        return torch.from_numpy(keys), rows, extra

    def load_rows(self, keys: torch.Tensor, rows: torch.Tensor, extra: dict[str, torch.Tensor], step: int) -> None:
        """Insert or overwrite rows by key (re-sharding): keys int64 [R] distinct, rows [R, D], `dump`'s dict."""
        knp = keys.numpy()
        slots = self.map.lookup(knp)
        miss = slots < 0
        if miss.any():
            slots[miss] = self._allocate(knp[miss], step)
            self.totals["admitted"] -= int(np.count_nonzero(miss))
        s = torch.from_numpy(slots).long()
        self.weights.index_copy_(0, s, rows.to(self.wdtype))
        for name, t in self.state.items():
            if name in extra:
                t.index_copy_(0, s, extra[name].to(t.dtype))
        if self.decay is not None:
            self.decay.loaded_rows(self.decay_step, s, extra.get("decay_step"))
        if self.meta is None:
            return
        meta = self.meta.index_select(0, s)
        count = extra["count"].long() if "count" in extra else meta >> 32
        last = extra["last_seen"].long() if "last_seen" in extra else meta & LOW32
        self.meta.index_copy_(0, s, (count << 32) | last)

    # ------------------------------------------------------------------ save / load
    def to_arrays(self, copy: bool = False) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """Every piece of state but the slot-major arrays (a save streams those: `saved_rows`) as plain
        arrays, plus scalar metadata. copy=False: the free stack views the live state (valid until the
        next push); copy=True: it is copied too (the others are new arrays anyway)."""
        arrays = {"free": self.free[: self.nfree].copy() if copy else self.free[: self.nfree]}
        arrays["map_keys"], arrays["map_slots"] = self.map.items()
        arrays.update({f"pending.{name}": a for name, a in self.pending.state().items()})
        arrays["evlog_keys"], arrays["evlog_steps"] = (t.numpy() for t in self.eviction_log())
        meta = {"hwm": self.hwm, "capacity": self.cap, "evlog_lost_through": self.evlog_lost_through,
                "pending_dropped": self.pending.dropped}
        meta.update(self.totals)
        if self.decay is not None:
            meta["decay_clock"] = self.decay.clock  # every saved row is caught up through it
        return arrays, meta

    def write_slots(self, keys: np.ndarray) -> np.ndarray:
        """int32 [M]: every slot a push (or `load_rows`) of keys int64 [N] may write: the rows of the
        keys that have one, plus the slots new keys would reuse (the top of the free stack)."""
        slots = self.map.lookup(keys)
        missing = int(np.count_nonzero(slots < 0))
        take = min(missing, self.nfree)
        return np.concatenate([slots, self.free[self.nfree - take : self.nfree]]) if take else slots

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """The slot-major tensors [C, ...]: weights, each optimizer state, the counters."""
        counters = {name: t for name, t in zip(_COUNTERS, (self.meta, self.decay_step)) if t is not None}
        return {"weights": self.weights, **{f"state.{name}": t for name, t in self.state.items()}, **counters}

    def from_arrays(self, arrays: dict[str, np.ndarray], meta: dict[str, int]) -> None:
        """Replace all state with a saved table's: `to_arrays`' and the slot-major arrays (copied)."""
        self._reset()
        h = int(meta["hwm"])
        if (need := max(h, int(meta["capacity"]), 64)) > self.cap:
            self._grow(need)
        self.hwm = h
        # np.copyto: the arrays may be read-only memory maps of a saved shard (torch.from_numpy warns on those)
        for name, t in self.slot_tensors().items():
            if name in arrays or name not in _COUNTERS:
                np.copyto(t[:h].numpy(), arrays[name], casting="no")
            else:  # saved without row counters: count 0, last seen at step 0
                t[:h] = 0
        self.free = np.array(arrays["free"], dtype=np.int32)
        self.nfree = self.free.shape[0]
        self.map = self._new_map(arrays["map_keys"].shape[0])
        self.map.insert(arrays["map_keys"], arrays["map_slots"])
        self.pending.set_state(arrays["pending.keys"], arrays["pending.count"], arrays["pending.last_seen"])
        self.pending.dropped = int(meta["pending_dropped"])
        log_keys, log_steps = arrays["evlog_keys"], arrays["evlog_steps"]
        cut = np.flatnonzero(np.diff(log_steps)) + 1      # the eviction log: one chunk per step
        self.evlog = [(k.copy(), int(s[0])) for k, s in zip(np.split(log_keys, cut), np.split(log_steps, cut))
                      if k.shape[0]]
        self.evlog_len = int(log_keys.shape[0])
        self.evlog_lost_through = int(meta["evlog_lost_through"])
        self.totals = {key: int(meta[key]) for key in self.totals}
        if self.decay is not None:  # the save's clock, or unset for a save without decay steps
            clock = meta.get("decay_clock") if "decay_step" in arrays else None
            self.decay.clock = None if clock is None else int(clock)

    # ------------------------------------------------------------------ global decay
    def advance(self, step: int) -> None:
        """Requests of `step` are served: global decay is due through step - 1 (a SAVE's step)."""
        if self.decay is not None:
            self.decay.advance(self.decay_step, self.hwm, step - 1)

    def saved_rows(self, stream=None):
        """What a save writes of the slot-major arrays (`TableSnapshot.rows`): `stream` (a copy-on-write
        `cow.RowStream`) or, for None, the live arrays (`LiveRows`); with global decay, the rows caught
        up through the clock (`CaughtUpRows`)."""
        if stream is None:
            live = {name: t[: self.hwm].numpy() for name, t in self.slot_tensors().items()}
            stream = LiveRows(live, copied=() if self.decay is None else CaughtUpRows.CHANGED)
        return stream if self.decay is None else CaughtUpRows(stream, self.decay, self.decay.clock)


def _regrow(t: torch.Tensor, cap: int, keep: int) -> torch.Tensor:
    """A tensor of `cap` rows (spare rows untouched, so not resident) holding t's first `keep` rows."""
    new = torch.empty((cap, *t.shape[1:]), dtype=t.dtype)
    new[:keep].copy_(t[:keep])
    return new
