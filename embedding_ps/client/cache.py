"""`CachingStore`: a trainer-side hot-row cache in front of any `EmbeddingStore`.

    store = CachingStore(PSClient(...), config, max_age=ps.max_staleness - prefetch)
    rows = store.pull_many_async([0, 1], [ids0, ids1], step).result()   # hits from memory, misses pulled
    store.push_many_async([0, 1], [ids0, ids1], grads, step)            # every row's grads, as without

Per table with `cache_rows > 0` (`TableConfig.cache_rows`) the wrapper keeps up to that many rows,
each with the step it was pulled for; the tables of one dim share one `FusedRowCache` (one lookup
for all of a call's parts, `embedding_ps.client.rowcache`). A pull for step t serves a cached row when the
row was pulled for a step s with 0 <= t - s <= max_age; an older row (or one whose pull is still
in flight) is a miss and is pulled again, refreshing the cached copy in place. Only misses go to
the wrapped store, in one multi-table call, so the shards see fewer rows per request. Pushes are
unchanged: the shard stays the owner of every row and applies every gradient; the cache never
changes a row itself.

Refresh ahead (`refresh_ahead` = R >= 1, default 1; 0 turns it off): a hit for step t whose row
was pulled for step s with t - s >= max(1, max_age - R), and no refresh already in flight, is
served from the cache AND pulled again for step t, in a second call to the wrapped store that the
step does not wait for; when it arrives the cached copy is replaced and counts as pulled for t.
So a row looked up at least once every max_age - R steps keeps hitting if its refresh arrives
within R steps (else it expires and misses); the max_age bound is unchanged. It hides latency, it
does not save shard work: the shard sends such a row once every max_age - R steps instead of every
max_age + 1, in vain for one not looked up again before it expires (BENCHMARKS.md, "benchmarks/row_cache.py").

Background (`background=True`, what the trainer uses): every call runs on one thread of the
cache's own, in the order made (pulls, pushes, barriers, saves, loads), so the caller's thread only
queues a lookup and the wrapped store still sees every call in the caller's order (a pull made
before a push never sees it). A barrier for step t sets the wrapper's `step` to t + 1 at once.

Staleness: a row pulled for step s by a trainer that prefetches K batches misses at most K of its
own steps' updates when step s uses it, and t - s + K at step t. The trainer passes
max_age = ps.max_staleness - K, so a cached row is never staler than ps.max_staleness steps (the
shard's own bound); max_age = 0 serves a row only to the step it was pulled for (and never
refreshes ahead): the cache then never hits across steps, and training is exactly the uncached run.

Eviction when a table's cache is full: `lfu` (fewest lookups while cached, ties: least recently
used) or `lru` (least recently used). Rows looked up at the current step are never evicted;
misses beyond the free and evictable slots are pulled but not cached. When a table cannot take all
of a call's misses, the slots go to the misses that occur most often in the batch (`counts`, which
the sparse arch passes), not to the first ones to arrive. `benchmarks/row_cache.py` measures both
(and both policies) on Zipf(1.05) streams (BENCHMARKS.md): DEFAULT_POLICY is its pick.

Counting (`cache_counts()`, per table, since the last call; the metrics: `cache_metrics`): `hits` and
`misses` per distinct id of each call (a hit: served without waiting for the store), `refreshes` (hits
also pulled ahead), and `lookups` / `lookup_hits`, the same weighted by each id's occurrences in the
batch when the caller passes `counts` (`SparseArch.lookup(counts=True)` does).

Rows live on `device` (the trainer's GPU when it trains on one): a pull's rows come back there;
gradients go to the wrapped store on the CPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch

from embedding_ps.wire.config import PSConfig
from embedding_ps.client.plan import combine, dedup_ids, gather_of
from embedding_ps.client.rowcache import COUNTS, FusedRowCache, move_rows
from embedding_ps.store import EmbeddingStore, done_future

logger = logging.getLogger(__name__)

Policy = Literal["lfu", "lru"]

DEFAULT_POLICY: Policy = "lfu"
"""The eviction policy the trainer uses: the better hit rate of the two (module docstring, "Eviction")."""


class CachingStore(EmbeddingStore):
    """An `EmbeddingStore` that serves hot rows from memory and forwards everything else.

    Example::

        store = CachingStore(LocalStore.create(cfg), cfg, max_age=2)
        store.pull(0, torch.tensor([5, 7]), step=0)   # two misses: pulled, cached
        store.pull(0, torch.tensor([5]), step=2)      # a hit (pulled 2 steps ago), also refreshed ahead
        store.cache_stats()                           # {"t0": (1, 2)}: hits, misses
    """

    def __init__(self, store: EmbeddingStore, config: PSConfig, *, max_age: int,
                 policy: Policy = DEFAULT_POLICY, device: torch.device | str = "cpu",
                 refresh_ahead: int = 1, background: bool = False) -> None:
        if max_age < 0:
            raise ValueError(f"CachingStore: max_age must be >= 0, got {max_age}")
        if refresh_ahead < 0:
            raise ValueError(f"CachingStore: refresh_ahead must be >= 0, got {refresh_ahead}")
        self.inner, self.config, self.max_age = store, config, max_age
        self.device = torch.device(device)
        # a hit this old (or older) is refreshed ahead; None: never (off, or max_age 0)
        self.refresh_after = max(1, max_age - refresh_ahead) if refresh_ahead and max_age >= 1 else None
        by_dim: dict[int, list[int]] = {}
        for i, t in enumerate(config.tables):
            if t.cache_rows > 0:
                by_dim.setdefault(t.dim, []).append(i)
        self.fused: list[tuple[FusedRowCache, list[int]]] = [           # (cache, its tables)
            (FusedRowCache([config.tables[i].cache_rows for i in tables], dim, policy, self.device), tables)
            for dim, tables in by_dim.items()]
        self.where: dict[int, tuple[FusedRowCache, int]] = {           # table -> (its cache, local index)
            t: (cache, k) for cache, tables in self.fused for k, t in enumerate(tables)}
        self._lock = threading.Lock()
        # background: lookups on one thread of their own (in call order), off the caller's
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="row-cache") if background else None
        self._step = store.step

    @property
    def step(self) -> int:
        """The step a call without one carries: the wrapped store's, or with `background` this
        wrapper's copy of it (module docstring, "Background")."""
        return self.inner.step if self._worker is None else self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self.inner.step = value

    # -- rows -------------------------------------------------------------------------------------

    def pull_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor], step: int | None = None,
                        counts: Sequence[torch.Tensor] | None = None) -> Future[torch.Tensor]:
        """A Future of rows [sum N_t, D] on `device`: cached hits, the rest pulled from the store.

        Every part's distinct rows go into one buffer [sum U_t, D] (hits now, misses when they
        arrive), which is the result itself when the parts' ids are distinct (what the sparse arch
        sends), else expanded to the caller's order. `counts` (optional, per part [N_t]): how often
        each id occurs in the batch, for the per-lookup hit rate."""
        if len(tables) != len(ids) or not tables:
            raise ValueError(f"CachingStore: {len(tables)} tables for {len(ids)} id tensors (need as many, >= 1)")
        step = self.step if step is None else step
        return self._chain(lambda: self._pull(tables, ids, step, counts))

    def _pull(self, tables: Sequence[int], ids: Sequence[torch.Tensor], step: int,
              counts: Sequence[torch.Tensor] | None) -> Future[torch.Tensor]:
        """`pull_many_async` on the calling thread."""
        cached = [t in self.where and x.numel() > 0 for t, x in zip(tables, ids)]
        caches = {id(self.where[t][0]) for t, c in zip(tables, cached) if c}
        if len(caches) > 1 or len({t for t, c in zip(tables, cached) if c}) < sum(cached):
            # mixed dims or a table twice: one call per part, in order (a repeated id is looked up once
            # per part, as two steps' lookups)
            return combine([self._pull([t], [x], step, None if counts is None else [counts[i]])
                            for i, (t, x) in enumerate(zip(tables, ids))], torch.cat)
        plan = _Plan(self, tables, ids, cached, counts)
        with self._lock:
            plan.look(step, self.max_age, self.refresh_after)
        out: Future = Future()

        def arrived(f: Future) -> None:
            try:
                pulled = f.result()
                with self._lock:
                    out.set_result(plan.assemble(pulled, step))
            except BaseException as e:   # the caller's .result() raises it
                out.set_exception(e)

        plan.issue(self.inner, step).add_done_callback(arrived)
        plan.issue_refresh(self.inner, step, self._lock)
        return out

    def push_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor], grads: torch.Tensor,
                        step: int | None = None) -> Future[None]:
        """Every row's grads [sum N_t, D] go to the wrapped store (on the CPU), cached or not, in
        order with the pulls (module docstring, "Background")."""
        grads = grads.detach().to("cpu")
        step = self.step if step is None else step
        return self._chain(lambda: self.inner.push_many_async(tables, ids, grads, step))

    def _chain(self, call) -> Future:
        """A Future of the Future that `call()` returns, called on the cache's thread in order (without
        `background`: that Future, called here)."""
        if self._worker is None:
            return call()
        out: Future = Future()

        def relay(f: Future) -> None:
            try:
                out.set_result(f.result())
            except BaseException as e:
                out.set_exception(e)

        def run() -> None:
            try:
                call().add_done_callback(relay)
            except BaseException as e:   # the caller's .result() raises it
                out.set_exception(e)

        self._worker.submit(run)
        return out

    def _call(self, fn, *args):
        """fn(*args), on the cache's thread after every call made before (with `background`)."""
        return fn(*args) if self._worker is None else self._worker.submit(fn, *args).result()

    # -- statistics -------------------------------------------------------------------------------

    def cache_counts(self) -> dict[str, dict[str, int]]:
        """{table name: {hits, misses, refreshes, lookups, lookup_hits}} of every cached table since
        the last call (then reset)."""
        out = {}
        with self._lock:
            for cache, tables in self.fused:
                got = cache.take_counts()
                for k, t in enumerate(tables):
                    out[self.config.tables[t].name] = {c: int(got[c][k]) for c in COUNTS}
        return out

    def cache_stats(self) -> dict[str, tuple[int, int]]:
        """{table name: (hits, misses)} of every cached table since the last call (then reset)."""
        return {name: (c["hits"], c["misses"]) for name, c in self.cache_counts().items()}

    # -- everything else is the wrapped store's (in call order: `_call`) ---------------------------

    def barrier(self, step: int) -> None:
        self._step = step + 1
        self._call(self.inner.barrier, step)

    def barrier_async(self, step: int) -> Future:
        self._step = step + 1
        return self._chain(lambda: self.inner.barrier_async(step))

    def sweep(self, step: int) -> list[dict]:
        return self._call(self.inner.sweep, step)       # dropped rows leave the cache within max_age steps

    def save(self, directory: str, step: int | None = None, background: bool = False) -> list[dict]:
        return self._call(self.inner.save, directory, step, background)

    def wait_saved(self, directory: str, timeout_s: float) -> list[dict]:
        return self._call(self.inner.wait_saved, directory, timeout_s)

    def load(self, directory: str) -> list[dict]:
        """The store loads `directory`; every cached row is dropped (they are the old rows)."""
        out = self._call(self.inner.load, directory)
        with self._lock:
            for cache, _ in self.fused:
                cache.clear()
        return out

    def stats(self) -> list[dict]:
        return self._call(self.inner.stats)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.inner.close()


