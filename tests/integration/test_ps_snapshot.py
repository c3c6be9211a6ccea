"""Background saves through live shards on 127.0.0.1.

1. Two shard processes: a background save while the client keeps pushing; status writing -> done,
   the files verify, and loading them gives exactly the state at the snapshot (later pushes absent).
2. One in-process shard (serve() on a thread) whose writes wait on a gate: it serves pulls while
   writing, parks a second SAVE until the first write ends, and wait_saved reports a failed or
   slow write naming the shard index and address.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from embedding_ps.client.client import PSClient, SaveFailedError, SaveTimeoutError
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.loop import serve
from embedding_ps.wire.sharding import route
from embedding_ps.shard.state import ShardState, verify_shard
from embedding_ps.shard.snapshot import shard_dir
from tests.unit.embedding_ps.test_protocol import StateStubs

pytestmark = pytest.mark.integration

TIMEOUT_S = 60.0
BULK_ROWS = 600_000       # table 1: enough rows (~80 MB per shard) that a write takes a while
CFG = PSConfig(num_shards=2, mode="async", timeout_s=TIMEOUT_S, retries=0, max_staleness=1000, tables=(
    TableConfig(name="small", dim=8, optimizer="rowwise_adagrad", lr=0.1),
    TableConfig(name="bulk", dim=64, optimizer="rowwise_adagrad", lr=0.1),
))


def _replica_push(replicas: list[ShardState], table: int, ids: torch.Tensor, grads: torch.Tensor, step: int) -> None:
    """What the client does: unique sorted ids, each shard gets its own in sorted order."""
    owner = route(ids, CFG.tables[table], CFG.num_shards)
    for s, state in enumerate(replicas):
        mine = owner == s
        state.push(table, ids[mine], grads[mine], step)


def _assert_dumps_equal(a, b) -> None:
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2].keys() == b[2].keys()
    for k in a[2]:
        assert torch.equal(a[2][k], b[2][k]), k


def test_background_save_while_pushing_is_a_consistent_cut(shard_processes, tmp_path):
    shards = shard_processes(CFG)
    replicas = [ShardState(CFG, s) for s in range(CFG.num_shards)]   # table 0 as of the snapshot
    gen = torch.Generator().manual_seed(0)
    ckpt = str(tmp_path / "ckpt")
    with PSClient(CFG, shards.addresses) as client:
        for lo in range(0, BULK_ROWS, 100_000):
            client.push(1, torch.arange(lo, lo + 100_000), torch.ones(100_000, 64), step=0)
        for step in range(3):
            ids = torch.unique(torch.randint(0, 5000, (2000,), generator=gen))
            grads = torch.randn(ids.numel(), 8, generator=gen)
            client.push(0, ids, grads, step=step)
            _replica_push(replicas, 0, ids, grads, step)
        replies = client.save(ckpt, step=3, background=True)
        assert [(r["directory"], r["background"]) for r in replies] == [(shard_dir(ckpt, s), True) for s in (0, 1)]
        assert all(r["snapshot_s"] > 0 for r in replies)
        seen, pushes_while_writing, step = [], 0, 3
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            states = [st["state"] for st in client.save_status()]
            seen.append(states)
            if states == ["done", "done"] or time.monotonic() > deadline:
                break
            ids = torch.unique(torch.randint(0, 5000, (2000,), generator=gen))
            client.push(0, ids, torch.randn(ids.numel(), 8, generator=gen), step=step)   # after the cut
            client.push(1, torch.arange(10**9 + 100 * step, 10**9 + 100 * step + 100), torch.ones(100, 64), step=step)
            pushes_while_writing += "writing" in states
            step += 1
        assert seen[0] == ["writing", "writing"] and seen[-1] == ["done", "done"], seen
        assert pushes_while_writing > 0                       # the shards served pushes during the write
        statuses = client.wait_saved(ckpt, timeout_s=TIMEOUT_S)
        assert all(st["bytes"] > BULK_ROWS // 2 * 256 and st["write_s"] > 0 and st["error"] is None for st in statuses)
        live = client.pull(0, torch.arange(5000))
    for s in range(CFG.num_shards):
        verify_shard(shard_dir(ckpt, s))
        restored = ShardState(CFG, s)
        restored.load(shard_dir(ckpt, s))
        _assert_dumps_equal(restored.dump_table(0), replicas[s].dump_table(0))
        keys = restored.dump_table(1)[0]
        assert keys.numel() > 0 and int(keys.max()) < BULK_ROWS            # none of the later bulk pushes
    at_snapshot = torch.empty(5000, 8)
    owner = route(torch.arange(5000), CFG.tables[0], 2)
    for s in range(2):
        at_snapshot[owner == s] = replicas[s].pull(0, torch.arange(5000)[owner == s])
    assert not torch.equal(live, at_snapshot)                 # the pushes after the cut did land


# ---------------------------------------------------------------------------------------------


class _GatedSnapshot:
    snapshot_s, nbytes, prepare_s = 0.001, 10, 0.0

    def stats(self) -> dict:
        return {}

    def __init__(self, state: "_GatedState") -> None:
        self.state = state

    def write(self, directory: str) -> dict:
        if not self.state.gate.wait(TIMEOUT_S):
            raise TimeoutError("test gate never opened")
        if self.state.fail:
            raise OSError(28, "No space left on device")
        return {"directory": directory, "bytes": 10, "write_s": 0.1}


class _GatedState(StateStubs):
    def __init__(self, config: PSConfig, shard: int) -> None:
        self.dim = config.tables[0].dim
        self.gate = threading.Event()
        self.fail = False

    def pull(self, table, ids, step=0, out=None):
        rows = torch.full((ids.numel(), self.dim), 7.0)
        return rows if out is None else out.copy_(rows)

    def snapshot(self):
        return _GatedSnapshot(self)

    def stats(self):
        return {}


def test_parked_save_resumes_after_the_write_and_wait_saved_names_the_shard(tmp_path):
    cfg = PSConfig(num_shards=1, mode="async", timeout_s=TIMEOUT_S, retries=0,
                   tables=(TableConfig(name="t", dim=4),))
    states: list[_GatedState] = []

    def factory(config, shard):
        states.append(_GatedState(config, shard))
        return states[-1]

    stop, ready = threading.Event(), tmp_path / "ready"
    thread = threading.Thread(target=serve, args=(cfg, 0), kwargs=dict(
        bind="127.0.0.1", ready_file=str(ready), state_factory=factory, stop=stop), daemon=True)
    thread.start()
    pool = ThreadPoolExecutor(1)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert time.monotonic() < deadline and thread.is_alive(), "in-process shard did not start"
            time.sleep(0.01)
        address = ready.read_text().strip()
        state = states[0]
        with PSClient(cfg, [address]) as client:
            client.save("/ckpt/a", background=True)
            assert client.save_status()[0]["state"] == "writing"
            assert torch.equal(client.pull(0, torch.tensor([1, 2])), torch.full((2, 4), 7.0))   # served
            slow = f"ps shard 0 at {address}: save to /ckpt/a/shard0 still writing"
            with pytest.raises(SaveTimeoutError, match=slow):
                client.wait_saved("/ckpt/a", timeout_s=0.3)
            second = pool.submit(client.save, "/ckpt/b", background=True)
            time.sleep(0.5)
            assert not second.done()                      # parked behind the running write
            state.gate.set()
            assert second.result(timeout=TIMEOUT_S)[0]["directory"] == "/ckpt/b/shard0"
            assert client.wait_saved("/ckpt/b", timeout_s=TIMEOUT_S)[0]["state"] == "done"
            with pytest.raises(SaveFailedError, match=f"ps shard 0 at {address}: its last save is '/ckpt/b/shard0'"):
                client.wait_saved("/ckpt/a", timeout_s=TIMEOUT_S)
            state.fail = True
            client.save("/ckpt/c", background=True)
            with pytest.raises(SaveFailedError, match=f"ps shard 0 at {address}: save to /ckpt/c/shard0 failed: "
                                                      "OSError: .*No space left on device"):
                client.wait_saved("/ckpt/c", timeout_s=TIMEOUT_S)
            assert torch.equal(client.pull(0, torch.tensor([3])), torch.full((1, 4), 7.0))    # still serving
    finally:
        for state in states:
            state.gate.set()
        pool.shutdown(wait=False, cancel_futures=True)
        stop.set()
        thread.join(TIMEOUT_S)
    assert not thread.is_alive()
