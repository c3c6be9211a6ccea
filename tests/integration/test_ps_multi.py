"""PSClient.pull_many_async / push_many_async against live shards equal the one-table calls:
2 shards, with and without client dedup, and the fallback for requests over ps.max_frame_bytes."""

import dataclasses

import pytest
import torch

from embedding_ps.client.client import PSClient
from embedding_ps.wire.config import PSConfig, TableConfig

pytestmark = pytest.mark.integration

D = 8
CFG = PSConfig(num_shards=2, mode="async", timeout_s=20.0, retries=0,
               tables=tuple(TableConfig(name=f"t{i}", dim=D, optimizer="rowwise_adagrad", lr=0.1) for i in range(3)))


# 1 shard, max_frame_bytes 1300: one table's 40 rows (1280 bytes) fit, the 65 of a three-table PULL do not
@pytest.mark.parametrize("dedup,shards,max_frame", [(False, 2, 1 << 30), (True, 2, 1 << 30), (False, 1, 1300)])
def test_many_equals_single_table_calls(shard_processes, dedup, shards, max_frame):
    cfg = dataclasses.replace(CFG, num_shards=shards, max_frame_bytes=max_frame)
    a, b = shard_processes(cfg, "a"), shard_processes(cfg, "b")
    g = torch.Generator().manual_seed(0)
    tables = [2, 0, 1]
    with PSClient(cfg, a.addresses, dedup=dedup) as single, PSClient(cfg, b.addresses, dedup=dedup) as many:
        for _ in range(3):
            if dedup:
                ids = [torch.randint(0, 50, (n,), generator=g) for n in (40, 0, 25)]
            else:                             # the sparse arch's case: unique ids
                ids = [torch.randperm(50, generator=g)[:n] for n in (40, 0, 25)]
            want = torch.cat([single.pull(t, x) for t, x in zip(tables, ids)])
            got = many.pull_many_async(tables, ids).result(timeout=30)
            assert torch.equal(got, want)
            grads = torch.randn(got.shape, generator=g)
            start = 0
            for t, x in zip(tables, ids):
                single.push(t, x, grads[start:start + x.numel()])
                start += x.numel()
            many.push_many_async(tables, ids, grads).result(timeout=30)
        for t in range(3):
            for every in torch.arange(50).split(25):
                assert torch.equal(single.pull(t, every), many.pull(t, every))
