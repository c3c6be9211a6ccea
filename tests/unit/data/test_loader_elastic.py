"""Elastic resume: states of W_old ranks -> W_new ranks, every example of the epoch exactly once."""

import collections
import json
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from data.elastic import Segment, after, share
from data.loader import ParquetLoader

TOTAL = 152


@pytest.fixture
def files(uneven_files):
    return uneven_files


def cfg(h, **kw):
    """Windows of 24 rows, batches of 5: most states fall inside a window."""
    return h.make_cfg(**{"shuffle": True, "shuffle_buffer_rows": 24, "batch_size": 5, **kw})


def ids(batch):
    return batch.extras["row_id"].tolist()


def run(h, path, world, k, states=None, epoch=0, **kw):
    """Every rank of `world` reads k[rank] batches (None: to the end of the epoch), after
    resume_from(states) when given: (row ids read per rank, JSON round-tripped states)."""
    k = k if isinstance(k, list) else [k] * world
    got, out = [], []
    for rank in range(world):
        with ParquetLoader(cfg(h, **kw), [path], rank=rank, world_size=world) as loader:
            if states is not None:
                loader.resume_from(states)
            loader.set_epoch(epoch)
            left = loader.remaining_batches
            it = iter(loader)
            batches = list(it) if k[rank] is None else [next(it) for _ in range(k[rank])]
            if k[rank] is None:
                assert len(batches) == left                        # remaining_batches is exact
            got.append([i for b in batches for i in ids(b)])
            out.append(json.loads(json.dumps(loader.state_dict())))
    return got, out


def fresh(h, path, rank, world, epoch=0, **kw):
    with ParquetLoader(cfg(h, **kw), [path], rank=rank, world_size=world) as loader:
        loader.set_epoch(epoch)
        return list(loader)


def run_rank(h, path, rank, world, states):
    with ParquetLoader(cfg(h), [path], rank=rank, world_size=world) as loader:
        loader.resume_from(states)
        return list(loader)


def threads():
    return [t for t in threading.enumerate() if t.name.startswith(("parquet-prefetch", "parquet-read"))]


def wait_no_threads(timeout=10.0):
    deadline = time.monotonic() + timeout
    while threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()


def assert_once(*reads):
    counts = collections.Counter(i for rows in reads for r in rows for i in r)
    assert sorted(counts) == list(range(TOTAL))
    assert set(counts.values()) == {1}, [i for i, c in counts.items() if c > 1]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("old, new, k", [(2, 1, [3, 7]), (1, 2, 5), (2, 3, [4, 0]), (3, 2, [1, 6, 2]),
                                         (2, 3, [None, 2]), (3, 1, [None, 0, None]), (2, 3, [None, 15])])
def test_every_row_once_when_the_world_size_changes(h, files, shuffle, old, new, k):
    """Old ranks stop at different places (inside windows, at the start, at the end, one row before
    it); the new ranks read the rest: together every row once, shares within one row of each other."""
    before, states = run(h, files, old, k, shuffle=shuffle)
    after_, _ = run(h, files, new, None, states, shuffle=shuffle)
    assert_once(before, after_)
    assert max(map(len, after_)) - min(map(len, after_)) <= 1


def test_remainder_order_is_old_rank_0_first(h, files):
    """Without shuffle the remainder is old rank 0's unread rows then old rank 1's, cut in two."""
    _, states = run(h, files, 2, [2, 3], shuffle=False)
    rest = list(range(10, 76)) + list(range(91, 152))             # rank 0 read 10 rows, rank 1 15
    assert run(h, files, 1, None, states, shuffle=False)[0] == [rest]
    assert run(h, files, 3, None, states, shuffle=False)[0] == [rest[:42], rest[42:84], rest[84:]]


@pytest.mark.parametrize("shuffle", [False, True])
def test_chain_of_world_sizes_interrupted_inside_remainders(h, files, shuffle):
    """2 -> 1 -> 2 -> 3 -> 2, each stopped part way through its plan (states through JSON)."""
    reads = []
    states = None
    for world, k in ((2, [3, 5]), (1, 4), (2, [2, 3]), (3, [1, 0, 2])):
        got, states = run(h, files, world, k, states, shuffle=shuffle)
        reads.append(got)
        assert all(s["elastic"] == int(len(reads) > 1) for s in states)
    last, _ = run(h, files, 2, None, states, shuffle=shuffle)
    assert_once(*reads, last)


