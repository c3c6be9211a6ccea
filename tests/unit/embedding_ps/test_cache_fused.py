"""The fused row cache (embedding_ps.client.rowcache behind CachingStore): one call over many tables
equals one call per table, served rows stay within the staleness bound on a hand-built stream with
pushes, refresh-ahead keeps hot rows hitting without breaking the bound, per-lookup counts, and
combined-key collisions between tables."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from embedding_ps.client.cache import CachingStore
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.local import LocalStore
from embedding_ps.client.rowcache import FusedRowCache

CFG = PSConfig(num_shards=2, tables=(
    TableConfig(name="a", dim=4, lr=0.1, seed=1, cache_rows=6),      # small: evicts every step
    TableConfig(name="b", dim=4, lr=0.1, seed=2),                    # not cached
    TableConfig(name="c", dim=4, lr=0.1, seed=3, cache_rows=200),    # evicts cap // 64 at a time
    TableConfig(name="d", dim=4, lr=0.1, seed=4, cache_rows=40),
))
ALL = [0, 1, 2, 3]


def stream(steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Per step, per table: distinct increasing ids (as the sparse arch sends), Zipf-like skew."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        parts = []
        for vocab in (20, 50, 600, 100):
            r = torch.rand(40, generator=g)
            parts.append(torch.unique((vocab * r ** 3).long() * 7 - 30))   # [U] skewed to small ranks
        out.append(parts)
    return out


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_one_call_over_all_tables_equals_one_call_per_table(policy: str) -> None:
    """Same rows and the same hits and misses per table, with pushes changing the rows between steps."""
    fused_inner, split_inner = LocalStore.create(CFG), LocalStore.create(CFG)
    fused = CachingStore(fused_inner, CFG, max_age=3, policy=policy)
    split = CachingStore(split_inner, CFG, max_age=3, policy=policy)
    for step, parts in enumerate(stream(30)):
        a = fused.pull_many_async(ALL, parts, step).result()
        b = torch.cat([split.pull_many_async([t], [x], step).result() for t, x in zip(ALL, parts)])
        assert torch.equal(a, b), step
        grads = torch.randn(a.shape[0], 4, generator=torch.Generator().manual_seed(step))
        fused.push_many_async(ALL, parts, grads, step).result()
        split.push_many_async(ALL, parts, grads, step).result()
        assert fused.cache_counts() == split.cache_counts(), step


@pytest.mark.parametrize("max_age, refresh_ahead", [(0, 1), (2, 0), (2, 1), (4, 1), (4, 3)])
def test_served_rows_are_never_older_than_max_age_steps(max_age: int, refresh_ahead: int) -> None:
    """Every row served for step t equals the store's row as it was at the start of some step s with
    t - max_age <= s <= t (the store applies every push at once, so rows change every step)."""
    inner = LocalStore.create(CFG)
    store = CachingStore(inner, CFG, max_age=max_age, refresh_ahead=refresh_ahead)
    every = [torch.arange(-30, 600 * 7, 7)] * 4                          # every id the stream can hold
    versions = []                                                        # per step: rows [4 * V, D]
    stale = 0
    for step, parts in enumerate(stream(40, seed=1)):
        versions.append(inner.pull_many_async(ALL, every, step).result())
        got = store.pull_many_async(ALL, parts, step).result()
        k = 0
        for t, x in enumerate(parts):
            at = t * every[0].numel() + (x + 30) // 7                    # rows of x in a version
            for i in range(x.numel()):
                ages = [step - s for s in range(max(0, step - max_age), step + 1)
                        if torch.equal(got[k + i], versions[s][at[i]])]
                assert ages, (step, t, int(x[i]))
                stale += min(ages) > 0
            k += x.numel()
        store.push_many_async(ALL, parts, torch.ones(got.shape[0], 4), step).result()
    assert (stale > 0) == (max_age > 0)                                  # the test saw old rows served


def test_refresh_ahead_keeps_a_hot_row_hitting_and_fresh() -> None:
    """max_age 3, refresh_ahead 1: a row looked up every step is pulled again (off the step's path)
    when it is 2 steps old, so it never misses after its first pull, and the step that requests the
    refresh is served the cached row (versions v0, v0, v0, v2, v2, v4, ...)."""
    inner = LocalStore.create(CFG)
    store = CachingStore(inner, CFG, max_age=3, refresh_ahead=1)
    x = torch.tensor([5])
    versions, served = [], []
    for step in range(9):
        versions.append(inner.pull(0, x))
        served.append(store.pull(0, x, step=step))
        store.push(0, x, torch.ones(1, 4), step=step)
    want = [0, 0, 0, 2, 2, 4, 4, 6, 6]
    assert all(torch.equal(s, versions[w]) for s, w in zip(served, want))
    c = store.cache_counts()["a"]
    assert (c["hits"], c["misses"], c["refreshes"]) == (8, 1, 4)      # refreshed at steps 2, 4, 6, 8


class _Deferred:
    """A store whose pulls resolve when the test says so (replies arriving over the network)."""

    def __init__(self, cfg: PSConfig) -> None:
        self.local = LocalStore.create(cfg)
        self.step = 0
        self.waiting: list[tuple[Future, torch.Tensor]] = []

    def pull_many_async(self, tables, ids, step=None) -> Future:
        fut: Future = Future()
        self.waiting.append((fut, self.local.pull_many_async(tables, ids, step).result()))
        return fut

    def resolve(self, i: int) -> None:
        fut, value = self.waiting[i]
        fut.set_result(value)


def test_a_late_refresh_lets_the_row_expire_and_never_overwrites_a_newer_pull() -> None:
    inner = _Deferred(CFG)
    store = CachingStore(inner, CFG, max_age=2, refresh_ahead=1)   # type: ignore[arg-type]
    x = torch.tensor([9])
    f0 = store.pull_many_async([0], [x], 0)
    inner.resolve(0)
    f0.result()
    assert store.pull_many_async([0], [x], 1).done()       # a hit, refresh requested (call 1)
    assert len(inner.waiting) == 2
    assert store.pull_many_async([0], [x], 2).done()       # a hit; the refresh is in flight: none more
    assert len(inner.waiting) == 2
    f3 = store.pull_many_async([0], [x], 3)                # 3 steps old, refresh not back: a miss
    assert not f3.done() and len(inner.waiting) == 3
    inner.local.push(0, x, torch.ones(1, 4))
    inner.waiting[2] = (inner.waiting[2][0], inner.local.pull(0, x))   # step 3's pull sees the push
    inner.resolve(2)
    inner.resolve(1)                                       # the refresh for step 1 arrives last
    assert torch.equal(store.pull(0, x, step=4), f3.result())          # step 3's row, not step 1's
    c = store.cache_counts()["a"]
    assert (c["hits"], c["misses"], c["refreshes"]) == (3, 2, 2)      # misses: steps 0, 3; refreshes: 1, 4


def test_lookups_are_counted_per_occurrence_when_counts_are_given() -> None:
    store = CachingStore(LocalStore.create(CFG), CFG, max_age=5)
    store.pull_many_async([0, 2], [torch.tensor([1, 2]), torch.tensor([3])], 0,
                          counts=[torch.tensor([5, 1]), torch.tensor([2])]).result()
    store.pull_many_async([0, 2], [torch.tensor([1, 4]), torch.tensor([3])], 1,
                          counts=[torch.tensor([3, 1]), torch.tensor([4])]).result()
    c = store.cache_counts()
    assert (c["a"]["lookups"], c["a"]["lookup_hits"], c["a"]["hits"], c["a"]["misses"]) == (10, 3, 1, 3)
    assert (c["c"]["lookups"], c["c"]["lookup_hits"]) == (6, 4)


def test_ids_of_two_tables_under_one_combined_key_are_served_right(monkeypatch) -> None:
    """Force every table's id i onto the same combined key: the second table's ids find the slot
    held by the first's, are served from the store and not cached, and the first keeps its rows."""
    monkeypatch.setattr(FusedRowCache, "key", lambda self, ids, tab: ids.copy())
    plain = LocalStore.create(CFG)
    store = CachingStore(LocalStore.create(CFG), CFG, max_age=5)
    x = torch.tensor([1, 2, 3])
    for step in range(3):
        got = store.pull_many_async([0, 2], [x, x], step).result()
        assert torch.equal(got, plain.pull_many_async([0, 2], [x, x], step).result()), step
    c = store.cache_counts()
    assert (c["a"]["hits"], c["c"]["hits"], c["c"]["misses"]) == (6, 0, 9)
    assert np.all(store.fused[0][0].tab[store.fused[0][0].tab >= 0] == 0)    # only table a cached


class _Recording:
    """A LocalStore that records the calls that reach it, with the step each carries."""

    def __init__(self, cfg: PSConfig) -> None:
        self.local = LocalStore.create(cfg)
        self.calls: list[tuple[str, int]] = []

    @property
    def step(self) -> int:
        return self.local.step

    @step.setter
    def step(self, value: int) -> None:
        self.local.step = value

    def pull_many_async(self, tables, ids, step=None):
        self.calls.append(("pull", step))
        return self.local.pull_many_async(tables, ids, step)

    def push_many_async(self, tables, ids, grads, step=None):
        self.calls.append(("push", self.local.step if step is None else step))
        return self.local.push_many_async(tables, ids, grads, step)

    def barrier_async(self, step):
        self.calls.append(("barrier", step))
        return self.local.barrier_async(step)

    def close(self) -> None:
        pass


def test_background_lookups_keep_the_order_and_steps_of_the_calls() -> None:
    """With `background` the trainer's async pattern (pull t + 1, push t, barrier t) reaches the
    store in call order with the steps a direct store would give, and serves the same rows."""
    rec, plain = _Recording(CFG), _Recording(CFG)
    bg = CachingStore(rec, CFG, max_age=2, background=True)       # type: ignore[arg-type]
    direct = CachingStore(plain, CFG, max_age=2)                  # type: ignore[arg-type]
    parts = stream(12, seed=3)
    served: dict[int, list[torch.Tensor]] = {id(bg): [], id(direct): []}
    try:
        for store in (bg, direct):
            nxt = store.pull_many_async(ALL, parts[0], 0)
            for step in range(11):
                rows = nxt.result(timeout=10)
                served[id(store)].append(rows)
                nxt = store.pull_many_async(ALL, parts[step + 1], step + 1)        # prefetch
                push = store.push_many_async(ALL, parts[step], torch.ones(rows.shape[0], 4))
                bar = store.barrier_async(step)
                assert store.step == step + 1
                push.result(timeout=10)
                bar.result(timeout=10)
            nxt.result(timeout=10)
        assert rec.calls == plain.calls
        assert all(torch.equal(a, b) for a, b in zip(served[id(bg)], served[id(direct)]))
        assert [s for c, s in rec.calls if c == "push"] == list(range(11))
        every = [torch.arange(-30, 600 * 7, 7)] * 4
        assert torch.equal(rec.local.pull_many_async(ALL, every).result(), plain.local.pull_many_async(ALL, every).result())
    finally:
        bg.close()


class _Failing(_Recording):
    """Pulls and pushes that fail as a shard that timed out would."""

    def pull_many_async(self, tables, ids, step=None):
        raise RuntimeError("shard 1 at tcp://127.0.0.1:9: pull timed out")

    def push_many_async(self, tables, ids, grads, step=None):
        fut: Future = Future()
        fut.set_exception(RuntimeError("shard 0 at tcp://127.0.0.1:8: push timed out"))
        return fut


def test_background_errors_reach_the_caller() -> None:
    store = CachingStore(_Failing(CFG), CFG, max_age=2, background=True)   # type: ignore[arg-type]
    try:
        with pytest.raises(RuntimeError, match="shard 1 .* pull timed out"):
            store.pull_many_async([0, 1], [torch.tensor([1]), torch.tensor([2])], 0).result(timeout=10)
        with pytest.raises(RuntimeError, match="shard 0 .* push timed out"):
            store.push_many_async([0], [torch.tensor([1])], torch.ones(1, 4), 0).result(timeout=10)
    finally:
        store.close()


def test_a_full_tables_slots_go_to_its_hottest_misses_whatever_order_they_came_in() -> None:
    # table 0: 3 slots, 6 new ids in one lookup, the hottest last; table 1 has room for all of its
    # misses and keeps their order. Counts (occurrences in the batch) decide who is cached.
    cache = FusedRowCache([3, 8], dim=2, policy="lfu", device=torch.device("cpu"))
    ids = np.array([10, 11, 12, 13, 14, 15, 50, 51], dtype=np.int64)
    tab = np.array([0, 0, 0, 0, 0, 0, 1, 1], dtype=np.int32)
    counts = np.array([1, 1, 2, 9, 1, 5, 1, 3], dtype=np.int64)
    lk = cache.lookup(ids, tab, step=0, max_age=3, refresh_after=None, counts=counts)
    cached = {int(i) for i, s in zip(ids, lk.slot) if s >= 0}
    assert cached == {13, 15, 12, 50, 51}                  # the 3 hottest of table 0, all of table 1
    assert list(lk.slot[6:]) == [3, 4]                     # table 1's in arrival order
    # without counts: arrival order (the first 3 of table 0)
    plain = FusedRowCache([3, 8], dim=2, policy="lfu", device=torch.device("cpu"))
    lk = plain.lookup(ids, tab, step=0, max_age=3, refresh_after=None)
    assert {int(i) for i, s in zip(ids, lk.slot) if s >= 0} == {10, 11, 12, 50, 51}
