"""Exact resume with shuffle on, the prefetch thread's errors and shutdown."""

import gc
import json
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

from data.loader import ParquetLoader
from data.parquet import DataError


@pytest.fixture
def files(uneven_files):
    return uneven_files


def cfg(h, **kw):
    return h.make_cfg(**{"shuffle": True, "shuffle_buffer_rows": 24, "batch_size": 10, **kw})


def batch_key(b):
    """Everything in a batch, as plain lists (equal keys = equal batches)."""
    return (b.extras["row_id"].tolist(), b.dense.tolist(), b.labels.tolist(), b.sparse.values.tolist(),
            b.sparse.lengths.tolist(), b.weights.tolist())


def full_read(h, path, epoch=0, **kw):
    with ParquetLoader(cfg(h, **kw), [path]) as loader:
        loader.set_epoch(epoch)
        return [batch_key(b) for b in loader]


def read_then_resume(h, path, k, epoch=0, prefetch_before=0, prefetch_after=0, **kw):
    """k batches from one loader, its state through JSON, the rest from a new loader."""
    with ParquetLoader(cfg(h, prefetch_batches=prefetch_before, **kw), [path]) as loader:
        loader.set_epoch(epoch)
        it = iter(loader)
        head = [batch_key(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))
    with ParquetLoader(cfg(h, prefetch_batches=prefetch_after, **kw), [path]) as fresh:
        fresh.load_state_dict(state)
        fresh.set_epoch(epoch)                     # the trainer's loop calls this; the position stays
        tail = [batch_key(b) for b in fresh]
    return head, tail, state


@pytest.mark.parametrize("prefetch_before, prefetch_after", [(0, 0), (3, 0), (0, 2), (2, 2)])
def test_resume_equals_uninterrupted_read(h, files, prefetch_before, prefetch_after):
    want = full_read(h, files)
    assert len(want) == 16                                 # 152 rows / 10
    for k in (0, 1, 2, 5, 7, 15, 16):                      # start, mid-window, mid-file, last, end
        head, tail, state = read_then_resume(h, files, k, prefetch_before=prefetch_before,
                                             prefetch_after=prefetch_after)
        assert head + tail == want, k
        assert state["batches"] == k
        assert all(isinstance(v, (int, str, list)) for v in state.values())


def test_resume_in_a_later_epoch_and_across_batch_sizes(h, files):
    want = full_read(h, files, epoch=3)
    head, tail, _ = read_then_resume(h, files, 6, epoch=3)
    assert head + tail == want
    assert want != full_read(h, files, epoch=0)
    # the position is in rows, so a different batch size continues at the same row
    rows = [i for b in want for i in b[0]]
    head, tail, _ = read_then_resume(h, files, 4, epoch=3)
    with ParquetLoader(cfg(h), [files]) as loader:
        loader.set_epoch(3)
        it = iter(loader)
        for _ in range(4):
            next(it)
        state = loader.state_dict()
    with ParquetLoader(cfg(h, batch_size=7), [files]) as other:
        other.load_state_dict(state)
        other.set_epoch(3)
        assert rows[40:] == h.row_ids(other)


def test_restored_finished_epoch_yields_nothing_then_next_epoch_is_fresh(h, files):
    with ParquetLoader(cfg(h), [files]) as loader:
        list(loader)
        state = loader.state_dict()
    with ParquetLoader(cfg(h), [files]) as fresh:
        fresh.load_state_dict(state)
        fresh.set_epoch(0)
        assert list(fresh) == []
        fresh.set_epoch(1)
        assert [batch_key(b) for b in fresh] == full_read(h, files, epoch=1)


def test_set_epoch_to_another_epoch_drops_a_restored_position(h, files):
    _, _, state = read_then_resume(h, files, 5)
    with ParquetLoader(cfg(h), [files]) as fresh:
        fresh.load_state_dict(state)
        fresh.set_epoch(1)
        assert [batch_key(b) for b in fresh] == full_read(h, files, epoch=1)