def test_all_old_ranks_finished_starts_the_next_epoch(h, files):
    _, states = run(h, files, 2, None)
    with ParquetLoader(cfg(h), [files], rank=0, world_size=3) as loader:
        loader.resume_from(states)
        loader.set_epoch(0)
        assert loader.remaining_batches == 0 and list(loader) == []
        loader.set_epoch(1)
        assert loader.remaining_batches == loader.num_batches
        assert [ids(b) for b in loader] == [ids(b) for b in fresh(h, files, 0, 3, epoch=1)]


def test_same_world_size_is_an_exact_resume(h, files):
    """resume_from with W_old = W_new continues each rank's stream batch for batch."""
    _, states = run(h, files, 2, [3, 6])
    for rank, k in ((0, 3), (1, 6)):
        with ParquetLoader(cfg(h), [files], rank=rank, world_size=2) as loader:
            loader.resume_from(states)
            loader.set_epoch(0)
            assert loader.state_dict() == states[rank]
            assert [ids(b) for b in loader] == [ids(b) for b in fresh(h, files, rank, 2)[k:]]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_elastic_state_resumes_exactly_in_the_same_world(h, files, prefetch):
    """A state inside an elastic remainder, restored by load_state_dict (same world), continues
    batch for batch as the uninterrupted remainder; so does resume_from with the same states."""
    _, states = run(h, files, 2, [3, 7])
    whole, _ = run(h, files, 3, None, states, prefetch_batches=prefetch)
    for k in (0, 2, 5):
        head, mid = run(h, files, 3, k, states)
        for rank in range(3):
            with ParquetLoader(cfg(h, prefetch_batches=prefetch), [files], rank=rank, world_size=3) as loader:
                loader.load_state_dict(mid[rank])
                loader.set_epoch(0)
                assert loader.remaining_batches == -(-(len(whole[rank]) - 5 * k) // 5)
                assert head[rank] + [i for b in loader for i in ids(b)] == whole[rank]
        tail, _ = run(h, files, 3, None, mid)
        assert [a + b for a, b in zip(head, tail)] == whole


def test_epoch_after_the_remainder_is_an_ordinary_epoch(h, files):
    _, states = run(h, files, 3, [2, 4, 1])
    for rank in range(2):
        with ParquetLoader(cfg(h), [files], rank=rank, world_size=2) as loader:
            loader.resume_from(states)
            for epoch in (0, 1):
                loader.set_epoch(epoch)
                got = [ids(b) for b in loader]
            assert got == [ids(b) for b in fresh(h, files, rank, 2, epoch=1)]
            assert loader.state_dict()["elastic"] == 0


def test_remaining_batches_with_drop_last_and_prefetch(h, files):
    _, states = run(h, files, 2, [3, 7])
    for rank in range(3):
        batches = []
        for prefetch in (0, 3):
            with ParquetLoader(cfg(h, drop_last=True, prefetch_batches=prefetch), [files],
                               rank=rank, world_size=3) as loader:
                loader.resume_from(states)
                left = loader.remaining_batches
                batches.append([ids(b) for b in loader])
                assert len(batches[-1]) == left and all(len(b) == 5 for b in batches[-1])
                assert loader.num_batches == (TOTAL * (rank + 1) // 3 - TOTAL * rank // 3) // 5
        assert batches[0] == batches[1]


def test_early_break_inside_a_remainder_stops_the_threads(h, files):
    _, states = run(h, files, 2, [3, 7])
    with ParquetLoader(cfg(h, prefetch_batches=2), [files], rank=1, world_size=3) as loader:
        loader.resume_from(states)
        it = iter(loader)
        head = [ids(next(it)) for _ in range(2)]
        state = loader.state_dict()
        assert threads()
    assert wait_no_threads() == []
    del it
    with ParquetLoader(cfg(h), [files], rank=1, world_size=3) as loader:
        loader.load_state_dict(state)
        assert head + [ids(b) for b in loader] == [ids(b) for b in run_rank(h, files, 1, 3, states)]


def test_remaining_batches_on_the_ordinary_path(h, files):
    with ParquetLoader(cfg(h), [files], rank=1, world_size=2) as loader:
        assert loader.remaining_batches == loader.num_batches == 16          # 76 rows / 5
        it = iter(loader)
        for k in range(1, 17):
            next(it)
            assert loader.remaining_batches == 16 - k
        assert list(it) == [] and loader.remaining_batches == 0


def test_skipped_bad_rows_are_neither_lost_nor_counted_twice(h, tmp_path):
    t = h.make_table(60, seed=1)
    d0 = t.column("d0").to_numpy(zero_copy_only=False).copy()
    null = t.column("d0").is_null().to_numpy(zero_copy_only=False).copy()
    bad = [3, 17, 18, 41, 59]
    d0[bad], null[bad] = np.nan, False                               # NaN is a bad dense value
    t = t.set_column(t.schema.get_field_index("d0"), "d0", pa.array(d0, mask=null))
    path = h.write(tmp_path / "bad.parquet", t, row_group_rows=8)
    kw = dict(on_bad_rows="skip", shuffle_buffer_rows=16, batch_size=4)
    before, states = run(h, path, 2, [2, 3], **kw)
    loaders = [ParquetLoader(cfg(h, **kw), [path], rank=r, world_size=3) for r in range(3)]
    after_ = []
    for loader in loaders:
        loader.resume_from(states)
        after_.append([i for b in loader for i in ids(b)])
    counts = collections.Counter(i for r in before + after_ for i in r)
    assert sorted(counts) == sorted(set(range(60)) - set(bad)) and set(counts.values()) == {1}
    assert sum(loader.num_bad_rows for loader in loaders) == 5


def test_bad_states_are_refused_naming_the_problem(h, files, tmp_path):
    _, states = run(h, files, 2, [1, 2])
    with ParquetLoader(cfg(h), [files], rank=0, world_size=3) as loader:
        with pytest.raises(ValueError, match=r"different epochs \(epoch 0: ranks \[0\]; epoch 1: ranks \[1\]\)"):
            loader.resume_from([states[0], {**states[1], "epoch": 1}])
        with pytest.raises(ValueError, match=r"states\[1\] was saved with dataset = 'x'"):
            loader.resume_from([states[0], {**states[1], "dataset": "x"}])
        with pytest.raises(ValueError, match=r"states\[0\] was saved with seed = 3, this loader has 0"):
            loader.resume_from([{**states[0], "seed": 3}, states[1]])
        with pytest.raises(ValueError, match=r"states\[0\] has rank = 1, world_size = 2; .* in rank order"):
            loader.resume_from(states[::-1])
        with pytest.raises(ValueError, match=r"states\[0\] has rank = 1, world_size = 2; .* all 1 old"):
            loader.resume_from(states[1:])
        with pytest.raises(ValueError, match="list of the loader states"):
            loader.resume_from(states[0])
        with pytest.raises(ValueError, match=r"states\[1\] position \(window 9, offset 0\)"):
            loader.resume_from([states[0], {**states[1], "window": 9, "offset": 0}])
    _, mid = run(h, files, 3, 1, states)
    with ParquetLoader(cfg(h), [files], rank=0, world_size=3) as loader:
        with pytest.raises(ValueError, match=r"'segments'\[0\] must be \[world, rank, lo, hi\].*got \[2, 2, 0, 5\]"):
            loader.load_state_dict({**mid[0], "segments": [[2, 2, 0, 5]]})
        with pytest.raises(ValueError, match=r"'done' must be an int in \[0, 76\].*got 99"):
            loader.load_state_dict({**mid[0], "segments": [[2, 0, 0, 76]], "done": 99})
        with pytest.raises(ValueError, match="'elastic' must be 0 or 1, got 'yes'"):
            loader.load_state_dict({**mid[0], "elastic": "yes"})


def test_version_1_states_still_load(h, files):
    _, states = run(h, files, 2, [3, 4])
    old = [{k: v for k, v in s.items() if k not in ("elastic", "segments", "done")} | {"version": 1}
           for s in states]
    assert run(h, files, 3, None, old)[0] == run(h, files, 3, None, states)[0]


def test_plan_algebra():
    plan = [Segment(2, 0, 10, 20), Segment(2, 1, 0, 5)]
    assert after(plan, 12) == [Segment(2, 1, 2, 5)]
    assert after(plan, 15) == []
    parts = [share(plan, rank=r, world_size=4) for r in range(4)]
    assert parts == [[Segment(2, 0, 10, 13)], [Segment(2, 0, 13, 17)], [Segment(2, 0, 17, 20), Segment(2, 1, 0, 1)],
                     [Segment(2, 1, 1, 5)]]
    assert share([Segment(1, 0, 0, 3), Segment(1, 0, 3, 6)], rank=0, world_size=1) == [Segment(1, 0, 0, 6)]
