"""CachingStore: hits and misses counted exactly, LRU / LFU eviction order, refresh at the staleness
bound, multi-table calls with duplicates and empty parts equal to the wrapped store, fills that
arrive late or out of order."""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import Future

import pytest
import torch

from embedding_ps.client.cache import CachingStore, cache_metrics
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.local import LocalStore
from embedding_ps.store import EmbeddingStore

TABLES = (
    TableConfig(name="a", dim=4, lr=0.1, seed=1, cache_rows=3),
    TableConfig(name="b", dim=4, lr=0.1, seed=2),                   # not cached
    TableConfig(name="c", dim=4, lr=0.1, seed=3, cache_rows=100),
)


def config(**table_a: object) -> PSConfig:
    return PSConfig(num_shards=2, tables=(dataclasses.replace(TABLES[0], **table_a), *TABLES[1:]))


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_caching_store_satisfies_the_protocol() -> None:
    assert isinstance(CachingStore(LocalStore.create(config()), config(), max_age=0), EmbeddingStore)


def test_hits_and_misses_are_counted_per_distinct_id_of_a_call() -> None:
    cfg = config(cache_rows=10)
    store = CachingStore(LocalStore.create(cfg), cfg, max_age=5)
    store.pull(0, ids(1, 2, 2, 3), step=0)          # 3 distinct: 3 misses
    store.pull(0, ids(3, 3, 4), step=1)             # 3 hit, 4 miss
    store.pull(0, ids(1, 4, 9, 9), step=2)          # 1, 4 hit; 9 miss
    store.pull(2, ids(), step=2)                    # an empty part counts nothing
    store.pull(1, ids(1, 2), step=2)                # table b is not cached: not counted
    assert store.cache_stats() == {"a": (3, 5), "c": (0, 0)}
    assert store.cache_stats() == {"a": (0, 0), "c": (0, 0)}          # reset by reading
    zero = dict.fromkeys(("refreshes", "lookups", "lookup_hits"), 0)
    m = cache_metrics({"a": {**zero, "hits": 3, "misses": 5}, "c": {**zero, "hits": 1, "misses": 1}})
    assert m["cache/a/hit_rate"] == 3 / 8 and m["cache/c/hit_rate"] == 0.5 and m["cache/hit_rate"] == 0.4
    assert math.isnan(m["cache/hit_rate_per_lookup"]) and m["cache/refresh_rate"] == 0.0


@pytest.mark.parametrize("policy, hit, miss", [("lru", 2, 1), ("lfu", 1, 2)])
def test_eviction_order(policy: str, hit: int, miss: int) -> None:
    """3 slots; 1 is looked up twice (steps 0, 1), then 2 and 3 once: when 4 needs a slot, LRU evicts 1
    (least recently used), LFU evicts 2 (fewest lookups; 2 and 3 tie, 2 is older)."""
    cfg = config()
    store = CachingStore(LocalStore.create(cfg), cfg, max_age=100, policy=policy)
    for step, x in enumerate([(1,), (1,), (2,), (3,), (4,)]):
        store.pull(0, ids(*x), step=step)
    assert store.cache_stats()["a"] == (1, 4)        # the step-1 lookup of 1 hit
    store.pull(0, ids(hit), step=5)
    assert store.cache_stats()["a"] == (1, 0)
    store.pull(0, ids(miss), step=6)
    assert store.cache_stats()["a"] == (0, 1)


def test_rows_looked_up_by_a_call_are_not_evicted_by_it() -> None:
    """5 distinct ids into 3 slots: all 5 rows are right, the 2 that found no slot are not cached."""
    cfg = config()
    inner = LocalStore.create(cfg)
    store = CachingStore(inner, cfg, max_age=100)
    x = ids(10, 11, 12, 13, 14)
    assert torch.equal(store.pull(0, x, step=0), inner.pull(0, x))
    store.pull(0, x, step=1)
    assert store.cache_stats()["a"] == (3, 7)


