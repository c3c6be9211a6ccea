"""Sharding across ranks and the deterministic shuffle, counted with a row-id passthrough column."""

import collections

import pytest

from data.loader import ParquetLoader
from data.sharding import Piece, Windows, list_units, rank_stream


def write_files(h, tmp_path, sizes, row_group_rows):
    row0 = 0
    for i, n in enumerate(sizes):
        h.write(tmp_path / "ds" / f"part-{i}.parquet", h.make_table(n, seed=i, row0=row0), row_group_rows)
        row0 += n
    return str(tmp_path / "ds"), row0


def rank_ids(h, path, world_size, epoch=0, **cfg):
    out = []
    for rank in range(world_size):
        with ParquetLoader(h.make_cfg(**cfg), [path], rank=rank, world_size=world_size) as loader:
            loader.set_epoch(epoch)
            out.append(h.row_ids(loader))
            assert loader.num_rows == len(out[-1])
    return out


@pytest.mark.parametrize("num_files", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_once_across_ranks(h, tmp_path, num_files, shuffle):
    """World sizes 1..5: the ranks' rows are disjoint, cover every row, and differ in count by <= 1."""
    sizes = [7, 3, 12, 1][:num_files]                    # 1 to 4 files, some with fewer rows than ranks
    path, total = write_files(h, tmp_path, sizes, row_group_rows=4)
    for world_size in range(1, 6):
        for epoch in (0, 1):
            ids = rank_ids(h, path, world_size, epoch, shuffle=shuffle, shuffle_buffer_rows=5, batch_size=3)
            counts = collections.Counter(i for r in ids for i in r)
            assert sorted(counts) == list(range(total)), (world_size, epoch)
            assert set(counts.values()) == {1}, (world_size, epoch)
            assert max(map(len, ids)) - min(map(len, ids)) <= 1


def test_single_row_group_split_into_row_ranges(h, tmp_path):
    """One file, one row group, 4 ranks: each rank reads its own quarter of the rows."""
    path, total = write_files(h, tmp_path, [10], row_group_rows=1000)
    ids = rank_ids(h, path, 4)
    assert ids == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]


def test_no_shuffle_keeps_file_order_per_rank(h, tmp_path):
    path, total = write_files(h, tmp_path, [6, 6], row_group_rows=3)
    assert rank_ids(h, path, 2) == [list(range(6)), list(range(6, 12))]


def test_more_ranks_than_rows_gives_empty_ranks(h, tmp_path):
    path, total = write_files(h, tmp_path, [3], row_group_rows=1)
    ids = rank_ids(h, path, 5)
    assert sorted(i for r in ids for i in r) == [0, 1, 2]
    assert sum(1 for r in ids if not r) == 2


def test_shuffle_is_deterministic_per_seed_epoch_rank(h, tmp_path):
    path, _ = write_files(h, tmp_path, [40, 25, 33], row_group_rows=8)
    kw = dict(shuffle=True, shuffle_buffer_rows=16, batch_size=5)
    a = rank_ids(h, path, 2, epoch=0, **kw)
    assert a == rank_ids(h, path, 2, epoch=0, **kw)                       # same seed, epoch, rank
    assert a != rank_ids(h, path, 2, epoch=1, **kw)                       # another epoch
    assert a != rank_ids(h, path, 2, epoch=0, seed=7, **kw)               # another seed
    assert a[0] != sorted(a[0])                                            # rows are shuffled
    # with prefetch, the same order
    assert a == rank_ids(h, path, 2, epoch=0, prefetch_batches=3, **kw)


def test_set_epoch_reshuffles_the_same_loader(h, tmp_path):
    path, _ = write_files(h, tmp_path, [30], row_group_rows=6)
    with ParquetLoader(h.make_cfg(shuffle=True, shuffle_buffer_rows=12), [path]) as loader:
        e0 = h.row_ids(loader)
        assert h.row_ids(loader) == e0                 # iterating again without set_epoch: same epoch
        loader.set_epoch(1)
        e1 = h.row_ids(loader)
        loader.set_epoch(0)
        assert h.row_ids(loader) == e0
    assert sorted(e0) == sorted(e1) and e0 != e1


def test_shuffle_buffer_bounds_how_far_rows_move(h, tmp_path):
    """Rows shuffle only inside windows of at most shuffle_buffer_rows whole row groups."""
    path, _ = write_files(h, tmp_path, [64], row_group_rows=8)
    (ids,) = rank_ids(h, path, 1, shuffle=True, shuffle_buffer_rows=16, batch_size=4)
    for start in range(0, 64, 16):              # each window: two whole row groups, rows mixed
        window = ids[start:start + 16]
        groups = {i // 8 for i in window}
        assert len(groups) == 2
        assert sorted(window) == sorted(i for g in groups for i in range(8 * g, 8 * g + 8))
    assert ids != sorted(ids)


def test_rank_stream_and_windows_directly():
    units = list_units([(5, 0, 3), (4,)])                       # an empty row group is skipped
    assert units == [Piece(0, 0, 0, 5), Piece(0, 2, 0, 3), Piece(1, 0, 0, 4)]
    r0 = rank_stream(units, epoch=0, seed=0, shuffle=False, rank=0, world_size=2)
    r1 = rank_stream(units, epoch=0, seed=0, shuffle=False, rank=1, world_size=2)
    assert r0 == [Piece(0, 0, 0, 5), Piece(0, 2, 0, 1)]
    assert r1 == [Piece(0, 2, 1, 3), Piece(1, 0, 0, 4)]
    w = Windows([Piece(0, 0, 0, 10), Piece(0, 1, 0, 3), Piece(0, 2, 0, 2)], window_rows=4)
    # 10 rows are cut into 3 + 3 + 4; then 3 rows, and 2 rows (3 + 2 > 4: separate windows)
    assert w.windows == [[Piece(0, 0, 0, 3)], [Piece(0, 0, 3, 6)], [Piece(0, 0, 6, 10)],
                         [Piece(0, 1, 0, 3)], [Piece(0, 2, 0, 2)]]
    assert all(sum(p.num_rows for p in win) <= 4 for win in w.windows)
    assert Windows([Piece(0, 0, 0, 2), Piece(0, 1, 0, 2), Piece(0, 2, 0, 1)], 4).windows == [
        [Piece(0, 0, 0, 2), Piece(0, 1, 0, 2)], [Piece(0, 2, 0, 1)]]
