"""Shared-memory pushes with late grads and notified replies (protocol.FLAG_GRADS_LATE / FLAG_NOTIFY),
without sockets: the C helpers against numpy/torch references, and a ShardServer fed requests whose
segment a test plays the client of. A late push applies exactly what the same push through a frame
applies; a non-finite one is refused (or its bad rows skipped) before any row changes, as is one
whose grads never come, whose client gave up or died; the done word is set only by a served request."""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from embedding_ps import native, reference

from embedding_ps.client.segments import NotifiedFuture
from embedding_ps.wire import shm
from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.server import ShardServer
from embedding_ps.shard.state import ShardState

pytestmark = [pytest.mark.skipif(not shm.available(), reason="no /dev/shm"),
              pytest.mark.skipif(not native.available(), reason="no C compiler for the native path")]

D = 8
N = 300
IDS = torch.arange(N, dtype=torch.int64) * 7 + 3


# ---------------------------------------------------------------------------- the C helpers
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 517, 4095])
def test_copy_finite_copies_the_bits_and_finds_any_non_finite(bad, where) -> None:
    src = torch.randn(4096) * 1e30
    src[7] = torch.finfo(torch.float32).max     # the largest finite float: still finite
    src[8] = -0.0
    if bad is not None:
        src[where] = bad
    dst = torch.full_like(src, 5.0)
    finite = native.copy_finite(src, dst)
    assert finite == bool(torch.isfinite(src).all())
    assert torch.equal(dst.view(torch.int32), src.view(torch.int32))      # NaN payloads and -0.0 too


def test_copy_finite_wakes_the_fd_first() -> None:
    r, w = os.pipe()
    try:
        src, dst = torch.randn(1000), torch.empty(1000)
        assert native.copy_finite(src, dst, w) and torch.equal(src, dst)
        assert os.read(r, 10) == b"x"
    finally:
        os.close(r), os.close(w)


def test_publish_and_wait_flag() -> None:
    flag = np.zeros(1, dtype=np.int64)
    t0 = time.monotonic()
    assert native.wait_flag(flag, 42, 0.05) == 0                  # times out: the value last read
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.02, lambda: native.publish(flag, 42)).start()
    assert native.wait_flag(flag, 42, 5.0) == 42
    native.publish(flag, -43)
    assert native.wait_flag(flag, 43, 5.0) == -43                 # the writer gave up


def test_notify_wakes_a_waiting_thread() -> None:
    word = np.zeros(1, dtype=np.int32)
    assert native.wait_word(word, 0.02) == 0
    threading.Timer(0.02, lambda: native.notify(word, shm.DONE_OK)).start()
    t0 = time.monotonic()
    assert native.wait_word(word, 5.0) == shm.DONE_OK
    assert time.monotonic() - t0 < 4.0


def test_a_store_without_a_wake_ends_the_wait() -> None:
    # a shard without the C library sets the done word with a plain store (reference.notify, no futex
    # wake): a client waiting in C sees it at its next check, not at its timeout (it waited 60 s)
    word = np.zeros(1, dtype=np.int32)
    threading.Timer(0.05, lambda: reference.notify(word, shm.DONE_OK)).start()
    t0 = time.monotonic()
    assert native.wait_word(word, 30.0) == shm.DONE_OK
    assert time.monotonic() - t0 < 20.0


# ---------------------------------------------------------------------------- the shard's side
class Client:
    """Plays a client: its segment holds grads [N, D] | ids [N] | trailer (shm layout)."""

    def __init__(self) -> None:
        self.pool = shm.ShmPool(1 << 26)
        self.rows_bytes = N * D * 4
        self.name, self.seg = self.pool.take(shm.ids_offset(self.rows_bytes) + 8 * N + shm.TRAILER_BYTES)
        start = shm.ids_offset(self.rows_bytes)
        self.seg[start:start + 8 * N].view(np.int64)[:] = IDS.numpy()
        self.grads = P.frame_tensor(memoryview(self.seg[:self.rows_bytes]), P.DType.FP32, N, D)
        self.trailer = shm.trailer(self.seg, self.rows_bytes, N)
        self.request = 0

    def request_frames(self, op: P.Op, flags: int) -> list:
        self.request += 1
        self.trailer[:] = 0
        h = P.Header(op=op, dtype=P.DType.FP32, count=1, dim=D, client=9, request=self.request,
                     flags=P.FLAG_SHM | flags)
        index = torch.tensor([[0, N]], dtype=torch.int64)
        return [h.pack(), b"", index.numpy().tobytes(), b"", self.name]

    def write(self, grads: torch.Tensor, give_up: bool = False) -> None:
        """What LateGrads.write does for one shard."""
        self.trailer[1] = int(native.copy_finite(grads, self.grads))
        native.publish(self.trailer[0:1], -self.request if give_up else self.request)

    def close(self) -> None:
        self.pool.close()


