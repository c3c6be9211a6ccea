"""An id flood: 10M distinct new ids pushed to one shard whose table has `max_rows`; the shard keeps
at most max_rows rows and its memory stays bounded.

The bound: the shard's peak RSS (VmHWM) grows by less than GROWTH_BOUND_MIB over its RSS before the
flood. Without max_rows the same flood would keep 10M rows of d=8 (320 MB of weights alone, plus
the optimizer state and the id map), so the bound fails without the eviction. Most of the growth
measured (+73 MiB) is the eviction log (ps.tables.eviction_log_max = 4M records of 16 bytes).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from embedding_ps.client.client import PSClient
from embedding_ps.wire.config import PSConfig, TableConfig

pytestmark = pytest.mark.integration

D = 8
MAX_ROWS = 50_000
IDS = 10_000_000
CHUNK = 250_000
GROWTH_BOUND_MIB = 160
CFG = PSConfig(num_shards=1, mode="async", timeout_s=60.0, retries=0,
               tables=(TableConfig(name="flood", dim=D, optimizer="sgd", lr=0.1, max_rows=MAX_ROWS),))


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def test_ten_million_new_ids_keep_the_shard_bounded(shard_process) -> None:
    shard = shard_process(CFG)
    grads = torch.full((CHUNK, D), 0.01)
    with PSClient(CFG, [shard.address]) as client:
        client.push(0, torch.arange(CHUNK), grads)        # warm: the first push's buffers count as baseline
        base = memory_kib(shard.proc.pid)["VmRSS"]
        t0 = time.monotonic()
        for start in range(CHUNK, IDS + CHUNK, CHUNK):        # ids CHUNK .. IDS + CHUNK - 1: 10M new ones
            client.push(0, torch.arange(start, start + CHUNK), grads)
        seconds = time.monotonic() - t0
        stats = client.stats()[0]
        newest = client.pull(0, torch.arange(IDS, IDS + 10))
    mem = memory_kib(shard.proc.pid)
    growth_mib = (mem["VmHWM"] - base) / 1024
    print(f"id flood: {IDS} ids in {seconds:.1f} s; RSS {base / 1024:.0f} MiB before, peak {mem['VmHWM'] / 1024:.0f} "
          f"MiB (+{growth_mib:.0f} MiB), now {mem['VmRSS'] / 1024:.0f} MiB; stats {stats}")
    assert growth_mib < GROWTH_BOUND_MIB, f"peak RSS grew {growth_mib:.0f} MiB (bound {GROWTH_BOUND_MIB})"
    state = stats["state"]
    assert 0 < state["flood/rows"] <= MAX_ROWS, state
    assert state["flood/admitted"] == IDS + CHUNK and state["flood/evicted_lfu"] == IDS + CHUNK - state["flood/rows"]
    assert torch.isfinite(newest).all() and not torch.equal(newest[0], newest[1])
    assert shard.proc.poll() is None
