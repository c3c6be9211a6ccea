"""ps.shared_memory: shard processes on 127.0.0.1 read gradients from and write rows into the
client's /dev/shm segments, with exactly the results of the socket path (async and sync, fp32 and
fp16 wire, several tables and shards, ps.threads > 1); a shard without it, or one that cannot open
the client's segment, makes the client fall back to the socket with the same results; a retried
pull hands back a copy and never reuses its segment."""

import contextlib
import dataclasses
import os
import threading
import time
import types

import pytest
import torch
import zmq

from embedding_ps.wire import protocol as P
from embedding_ps.wire import shm
from embedding_ps.client.client import PSClient, PSRequestError
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.loop import serve

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


@pytest.mark.parametrize("mode,wire", [("async", "fp32"), ("sync", "fp32"), ("sync", "fp16")])
def test_shared_memory_gives_the_socket_results(shard_processes, mode: str, wire: str) -> None:
    base = PSConfig(num_shards=2, mode=mode, wire_dtype=wire, timeout_s=60.0, threads=2, tables=TABLES,
                    shared_memory=False)
    via_socket, s_stats = run(shard_processes, base, "socket")
    via_shm, m_stats = run(shard_processes, dataclasses.replace(base, shared_memory="auto"), "shm")
    for a, b in zip(via_socket, via_shm, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert all(s["shm_requests"] == 0 for s in s_stats)
    assert all(s["shm_requests"] >= 6 for s in m_stats)   # 3 pulls + 3 pushes per shard (>= 1 MB) went through /dev/shm
    assert not [n for n in os.listdir(shm.SHM_DIR) if shm.owner_pid(n) == os.getpid()]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_every_optimizer_gets_the_socket_results(shard_processes, mode: str) -> None:
    optimizers = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
    base = PSConfig(num_shards=1, mode=mode, timeout_s=60.0, shared_memory=False,
                    tables=tuple(TableConfig(name=o, dim=D, optimizer=o, lr=0.05) for o in optimizers))
    got = {}
    for sm in (False, "auto"):
        config = dataclasses.replace(base, shared_memory=sm)
        shards = shard_processes(config, f"{mode}-{sm}")
        gen = torch.Generator().manual_seed(3)
        ids = torch.randperm(4 * ROWS, generator=gen)[:ROWS]
        tables = list(range(len(optimizers)))
        with PSClient(config, shards.addresses, dedup=False) as c:
            for step in range(3):
                rows = c.pull_many_async(tables, [ids] * len(tables), step).result(timeout=60)
                c.push_many_async(tables, [ids] * len(tables), torch.randn(rows.shape, generator=gen) * rows,
                                  step).result(timeout=60)
                c.barrier(step)
            got[sm] = c.pull_many_async(tables, [ids] * len(tables)).result(timeout=60).clone()
            assert (c.stats()[0]["shm_requests"] >= 7) == (sm == "auto")
    torch.testing.assert_close(got["auto"], got[False], atol=0, rtol=0)


@pytest.mark.parametrize("shared_memory", [False, "auto"])
def test_non_finite_push_is_refused_with_no_row_changed(shard_processes, shared_memory) -> None:
    """A push with one NaN among 12k rows fails naming it and changes no row, through the socket and
    through shared memory (where the client's copy checks the grads and the shard trusts it only when
    every value was finite)."""
    config = PSConfig(num_shards=1, mode="async", timeout_s=30.0, shared_memory=shared_memory, tables=TABLES)
    shards = shard_processes(config, f"nonfinite-{shared_memory}")
    ids = torch.arange(ROWS)
    with PSClient(config, shards.addresses, dedup=False) as c:
        c.push(0, ids, torch.ones(ROWS, D))
        before = c.pull(0, ids).clone()
        grads = torch.ones(ROWS, D)
        grads[ROWS - 1, D - 1] = float("nan")
        with pytest.raises(PSRequestError, match="NaN or infinite"):
            c.push(0, ids, grads)
        torch.testing.assert_close(c.pull(0, ids), before, atol=0, rtol=0)
        c.push(0, ids, torch.ones(ROWS, D))              # the next push goes through as before
        assert not torch.equal(c.pull(0, ids), before)
        stats = c.stats()[0]
    assert stats["errors"] == 1
    assert (stats["shm_requests"] >= 5) == (shared_memory == "auto")


def test_shard_without_shared_memory_falls_back_to_the_socket(shard_processes, caplog) -> None:
    """A shard with ps.shared_memory = false answers NO_SHM: the client resends through the socket
    (one warning), gets the socket's rows, and does not try that shard again."""
    config = PSConfig(num_shards=1, mode="async", timeout_s=30.0, shared_memory=False, tables=TABLES)
    shards = shard_processes(config)
    ids = torch.arange(ROWS)
    with PSClient(config, shards.addresses) as plain:
        want = plain.pull(0, ids).clone()
    with PSClient(dataclasses.replace(config, shared_memory="auto"), shards.addresses) as c:
        with caplog.at_level("WARNING", logger="embedding_ps.wire.shm"):
            torch.testing.assert_close(c.pull(0, ids), want, atol=0, rtol=0)
            c.push(0, ids, torch.ones(ROWS, D))
            c.pull(0, ids)
        stats = c.stats()[0]
    assert stats["shm_refused"] == 1 and stats["shm_requests"] == 0 and stats["errors"] == 0
    assert stats["requests"]["push"] == 1 and stats["requests"]["pull"] == 3    # the push applied once
    assert len([r for r in caplog.records if "cannot use this client's shared memory" in r.message]) == 1


@contextlib.contextmanager
def thread_shards(config: PSConfig, tmp_path, name: str):
    """config.num_shards shards served by threads of this process (so a test can patch their shm)."""
    stop, threads, addresses = threading.Event(), [], []
    try:
        for i in range(config.num_shards):
            ready = tmp_path / f"{name}-{i}.ready"
            threads.append(threading.Thread(target=serve, args=(config, i), daemon=True,
                                            kwargs={"ready_file": str(ready), "stop": stop}))
            threads[-1].start()
            deadline = time.monotonic() + 30
            while not ready.exists():
                assert time.monotonic() < deadline and threads[-1].is_alive(), f"shard {i} did not start"
                time.sleep(0.01)
            addresses.append(ready.read_text().strip())
        yield types.SimpleNamespace(addresses=addresses)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_shard_that_cannot_open_the_segment_falls_back_with_the_same_results(tmp_path, monkeypatch,
                                                                            mode: str) -> None:
    """Containers that share a network but not /dev/shm: the shard's open fails (FileNotFoundError);
    every pull and push still gives the socket's results, bit for bit."""
    base = PSConfig(num_shards=2, mode=mode, timeout_s=60.0, threads=2, tables=TABLES)
    with thread_shards(dataclasses.replace(base, shared_memory=False), tmp_path, "socket") as shards:
        via_socket, _ = run(lambda cfg, name: shards, dataclasses.replace(base, shared_memory=False), "socket")

    def not_here(name: bytes, job: str):
        raise FileNotFoundError(2, "No such file or directory", name.decode())

    monkeypatch.setattr(shm, "_open", not_here)
    with thread_shards(base, tmp_path, "auto") as shards:           # "auto" on both ends, loopback
        via_fallback, stats = run(lambda cfg, name: shards, base, "auto")
    for a, b in zip(via_socket, via_fallback, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert all(s["shm_refused"] == 1 and s["shm_requests"] == 0 and s["errors"] == 0 for s in stats)


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
            # the segment is dropped by the request's done callback, on the I/O thread, which may run
            # just after the caller's result() returned
            path, deadline = os.path.join(shm.SHM_DIR, first[5].decode()), time.monotonic() + 10.0
            while os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not os.path.exists(path)
    finally:
        router.close()
        ctx.term()


def test_segments_are_reused_not_piled_up(shard_processes) -> None:
    """Segments come back to the pool once the rows viewing them are dropped (no reference cycle
    holding them until a garbage collection): 30 pull + push rounds use a couple of files."""
    config = PSConfig(num_shards=1, mode="async", timeout_s=30.0, shared_memory=True, tables=TABLES)
    shards = shard_processes(config)
    ids, grads = torch.arange(ROWS), torch.ones(ROWS, D)
    with PSClient(config, shards.addresses, dedup=False) as c:
        kept = c.pull(0, ids)                        # a caller's rows keep their segment busy
        before = kept.clone()
        for _ in range(30):
            assert c.pull(0, ids).shape == (ROWS, D)
            c.push(0, ids, grads)
        files = [n for n in os.listdir(shm.SHM_DIR) if shm.owner_pid(n) == os.getpid()]
        assert 2 <= len(files) <= 4, files
        assert c.stats()[0]["shm_requests"] == 61            # 31 pulls + 30 pushes
        now = c.pull(0, ids)
        assert not torch.equal(now, before)          # the rows moved ...
        torch.testing.assert_close(kept, before, atol=0, rtol=0)   # ... but not under the caller's tensor


def test_a_kept_push_future_does_not_keep_its_segment(shard_processes) -> None:
    # a caller that keeps the futures of its pushes lets their segments be reused: the done
    # callback, which a Future keeps, lets go of them (a pull's future is another matter: its
    # result is the rows, a view of the segment)
    config = PSConfig(num_shards=1, timeout_s=60.0, tables=TABLES, shared_memory="auto")
    shards = shard_processes(config, "kept")
    ids = torch.arange(ROWS, dtype=torch.int64) * 3 + 1
    grads = torch.full((ROWS, D), 1e-3)
    with PSClient(config, shards.addresses, dedup=False) as c:
        kept = []
        for _ in range(4):
            f = c.push_async(0, ids, grads)
            f.result(timeout=60)
            deadline = time.monotonic() + 30
            while not f.done() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)                       # its reply handled
            kept.append(f)
        assert len(c._shm.pool.segs) == 1          # one segment, reused by every push
