"""IdMap against a Python dict: inserts, lookups, deletes, collisions, growth, extreme int64 keys."""

import numpy as np
import pytest

from embedding_ps.idmap import BoundedCounter, IdMap
from embedding_ps.reference import home as _home

EXTREMES = np.array([0, -1, 1, -(2**63), 2**63 - 1, -(2**63) + 1, 2**63 - 2], dtype=np.int64)


def colliding_keys(n: int, bits: int = 12) -> np.ndarray:
    """n keys whose home bucket is the last one of every map with <= 2**bits buckets (probes wrap)."""
    cand = np.random.default_rng(1).integers(-(2**63), 2**63 - 1, 1 << 22, dtype=np.int64)
    keys = cand[_home(cand, 1 << bits) == (1 << bits) - 1]
    assert keys.shape[0] >= n
    return keys[:n]


def check_against(m: IdMap, ref: dict[int, int], probe: np.ndarray) -> None:
    got = m.lookup(probe)
    assert got.dtype == np.int32
    assert got.tolist() == [ref.get(int(k), -1) for k in probe]
    assert len(m) == len(ref)
    keys, vals = m.items()
    assert dict(zip(keys.tolist(), vals.tolist())) == ref


def test_random_ops_against_dict() -> None:
    rng = np.random.default_rng(0)
    pool = np.concatenate(
        [EXTREMES, colliding_keys(40), rng.integers(-60, 60, 120), rng.integers(-(2**63), 2**63 - 1, 200)]
    )
    m, ref = IdMap(), {}
    for it in range(120):
        batch = np.unique(rng.choice(pool, 60))
        check_against(m, ref, np.concatenate([batch, batch[:5]]))  # duplicates in a lookup are fine
        absent = batch[m.lookup(batch) < 0]
        vals = rng.integers(0, 2**31 - 1, absent.shape[0]).astype(np.int32)
        m.insert(absent, vals)
        ref.update(zip(absent.tolist(), vals.tolist()))
        dels = rng.choice(pool, 25)  # some absent, some repeated
        removed = m.delete(dels)
        for k, r in zip(dels.tolist(), removed.tolist()):
            assert r == ref.pop(k, -1) or (r >= 0 and k not in ref)
        check_against(m, ref, pool)


def test_colliding_keys_wrap_around_the_table() -> None:
    keys = colliding_keys(300)
    m = IdMap()
    m.insert(keys[:30], np.arange(30, dtype=np.int32))
    assert m.num_buckets == 64  # all 30 share the last bucket of 64 and wrap to the front
    assert m.lookup(keys[:30]).tolist() == list(range(30))
    assert (m.lookup(keys[30:]) == -1).all()
    m.delete(keys[:30:2])  # tombstones in the middle of the chain
    assert m.lookup(keys[:30]).tolist() == [-1 if i % 2 == 0 else i for i in range(30)]
    m.insert(keys[30:300], np.arange(30, 300, dtype=np.int32))  # reuses tombstones, then grows
    expect = [-1 if (i < 30 and i % 2 == 0) else i for i in range(300)]
    assert m.lookup(keys).tolist() == expect
    assert len(m) == 285


def test_growth_and_extreme_values() -> None:
    rng = np.random.default_rng(2)
    keys = np.unique(np.concatenate([EXTREMES, rng.integers(-(2**63), 2**63 - 1, 50_000)]))
    rng.shuffle(keys)
    m = IdMap()
    for i in range(0, keys.shape[0], 7_000):
        m.insert(keys[i : i + 7_000], np.arange(i, min(i + 7_000, keys.shape[0]), dtype=np.int32))
    assert len(m) == keys.shape[0]
    assert m.num_buckets >= keys.shape[0] / m.max_load
    assert (m.lookup(keys) == np.arange(keys.shape[0])).all()
    assert (m.lookup(EXTREMES) >= 0).all()
    # deleting most entries and re-inserting keeps it consistent through tombstone rehashes
    m.delete(keys[: 45_000])
    assert (m.lookup(keys[:45_000]) == -1).all()
    assert (m.lookup(keys[45_000:]) == np.arange(45_000, keys.shape[0])).all()
    m.insert(keys[:1000], np.full(1000, 7, dtype=np.int32))
    assert (m.lookup(keys[:1000]) == 7).all() and len(m) == keys.shape[0] - 44_000


def test_insert_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        IdMap().insert(np.array([1, 2]), np.array([0], dtype=np.int32))


