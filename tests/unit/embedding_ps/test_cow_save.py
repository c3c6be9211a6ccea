"""The copy-on-write background save (`embedding_ps.shard.cow`): updates while the writer runs never reach
the files (they equal a blocking save at the snapshot, byte for byte) but do reach the live state;
a full side buffer makes updates wait for the writer; the accounted extra memory stays within
`ps.checkpoint_extra_memory` of the rows' bytes."""

import dataclasses
import os
import threading

import pytest
import torch

from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.cow import SIDE_FLOOR
from embedding_ps.shard.state import ShardState

JOIN_S = 60.0
TABLES = (
    # admission (min_count), TTL and LFU eviction: slots go back on the free stack and are reused
    TableConfig(name="rw", dim=16, optimizer="rowwise_adagrad", min_count=2, ttl_steps=3, max_rows=900),
    TableConfig(name="adam", dim=8, optimizer="adam", dtype="fp16", admit_probability=0.7),
    TableConfig(name="ftrl", dim=4, kind="hashed", num_embeddings=300, optimizer="ftrl"),
)


def files_of(path: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(path) for f in fs}


def fill(state: ShardState, seed: int, steps: range, ids: int = 1500, n: int = 400) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        for t, table in enumerate(state.config.tables):
            batch = torch.randint(0, ids, (n,), generator=g)
            state.push(t, batch, torch.randn(n, table.dim, generator=g), step)
        if step % 4 == 3:
            state.sweep(step)


def dumps_equal(a: ShardState, b: ShardState) -> None:
    for t in range(len(a.tables)):
        (ka, ra, sa), (kb, rb, sb) = a.dump_table(t), b.dump_table(t)
        assert torch.equal(ka, kb) and torch.equal(ra, rb) and sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), t
        assert a.tables[t].pending.state()["keys"].tolist() == b.tables[t].pending.state()["keys"].tolist()


def save_while_pushing(tmp_path, fraction: float, seed: int = 0, tables: tuple[TableConfig, ...] = TABLES,
                       before: int = 10) -> tuple[dict, ShardState, ShardState]:
    """Blocking save, then a background save: `before` ids per table pushed before the writer starts
    (there must be room for them), then pushes and sweeps from this thread while a thread writes.
    Returns (the save's stats, the live state, a replica that got the same updates without a save)."""
    cfg = PSConfig(tables=tables, checkpoint_extra_memory=fraction)
    state, replica = ShardState(cfg, 0), ShardState(cfg, 0)
    fill(state, seed, range(0, 6))
    fill(replica, seed, range(0, 6))
    state.save(str(tmp_path / "blocking"))
    snap = state.snapshot()
    fill(state, seed + 1, range(6, 7), n=before)  # before the writer starts: pre-images for sure
    writer = threading.Thread(target=snap.write, args=(str(tmp_path / "background"),))
    writer.start()
    try:
        fill(state, seed + 2, range(7, 15))       # before and after the writer reaches each row
    finally:
        writer.join(JOIN_S)
    assert not writer.is_alive()
    fill(replica, seed + 1, range(6, 7), n=before)
    fill(replica, seed + 2, range(7, 15))
    assert files_of(str(tmp_path / "background")) == files_of(str(tmp_path / "blocking"))
    dumps_equal(state, replica)                   # the live state has every update
    return snap.stats(), state, replica


def test_updates_during_the_write_reach_the_state_not_the_files(tmp_path):
    stats, state, _ = save_while_pushing(tmp_path, fraction=1.0)
    assert stats["preserved_rows"] > 0            # pre-images were taken and written
    restored = ShardState(state.config, 0)
    restored.load(str(tmp_path / "background"))   # and the save loads
    assert len(restored.tables[0]) > 0


def test_a_full_side_buffer_makes_updates_wait_for_the_writer(tmp_path):
    """d64 rows and a 6% bound: room for a few pre-images per table (pushes bring 400 ids), so
    updates of rows the writer has not passed wait for it (back-pressure; 3 ids per table pushed
    before the writer starts make pre-images certain); the files and the live
    state are still exact, and the accounted memory stays within the bound."""
    wide = tuple(dataclasses.replace(t, dim=64) for t in TABLES)
    stats, _, _ = save_while_pushing(tmp_path, fraction=0.06, seed=3, tables=wide, before=3)
    assert stats["push_waits"] > 0 and stats["push_wait_s"] > 0 and stats["preserved_rows"] > 0
    assert stats["extra_bytes_peak"] <= stats["extra_bytes_bound"]


def test_rows_too_small_for_the_bound_get_a_floor_side_buffer(tmp_path, caplog):
    """d4 rows: the id map copy alone is more than the bound. The save says so, keeps a side buffer
    of SIDE_FLOOR of the rows' bytes, and is still exact."""
    cfg = PSConfig(tables=(TableConfig(name="t", dim=4),), checkpoint_extra_memory=0.1)
    state = ShardState(cfg, 0)
    state.push(0, torch.arange(5000), torch.ones(5000, 4), step=0)
    state.save(str(tmp_path / "blocking"))
    with caplog.at_level("WARNING", logger="embedding_ps.shard.cow"):
        snap = state.snapshot()
    assert "more than the bound" in caplog.text
    stream = state._cow.streams[0]
    assert stream.capacity == int(SIDE_FLOOR * 5000 * stream.row_bytes) // stream.entry_bytes > 0
    state.push(0, torch.arange(0, 5000, 100), torch.ones(50, 4), step=1)     # room: no writer needed yet
    snap.write(str(tmp_path / "background"))
    assert snap.stats()["preserved_rows"] == 50 and snap.stats()["push_waits"] == 0
    assert files_of(str(tmp_path / "background")) == files_of(str(tmp_path / "blocking"))