def test_multi_table_call_with_duplicates_and_empty_parts_equals_the_wrapped_store() -> None:
    cfg = config(cache_rows=4)
    plain = LocalStore.create(cfg)                 # rows are a function of (seed, id): same init
    store = CachingStore(LocalStore.create(cfg), cfg, max_age=3)
    calls = [([0, 1, 2, 0], [ids(5, 7, 5, -3), ids(5, 2**62), ids(), ids(8, 8)]),
             ([2, 0], [ids(1, 2, 3), ids(7, 5, 6, 9, 10, 5)]),
             ([0], [ids()]),
             ([1, 0, 0], [ids(4), ids(5), ids(7, -3)])]
    for step, (tables, parts) in enumerate(calls):
        got = store.pull_many_async(tables, parts, step).result()
        assert torch.equal(got, plain.pull_many_async(tables, parts, step).result()), step
    h, m = store.cache_stats()["a"]
    assert h > 0 and m > 0


@pytest.mark.parametrize("max_age", [0, 1, 2])
def test_cached_row_is_refreshed_after_max_age_steps(max_age: int) -> None:
    """Without refresh ahead, a row pulled for step 0 is served unchanged (although the shard
    updated it) up to step max_age, and pulled again, with the update, at step max_age + 1."""
    cfg = config(cache_rows=10)
    inner = LocalStore.create(cfg)
    store = CachingStore(inner, cfg, max_age=max_age, refresh_ahead=0)
    x = ids(42)
    first = store.pull(0, x, step=0)
    store.push(0, x, torch.ones(1, 4), step=0)                # applied by the store at once
    updated = inner.pull(0, x)
    assert not torch.equal(updated, first)
    for step in range(1, max_age + 1):
        assert torch.equal(store.pull(0, x, step=step), first), step
    assert torch.equal(store.pull(0, x, step=max_age + 1), updated)
    assert store.cache_stats()["a"] == (max_age, 2)


def test_push_goes_to_the_store_for_hits_too() -> None:
    cfg = config(cache_rows=10)
    inner, plain = LocalStore.create(cfg), LocalStore.create(cfg)
    store = CachingStore(inner, cfg, max_age=5)
    x, g = ids(1, 2), torch.arange(8, dtype=torch.float32).view(2, 4)
    for step in range(3):
        store.pull(0, x, step=step)
        store.push(0, x, g, step=step)
        plain.push(0, x, g, step=step)
    assert store.cache_stats()["a"] == (4, 2)
    assert torch.equal(inner.pull(0, x), plain.pull(0, x))


def test_load_drops_the_cached_rows(tmp_path) -> None:
    cfg = config(cache_rows=10)
    inner = LocalStore.create(cfg)
    store = CachingStore(inner, cfg, max_age=100)
    x = ids(3)
    before = store.pull(0, x, step=0)
    store.save(str(tmp_path / "s"))
    store.push(0, x, torch.ones(1, 4), step=0)
    assert torch.equal(store.pull(0, x, step=1), before)          # cached
    store.push(0, x, torch.ones(1, 4), step=1)
    after_push = inner.pull(0, x)
    store.save(str(tmp_path / "t"))
    store.load(str(tmp_path / "t"))
    assert torch.equal(store.pull(0, x, step=2), after_push)      # a miss after the load


class _Deferred:
    """A store whose pulls resolve when the test says so (as replies arriving over the network)."""

    def __init__(self, cfg: PSConfig) -> None:
        self.local = LocalStore.create(cfg)
        self.step = 0
        self.waiting: list[tuple[Future, torch.Tensor]] = []

    def pull_many_async(self, tables, ids, step=None) -> Future:
        fut: Future = Future()
        self.waiting.append((fut, self.local.pull_many_async(tables, ids, step).result()))
        return fut

    def resolve(self, i: int, rows: torch.Tensor | None = None) -> None:
        fut, value = self.waiting[i]
        fut.set_result(value if rows is None else rows)


def test_pending_rows_are_misses_and_late_fills_do_not_overwrite_newer_ones() -> None:
    cfg = config(cache_rows=10)
    inner = _Deferred(cfg)
    store = CachingStore(inner, cfg, max_age=5)   # type: ignore[arg-type]
    x = ids(7)
    f0 = store.pull_many_async([0], [x], step=0)
    f1 = store.pull_many_async([0], [x], step=1)  # step 0's row has not arrived: pulled again
    assert len(inner.waiting) == 2 and not f0.done()
    newer = torch.full((1, 4), 2.0)
    inner.resolve(1, newer)
    inner.resolve(0, torch.full((1, 4), 1.0))     # arrives last but is older: not cached
    assert torch.equal(f1.result(), newer) and torch.equal(f0.result(), torch.full((1, 4), 1.0))
    assert torch.equal(store.pull(0, x, step=2), newer)           # served from the cache
    assert store.cache_stats()["a"] == (1, 2)


