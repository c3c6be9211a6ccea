"""Global weight decay over 2 shard processes in sync mode (2 workers): pulls and a SAVE equal the
eager table, every row decayed every step, also through steps that push nothing to a shard."""

import dataclasses

import pytest
import torch

from embedding_ps.client.client import PSClient
from embedding_ps.wire.config import PSConfig, TableConfig
from tests.optim_reference import reference_update
from embedding_ps.shard.snapshot import SavedShard, saved_shard_dirs

pytestmark = pytest.mark.integration

LR, WD, V = 0.05, 0.4, 40
TABLE = TableConfig(name="g", dim=8, optimizer="rowwise_adagrad", lr=LR, weight_decay=WD, weight_decay_mode="global",
                    init="normal", init_scale=0.5)
CFG = PSConfig(num_shards=2, mode="sync", num_workers=2, timeout_s=30.0, retries=0, tables=(TABLE,))


def test_sync_pulls_and_save_equal_the_eager_table(shard_processes, tmp_path):
    shards = shard_processes(CFG)
    gen = torch.Generator().manual_seed(0)
    every = torch.arange(V)
    plain = dataclasses.replace(TABLE, weight_decay=0.0)
    with PSClient(CFG, shards.addresses, worker_id=0) as w0, PSClient(CFG, shards.addresses, worker_id=1) as w1:
        w = w0.pull(0, every).clone()                       # [V, D] the eager table (rows exist once pushed)
        exists = torch.zeros(V, dtype=torch.bool)
        sum_sq = [torch.tensor(0.0) for _ in range(V)]
        for step in range(10):
            torch.testing.assert_close(w1.pull(0, every), w, rtol=0, atol=1e-5)
            pushes = []
            for client in (w0, w1):
                if step not in (4, 5, 6):                   # steps 4-6: barriers only
                    ids = torch.randint(0, V // 2 if step % 3 else V, (12,), generator=gen)
                    grads = torch.randn(12, TABLE.dim, generator=gen)
                    client.push(0, ids, grads)
                    pushes.append((ids, grads))
            w0.barrier(step)
            w1.barrier(step)
            summed: dict[int, torch.Tensor] = {}
            for ids, grads in pushes:
                for k, g in zip(ids.tolist(), grads):
                    summed[k] = summed[k] + g if k in summed else g.clone()
            exists[list(summed)] = True
            w[exists] *= 1.0 - LR * WD
            for k, g in summed.items():
                reference_update(plain, w[k], {"sum_sq": sum_sq[k]}, g)
        torch.testing.assert_close(w0.pull(0, every), w, rtol=0, atol=1e-5)
        w0.save(str(tmp_path / "ps"))                       # step 10: rows decayed through step 9
    for directory in saved_shard_dirs(tmp_path / "ps"):
        keys, rows, extra = SavedShard(directory).dump_table(0)
        torch.testing.assert_close(rows, w[keys], rtol=0, atol=1e-5)
        assert (extra["decay_step"] == 9).all()
