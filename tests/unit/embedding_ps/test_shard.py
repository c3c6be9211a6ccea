"""ShardState: sharded == unsharded, init determinism, re-sharding, hashed tables, input errors."""

import dataclasses

import pytest
import torch

from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.init import init_rows
from embedding_ps.local import LocalStore
from embedding_ps.shard.optim import state_specs
from tests.init_reference import init_row_reference
from tests.optim_reference import ReferenceTable
from embedding_ps.wire.sharding import hashed_row
from embedding_ps.shard.state import ShardState

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"]


class Sharded(LocalStore):
    """S in-process shards behind the client's routing rule (`LocalStore`; the network helper tests
    the real client), plus every shard's dump merged."""

    def __init__(self, config: PSConfig) -> None:
        super().__init__(config, [ShardState(config, i) for i in range(config.num_shards)])
        self.shards = self.states

    def dump(self, table: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        parts = [s.dump_table(table) for s in self.shards]
        keys = torch.cat([p[0] for p in parts])
        order = keys.argsort()
        rows = torch.cat([p[1] for p in parts])[order]
        state = {k: torch.cat([p[2][k] for p in parts])[order] for k in parts[0][2]}
        return keys[order], rows, state


def pushes(num: int, dim: int, seed: int = 0, n: int = 64, id_range: int = 200):
    g = torch.Generator().manual_seed(seed)
    for step in range(num):
        ids = torch.randint(-id_range, id_range, (n,), generator=g)
        ids[:3] = torch.tensor([0, 2**63 - 1, -(2**63)])
        yield step, ids, torch.randn(n, dim, generator=g)


def assert_dumps_equal(a, b, atol: float = 1e-6) -> None:
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], atol=atol, rtol=0)
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        torch.testing.assert_close(a[2][k], b[2][k], atol=atol, rtol=0)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_three_shards_equal_one(optimizer: str) -> None:
    tables = (
        TableConfig(name="dyn", dim=6, optimizer=optimizer, init="normal", seed=3),
        TableConfig(name="hash", dim=4, kind="hashed", num_embeddings=37, optimizer=optimizer, seed=4),
    )
    one = Sharded(PSConfig(num_shards=1, tables=tables))
    three = Sharded(PSConfig(num_shards=3, tables=tables))
    for t, table in enumerate(tables):
        for step, ids, grads in pushes(6, table.dim, seed=t):
            one.push(t, ids, grads, step)
            three.push(t, ids, grads, step)
        assert_dumps_equal(one.dump(t), three.dump(t))
        probe = torch.arange(-250, 250)
        torch.testing.assert_close(one.pull(t, probe), three.pull(t, probe), atol=1e-6, rtol=0)
        assert all(len(s.tables[t]) > 0 for s in three.shards)  # every shard got rows


def test_hashed_table_sums_ids_that_share_a_row() -> None:
    cfg = TableConfig(name="h", dim=3, kind="hashed", num_embeddings=5, optimizer="adagrad", seed=9)
    state = ShardState(PSConfig(tables=(cfg,)), 0)
    ref = ReferenceTable(cfg, lambda k: init_rows(torch.tensor([k]), 3, 9, cfg.init, cfg.init_scale)[0])
    for step, ids, grads in pushes(4, 3):
        state.push(0, ids, grads, step)
        ref.push(hashed_row(ids, 5), grads)  # the reference works on row indices
    keys, rows, _ = state.dump_table(0)
    assert keys.tolist() == sorted(ref.rows) and len(keys) <= 5
    torch.testing.assert_close(rows, torch.stack([ref.rows[k][0] for k in keys.tolist()]), atol=1e-6, rtol=1e-5)
    ids = torch.arange(100)
    torch.testing.assert_close(state.pull(0, ids), ref.pull(hashed_row(ids, 5)), atol=1e-6, rtol=1e-5)