def test_bounded_counter_counts_and_stays_bounded() -> None:
    c = BoundedCounter(max_entries=100)
    assert c.add(np.array([5, -(2**63)]), step=1).tolist() == [1, 1]
    assert c.add(np.array([5, 7]), step=2).tolist() == [2, 1]
    c.remove(np.array([5, 123]))
    assert c.add(np.array([5]), step=3).tolist() == [1]
    for step in range(10, 30):  # a flood of 20 x 50 new keys
        c.add(np.arange(step * 1000, step * 1000 + 50), step)
        assert len(c) <= 100
    assert c.dropped > 0
    st = c.state()
    d = BoundedCounter(max_entries=100)
    d.set_state(st["keys"], st["count"], st["last_seen"])
    assert sorted(d.state()["keys"].tolist()) == sorted(st["keys"].tolist())
    expect_old = {k for k, s in zip(st["keys"].tolist(), st["last_seen"].tolist()) if s <= 28}
    assert set(c.older_than(28).tolist()) == expect_old and 0 < len(expect_old) < len(c)


def test_bounded_counter_drops_lowest_counts_first() -> None:
    c = BoundedCounter(max_entries=8)
    hot = np.array([1, 2, 3])
    for step in range(3):
        c.add(hot, step)
    c.add(np.arange(100, 110), step=5)  # 10 new keys: more than fit beside the hot ones
    assert len(c) <= 8
    assert c.add(hot, step=6).tolist() == [4, 4, 4]  # the hot keys survived with their counts


def test_reserve_sizes_exactly_and_never_rehashes_up_to_n() -> None:
    """reserve(n) at max_load 0.9: ceil(n / 0.9) buckets rounded to 64 (not a power of two); n inserts keep them."""
    n = 10_000
    m = IdMap(max_load=0.9)
    m.reserve(n)
    assert m.num_buckets == 11_136 and m.num_buckets & (m.num_buckets - 1)   # ceil(10000 / 0.9) = 11112 -> x64
    keys = np.random.default_rng(3).permutation(np.arange(-n // 2, n // 2, dtype=np.int64) * 7919)
    before = m._keys
    for i in range(0, n, 999):
        m.insert(keys[i : i + 999], np.arange(i, min(i + 999, n), dtype=np.int32))
    assert m._keys is before and len(m) == n        # the same arrays: no rehash on the way to n
    assert (m.lookup(keys) == np.arange(n)).all()
    extra = np.arange(2**62, 2**62 + 100, dtype=np.int64)        # past 0.9 * 11136 = 10022: grows as usual
    m.insert(extra, np.full(100, 5, dtype=np.int32))
    assert m.num_buckets > 11_136 and (m.lookup(extra) == 5).all() and (m.lookup(keys) == np.arange(n)).all()


@pytest.mark.parametrize("load", [0.85, 0.95])
def test_high_load_non_power_of_two_against_dict(load: float) -> None:
    """A reserved map at a high load factor, filled to it, with deletes, tombstones, re-inserts and the
    tombstone rehash (which keeps the reserved buckets), against a dict; probes wrap at the last bucket."""
    rng = np.random.default_rng(4)
    buckets = 1000                                               # not a multiple of 64: reserve rounds it to 1024
    m = IdMap(max_load=load)
    m.reserve(int(load * buckets))
    nb = m.num_buckets
    last = colliding_last(nb, 25)
    pool = np.unique(np.concatenate([EXTREMES, last, rng.integers(-(2**63), 2**63 - 1, 3 * nb)]))
    ref: dict[int, int] = {}
    for it in range(60):
        room = int(load * nb) - len(ref) - m._tombs
        cand = rng.choice(pool, 80)
        absent = np.unique(cand[m.lookup(cand) < 0])[: max(room, 0)]
        vals = rng.integers(0, 2**31 - 1, absent.shape[0]).astype(np.int32)
        m.insert(absent, vals)
        ref.update(zip(absent.tolist(), vals.tolist()))
        assert m.num_buckets == nb                               # filled up to the load factor, never grown
        dels = rng.choice(pool, 40)
        removed = m.delete(dels)
        for k, r in zip(dels.tolist(), removed.tolist()):
            assert r == ref.pop(k, -1) or (r >= 0 and k not in ref)
        check_against(m, ref, np.concatenate([pool[:500], last]))
    assert len(ref) > 0.5 * load * nb


def colliding_last(buckets: int, n: int) -> np.ndarray:
    """n keys whose home is the last of `buckets` buckets."""
    cand = np.random.default_rng(9).integers(-(2**63), 2**63 - 1, 1 << 21, dtype=np.int64)
    keys = cand[_home(cand, buckets) == buckets - 1]
    assert keys.shape[0] >= n
    return keys[:n]


def test_home_of_any_bucket_count_is_uniform_and_in_range() -> None:
    keys = np.random.default_rng(6).integers(-(2**63), 2**63 - 1, 200_000, dtype=np.int64)
    for nb in (64, 960, 1 << 20, 3_000_000_000):
        h = _home(keys, nb)
        assert h.min() >= 0 and h.max() < nb
    counts = np.bincount(_home(keys, 1000), minlength=1000)      # 200 a bucket expected
    assert counts.min() > 130 and counts.max() < 280