def server(on_nonfinite: str = "error", timeout_s: float = 30.0, mode: str = "async",
           optimizer: str = "adagrad", **table) -> ShardServer:
    cfg = PSConfig(mode=mode, shared_memory=True, timeout_s=timeout_s, on_nonfinite=on_nonfinite,
                   tables=(TableConfig(name="t", dim=D, optimizer=optimizer, lr=0.1, **table),))
    return ShardServer(cfg, 0, ShardState(cfg, 0), bind="127.0.0.1")


def frame_push(srv: ShardServer, grads: torch.Tensor, request: int) -> list:
    h = P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=1, dim=D, client=8, request=request)
    index = torch.tensor([[0, N]], dtype=torch.int64)
    return srv.handle([h.pack(), b"", index.numpy().tobytes(), IDS.numpy().tobytes(), P.tensor_frame(grads)])


def status(reply: list) -> int:
    return P.unpack_header(memoryview(reply[0])).status


def rows(srv: ShardServer) -> torch.Tensor:
    return srv.state.pull(0, IDS).clone()


@pytest.mark.parametrize("optimizer,table", [("sgd", {}), ("adagrad", {}), ("rowwise_adagrad", {}), ("adam", {}),
                                             ("ftrl", {}), ("adagrad", {"min_count": 2}),
                                             ("rowwise_adagrad", {"max_rows": N // 2})])
def test_late_push_applies_what_a_frame_push_applies(optimizer: str, table: dict) -> None:
    """Also with admission (min_count 2: rows appear on the second push) and LFU eviction (max_rows):
    the slots the shard looked up while it waited for the grads are the ones a lookup would give."""
    gen = torch.Generator().manual_seed(1)
    late, framed, client = server(optimizer=optimizer, **table), server(optimizer=optimizer, **table), Client()
    try:
        for step in range(3):
            grads = torch.randn(N, D, generator=gen)
            frames = client.request_frames(P.Op.PUSH, P.FLAG_GRADS_LATE | P.FLAG_NOTIFY)
            writer = threading.Timer(0.01, client.write, args=(grads,))    # the grads come after the request
            writer.start()
            assert status(late.handle(frames)) == P.Status.OK
            writer.join(5)
            assert status(frame_push(framed, grads, step + 1)) == P.Status.OK
            assert shm.done_word(client.trailer)[0] == shm.DONE_OK
            torch.testing.assert_close(rows(late), rows(framed), atol=0, rtol=0)
            assert late.state._hints == {}
    finally:
        client.close()


def test_hinted_slots_are_used_only_for_that_ids_tensor() -> None:
    cfg = PSConfig(tables=(TableConfig(name="t", dim=D, optimizer="adagrad", lr=0.1),))
    a, b = ShardState(cfg, 0), ShardState(cfg, 0)
    grads = torch.randn(N, D)
    for s in (a, b):
        s.push(0, IDS[: N // 2], torch.ones(N // 2, D), step=0)
    ids = IDS.clone()
    a.hint_slots(0, ids)                         # half the ids have rows, half get them in the push
    a.push(0, ids, grads, step=1)
    b.push(0, IDS, grads, step=1)
    torch.testing.assert_close(a.pull(0, IDS), b.pull(0, IDS), atol=0, rtol=0)
    a.hint_slots(0, ids[:10])                    # a hint for another tensor: the push looks up itself
    a._hints[0] = (a._hints[0][0], np.zeros(10, dtype=np.int32))       # (a wrong hint would show)
    a.push(0, ids[:10].clone(), grads[:10], step=2)
    b.push(0, IDS[:10], grads[:10], step=2)
    torch.testing.assert_close(a.pull(0, IDS), b.pull(0, IDS), atol=0, rtol=0)
    assert a._hints == {}


def test_late_non_finite_push_is_refused_with_no_row_changed() -> None:
    srv, client = server(), Client()
    try:
        before = rows(srv)
        grads = torch.ones(N, D)
        grads[N - 1, 3] = float("nan")
        frames = client.request_frames(P.Op.PUSH, P.FLAG_GRADS_LATE | P.FLAG_NOTIFY)
        client.write(grads)
        assert client.trailer[1] == 0                    # the copy saw the NaN: the shard checks itself
        reply = srv.handle(frames)
        assert status(reply) == P.Status.BAD_VALUE and "NaN or infinite" in bytes(reply[1]).decode()
        assert shm.done_word(client.trailer)[0] == 0     # not served: the caller waits for the reply
        torch.testing.assert_close(rows(srv), before, atol=0, rtol=0)
        assert frame_push(srv, grads, 99) and torch.equal(rows(srv), before)   # the socket path alike
    finally:
        client.close()


def test_late_non_finite_rows_are_skipped_under_skip() -> None:
    srv, ref, client = server("skip"), server("skip"), Client()
    try:
        grads = torch.randn(N, D)
        grads[5, 0] = float("inf")
        frames = client.request_frames(P.Op.PUSH, P.FLAG_GRADS_LATE)
        client.write(grads)
        assert status(srv.handle(frames)) == P.Status.OK
        assert status(frame_push(ref, grads, 1)) == P.Status.OK
        torch.testing.assert_close(rows(srv), rows(ref), atol=0, rtol=0)
        assert srv.nonfinite_skipped == ref.nonfinite_skipped == 1
    finally:
        client.close()


@pytest.mark.parametrize("give_up", [True, False])
def test_late_push_whose_grads_never_come_changes_nothing(give_up: bool) -> None:
    srv, client = server(timeout_s=0.2), Client()
    try:
        before = rows(srv)
        frames = client.request_frames(P.Op.PUSH, P.FLAG_GRADS_LATE)
        if give_up:
            client.write(torch.ones(N, D), give_up=True)
        reply = srv.handle(frames)
        assert status(reply) == P.Status.BAD_VALUE
        assert ("gave up" if give_up else "not written") in bytes(reply[1]).decode()
        torch.testing.assert_close(rows(srv), before, atol=0, rtol=0)
    finally:
        client.close()


def test_sync_late_push_keeps_a_copy_of_the_grads() -> None:
    """Sync mode applies at the barrier, after the client may have reused its segment."""
    srv, ref, client = server(mode="sync"), server(mode="sync"), Client()
    try:
        grads = torch.randn(N, D)
        frames = client.request_frames(P.Op.PUSH, P.FLAG_GRADS_LATE)
        client.write(grads)
        assert status(srv.handle(frames)) == P.Status.OK
        client.grads.fill_(123.0)                        # the client reuses the segment
        assert status(frame_push(ref, grads, 1)) == P.Status.OK
        for s in (srv, ref):
            h = P.Header(op=P.Op.BARRIER, step=0, worker=0, client=5, request=77)
            assert status(s.handle([h.pack(), b""])) == P.Status.OK
        torch.testing.assert_close(rows(srv), rows(ref), atol=0, rtol=0)
    finally:
        client.close()


def test_notified_pull_sets_the_done_word_after_the_rows() -> None:
    srv, client = server(), Client()
    try:
        frames = client.request_frames(P.Op.PULL, P.FLAG_NOTIFY)
        assert status(srv.handle(frames)) == P.Status.OK
        assert shm.done_word(client.trailer)[0] == shm.DONE_OK
        torch.testing.assert_close(client.grads, rows(srv), atol=0, rtol=0)       # the rows are in the segment
        bad = client.request_frames(P.Op.PULL, P.FLAG_NOTIFY)
        bad[2] = torch.tensor([[3, N]], dtype=torch.int64).numpy().tobytes()    # unknown table
        assert status(srv.handle(bad)) == P.Status.BAD_VALUE
        assert shm.done_word(client.trailer)[0] == 0
    finally:
        client.close()


def test_notified_future_returns_once_the_word_is_set_and_lets_go_of_it() -> None:
    word = np.zeros(1, dtype=np.int32)
    fut = NotifiedFuture([word], lambda: "fast")
    threading.Timer(0.02, lambda: native.notify(word, shm.DONE_OK)).start()
    assert fut.result(timeout=5) == "fast" and not fut.done()
    fut.set_result("reply")
    assert fut.result() == "reply" and fut.words == [] and fut.fast is None
    other = np.zeros(1, dtype=np.int32)
    err = NotifiedFuture([other], lambda: "fast")
    threading.Timer(0.02, lambda: err.set_exception(RuntimeError("shard said no"))).start()
    with pytest.raises(RuntimeError, match="shard said no"):      # the reply wakes the caller
        err.result(timeout=5)
    assert other[0] == shm.DONE_REPLY


def test_late_push_retried_is_answered_from_the_replay_cache() -> None:
    srv, ref, client = server(), server(), Client()
    try:
        grads = torch.randn(N, D)
        frames = client.request_frames(P.Op.PUSH, P.FLAG_GRADS_LATE | P.FLAG_NOTIFY)
        client.write(grads)
        assert status(srv.handle(frames)) == status(srv.handle(frames)) == P.Status.OK   # a retry: not applied again
        assert status(frame_push(ref, grads, 1)) == P.Status.OK
        torch.testing.assert_close(rows(srv), rows(ref), atol=0, rtol=0)
    finally:
        client.close()


def test_hinted_pushes_during_a_background_save_keep_save_and_state_right(tmp_path, monkeypatch) -> None:
    """test_cow_save's save-while-pushing with every push of the saved state hinted first (new ids,
    duplicates, sweeps, freed slots reused): the files equal a blocking save, the state a replica's."""
    from tests.unit.embedding_ps import test_cow_save

    made, init, push = [], ShardState.__init__, ShardState.push

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    def hinted(self, table, ids, grads, step):
        if self is made[0]:                  # the saved state; its replica pushes without hints
            self.hint_slots(table, ids)
        return push(self, table, ids, grads, step)

    monkeypatch.setattr(ShardState, "__init__", record)
    monkeypatch.setattr(ShardState, "push", hinted)
    stats, state, _ = test_cow_save.save_while_pushing(tmp_path, fraction=1.0)
    assert stats["preserved_rows"] > 0 and state is made[0]


# ---------------------------------------------------------------------------- a client that dies
_CHILD = """
import sys, time
from embedding_ps.wire import shm
pool = shm.ShmPool(1 << 26)
name, seg = pool.take(int(sys.argv[1]))
start = shm.ids_offset(int(sys.argv[2]))
seg[start:start + 8 * int(sys.argv[3])].view('int64')[:] = [i * 7 + 3 for i in range(int(sys.argv[3]))]
print(name.decode(), flush=True)
time.sleep(60)
"""


def _segment_of_a_killed_client() -> bytes:
    """The name of a segment (ids IDS written, no grads) whose client process was killed (SIGKILL)."""
    rows_bytes = N * D * 4
    size = shm.ids_offset(rows_bytes) + 8 * N + shm.TRAILER_BYTES
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(size), str(rows_bytes), str(N)],
                            stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip().encode()
        assert name.startswith(b"recsys-ps-"), name
        assert shm.writer_alive(name)                      # its client lives and holds the lock
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    return name


def test_writer_alive_follows_the_clients_lock() -> None:
    pool = shm.ShmPool(1 << 26)
    name, _ = pool.take(2 << 20)
    assert shm.writer_alive(name)
    pool.close()                                          # unlinked, lock dropped
    assert not shm.writer_alive(name)
    assert not shm.writer_alive(b"../etc/passwd")
    dead = _segment_of_a_killed_client()
    try:
        assert not shm.writer_alive(dead)                 # the kernel dropped the dead process's lock
    finally:
        shm._unlink(dead)


def test_writer_alive_cannot_tell_when_the_segment_will_not_open(monkeypatch) -> None:
    # out of file descriptors (or any error but "no such file") says nothing of the client: the
    # shard must not refuse a live client's push for it (it waits for the timeout, as before)
    import errno
    pool = shm.ShmPool(1 << 26)
    try:
        name, _ = pool.take(2 << 20)

        def no_fds(*args, **kwargs):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(shm.os, "open", no_fds)
        assert shm.writer_alive(name)
        monkeypatch.undo()
        assert shm.writer_alive(name)
    finally:
        pool.close()


def test_late_push_of_a_client_killed_before_its_grads_is_refused_at_once() -> None:
    # a client killed mid-copy: the shard sees it gone within ~WRITER_CHECK_S, not after the 10 s
    # bound (min(ps.timeout_s, GRADS_WAIT_S)), and applies nothing
    srv = server(timeout_s=30.0)
    name = _segment_of_a_killed_client()
    try:
        before = rows(srv)
        h = P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=1, dim=D, client=9, request=1,
                     flags=P.FLAG_SHM | P.FLAG_GRADS_LATE)
        index = torch.tensor([[0, N]], dtype=torch.int64)
        t0 = time.monotonic()
        reply = srv.handle([h.pack(), b"", index.numpy().tobytes(), b"", name])
        took = time.monotonic() - t0
        assert status(reply) == P.Status.BAD_VALUE and "client is gone" in bytes(reply[1]).decode()
        assert took < 5.0, took                            # generous for a loaded machine; the bound is 10 s
        torch.testing.assert_close(rows(srv), before, atol=0, rtol=0)
    finally:
        shm._unlink(name)


_FORKING_CHILD = """
import os, sys, time
from embedding_ps.wire import shm
pool = shm.ShmPool(1 << 26)
name, seg = pool.take(2 << 20)
pid = os.fork()
if pid == 0:                      # a forked helper (a DataLoader worker, say) living on
    assert not pool.fds and not pool.segs
    time.sleep(60)
    os._exit(0)
print(name.decode(), pid, flush=True)
time.sleep(60)
"""


def test_a_forked_child_does_not_keep_a_dead_client_alive() -> None:
    # the client forks, then dies: its child, still running, must not hold the client's lock
    proc = subprocess.Popen([sys.executable, "-c", _FORKING_CHILD], stdout=subprocess.PIPE, text=True)
    child = None
    name = b""
    try:
        text, pid = proc.stdout.readline().split()
        name, child = text.encode(), int(pid)
        assert shm.writer_alive(name)                      # the client lives
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(child, 0)                                  # its child still runs
        assert not shm.writer_alive(name)                  # yet the lock went with the client
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if name:
            shm._unlink(name)
