"""`FusedRowCache`: the cached rows of every cached table of one dim, in one key space.

One lookup per pull, whatever the number of tables: the (table, id) pairs of all the call's parts
are looked up in one `IdMap` (native C when built) under a combined key, and every hit's age,
every bookkeeping update and every count is one numpy operation over all of them. Only a table
whose slots are full and needs an eviction runs code of its own (a partial sort of its slots,
every few steps: an eviction frees the C/64 lowest-ranked rows at once).

Layout: table k owns slots [base[k], base[k] + cap[k]) (`TableConfig.cache_rows` of them) of
`rows` [sum cap, D] on `device`, and per slot the arrays that `clear()` makes. `rows` is zeroed when
the cache is built (sum cap x D x 4 bytes, at once): first touches of fresh pages while the cache
fills slowed the steps (benchmarks/history/2026-11-25.md).

Combined key: splitmix64(id ^ splitmix64(k + 1)), a bijection of the id for one table, so two ids
of one table never share a key; two tables' ids may (probability ~ n^2 / 2^64), which the slot's
(id, table) check catches: such an id is served from the store and not cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embedding_ps.idmap import IdMap
from embedding_ps.wire.sharding import splitmix64_np

NEVER = np.iinfo(np.int64).min // 2
"""`pulled` of a slot whose row has not arrived yet: older than any max_age allows."""
_KEEP = np.iinfo(np.int64).max
"""Eviction key of a slot that may not be evicted now (free, or looked up at this step)."""
SMALL = 127
"""A table of at most this many slots evicts together with the other small ones, in one sort; a
bigger one by itself. Both evict max(needed, cap // 64) rows, which is exactly the rows needed here."""
UNCACHED = -1
"""Slot of a looked-up id that is not cached (no slot free for it)."""
COUNTS = ("hits", "misses", "refreshes", "lookups", "lookup_hits")
"""The per-table counters (`take_counts`; what they count: `embedding_ps.client.cache`, "Counting")."""


@dataclass
class Lookup:
    """What `FusedRowCache.lookup` decided for the entries [U] of one call."""

    hit: np.ndarray        # bool [U]: served from `rows[slot]`
    slot: np.ndarray       # int64 [U]: its slot (a miss: where its row goes when pulled), or UNCACHED
    refresh: np.ndarray    # bool [U]: a hit whose row is pulled again ahead of its expiry
    generation: int        # the cache's generation at the lookup (fills of an older one are dropped)


class FusedRowCache:
    """Cached rows of tables `caps` (local index k -> capacity) sharing one row width `dim`.

    Not thread-safe by itself: `CachingStore` holds one lock around every call.
    """

    def __init__(self, caps: list[int], dim: int, policy: str, device: torch.device) -> None:
        if not caps or min(caps) < 1:
            raise ValueError(f"FusedRowCache: every capacity must be >= 1, got {caps}")
        if policy not in ("lfu", "lru"):
            raise ValueError(f"FusedRowCache: policy must be 'lfu' or 'lru', got {policy!r}")
        self.policy = policy
        self.cap = np.asarray(caps, dtype=np.int64)                     # [T]
        self.base = np.cumsum(self.cap) - self.cap                      # [T] first slot of table k
        self.rows = torch.zeros(int(self.cap.sum()), dim, device=device)   # [C, D]
        self._mix = splitmix64_np(np.arange(1, len(caps) + 1, dtype=np.uint64))   # [T] per-table salt
        self.counts = {c: np.zeros(len(caps), dtype=np.int64) for c in COUNTS}   # per table [T], since taken
        self.generation = -1
        self.clear()

    def key(self, ids: np.ndarray, tab: np.ndarray) -> np.ndarray:
        """Combined keys int64 [U] of ids int64 [U] in local tables tab [U]."""
        z = ids.view(np.uint64) ^ self._mix[tab]
        return splitmix64_np(z, copy=False).view(np.int64)

    def lookup(self, ids: np.ndarray, tab: np.ndarray, step: int, max_age: int, refresh_after: int | None,
               counts: np.ndarray | None = None) -> Lookup:
        """Entries (ids int64 [U], local table int32 [U]; distinct pairs) looked up for `step`: hits,
        refreshes (refresh_after None: never) and slots of misses as `embedding_ps.client.cache`'s module
        docstring says. `counts` [U]: the entry's occurrences in the batch, for the per-lookup hit rate."""
        n = ids.shape[0]
        ck = self.key(ids, tab)                                         # [U]
        slot = self.map.lookup(ck).astype(np.int64)                     # [U], -1 absent
        absent = slot < 0
        pi = np.flatnonzero(~absent)                                    # [P] present
        s = slot[pi]
        same = (self.ids[s] == ids[pi]) & (self.tab[s] == tab[pi])
        if not same.all():          # another table's id under the same key: served, never cached
            slot[pi[~same]] = UNCACHED
            pi, s = pi[same], s[same]
        age = step - self.pulled[s]                                     # [P]
        fresh = (age >= 0) & (age <= max_age)
        hit = np.zeros(n, dtype=bool)
        hit[pi] = fresh
        refresh = np.zeros(n, dtype=bool)
        if refresh_after is not None:
            r = fresh & (age >= refresh_after) & (self.refreshing[s] <= self.pulled[s])
            refresh[pi] = r
            self.refreshing[s[r]] = step
        self.count[s] += 1
        self.last[s] = step
        self.pulled[s[~fresh]] = NEVER                                  # stale: refreshed by this pull
        a = np.flatnonzero(absent)
        if a.size:
            if counts is not None:
                a = self._hottest_first(a, tab, counts)
            new = self._allocate(tab[a], step)                          # [A], UNCACHED where none
            ok = new >= 0
            took, ns = a[ok], new[ok]
            self.ids[ns], self.tab[ns] = ids[took], tab[took]
            self.map.insert(ck[took], ns.astype(np.int32))
            back = self.map.lookup(ck[took])                            # [A'] finds itself unless
            if (back != ns).any():                                      # two took one combined key
                self._undo_duplicates(took[back != ns], ns[back != ns], new, a)
                ok = new >= 0
                took, ns = a[ok], new[ok]
            self.pulled[ns] = self.refreshing[ns] = NEVER
            self.count[ns], self.last[ns] = 1, step
            slot[a] = new
        T, c = self.cap.shape[0], self.counts
        c["hits"] += np.bincount(tab[hit], minlength=T)
        c["misses"] += np.bincount(tab[~hit], minlength=T)
        c["refreshes"] += np.bincount(tab[refresh], minlength=T)
        if counts is not None:
            c["lookups"] += np.bincount(tab, weights=counts, minlength=T).astype(np.int64)
            c["lookup_hits"] += np.bincount(tab[hit], weights=counts[hit], minlength=T).astype(np.int64)
        return Lookup(hit, slot, refresh, self.generation)

    def _hottest_first(self, a: np.ndarray, tab: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Entries a [A] (misses to place) with those of each table that cannot take all of its
        misses in free slots reordered by their occurrences in the batch, most first (ties: as
        they came), so that the free and evicted slots go to the hottest misses whatever order the
        ids came in; the other tables' entries stay where they are (no sort for them)."""
        ta = tab[a]
        over = np.bincount(ta, minlength=self.cap.shape[0]) > self.cap - self.used     # [T]
        at = np.flatnonzero(over[ta])
        if at.size > 1:
            a = a.copy()
            a[at] = a[at][np.argsort(-counts[a[at]], kind="stable")]
        return a

    def fill(self, ids: np.ndarray, tab: np.ndarray, slots: np.ndarray, rows: torch.Tensor, step: int,
             generation: int) -> None:
        """Rows [M, D] pulled for `step` of entries (ids [M], tab [M]) into their slots [M]
        (UNCACHED: not cached). A slot handed to another entry meanwhile, or holding a row pulled
        for a later step, is left alone, and so is every row of a lookup before the last clear()."""
        if generation != self.generation:
            return
        ok = slots >= 0
        s = slots[ok]
        ok[ok] = (self.ids[s] == ids[ok]) & (self.tab[s] == tab[ok]) & (self.pulled[s] <= step)
        pos = np.flatnonzero(ok)
        if pos.size:
            s = slots[pos]
            move_rows(self.rows, s, rows, pos)
            self.pulled[s] = step

    def clear(self) -> None:
        """Forget every row (the store's rows changed underneath: a LOAD); `rows` and the counts stay."""
        total = self.rows.shape[0]
        self.used = np.zeros(self.cap.shape[0], dtype=np.int64)          # [T] slots handed out
        self.spare: list[np.ndarray] = [np.zeros(0, dtype=np.int64) for _ in self.cap]   # evicted, free
        self.map = IdMap(total)                                         # combined key -> slot
        self.ids = np.zeros(total, dtype=np.int64)                      # [C] id held by each slot
        self.tab = np.full(total, -1, dtype=np.int32)                   # [C] its table, -1 free
        self.pulled = np.full(total, NEVER, dtype=np.int64)             # [C] step its row was pulled for
        self.refreshing = np.full(total, NEVER, dtype=np.int64)         # [C] step of a refresh requested
        self.count = np.zeros(total, dtype=np.int64)                    # [C] lookups while cached
        self.last = np.zeros(total, dtype=np.int64)                     # [C] last step looked up
        self.generation += 1

    def _undo_duplicates(self, dup: np.ndarray, dup_slots: np.ndarray, new: np.ndarray, a: np.ndarray) -> None:
        """Entries `dup` [X] (slots dup_slots [X]) were inserted under a combined key that another
        entry of the same call took first (two tables' ids, ~n^2 / 2^64): rebuild the map without
        them, and leave them uncached (`new`, the slots of entries `a`, gets UNCACHED there)."""
        self.tab[dup_slots] = -1
        live = np.flatnonzero(self.tab >= 0)
        self.map.clear()
        self.map.insert(self.key(self.ids[live], self.tab[live]), live.astype(np.int32))
        new[np.isin(a, dup)] = UNCACHED

    def take_counts(self) -> dict[str, np.ndarray]:
        """Per local table: the COUNTS since the last call (then 0)."""
        out = self.counts
        self.counts = {c: np.zeros_like(a) for c, a in out.items()}
        return out

    # -- slots ------------------------------------------------------------------------------------

    def _allocate(self, tab: np.ndarray, step: int) -> np.ndarray:
        """A slot int64 [A] for each new entry of local tables tab [A] (UNCACHED where its table has
        none free or evictable): never-used slots first (all tables at once), then per full table
        its spare and evicted ones."""
        A, T = tab.shape[0], self.cap.shape[0]
        order = np.argsort(tab, kind="stable")                          # [A] grouped by table
        ts = tab[order]
        n = np.bincount(ts, minlength=T)                                # [T] new entries per table
        fresh = np.minimum(n, self.cap - self.used)                     # [T]
        start = np.cumsum(n) - n
        rank = np.arange(A) - start[ts]                                 # [A] place within its table
        got = np.full(A, UNCACHED, dtype=np.int64)
        f = rank < fresh[ts]
        got[f] = self.base[ts[f]] + self.used[ts[f]] + rank[f]
        self.used += fresh
        full = n > fresh
        if full.any():
            evicted = []
            small = full & (self.cap <= SMALL)
            if small.any():                                            # every small table at once
                vt, vr, vs = self._evict_small(np.flatnonzero(small), (n - fresh)[small], step)
                got[start[vt] + fresh[vt] + vr] = vs
                evicted.append(vs)
            for k in np.flatnonzero(full & ~small):                     # a big table: its own pass
                lo = start[k] + fresh[k]
                more, victims = self._reuse(int(k), int(n[k] - fresh[k]), step)
                got[lo:lo + more.shape[0]] = more
                evicted.append(victims)
            victims = np.concatenate(evicted)                           # one map delete for all
            self.map.delete(self.key(self.ids[victims], self.tab[victims]))
            self.tab[victims] = -1
            self.pulled[victims] = NEVER
        out = np.empty(A, dtype=np.int64)
        out[order] = got
        return out

    def _evict_small(self, ks: np.ndarray, need: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Up to need [K] rows of each small full table ks [K] to evict (never one looked up at
        `step`), in one sort over their slots -> (table [V], rank within its table [V], slot [V])."""
        caps = self.cap[ks]
        slots = np.repeat(self.base[ks] - np.cumsum(caps) + caps, caps) + np.arange(int(caps.sum()))   # [S]
        owner = np.repeat(np.arange(ks.shape[0]), caps)                 # [S] index into ks
        key = self._rank_key(slots, ks[owner], step)
        order = np.lexsort((key, owner))                                # by table, then rank
        slots, owner, key = slots[order], owner[order], key[order]
        rank = np.arange(slots.shape[0]) - np.repeat(np.cumsum(caps) - caps, caps)   # [S] within table
        take = (rank < need[owner]) & (key != _KEEP)
        return ks[owner[take]], rank[take], slots[take]

    def _rank_key(self, slots: np.ndarray | slice, k: np.ndarray | int, step: int) -> np.ndarray:
        """Eviction order of `slots` of tables k (lowest first): LRU the last lookup step, LFU the
        lookups while cached, ties broken by the last lookup step; _KEEP where a slot is not k's
        (free) or was looked up at `step`."""
        if self.policy == "lru":
            key = self.last[slots].copy()
        else:
            key = (np.minimum(self.count[slots], (1 << 30) - 1) << 32) | (self.last[slots] & 0xFFFFFFFF)
        key[(self.tab[slots] != k) | (self.last[slots] == step)] = _KEEP
        return key

    def _reuse(self, k: int, need: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(up to `need` slots of full table k, the slots to evict now): spare ones, then evicted
        ones (never one looked up at `step`). An eviction scans the table's slots (O(cap)), so it
        takes the cap/64 lowest-ranked rows at once (at least the `need`) and keeps the extra ones
        as spare slots (free from now on, as the caller deletes every victim)."""
        none = np.zeros(0, dtype=np.int64)
        out = self.spare[k][:need]
        self.spare[k] = self.spare[k][need:]
        need -= out.shape[0]
        if need <= 0:
            return out, none
        lo, hi = int(self.base[k]), int(self.base[k] + self.cap[k])
        key = self._rank_key(slice(lo, hi), k, step)
        m = min(int((key != _KEEP).sum()), max(need, int(self.cap[k]) // 64))
        if m <= 0:
            return out, none
        victims = np.argpartition(key, m - 1)[:m]                       # the m lowest keys
        victims = victims[np.argsort(key[victims], kind="stable")] + lo  # the lowest go first
        self.spare[k] = victims[need:]
        return np.concatenate([out, victims[:need]]), victims


def move_rows(dst: torch.Tensor, at: np.ndarray, src: torch.Tensor, rows: np.ndarray | None) -> None:
    """dst[at] = src[rows] (src itself when rows is None) for float [*, D] tensors on one device.

    On the CPU through numpy: single-threaded copies of a few thousand rows, where torch's
    index_select / index_copy_ open parallel regions whose threads, on busy cores, cost more than the
    copy (benchmarks/history/figures-from-the-code.md)."""
    if dst.device.type == "cpu":
        s = src.numpy()
        dst.numpy()[at] = s if rows is None else s[rows]
        return
    at_t = torch.from_numpy(at).to(dst.device)
    dst.index_copy_(0, at_t, src if rows is None else src.index_select(0, torch.from_numpy(rows).to(src.device)))


__all__ = ["COUNTS", "FusedRowCache", "Lookup", "NEVER", "UNCACHED", "move_rows"]
