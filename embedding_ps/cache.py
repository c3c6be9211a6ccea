"""`CachingStore`: a trainer-side hot-row cache in front of any `EmbeddingStore`.

    store = CachingStore(PSClient(...), config, max_age=ps.max_staleness - prefetch)
    rows = store.pull_many_async([0, 1], [ids0, ids1], step).result()   # hits from memory, misses pulled
    store.push_many_async([0, 1], [ids0, ids1], grads, step)            # every row's grads, as without

Per table with `cache_rows > 0` (`TableConfig.cache_rows`) the wrapper keeps up to that many rows,
each with the step it was pulled at. A pull for step t serves a cached row when the row was pulled
for a step s with 0 <= t - s <= max_age; an older row (or one whose pull is still in flight) is a
miss and is pulled again, refreshing the cached copy in place. Only misses go to the wrapped store,
in one multi-table call, so the shards see fewer rows per request. Pushes are unchanged: the shard
stays the owner of every row and applies every gradient; the cache never changes a row itself.

Staleness: a row pulled for step s by a trainer that prefetches K batches misses at most K of its
own steps' updates when step s uses it, and t - s + K at step t. The trainer passes
max_age = ps.max_staleness - K, so a cached row is never staler than ps.max_staleness steps (the
shard's own bound); max_age = 0 serves a row only to the step it was pulled for: the cache then
never hits across steps, and training is exactly the uncached run.

Eviction when a table's cache is full: `lfu` (fewest lookups while cached, ties: least recently
used) or `lru` (least recently used). Rows looked up by the current call are never evicted by it;
misses beyond the free and evictable slots are pulled but not cached. `benchmarks/row_cache.py`
measures both on Zipf(1.05) streams: DEFAULT_POLICY is its pick.

Counting: hits and misses per table count the distinct ids of each call (the rows the wrapped
store would have had to send), `cache_stats()` returns them since the last call. Rows live on
`device` (the trainer's GPU when it trains on one): hits are gathered there and misses copied
there, so a pull's rows come back on `device`; gradients go to the wrapped store on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Literal

import numpy as np
import torch

from embedding_ps.config import PSConfig
from embedding_ps.idmap import IdMap
from embedding_ps.store import EmbeddingStore, done_future

Policy = Literal["lfu", "lru"]

DEFAULT_POLICY: Policy = "lfu"
"""The eviction policy the trainer uses. `benchmarks/row_cache.py` (Zipf(1.05), B = 4096, 5% of a
100k / 1M / 10M vocabulary, max_age 3 / 7 / no expiry; BENCHMARKS.md): hit rates equal in 5 of the
9 settings, LFU 1.6-10 points higher in the 2 without expiry, LRU 0.7-2.3 points higher in 2 (100k)."""

NEVER = np.iinfo(np.int64).min // 2
"""`pulled` of a slot whose row has not arrived yet: older than any max_age allows."""
_KEEP = np.iinfo(np.int64).max
"""Eviction key of a slot the current call looked up (never evicted by it)."""


class RowCache:
    """One table's cached rows: id -> slot (`IdMap`), rows [C, D] on `device`, per-slot bookkeeping.

    Not thread-safe by itself: `CachingStore` holds one lock around every call.
    """

    def __init__(self, capacity: int, dim: int, policy: Policy, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"RowCache: capacity must be >= 1, got {capacity}")
        if policy not in ("lfu", "lru"):
            raise ValueError(f"RowCache: policy must be 'lfu' or 'lru', got {policy!r}")
        self.capacity, self.policy = capacity, policy
        self.map = IdMap(capacity)                                  # id -> slot
        self.keys = np.zeros(capacity, dtype=np.int64)              # [C] id held by each slot
        self.pulled = np.full(capacity, NEVER, dtype=np.int64)      # [C] step its row was pulled for
        self.count = np.zeros(capacity, dtype=np.int64)             # [C] lookups while cached (lfu)
        self.last = np.zeros(capacity, dtype=np.int64)              # [C] last step looked up
        self.rows = torch.zeros(min(capacity, 1024), dim, device=device)   # [<= C, D], grows as slots fill
        self.used = 0                                               # slots [0, used) were handed out
        self.spare = np.zeros(0, dtype=np.int64)                    # evicted slots not handed out yet
        self.generation = 0                                         # + 1 at every clear()
        self.hits = 0
        self.misses = 0

    def lookup(self, ids: np.ndarray, step: int, max_age: int) -> tuple[np.ndarray, np.ndarray]:
        """Distinct ids int64 [U] looked up for `step` -> (hit bool [U], slot int32 [U]).

        A hit's slot holds its row; a miss's slot (or -1: not cached) is where its row goes when the
        pull arrives (`fill`). Counts the lookups and evicts as needed.
        """
        slot = self.map.lookup(ids)                                 # [U], -1 absent
        present = slot >= 0
        ps = slot[present].astype(np.int64)
        age = step - self.pulled[ps]
        hit = np.zeros(ids.shape[0], dtype=bool)
        hit[present] = (age >= 0) & (age <= max_age)
        self.count[ps] += 1
        self.last[ps] = step
        self.pulled[ps[~hit[present]]] = NEVER                      # stale: refreshed by this pull
        absent = np.flatnonzero(~present)
        if absent.size:
            new = self._allocate(absent.size, ps)                   # [A'] <= [A]
            took = absent[:new.size]
            self.map.insert(ids[took], new.astype(np.int32))
            self.keys[new] = ids[took]
            self.pulled[new] = NEVER
            self.count[new] = 1
            self.last[new] = step
            slot[took] = new
        nh = int(hit.sum())
        self.hits += nh
        self.misses += ids.shape[0] - nh
        return hit, slot

    def fill(self, ids: np.ndarray, slots: np.ndarray, rows: torch.Tensor, step: int, generation: int) -> None:
        """Rows [M, D] pulled for `step` of ids [M] into their slots [M] (-1: not cached); a slot
        handed to another id meanwhile, or holding a newer pull, is left alone, and so is every
        row of a pull looked up before the last clear() (`generation`)."""
        if generation != self.generation:
            return
        ok = slots >= 0
        s = slots[ok].astype(np.int64)
        ok[ok] = (self.keys[s] == ids[ok]) & (self.pulled[s] <= step)
        if not ok.any():
            return
        pos = np.flatnonzero(ok)
        s = slots[pos].astype(np.int64)
        _move(self.rows, s, rows, pos)
        self.pulled[s] = step

    def clear(self) -> None:
        """Forget every row (the store's rows changed underneath: a LOAD)."""
        self.map.clear()
        self.pulled[:] = NEVER
        self.count[:] = 0
        self.used = 0
        self.spare = np.zeros(0, dtype=np.int64)
        self.generation += 1

    def _allocate(self, n: int, protect: np.ndarray) -> np.ndarray:
        """Up to n slots int64 [<= n]: never used ones, then spare ones, then evicted ones (never one
        in `protect`, the slots this call looked up).

        An eviction scans every slot (O(C)), so it takes the C/64 lowest-ranked rows at once (at least
        the n needed) and keeps the extra ones as spare slots for the next calls."""
        fresh = min(n, self.capacity - self.used)
        out = [np.arange(self.used, self.used + fresh, dtype=np.int64)]
        self.used += fresh
        if self.used > self.rows.shape[0]:         # grow by doubling: memory follows the rows held
            grown = self.rows.new_zeros(min(self.capacity, max(self.used, 2 * self.rows.shape[0])), self.rows.shape[1])
            grown[:self.rows.shape[0]] = self.rows
            self.rows = grown
        need = n - fresh
        if need and self.spare.size:
            out.append(self.spare[:need])
            self.spare = self.spare[need:]
            need -= out[-1].size
        k = min(len(self.map) - protect.size, max(need, self.capacity // 64))   # mapped, not looked up now
        if need <= 0 or k <= 0:
            return np.concatenate(out)
        if self.policy == "lru":
            key = self.last.copy()
        else:                            # fewest lookups first, then least recently used
            key = (np.minimum(self.count, (1 << 30) - 1) << 32) | (self.last & 0xFFFFFFFF)
        key[protect] = _KEEP
        for taken in out:
            key[taken] = _KEEP
        victims = np.argpartition(key, k - 1)[:k]                        # the k lowest keys
        victims = victims[key[victims] != _KEEP]
        victims = victims[np.argsort(key[victims], kind="stable")]       # the lowest go first
        self.map.delete(self.keys[victims])
        self.pulled[victims] = NEVER
        out.append(victims[:need])
        self.spare = victims[need:]
        return np.concatenate(out)


class CachingStore:
    """An `EmbeddingStore` that serves hot rows from memory and forwards everything else.

    Example::

        store = CachingStore(LocalStore.create(cfg), cfg, max_age=2)
        store.pull(0, torch.tensor([5, 7]), step=0)   # two misses: pulled, cached
        store.pull(0, torch.tensor([5]), step=2)      # a hit (pulled 2 steps ago)
        store.cache_stats()                           # {"t0": (1, 2)}: hits, misses
    """

    def __init__(self, store: EmbeddingStore, config: PSConfig, *, max_age: int,
                 policy: Policy = DEFAULT_POLICY, device: torch.device | str = "cpu") -> None:
        if max_age < 0:
            raise ValueError(f"CachingStore: max_age must be >= 0, got {max_age}")
        self.inner, self.config, self.max_age = store, config, max_age
        self.device = torch.device(device)
        self.caches: list[RowCache | None] = [
            RowCache(t.cache_rows, t.dim, policy, self.device) if t.cache_rows > 0 else None
            for t in config.tables]
        self._lock = threading.Lock()

    @property
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    # -- rows -------------------------------------------------------------------------------------

    def pull_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor],
                        step: int | None = None) -> Future[torch.Tensor]:
        """A Future of rows [sum N_t, D] on `device`: cached hits, the rest pulled from the store.

        Every part's distinct rows go into one buffer [sum U_t, D] (hits now, misses when they
        arrive), which is the result itself when the parts' ids are distinct and increasing (what
        the sparse arch sends), else expanded to the caller's order."""
        if len(tables) != len(ids) or not tables:
            raise ValueError(f"CachingStore: {len(tables)} tables for {len(ids)} id tensors (need as many, >= 1)")
        step = self.inner.step if step is None else step
        dim, dev = self.config.tables[tables[0]].dim, self.device
        parts = []   # per part: (cache | None, distinct ids np [U], inverse [N] | None, hit [U], (slots [U], generation), rows [U, D])
        miss_tables, miss_ids = [], []
        with self._lock:
            looked = []
            for t, x in zip(tables, ids):
                cache = self.caches[t]
                if cache is None or x.numel() == 0:
                    looked.append((None, x, None, None, None))
                    continue
                uniq, inverse = _distinct(x.to("cpu", torch.int64))                        # [U], [N] | None
                hit, slots = cache.lookup(uniq.numpy(), step, self.max_age)
                looked.append((cache, uniq, inverse, hit, slots))
            buf = torch.empty(sum(x.numel() for _, x, _, _, _ in looked), dim, device=dev)  # [sum U_t, D]
            start = 0
            for t, (cache, uniq, inverse, hit, slots) in zip(tables, looked):
                rows = buf[start:start + uniq.numel()]                                     # [U, D] view
                start += uniq.numel()
                if cache is None:
                    miss_tables.append(t)
                    miss_ids.append(uniq)
                    parts.append((None, None, None, None, (None, 0), rows))
                    continue
                u = uniq.numpy()
                if hit.any():
                    h = np.flatnonzero(hit)
                    _move(rows, h, cache.rows, slots[h].astype(np.int64))
                if not hit.all():
                    miss_tables.append(t)
                    miss_ids.append(torch.from_numpy(u[~hit]))
                parts.append((cache, u, None if inverse is None else inverse.to(dev), hit, (slots, cache.generation), rows))
        if not miss_tables:
            return done_future(self._assemble(parts, [], step, buf))
        inner = self.inner.pull_many_async(miss_tables, miss_ids, step)
        out: Future = Future()

        def arrived(fut: Future) -> None:
            try:
                pulled = fut.result().to(dev)
                pieces = list(torch.split(pulled, [x.numel() for x in miss_ids]))
                with self._lock:
                    out.set_result(self._assemble(parts, pieces, step, buf))
            except BaseException as e:   # the caller's .result() raises it
                out.set_exception(e)

        inner.add_done_callback(arrived)
        return out

    def _assemble(self, parts: list, pieces: list[torch.Tensor], step: int, buf: torch.Tensor) -> torch.Tensor:
        """The misses' rows (`pieces`, in part order) into `buf` and the cache; the rows [sum N_t, D]."""
        k = 0
        for cache, u, _, hit, (slots, generation), rows in parts:
            if cache is None:                      # not cached: the store's rows as they are
                rows.copy_(pieces[k])
                k += 1
            elif not hit.all():
                miss = np.flatnonzero(~hit)
                got = pieces[k]                                                            # [M, D]
                k += 1
                _move(rows, miss, got, None)
                cache.fill(u[miss], slots[miss], got, step, generation)
        if all(p[2] is None for p in parts):
            return buf
        out = [rows if inverse is None else rows.index_select(0, inverse) for _, _, inverse, _, _, rows in parts]
        return out[0] if len(out) == 1 else torch.cat(out)                                 # [sum N_t, D]

    def push_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor], grads: torch.Tensor,
                        step: int | None = None) -> Future[None]:
        """Every row's grads [sum N_t, D] go to the wrapped store (on the CPU), cached or not."""
        return self.inner.push_many_async(tables, ids, grads.detach().to("cpu"), step)

    def pull(self, table: int, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        return self.pull_many_async([table], [ids], step).result()

    def push(self, table: int, ids: torch.Tensor, grads: torch.Tensor, step: int | None = None) -> None:
        self.push_many_async([table], [ids], grads, step).result()

    # -- statistics -------------------------------------------------------------------------------

    def cache_stats(self) -> dict[str, tuple[int, int]]:
        """{table name: (hits, misses)} of every cached table since the last call (then reset)."""
        out = {}
        with self._lock:
            for t, cache in zip(self.config.tables, self.caches):
                if cache is not None:
                    out[t.name] = (cache.hits, cache.misses)
                    cache.hits = cache.misses = 0
        return out

    # -- everything else is the wrapped store's ---------------------------------------------------

    def barrier(self, step: int) -> None:
        self.inner.barrier(step)

    def barrier_async(self, step: int) -> Future:
        return self.inner.barrier_async(step)

    def sweep(self, step: int) -> list[dict]:
        return self.inner.sweep(step)       # dropped rows leave the cache within max_age steps

    def save(self, directory: str, step: int | None = None, background: bool = False) -> list[dict]:
        return self.inner.save(directory, step, background)

    def prepare_save(self) -> Future[list]:
        return self.inner.prepare_save()

    def wait_saved(self, directory: str, timeout_s: float) -> list[dict]:
        return self.inner.wait_saved(directory, timeout_s)

    def load(self, directory: str) -> list[dict]:
        """The store loads `directory`; every cached row is dropped (they are the old rows)."""
        out = self.inner.load(directory)
        with self._lock:
            for cache in self.caches:
                if cache is not None:
                    cache.clear()
        return out

    def stats(self) -> list[dict]:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def _move(dst: torch.Tensor, at: np.ndarray, src: torch.Tensor, rows: np.ndarray | None) -> None:
    """dst[at] = src[rows] (src itself when rows is None) for float [*, D] tensors on one device.

    On the CPU through numpy: single-threaded copies of a few thousand rows, where torch's
    index_select / index_copy_ open parallel regions whose threads, on busy cores, cost more than the
    copy. The cache's work per step for 26 criteo-like tables, this way and with the torch ops:
    BENCHMARKS.md, "Figures moved here from the code"."""
    if dst.device.type == "cpu":
        s = src.numpy()
        dst.numpy()[at] = s if rows is None else s[rows]
        return
    at_t = torch.from_numpy(at).to(dst.device)
    dst.index_copy_(0, at_t, src if rows is None else src.index_select(0, torch.from_numpy(rows).to(src.device)))


def _distinct(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(distinct ids [U], inverse [N] into them), inverse None when `ids` [N] already are distinct
    and increasing (what the sparse arch sends: `torch.unique`'s output), which skips a sort."""
    if ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all()):
        return ids, None
    return torch.unique(ids, return_inverse=True)


def cache_metrics(stats: dict[str, tuple[int, int]]) -> dict[str, float]:
    """`cache/<table>/hit_rate` of each table and `cache/hit_rate` over all, from `cache_stats()`
    (NaN, written as null, for a table that had no lookups)."""
    out = {f"cache/{name}/hit_rate": h / (h + m) if h + m else float("nan") for name, (h, m) in stats.items()}
    hits = sum(h for h, _ in stats.values())
    total = hits + sum(m for _, m in stats.values())
    out["cache/hit_rate"] = hits / total if total else float("nan")
    return out


__all__ = ["CachingStore", "RowCache", "DEFAULT_POLICY", "cache_metrics"]
