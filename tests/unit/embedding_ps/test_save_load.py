"""save/load round-trips every piece of shard state, and training then continues identically;
checksums catch damaged files; a snapshot written later equals a blocking save at snapshot time."""

import dataclasses
import hashlib
import json
import os
import threading

import numpy as np
import pytest
import torch

from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import FORMAT_VERSION, CorruptShardError, ShardState, verify_shard
from embedding_ps.shard.snapshot import (SavedShard, saved_file_checksums, saved_files, saved_num_shards,
                                         saved_shard_dirs, shard_dir)

TABLES = (
    TableConfig(name="rw", dim=4, optimizer="rowwise_adagrad", min_count=2, max_rows=60, ttl_steps=2),
    TableConfig(name="adam", dim=3, optimizer="adam", dtype="fp16", admit_probability=0.7, max_rows=50),
    TableConfig(name="ftrl", dim=2, kind="hashed", num_embeddings=40, optimizer="ftrl", ftrl_l1=0.001),
    TableConfig(name="ada", dim=5, optimizer="adagrad", initial_accumulator=0.5, unadmitted="zeros", min_count=3),
)
CONFIG = PSConfig(num_shards=2, tables=TABLES)


def drive(state: ShardState, steps: range, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in steps:
        for t, table in enumerate(TABLES):
            ids = torch.randint(0, 400, (80,), generator=g)
            state.push(t, ids, torch.randn(80, table.dim, generator=g), step)
        if step % 3 == 2:
            state.sweep(step)


def full_view(state: ShardState) -> list:
    view = []
    for t, table in enumerate(state.tables):
        pend = table.pending.state()
        order = np.argsort(pend["keys"])
        view.append(
            (
                state.dump_table(t),
                state.eviction_log(t),
                {k: v[order].tolist() for k, v in pend.items()},
                table.free[: table.nfree].tolist(),
                table.hwm,
                # byte counts include the map's bucket array, which a load sizes afresh
                {k: v for k, v in table.stats().items() if k not in ("map_buckets", "bytes", "bytes_reserved")},
            )
        )
    return view


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def test_round_trip_then_identical_training(tmp_path) -> None:
    never_saved = ShardState(CONFIG, 1)
    drive(never_saved, range(0, 8), seed=1)
    assert never_saved.stats()["rw/pending"] > 0 and never_saved.stats()["rw/evicted_ttl"] > 0
    assert never_saved.stats()["adam/evicted_lfu"] > 0 and never_saved.stats()["rw/free_slots"] > 0
    never_saved.save(str(tmp_path / "ckpt"))
    restored = ShardState(CONFIG, 1)
    restored.push(0, torch.tensor([5]), torch.ones(1, 4), step=0)  # state that load must replace
    restored.load(str(tmp_path / "ckpt"))
    assert_same(full_view(restored), full_view(never_saved))
    drive(never_saved, range(8, 14), seed=2)
    drive(restored, range(8, 14), seed=2)
    assert_same(full_view(restored), full_view(never_saved))


def test_save_is_plain_arrays_and_json_and_overwrites(tmp_path) -> None:
    state = ShardState(CONFIG, 0)
    drive(state, range(3), seed=3)
    path = str(tmp_path / "s0")
    state.save(path)
    drive(state, range(3, 5), seed=4)
    state.save(path)  # over an existing save: renamed into place, no leftovers
    assert sorted(os.listdir(tmp_path)) == ["s0"]
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["shard_index"] == 0 and manifest["num_shards"] == 2 and len(manifest["tables"]) == 4
    for i in range(4):
        for name in manifest["tables"][i]["arrays"]:
            np.load(os.path.join(path, f"table{i}", f"{name}.npy"), allow_pickle=False)
    fresh = ShardState(CONFIG, 0)
    fresh.load(path)
    assert_same(full_view(fresh), full_view(state))


def test_load_rejects_other_layouts(tmp_path) -> None:
    state = ShardState(CONFIG, 0)
    state.save(str(tmp_path / "s"))
    other = dataclasses.replace(CONFIG, tables=(dataclasses.replace(TABLES[0], dim=8), *TABLES[1:]))
    with pytest.raises(ValueError, match=r"table 0 saved with dim=4, config has dim=8"):
        ShardState(other, 0).load(str(tmp_path / "s"))
    with pytest.raises(ValueError, match="saved shard_index=0 but this shard has shard_index=1"):
        ShardState(CONFIG, 1).load(str(tmp_path / "s"))
    with pytest.raises(FileNotFoundError, match="shard 0: no saved shard at"):
        ShardState(CONFIG, 0).load(str(tmp_path / "missing"))


# ---------------------------------------------------------------------------------------------
# checksums


def saved(tmp_path, name: str = "s", shard: int = 0, steps: int = 4) -> tuple[ShardState, str]:
    state = ShardState(CONFIG, shard)
    drive(state, range(steps), seed=5)
    path = str(tmp_path / name)
    state.save(path)
    return state, path


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path) -> None:
    _, path = saved(tmp_path)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["format_version"] == FORMAT_VERSION == 2
    on_disk = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
    assert sorted(manifest["files"]) == [f for f in on_disk if f != "manifest.json"]
    for rel, entry in manifest["files"].items():
        data = open(os.path.join(path, rel), "rb").read()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    verify_shard(path)