def test_accounted_extra_memory_stays_within_the_bound(tmp_path):
    """d64 rows (the map copy is ~5% of them): pushes of every row at once want a pre-image of each,
    far more than a 10% bound holds; the peak stays within it, checked after every push."""
    cfg = PSConfig(tables=(TableConfig(name="t", dim=64, optimizer="rowwise_adagrad"),), checkpoint_extra_memory=0.1)
    state = ShardState(cfg, 0)
    rows = 40_000
    state.push(0, torch.arange(rows), torch.ones(rows, 64), step=0)
    state.save(str(tmp_path / "blocking"))
    snap = state.snapshot()
    cow = state._cow
    bound = cfg.checkpoint_extra_memory * rows * (64 * 4 + 4 + 8)
    assert cow.bound_bytes == int(bound) and cow.extra_bytes <= bound
    # before the writer starts (room for 1,000 pre-images beside the map copy): pre-images for sure,
    # however fast the writer then is
    state.push(0, torch.arange(0, rows, rows // 1000), torch.full((1000, 64), 0.25), step=1)
    seen = [cow.extra_bytes]
    assert 0 < seen[0] <= bound
    writer = threading.Thread(target=snap.write, args=(str(tmp_path / "background"),))
    writer.start()
    try:
        g = torch.Generator().manual_seed(1)
        for step in range(2, 30):
            state.push(0, torch.randperm(rows, generator=g)[:8000], torch.full((8000, 64), 0.5), step)
            seen.append(cow.extra_bytes)
    finally:
        writer.join(JOIN_S)
    stats = snap.stats()
    assert max(seen) <= bound and stats["extra_bytes_peak"] <= bound
    assert stats["preserved_rows"] > 0 and stats["extra_bytes_peak"] > cow.fixed_bytes
    assert files_of(str(tmp_path / "background")) == files_of(str(tmp_path / "blocking"))


def test_one_background_save_at_a_time_and_no_load_meanwhile(tmp_path):
    cfg = PSConfig(tables=(TableConfig(name="t", dim=4), TableConfig(name="never_pushed", dim=4)))
    state = ShardState(cfg, 0)
    state.push(0, torch.arange(10), torch.ones(10, 4), step=0)
    state.save(str(tmp_path / "a"))
    snap = state.snapshot()
    with pytest.raises(RuntimeError, match="shard 0: a background save is still being written"):
        state.snapshot()
    with pytest.raises(RuntimeError, match="cannot load .* while a background save is being written"):
        state.load(str(tmp_path / "a"))
    snap.close()                                  # given up: the shard forgets it
    state.push(0, torch.arange(10), torch.ones(10, 4), step=1)
    state.snapshot().write(str(tmp_path / "b"))


def test_config_rejects_a_bound_outside_0_1():
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"ps.checkpoint_extra_memory must be in \(0, 1\].*got {bad}"):
            PSConfig(checkpoint_extra_memory=bad)


def test_new_ids_taking_freed_slots_keep_the_old_rows_in_the_save(tmp_path):
    """TTL evicts half the rows before the snapshot; new ids admitted after it reuse those slots (the
    free stack), whose old bytes the save must keep. All updates come before the write starts (room
    for them in the side buffer), so the writer meets every pre-image."""
    cfg = PSConfig(tables=(TableConfig(name="t", dim=64, optimizer="rowwise_adagrad", ttl_steps=2),),
                   checkpoint_extra_memory=1.0)
    state = ShardState(cfg, 0)
    state.push(0, torch.arange(1000), torch.ones(1000, 64), step=0)
    state.push(0, torch.arange(500), torch.ones(500, 64), step=5)
    assert state.sweep(5)["evicted_ttl"] == 500 and state.tables[0].nfree == 500
    state.save(str(tmp_path / "blocking"))
    snap = state.snapshot()
    state.push(0, torch.arange(5000, 5300), torch.full((300, 64), 2.0), step=6)    # into freed slots
    state.push(0, torch.arange(100), torch.full((100, 64), 3.0), step=6)
    assert state.tables[0].hwm == 1000 and state.tables[0].nfree == 200
    snap.write(str(tmp_path / "background"))
    assert snap.stats()["preserved_rows"] == 400 and snap.stats()["push_waits"] == 0
    assert files_of(str(tmp_path / "background")) == files_of(str(tmp_path / "blocking"))


def test_capacity_hint_and_no_row_counters(tmp_path):
    """The scale layout (a reserved capacity, no count/last-seen per row) under a copy-on-write save:
    the same bytes as a blocking save, every update in the live state."""
    tables = (TableConfig(name="big", dim=16, optimizer="rowwise_adagrad", capacity=4000, row_counters=False),
              TableConfig(name="adam", dim=8, optimizer="adam", capacity=2000, row_counters=False))
    stats, state, _ = save_while_pushing(tmp_path, fraction=1.0, tables=tables)
    assert stats["preserved_rows"] > 0
    assert state.tables[0].meta is None and state.tables[0].cap >= 4000
    assert not os.path.exists(tmp_path / "background" / "big" / "meta.npy")
