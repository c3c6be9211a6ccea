"""save/load round-trips every piece of shard state, and training then continues identically."""

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from embedding_ps.config import PSConfig, TableConfig
from embedding_ps.shard import ShardState

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
