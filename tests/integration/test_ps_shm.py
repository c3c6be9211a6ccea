"""ps.shared_memory: shard processes on 127.0.0.1 read gradients from and write rows into the
client's /dev/shm segments, with exactly the results of the socket path (async and sync, fp32 and
fp16 wire, several tables and shards, ps.threads > 1); a shard without it refuses; a retried pull
hands back a copy and never reuses its segment."""

import dataclasses
import os

import pytest
import torch
import zmq

from embedding_ps import protocol as P
from embedding_ps import shm
from embedding_ps.client import PSClient, PSRequestError
from embedding_ps.config import PSConfig, TableConfig

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not shm.available(), reason="no /dev/shm")]

D = 32
TABLES = (TableConfig(name="a", dim=D, optimizer="rowwise_adagrad", lr=0.1),
          TableConfig(name="b", dim=D, optimizer="adagrad", dtype="fp16", lr=0.1))
ROWS = 12_000     # 1.5 MB of fp32 rows per table and shard: above shm.MIN_BYTES


def run(shard_processes, config: PSConfig, name: str) -> tuple[list[torch.Tensor], list[dict]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(10 * ROWS, generator=gen)[: 2 * ROWS] * 11 - 5000       # unique, both shards
    seen = []
    shards = shard_processes(config, name)
    with PSClient(config, shards.addresses, dedup=False) as c:
        for step in range(3):
            rows = c.pull_many_async([0, 1], [ids, ids[: ROWS]], step).result(timeout=60)
            seen.append(rows.clone())
            grads = torch.randn(rows.shape, generator=gen)
            c.push_many_async([0, 1], [ids, ids[: ROWS]], grads, step).result(timeout=60)
            c.barrier(step)
        seen.append(c.pull(1, ids).clone())
        stats = c.stats()
    return seen, stats


@pytest.mark.parametrize("mode,wire", [("async", "fp32"), ("sync", "fp16")])
def test_shared_memory_gives_the_socket_results(shard_processes, mode: str, wire: str) -> None:
    base = PSConfig(num_shards=2, mode=mode, wire_dtype=wire, timeout_s=60.0, threads=2, tables=TABLES)
    via_socket, s_stats = run(shard_processes, base, "socket")
    via_shm, m_stats = run(shard_processes, dataclasses.replace(base, shared_memory=True), "shm")
    for a, b in zip(via_socket, via_shm, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert all(s["shm_requests"] == 0 for s in s_stats)
    assert all(s["shm_requests"] >= 6 for s in m_stats)   # 3 pulls + 3 pushes per shard (>= 1 MB) went through /dev/shm
    assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"recsys-ps-{os.getpid():08x}")]


def test_shard_without_shared_memory_refuses(shard_processes) -> None:
    config = PSConfig(num_shards=1, mode="async", timeout_s=30.0, tables=TABLES)
    shards = shard_processes(config)
    with PSClient(dataclasses.replace(config, shared_memory=True), shards.addresses) as c:
        with pytest.raises(PSRequestError, match="refused: this shard does not take shared memory"):
            c.pull(0, torch.arange(ROWS))
        assert c.pull(0, torch.arange(10)).shape == (10, D)   # small requests use the socket


def test_retried_pull_returns_a_copy_and_drops_its_segment() -> None:
    """A fake shard answers only the second attempt and writes the segment after replying (a late
    write of the first attempt): the caller's rows must not change, the segment must be gone."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.rcvtimeo = 10_000
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = PSConfig(num_shards=1, timeout_s=0.3, retries=2, shared_memory=True, tables=TABLES)
    try:
        with PSClient(cfg, [f"tcp://127.0.0.1:{port}"], dedup=False) as client:
            fut = client.pull_async(0, torch.arange(ROWS))
            first, second = router.recv_multipart(), router.recv_multipart()   # no reply to the first
            assert first == second
            h = P.unpack_header(first[1])
            assert h.flags & P.FLAG_SHM and len(first) == 6                    # id, header, auth, index, ids, name
            seg = shm.ShmAttacher().attach(first[5], ROWS * D * 4)
            seg.view("float32")[:] = 1.0
            router.send_multipart([first[0], h.reply().pack()])
            rows = fut.result(timeout=10)
            seg.view("float32")[:] = 2.0                                         # the late attempt
            assert rows.shape == (ROWS, D) and bool((rows == 1.0).all())
            assert not os.path.exists(os.path.join(shm.SHM_DIR, first[5].decode()))
    finally:
        router.close()
        ctx.term()


def test_segments_are_reused_not_piled_up(shard_processes) -> None:
    """Segments come back to the pool once the rows viewing them are dropped (no reference cycle
    holding them until a garbage collection): 30 pull + push rounds use a couple of files."""
    config = PSConfig(num_shards=1, mode="async", timeout_s=30.0, shared_memory=True, tables=TABLES)
    shards = shard_processes(config)
    mine = f"recsys-ps-{os.getpid():08x}"
    ids, grads = torch.arange(ROWS), torch.ones(ROWS, D)
    with PSClient(config, shards.addresses, dedup=False) as c:
        kept = c.pull(0, ids)                        # a caller's rows keep their segment busy
        before = kept.clone()
        for _ in range(30):
            assert c.pull(0, ids).shape == (ROWS, D)
            c.push(0, ids, grads)
        files = [n for n in os.listdir(shm.SHM_DIR) if n.startswith(mine)]
        assert 2 <= len(files) <= 4, files
        assert c.stats()[0]["shm_requests"] == 61            # 31 pulls + 30 pushes
        now = c.pull(0, ids)
        assert not torch.equal(now, before)          # the rows moved ...
        torch.testing.assert_close(kept, before, atol=0, rtol=0)   # ... but not under the caller's tensor