def test_init_is_a_function_of_seed_and_id_only(tmp_path) -> None:
    cfg = TableConfig(name="t", dim=7, optimizer="sgd", init="uniform", init_scale=0.5, seed=11)
    ids = torch.tensor([5, -5, 0, 2**63 - 1, -(2**63), 123456789012345, 77, 78])
    expect = torch.tensor([init_row_reference(i, 7, 11, "uniform", 0.5) for i in ids.tolist()])
    one = Sharded(PSConfig(num_shards=1, tables=(cfg,)))
    three = Sharded(PSConfig(num_shards=3, tables=(cfg,)))
    torch.testing.assert_close(one.pull(0, ids), expect, atol=1e-7, rtol=0)  # before any push
    zero = torch.zeros(len(ids), 7)
    one.push(0, ids, zero, step=0)  # inserted, sgd with a zero gradient keeps the init
    three.push(0, ids.flip(0)[:4], zero[:4], step=0)  # other order, other batches
    three.push(0, ids.flip(0)[4:], zero[4:], step=1)
    for pulled in (one.pull(0, ids), three.pull(0, ids)):
        torch.testing.assert_close(pulled, expect, atol=1e-7, rtol=0)
    for i, shard in enumerate(three.shards):
        shard.save(str(tmp_path / f"s{i}"))
    restored = Sharded(PSConfig(num_shards=3, tables=(cfg,)))
    for i, shard in enumerate(restored.shards):
        shard.load(str(tmp_path / f"s{i}"))
    torch.testing.assert_close(restored.pull(0, ids), expect, atol=1e-7, rtol=0)
    other_seed = ShardState(PSConfig(tables=(dataclasses.replace(cfg, seed=12),)), 0)
    assert not torch.allclose(other_seed.pull(0, ids), expect)
    normal = init_rows(torch.arange(20000), 16, 1, "normal", 2.0)
    assert abs(normal.std().item() - 2.0) < 0.05 and abs(normal.mean().item()) < 0.05


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam", "ftrl"])
def test_reshard_three_to_two_via_dumps(optimizer: str) -> None:
    tables = (TableConfig(name="t", dim=4, optimizer=optimizer),)
    three = Sharded(PSConfig(num_shards=3, tables=tables))
    one = Sharded(PSConfig(num_shards=1, tables=tables))
    stream = list(pushes(8, 4, seed=5))
    for step, ids, grads in stream[:5]:
        three.push(0, ids, grads, step)
        one.push(0, ids, grads, step)
    two = Sharded(PSConfig(num_shards=2, tables=tables))
    taken = 0
    for old in three.shards:
        dump = old.dump_table(0)
        for new in two.shards:
            taken += new.load_dump(0, *dump)
    assert taken == len(one.dump(0)[0])
    assert_dumps_equal(two.dump(0), three.dump(0), atol=0.0)
    for step, ids, grads in stream[5:]:  # training continues identically after the re-shard
        two.push(0, ids, grads, step)
        one.push(0, ids, grads, step)
    assert_dumps_equal(two.dump(0), one.dump(0))


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("old_shards,new_shards", [(3, 2), (2, 5)])
def test_reshard_from_saved_directories(tmp_path, optimizer: str, old_shards: int, new_shards: int) -> None:
    """Every row, every optimizer slot, count and last-seen step moves N -> M through checksummed saves."""
    tables = (TableConfig(name="a", dim=3, optimizer=optimizer),
              TableConfig(name="b", dim=2, kind="hashed", num_embeddings=30, optimizer=optimizer))
    old = Sharded(PSConfig(num_shards=old_shards, tables=tables))
    for t, table in enumerate(tables):
        for step, ids, grads in pushes(4, table.dim, seed=t):
            old.push(t, ids, grads, step)
    dirs = []
    for i, shard in enumerate(old.shards):
        dirs.append(str(tmp_path / f"old{i}"))
        shard.save(dirs[-1])
    new = Sharded(PSConfig(num_shards=new_shards, tables=tables))
    taken = sum(shard.load_resharded(dirs) for shard in new.shards)
    assert taken == sum(len(t) for s in old.shards for t in s.tables)
    for t in range(len(tables)):
        a, b = new.dump(t), old.dump(t)
        assert set(a[2]) == {s.name for s in state_specs(tables[t])} | {"count", "last_seen", "last_update"}
        assert_dumps_equal(a, b, atol=0.0)
        assert all(len(s.tables[t]) > 0 for s in new.shards)


def test_input_errors_name_shard_table_and_values() -> None:
    state = ShardState(PSConfig(num_shards=2, tables=(TableConfig(name="t", dim=4),)), 1)
    with pytest.raises(ValueError, match=r"shard 1 table 0 \('t'\): grads must be \[2, 4\], got \[2, 3\]"):
        state.push(0, torch.tensor([1, 2]), torch.zeros(2, 3), step=0)
    with pytest.raises(ValueError, match="ids must be int64"):
        state.pull(0, torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(IndexError, match=r"table 3 out of range \[0, 1\)"):
        state.pull(3, torch.tensor([1]))
    with pytest.raises(ValueError, match="step must be in"):
        state.push(0, torch.tensor([1]), torch.zeros(1, 4), step=2**31)
    with pytest.raises(ValueError, match=r"shard_index must be in \[0, 2\), got 2"):
        ShardState(state.config, 2)
    state.push(0, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), step=0)  # empty push is fine
    assert state.pull(0, torch.zeros(0, dtype=torch.int64)).shape == (0, 4)