def test_resume_with_skipped_rows_keeps_the_count(h, tmp_path):
    t = h.make_table(60, seed=1)
    d0 = t.column("d0").to_numpy(zero_copy_only=False).copy()       # nulls come out as NaN
    null = t.column("d0").is_null().to_numpy(zero_copy_only=False).copy()
    bad = [3, 17, 18, 41, 59]
    d0[bad], null[bad] = np.nan, False                               # 5 bad rows: NaN, not null
    t = t.set_column(t.schema.get_field_index("d0"), "d0", pa.array(d0, mask=null))
    path = h.write(tmp_path / "bad.parquet", t, row_group_rows=16)
    kw = dict(on_bad_rows="skip", batch_size=6)
    with ParquetLoader(cfg(h, **kw), [path]) as loader:
        want = [batch_key(b) for b in loader]
        assert loader.num_bad_rows == 5
    assert sum(len(b[0]) for b in want) == 55
    for k in (0, 1, 3, 4, 9):
        with ParquetLoader(cfg(h, **kw), [path]) as loader:
            it = iter(loader)
            head = [batch_key(next(it)) for _ in range(k)]
            state = loader.state_dict()
        with ParquetLoader(cfg(h, **kw), [path]) as fresh:
            fresh.load_state_dict(state)
            tail = [batch_key(b) for b in fresh]
            assert fresh.num_bad_rows == 5, k                  # counted once, not again after the restore
        assert head + tail == want, k


def test_load_state_dict_rejects_a_state_for_other_data_or_layout(h, files, tmp_path):
    with ParquetLoader(cfg(h), [files]) as loader:
        state = loader.state_dict()
    with ParquetLoader(cfg(h), [files], rank=0, world_size=2) as other:
        with pytest.raises(ValueError, match="world_size = 1, this loader has 2"):
            other.load_state_dict(state)
    with ParquetLoader(cfg(h, seed=5), [files]) as other:
        with pytest.raises(ValueError, match="seed = 0, this loader has 5"):
            other.load_state_dict(state)
    h.write(tmp_path / "other" / "x.parquet", h.make_table(9))
    with ParquetLoader(cfg(h), [str(tmp_path / "other")]) as other:
        with pytest.raises(ValueError, match="dataset"):
            other.load_state_dict(state)
        with pytest.raises(ValueError, match="version 2 \\(or 1\\), got 7"):
            other.load_state_dict({**state, "version": 7})
        with pytest.raises(ValueError, match="'offset' must be an int >= 0, got -1"):
            other.load_state_dict({**state, "dataset": other.state_dict()["dataset"], "offset": -1})


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith(("parquet-prefetch", "parquet-read"))]


def wait_no_threads(timeout=10.0):
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return prefetch_threads()


def test_early_break_and_close_stop_the_threads(h, files):
    assert wait_no_threads() == []
    with ParquetLoader(cfg(h, prefetch_batches=2, batch_size=4), [files]) as loader:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        gc.collect()
        assert wait_no_threads() == []                 # the dropped iterator stopped its thread
        it = iter(loader)
        next(it)
        assert prefetch_threads()
    assert wait_no_threads() == []                     # close() (context exit) stopped it
    del it


def test_thread_exception_reaches_the_consumer(h, files, tmp_path):
    with ParquetLoader(cfg(h, prefetch_batches=2, batch_size=4), [files]) as loader:
        # the footers were read at construction; now the data pages go bad under the reader
        for f in loader.files:
            size = len(open(f, "rb").read())
            with open(f, "r+b") as fh:
                fh.seek(4)
                fh.write(b"\xff" * (size // 2))
        with pytest.raises(DataError, match=r"part-\d\.parquet: row group \d+: unreadable"):
            for _ in loader:
                pass
    assert wait_no_threads() == []


def test_state_before_iteration_and_after_each_batch(h, files):
    with ParquetLoader(cfg(h), [files]) as loader:
        s0 = loader.state_dict()
        assert (s0["epoch"], s0["window"], s0["offset"], s0["batches"]) == (0, 0, 0, 0)
        positions = []
        for _ in loader:
            s = loader.state_dict()
            positions.append((s["window"], s["offset"]))
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        assert loader.state_dict()["batches"] == 16
        torch.manual_seed(0)