@pytest.mark.parametrize("uri", [False, True])
def test_saved_files_are_what_the_shards_manifests_list(tmp_path, uri: bool) -> None:
    """What a checkpoint's manifest records of the shards (snapshot.py reads their manifests, a URI too)."""
    root = tmp_path / "ps"
    for shard in range(2):
        state = ShardState(dataclasses.replace(CONFIG, num_shards=2), shard)
        drive(state, range(3), seed=shard)
        state.save(shard_dir(str(root), shard))
    where = f"file://{root}" if uri else str(root)
    files = saved_files(where, 2)
    on_disk = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    assert sorted(files) == on_disk
    for rel, entry in files.items():
        data = open(root / rel, "rb").read()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert saved_num_shards(shard_dir(where, 1)) == 2
    with pytest.raises(FileNotFoundError):
        saved_num_shards(shard_dir(where, 2))
    with pytest.raises(FileNotFoundError):
        saved_files(where, 3)


def _flip_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 5)


DAMAGE = {
    "flipped byte": (_flip_byte, r"table0/weights\.npy: sha256 mismatch"),
    "truncated": (_truncate, r"table0/weights\.npy: truncated, (\d+) bytes, manifest says \d+"),
    "missing": (os.remove, r"table0/weights\.npy: missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_file_is_named_by_verify_load_and_reshard(tmp_path, damage: str) -> None:
    _, path = saved(tmp_path)
    fn, pattern = DAMAGE[damage]
    fn(os.path.join(path, "table0", "weights.npy"))
    with pytest.raises(CorruptShardError, match=pattern) as info:
        verify_shard(path)
    assert str(tmp_path / "s" / "table0" / "weights.npy") in str(info.value)
    other, _ = saved(tmp_path, "other")
    before = full_view(other)
    with pytest.raises(CorruptShardError, match=pattern):
        other.load(path)
    assert_same(full_view(other), before)          # nothing was replaced: every file is checked first
    with pytest.raises(CorruptShardError, match=pattern):
        ShardState(dataclasses.replace(CONFIG, num_shards=1), 0).load_resharded([path])
    for mmap in (False, True):                     # export's memory-mapped reads check it too
        with pytest.raises(CorruptShardError, match=pattern):
            SavedShard(path).array(0, "weights", mmap=mmap)


def test_missing_or_broken_manifest_is_named(tmp_path) -> None:
    _, path = saved(tmp_path)
    manifest = os.path.join(path, "manifest.json")
    text = open(manifest).read()
    open(manifest, "w").write(text[: len(text) // 2])
    for call in (lambda: verify_shard(path), lambda: ShardState(CONFIG, 0).load(path)):
        with pytest.raises(CorruptShardError, match=f"{path}/manifest.json: not valid JSON"):
            call()
    os.remove(manifest)
    with pytest.raises(CorruptShardError, match=f"{path}/manifest.json: missing"):
        verify_shard(path)
    with pytest.raises(CorruptShardError, match=f"{path}/manifest.json: missing"):
        ShardState(CONFIG, 0).load_resharded([path])
    entry = json.loads(text)
    del entry["files"]["table2/meta.npy"]
    open(manifest, "w").write(json.dumps(entry))
    with pytest.raises(CorruptShardError, match=r"table2/meta\.npy is not listed under 'files'"):
        ShardState(CONFIG, 0).load(path)


def test_format_1_saves_still_load(tmp_path) -> None:
    state, path = saved(tmp_path)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    manifest["format_version"] = 1
    del manifest["files"]
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    restored = ShardState(CONFIG, 0)
    restored.load(path)
    assert_same(full_view(restored), full_view(state))
    verify_shard(path)                              # no checksums to check: only that files exist
    os.remove(os.path.join(path, "table1", "meta.npy"))
    with pytest.raises(CorruptShardError, match=r"table1/meta\.npy: missing"):
        verify_shard(path)


# ---------------------------------------------------------------------------------------------
# snapshot + write


def files_of(path: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(path) for f in fs}


def test_snapshot_write_equals_blocking_save_and_is_a_consistent_cut(tmp_path) -> None:
    """Pushes and sweeps run while another thread writes the snapshot (copy-on-write): the files are
    the blocking save's bytes, and the live state has every later update."""
    state, blocking = saved(tmp_path, "blocking", shard=1, steps=8)
    replica = ShardState(CONFIG, 1)
    replica.load(blocking)
    view_at_snapshot = full_view(state)
    snap = state.snapshot()
    assert snap.snapshot_s > 0 and snap.nbytes > 0
    for table, t in zip(state.tables, snap.tables):   # small arrays are copies; rows stream from the live state
        assert "weights" not in t.arrays and set(t.rows.specs) == set(table.slot_tensors())
        assert all(not np.shares_memory(table.free, a) for a in t.arrays.values())
    writer = threading.Thread(target=snap.write, args=(str(tmp_path / "background"),))
    writer.start()
    try:
        drive(state, range(8, 12), seed=9)            # pushes after the snapshot, while it is written
    finally:
        writer.join(60)
    assert not writer.is_alive()
    drive(replica, range(8, 12), seed=9)
    assert_same(full_view(state), full_view(replica))
    assert files_of(str(tmp_path / "background")) == files_of(blocking)    # bit for bit
    restored = ShardState(CONFIG, 1)
    restored.load(str(tmp_path / "background"))
    assert_same(full_view(restored), view_at_snapshot)


def test_failed_write_removes_its_tmp_dir_and_keeps_the_older_save(tmp_path) -> None:
    state, path = saved(tmp_path)
    before = files_of(path)
    snap = state.snapshot()
    snap.tables[1].arrays["zz_bad"] = np.array([object()])   # written after table 0's files
    with pytest.raises(ValueError, match=r"zz_bad\.npy: array of dtype object holds Python objects"):
        snap.write(path)
    assert sorted(os.listdir(tmp_path)) == ["s"] and files_of(path) == before
    drive(state, range(4, 6), seed=8)                 # the failed save ended: updates need no room
    state.snapshot().write(str(tmp_path / "again"))   # and the next one may start


def test_saved_shard_reads_what_was_saved_mapped_or_not(tmp_path) -> None:
    state, path = saved(tmp_path)
    shard = SavedShard(path)
    assert (shard.shard_index, shard.num_shards, shard.num_tables) == (0, 2, len(TABLES))
    shard.check(TABLES, shard_index=0, num_shards=2)
    for t in range(len(TABLES)):
        read, mapped = shard.table_arrays(t), shard.table_arrays(t, mmap=True)
        assert read.keys() == mapped.keys() and all(np.array_equal(read[n], mapped[n]) for n in read)
        assert isinstance(mapped["weights"], np.memmap) and not isinstance(read["weights"], np.memmap)
        keys, rows, extra = shard.dump_table(t)
        live_keys, live_rows, live_extra = state.dump_table(t)
        order = torch.argsort(keys)
        assert torch.equal(keys[order], live_keys) and torch.equal(rows[order], live_rows)
        for name, value in extra.items():
            assert torch.equal(value[order], live_extra[name]), name
    with pytest.raises(CorruptShardError, match="nope.npy: not in the saved shard's manifest"):
        shard.array(0, "nope")


def test_saved_shard_dirs_lists_and_checks_the_shards_of_a_save(tmp_path) -> None:
    root = tmp_path / "ps"
    with pytest.raises(FileNotFoundError, match="no saved shards"):
        saved_shard_dirs(root)
    for i in range(2):
        state = ShardState(CONFIG, i)
        drive(state, range(2), seed=i)
        state.save(shard_dir(root, i))
    os.makedirs(root / "shard0.tmp-123")          # a killed save's leftovers are not shards
    os.makedirs(root / "shards")
    assert saved_shard_dirs(root) == [str(root / "shard0"), str(root / "shard1")]
    sums = saved_file_checksums(root)
    assert sums["shard1/table0/weights.npy"] == SavedShard(root / "shard1").manifest["files"]["table0/weights.npy"]
    assert {k.split("/")[0] for k in sums} == {"shard0", "shard1"}
    os.rename(root / "shard1", tmp_path / "away")
    with pytest.raises(FileNotFoundError, match=r"saved with 2 shards but .*shard1 missing"):
        saved_shard_dirs(root)