def test_a_failed_pull_reaches_the_caller() -> None:
    cfg = config(cache_rows=10)
    inner = _Deferred(cfg)
    store = CachingStore(inner, cfg, max_age=5)   # type: ignore[arg-type]
    fut = store.pull_many_async([0], [ids(1)], step=0)
    inner.waiting[0][0].set_exception(RuntimeError("shard 0 at tcp://x: timed out"))
    with pytest.raises(RuntimeError, match="shard 0"):
        fut.result(timeout=1)


def test_cache_rows_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=r"ps.tables\[a\].cache_rows must be >= 0, got -1"):
        TableConfig(name="a", dim=4, cache_rows=-1)


def test_cached_rows_survive_many_fills() -> None:
    """4000 rows cached over 4 calls are all served right afterwards, from the cache."""
    cfg = config(cache_rows=5000)
    plain = LocalStore.create(cfg)
    store = CachingStore(LocalStore.create(cfg), cfg, max_age=10)
    chunks = [torch.arange(i * 1000, (i + 1) * 1000) * 7919 for i in range(4)]   # 4000 distinct ids
    for step, x in enumerate(chunks):
        store.pull(0, x, step=step)
    everything = torch.cat(chunks)
    assert torch.equal(store.pull(0, everything, step=4), plain.pull(0, everything))
    assert store.cache_stats()["a"] == (4000, 4000)
    assert store.fused[0][0].rows.shape[0] == 5000 + 100          # tables a and c share one dim


def test_an_eviction_frees_a_64th_of_the_slots_lowest_first() -> None:
    """LRU over 128 slots: the first new id after they fill evicts the 2 (128 / 64) least recently
    used rows, the second new id takes the spare slot, so the third-oldest row is still cached."""
    cfg = config(cache_rows=128)
    plain = LocalStore.create(cfg)
    store = CachingStore(LocalStore.create(cfg), cfg, max_age=1000, policy="lru")
    for step in range(128):
        store.pull(0, ids(step * 11), step=step)
    store.pull(0, ids(100_000), step=128)           # evicts ids 0 and 11
    store.pull(0, ids(100_001), step=129)           # the spare slot: nothing else evicted
    assert store.cache_stats()["a"] == (0, 130)
    x = ids(11, 22, 100_000, 100_001)
    assert torch.equal(store.pull(0, x, step=130), plain.pull(0, x))
    assert store.cache_stats()["a"] == (3, 1)


def test_a_pull_in_flight_across_a_load_does_not_refill_the_cache(tmp_path) -> None:
    """Step 0's pull flies across a LOAD; step 1 misses (pulled again, still in flight) when step 0's
    pre-load row arrives: step 2 must not be served that row from the cache."""
    cfg = config(cache_rows=10)
    inner = _Deferred(cfg)
    inner.save = inner.local.save                  # type: ignore[attr-defined]
    inner.load = inner.local.load                  # type: ignore[attr-defined]
    store = CachingStore(inner, cfg, max_age=5)    # type: ignore[arg-type]
    x = ids(7)
    old = store.pull_many_async([0], [x], step=0)
    store.save(str(tmp_path / "s"))
    store.load(str(tmp_path / "s"))                # the cache is dropped while step 0's pull flies
    new = store.pull_many_async([0], [x], step=1)
    inner.resolve(0, torch.full((1, 4), 9.0))      # a row from before the load
    assert torch.equal(old.result(), torch.full((1, 4), 9.0))
    third = store.pull_many_async([0], [x], step=2)
    assert len(inner.waiting) == 3                 # a miss: pulled again
    inner.resolve(1)
    inner.resolve(2)
    assert torch.equal(third.result(), inner.local.pull(0, x)) and torch.equal(new.result(), third.result())
