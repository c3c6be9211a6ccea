"""A shard's memory layout options: the `capacity` hint (reserved up front, no regrow on the way) and
`row_counters = false` (no per-row count / last-seen), each against the default layout's results."""

import dataclasses

import numpy as np
import pytest
import torch

from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import ShardState
from embedding_ps.wire.sharding import shard_of
from embedding_ps.shard.snapshot import SavedShard, shard_dir
from embedding_ps.shard.table import RESERVED_MAP_LOAD, reserve_rows

BASE = TableConfig(name="t", dim=4, optimizer="rowwise_adagrad", lr=0.1)


def drive(state: ShardState, steps: int, seed: int = 0, vocab: int = 3000) -> None:
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randint(0, vocab, (300,), generator=g)
        state.push(0, ids, torch.randn(300, 4, generator=g), step)


def same_rows(a: ShardState, b: ShardState) -> None:
    ka, ra, sa = a.dump_table(0)
    kb, rb, sb = b.dump_table(0)
    assert torch.equal(ka, kb) and torch.equal(ra, rb)
    for name in a.tables[0].state:                      # every optimizer state tensor
        assert torch.equal(sa[name], sb[name])
    probe = torch.arange(-5, 3100)
    assert torch.equal(a.pull(0, probe), b.pull(0, probe))


def test_capacity_hint_reserves_the_share_and_never_regrows() -> None:
    cfg = PSConfig(num_shards=2, tables=(dataclasses.replace(BASE, capacity=3000),))
    hinted, plain = ShardState(cfg, 0), ShardState(dataclasses.replace(cfg, tables=(BASE,)), 0)
    t = hinted.tables[0]
    share = reserve_rows(cfg.tables[0], 2)
    assert share == 1500 + 15 + 1024 and t.cap == share
    buckets, weights, sum_sq = t.map.num_buckets, t.weights, t.state["sum_sq"]
    assert buckets == -(-int(np.ceil(share / RESERVED_MAP_LOAD)) // 64) * 64
    drive(hinted, 12)
    drive(plain, 12)
    assert 1300 < len(t) <= share                       # about half of the 3000 ids live here
    assert t.weights is weights and t.state["sum_sq"] is sum_sq and t.map.num_buckets == buckets
    assert t.meta is not None and t.meta.shape[0] == share
    same_rows(hinted, plain)                            # the hint changes where rows live, not what they are


def test_capacity_hint_survives_save_and_load_then_grows_past_it(tmp_path) -> None:
    cfg = PSConfig(num_shards=1, tables=(dataclasses.replace(BASE, capacity=1000),))
    a = ShardState(cfg, 0)
    drive(a, 3, vocab=1500)
    a.save(str(tmp_path / "s"))
    b = ShardState(cfg, 0)
    b.load(str(tmp_path / "s"))
    assert b.tables[0].cap == reserve_rows(cfg.tables[0], 1) and b.tables[0].map.num_buckets == a.tables[0].map.num_buckets
    same_rows(a, b)
    drive(a, 30, seed=1, vocab=4000)                    # 4000 ids > 2034 reserved: grows like an unhinted table
    drive(b, 30, seed=1, vocab=4000)
    assert len(a.tables[0]) > reserve_rows(cfg.tables[0], 1) and a.tables[0].cap > reserve_rows(cfg.tables[0], 1)
    same_rows(a, b)


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_without_row_counters_results_are_identical(tmp_path, optimizer: str) -> None:
    """row_counters = false: same rows, state, pulls, save/load and re-sharding as with them; no meta."""
    on = dataclasses.replace(BASE, optimizer=optimizer, min_count=2)
    off = dataclasses.replace(on, row_counters=False)
    a, b = ShardState(PSConfig(tables=(on,)), 0), ShardState(PSConfig(tables=(off,)), 0)
    drive(a, 10)
    drive(b, 10)
    tb = b.tables[0]
    assert tb.meta is None and tb.row_bytes() == a.tables[0].row_bytes() - 8
    same_rows(a, b)
    _, _, sa = a.dump_table(0)
    _, _, sb = b.dump_table(0)
    assert "count" in sa and "count" not in sb and "last_seen" not in sb
    b.save(str(tmp_path / "s"))
    assert "meta" not in SavedShard(str(tmp_path / "s")).array_names(0)
    c = ShardState(PSConfig(tables=(off,)), 0)
    c.load(str(tmp_path / "s"))
    same_rows(b, c)
    # re-sharding 1 -> 2 from a save without counters, into tables with and without them
    b.save(shard_dir(tmp_path / "ps", 0))
    for cfg in (on, off):
        two = [ShardState(PSConfig(num_shards=2, tables=(cfg,)), i) for i in range(2)]
        taken = sum(s.load_resharded([shard_dir(tmp_path / "ps", 0)]) for s in two)
        assert taken == len(tb)
        ids = torch.arange(3000)
        owner = shard_of(ids, 2)
        for i, s in enumerate(two):                     # each id from the shard that owns it
            assert torch.equal(s.pull(0, ids[owner == i]), b.pull(0, ids[owner == i]))
            _, _, st = s.dump_table(0)
            assert ("count" in st) == cfg.row_counters


def test_row_counters_off_is_refused_where_something_reads_them() -> None:
    with pytest.raises(ValueError, match=r"ps.tables\[t\].row_counters = false, but ttl_steps = 5"):
        dataclasses.replace(BASE, row_counters=False, ttl_steps=5)
    with pytest.raises(ValueError, match=r"max_rows = 10 read them"):
        dataclasses.replace(BASE, row_counters=False, max_rows=10)
    with pytest.raises(ValueError, match=r"ps.tables\[t\].capacity must be >= 0, got -1"):
        dataclasses.replace(BASE, capacity=-1)
