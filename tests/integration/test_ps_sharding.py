"""3 shard processes behave as one in-process ShardState: same initial rows, same rows after the
same pushes for every optimizer (and a hashed table), rows that survive a restart, and a save /
load through the client that round-trips."""

import dataclasses

import pytest
import torch

from embedding_ps.client.client import PSClient
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import ShardState

pytestmark = pytest.mark.integration

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
CFG = PSConfig(num_shards=3, mode="async", timeout_s=30.0, retries=1, tables=tuple(
    [TableConfig(name=opt, dim=8, optimizer=opt, lr=0.05, seed=10 + i, ftrl_l1=0.01 if opt == "ftrl" else 0.0)
     for i, opt in enumerate(OPTIMIZERS)]
    + [TableConfig(name="hashed", dim=4, kind="hashed", num_embeddings=50, optimizer="adagrad", init="normal")]
))
TABLE_NAMES = [t.name for t in CFG.tables]
# ids with duplicates, negatives and extremes, spread over every shard
EXTREMES = torch.tensor([0, -1, 2**63 - 1, -(2**63), 2**40 + 7], dtype=torch.int64)


def _batch(gen: torch.Generator, n: int = 300) -> torch.Tensor:
    return torch.cat([torch.randint(-100, 400, (n,), generator=gen), EXTREMES])


def test_shards_started_by_hand_exit_when_the_job_cannot_use_them(shard_processes):
    """#28 item 5: trainers (`python -m recsys.train`) that fail on their own error, such as shards
    started for another trainer count, stop the shards started by hand for them instead of leaving
    them up for nothing; a lost peer (worth torchrun's restart) does not."""
    from recsys.config import ConfigError, JobConfig
    from recsys.train import stop_shards_after
    from recsys.training.worker import check_shards

    cfg = dataclasses.replace(CFG, num_shards=1, timeout_s=10.0)
    shards = shard_processes(cfg)
    job = JobConfig(ps=dataclasses.replace(cfg, addresses=tuple(shards.addresses)))
    with PSClient(cfg, shards.addresses) as client:
        with pytest.raises(ConfigError, match=r"start the shards with --set ps.num_workers=8") as e:
            check_shards(client, 8)
    assert not stop_shards_after(ConnectionError("peer lost"), job)
    assert shards.procs[0].poll() is None
    assert stop_shards_after(e.value, job)
    assert shards.procs[0].wait(timeout=30) == 0


def test_sharded_equals_unsharded_restart_and_save_load(shard_processes, tmp_path):
    shards = shard_processes(CFG)
    ref = ShardState(dataclasses.replace(CFG, num_shards=1), 0)
    gen = torch.Generator().manual_seed(1)
    every = torch.unique(torch.cat([torch.arange(-100, 400), EXTREMES]))
    with PSClient(CFG, shards.addresses) as client, PSClient(CFG, shards.addresses, dedup=False) as raw:
        # 1 vs 3 shards: the same initial rows
        for t, name in enumerate(TABLE_NAMES):
            assert torch.equal(client.pull(t, every), ref.pull(t, every, 0)), name
        assert [h["shard"] for h in client.health()] == [0, 1, 2]
        # #28 item 5: a trainer count the shards were not started for is one line at connect time
        from recsys.config import ConfigError
        from recsys.training.worker import check_shards
        check_shards(client, CFG.num_workers)
        with pytest.raises(ConfigError, match=rf"ps shard 0 at {shards.addresses[0]} was started with ps.num_workers = "
                                              rf"{CFG.num_workers}, but 8 trainers run: start the shards with --set "
                                              rf"ps.num_workers=8"):
            check_shards(client, 8)
        # the same pushes through 3 shards and through one in-process state
        for step in range(3):
            for t, table in enumerate(CFG.tables):
                ids = _batch(gen)
                grads = torch.randn(ids.numel(), table.dim, generator=gen)
                (client if step % 2 == 0 else raw).push(t, ids, grads, step=step)   # with / without dedup
                ref.push(t, ids, grads, step)
        trained = {}
        for t, name in enumerate(TABLE_NAMES):
            trained[t] = client.pull(t, every)
            torch.testing.assert_close(trained[t], ref.pull(t, every, 3), rtol=0, atol=1e-6, msg=name)
            shuffled = torch.cat([every, every])[torch.randperm(2 * every.numel(), generator=gen)]
            assert torch.equal(raw.pull(t, shuffled), client.pull(t, shuffled)), name
        rows_per_shard = [s["state"]["rows"] for s in client.stats()]
        assert all(r > 0 for r in rows_per_shard) and sum(rows_per_shard) == ref.stats()["rows"]

        # init determinism across a restart without save: untouched ids give the same rows
        fresh = torch.arange(10**6, 10**6 + 200)
        before = client.pull(0, fresh)
        shards.restart(0)
        assert torch.equal(client.pull(0, fresh), before)
        assert torch.equal(before, ref.pull(0, fresh, 3))

        # save / load through the client into fresh shard processes
        for t in range(len(CFG.tables)):
            trained[t] = client.pull(t, every)            # shard 0 lost its trained rows on restart
        saved = client.save(str(tmp_path / "ckpt"))
        assert [s["directory"] for s in saved] == [str(tmp_path / "ckpt" / f"shard{i}") for i in range(3)]
        client.shutdown()
        assert shards.wait_exit() == [0, 0, 0]
        shards.start(range(3), port_of_old_address=True)
        assert not torch.equal(client.pull(1, every), trained[1])    # fresh: init rows again
        client.load(str(tmp_path / "ckpt"))
        for t, name in enumerate(TABLE_NAMES):
            assert torch.equal(client.pull(t, every), trained[t]), name