class _Plan:
    """One fused call: the parts' distinct ids, where each lands in the row buffer, the lookup.

    Parts are the call's (table, ids) pairs, P of them; entries are the cached parts' distinct ids
    back to back, E of them (M of them misses after `look`).
    """

    def __init__(self, store: CachingStore, tables: Sequence[int], ids: Sequence[torch.Tensor], cached: list[bool],
                 counts: Sequence[torch.Tensor] | None) -> None:
        self.tables = list(tables)
        self.uniq: list[torch.Tensor] = []                 # per part: distinct ids [U] (cpu)
        inverse, cnt = [], []                              # per part: inverse [N] or None, occurrences [U]
        for i, x in enumerate(ids):
            u, inv = dedup_ids(x.to("cpu", torch.int64))
            self.uniq.append(u)
            inverse.append(inv)
            if counts is not None:                         # the given occurrences, summed per distinct id
                c = counts[i].to("cpu", torch.int64)
                if inv is not None:
                    c = torch.zeros(u.numel(), dtype=torch.int64).index_add_(0, inv, c)
                cnt.append(c.numpy())
        self.gather = gather_of(self.uniq, inverse)        # [N] caller position -> buffer row, or None
        sizes = np.array([u.numel() for u in self.uniq], dtype=np.int64)            # [P]
        self.starts = np.cumsum(sizes) - sizes                                       # [P] first buffer row
        dim = store.config.tables[tables[0]].dim
        self.buf = torch.empty(int(sizes.sum()), dim, device=store.device)           # [sum U, D]
        self.cparts = [i for i, c in enumerate(cached) if c]                         # cached parts
        self.uparts = [i for i, c in enumerate(cached) if not c]                     # the rest
        self.cache: FusedRowCache | None = None
        self.lk = None                                     # the lookup (`look`)
        self.miss = np.zeros(0, dtype=np.int64)            # [M] entries that missed (`look`)
        if not self.cparts:
            return
        self.cache = store.where[tables[self.cparts[0]]][0]
        local = np.array([store.where[tables[i]][1] for i in self.cparts], dtype=np.int32)
        csizes = sizes[self.cparts]
        self.ids = np.concatenate([self.uniq[i].numpy() for i in self.cparts])       # [E] entries
        self.tab = np.repeat(local, csizes)                                          # [E] local table
        self.part = np.repeat(np.arange(len(self.cparts)), csizes)                   # [E] cached part no.
        first = np.cumsum(csizes) - csizes
        self.pos = np.arange(self.ids.shape[0]) + np.repeat(self.starts[self.cparts] - first, csizes)   # [E] buffer row
        self.counts = None if counts is None else np.concatenate([cnt[i] for i in self.cparts])          # [E]

    def look(self, step: int, max_age: int, refresh_after: int | None) -> None:
        """The lookup of every cached entry; hits copied into the buffer (under the store's lock)."""
        if self.cache is None:
            return
        self.lk = self.cache.lookup(self.ids, self.tab, step, max_age, refresh_after, self.counts)
        h = np.flatnonzero(self.lk.hit)
        if h.size:
            move_rows(self.buf, self.pos[h], self.cache.rows, self.lk.slot[h])
        self.miss = np.flatnonzero(~self.lk.hit)                                    # [M] entries

    def issue(self, inner: EmbeddingStore, step: int) -> Future:
        """One call to the wrapped store: the uncached parts' ids, then each cached part's misses (a
        done Future of None when there are none)."""
        tables_m, ids_m = self._by_part(self.miss)
        tables = [self.tables[i] for i in self.uparts] + tables_m
        ids = [self.uniq[i] for i in self.uparts] + ids_m
        return inner.pull_many_async(tables, ids, step) if tables else done_future(None)

    def _by_part(self, e: np.ndarray) -> tuple[list[int], list[torch.Tensor]]:
        """Entries e [M] (increasing) -> (tables, ids per part) of the cached parts that have any, in part order."""
        if not e.size:
            return [], []
        n = np.bincount(self.part[e], minlength=len(self.cparts))
        pieces = torch.from_numpy(self.ids[e]).split(n.tolist())
        keep = np.flatnonzero(n)
        return [self.tables[self.cparts[i]] for i in keep], [pieces[i] for i in keep]

    def assemble(self, pulled: torch.Tensor | None, step: int) -> torch.Tensor:
        """The pulled rows [sum U_uncached + M, D] into the buffer and the cache; the rows [sum N, D]."""
        k = 0
        if pulled is not None:
            pulled = pulled.to(self.buf.device)
            for i in self.uparts:
                n = self.uniq[i].numel()
                self.buf[self.starts[i]:self.starts[i] + n] = pulled[k:k + n]
                k += n
        if self.miss.size:
            got = pulled[k:]                                                        # [M, D]
            move_rows(self.buf, self.pos[self.miss], got, None)
            self.cache.fill(self.ids[self.miss], self.tab[self.miss], self.lk.slot[self.miss], got, step,
                            self.lk.generation)
        return self.buf if self.gather is None else self.buf.index_select(0, self.gather.to(self.buf.device))

    def issue_refresh(self, inner: EmbeddingStore, step: int, lock: threading.Lock) -> None:
        """The hits due for a refresh, pulled again for `step` in a call nobody waits for."""
        if self.cache is None or not (r := np.flatnonzero(self.lk.refresh)).size:
            return
        ids_r, tab_r, slot_r = self.ids[r], self.tab[r], self.lk.slot[r]
        cache, generation = self.cache, self.lk.generation

        def arrived(f: Future) -> None:
            try:
                rows = f.result()
            except Exception as e:   # the rows expire and miss later: nothing is served wrong
                logger.warning("row cache: a refresh-ahead pull of %d rows failed (%s); they will miss "
                               "when they expire", r.size, e)
                return
            with lock:
                cache.fill(ids_r, tab_r, slot_r, rows.to(cache.rows.device), step, generation)

        inner.pull_many_async(*self._by_part(r), step).add_done_callback(arrived)


def cache_metrics(counts: dict[str, dict[str, int]]) -> dict[str, float]:
    """Metrics of `cache_counts()`, as docs/performance.md ("Row cache") defines them: `cache/<table>/hit_rate`,
    `cache/hit_rate`, `cache/hit_rate_per_lookup` (needs counts), `cache/refresh_rate`; NaN (written as
    null) where nothing was counted."""
    def rate(a: int, b: int) -> float:
        return a / b if b else float("nan")

    out = {f"cache/{name}/hit_rate": rate(c["hits"], c["hits"] + c["misses"]) for name, c in counts.items()}
    tot = {k: sum(c[k] for c in counts.values()) for k in COUNTS}
    distinct = tot["hits"] + tot["misses"]
    out["cache/hit_rate"] = rate(tot["hits"], distinct)
    out["cache/hit_rate_per_lookup"] = rate(tot["lookup_hits"], tot["lookups"])
    out["cache/refresh_rate"] = rate(tot["refreshes"], distinct)
    return out


__all__ = ["CachingStore", "DEFAULT_POLICY", "cache_metrics"]
