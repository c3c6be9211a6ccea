"""Sync mode over 2 shard processes: 2 workers' pushes of one step are applied once, as one push of
their concatenation, and a pull for the next step waits for the slower worker's barrier."""

import dataclasses
import time

import pytest
import torch

from embedding_ps.client.client import PSClient, PSRequestError
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import ShardState

pytestmark = pytest.mark.integration

CFG = PSConfig(num_shards=2, mode="sync", num_workers=2, timeout_s=30.0, retries=0, tables=(
    TableConfig(name="adagrad", dim=8, optimizer="adagrad", lr=0.1, seed=3),
    TableConfig(name="adam", dim=4, optimizer="adam", lr=0.05, seed=4),
))


def test_two_workers_one_step_equals_one_push_of_the_concatenation(shard_processes):
    shards = shard_processes(CFG)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 60, (200,), generator=gen) for _ in range(2)]            # overlapping ids
    grads = {(w, t): torch.randn(200, CFG.tables[t].dim, generator=gen) for w in range(2) for t in range(2)}
    every = torch.arange(60)
    ref = ShardState(dataclasses.replace(CFG, num_shards=1), 0)
    with PSClient(CFG, shards.addresses, worker_id=0) as w0, PSClient(CFG, shards.addresses, worker_id=1) as w1:
        init = [w0.pull(t, every) for t in range(2)]
        for t in range(2):
            assert torch.equal(init[t], ref.pull(t, every, 0))
        for t in range(2):
            w0.push(t, ids[0], grads[0, t])
        w0.barrier(0)
        early = [w0.pull_async(t, every) for t in range(2)]           # step 1: must wait for worker 1
        time.sleep(0.5)
        assert not any(f.done() for f in early), "a step-1 pull returned before step 0 was applied"
        stats = w1.stats()
        assert sum(s["requests"]["push"] for s in stats) == 4 and {s["last_applied_step"] for s in stats} == {-1}
        for t in range(2):
            w1.push(t, ids[1], grads[1, t])
        w1.barrier(0)
        rows = [f.result(timeout=30) for f in early]
        for t in range(2):
            ref.push(t, torch.cat(ids), torch.cat([grads[0, t], grads[1, t]]), 0)
            torch.testing.assert_close(rows[t], ref.pull(t, every, 1), rtol=0, atol=1e-6)
            assert not torch.allclose(rows[t], init[t])                 # the step did change the rows
        assert [s["last_applied_step"] for s in w0.stats()] == [0, 0]
        with pytest.raises(PSRequestError, match="STALE_STEP"):       # step 0 is closed
            w1.push(0, ids[1], grads[1, 0], step=0)
        # step 1: only worker 0 pushes; worker 1's barrier alone (no pushes) completes the step
        w0.push(0, ids[0], grads[0, 0])
        w0.barrier(1)
        w1.barrier(1)
        ref.push(0, ids[0], grads[0, 0], 1)
        assert (w0.step, w1.step) == (2, 2)
        torch.testing.assert_close(w1.pull(0, every), ref.pull(0, every, 2), rtol=0, atol=1e-6)
    for proc in shards.procs:          # SIGTERM (what the launcher sends) stops a shard cleanly
        proc.terminate()
    assert shards.wait_exit() == [0, 0]

