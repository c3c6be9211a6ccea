"""embedding_ps.wire.shm: the client's segment pool (reuse only when idle, discard, cleanup) and the
shard's checks before it maps a segment a request names."""

import os
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from embedding_ps.client.segments import ClientSegments
from embedding_ps.wire import shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")


def test_pool_reuses_idle_segments_only() -> None:
    pool = shm.ShmPool(64 << 20)
    try:
        name, a = pool.take(3 << 20)
        assert a.nbytes == 3 << 20 and os.path.exists(os.path.join(shm.SHM_DIR, name.decode()))
        rows = torch.from_numpy(a).view(torch.float32)            # a caller's tensor viewing the segment
        del a
        name2, b = pool.take(3 << 20)
        assert name2 != name                                       # still viewed: a second segment
        del b
        name3, _ = pool.take(2 << 20)
        assert name3 == name2                                      # idle again: reused (smallest that fits)
        del rows
        pool.discard(pool.take(1 << 20)[1])                        # discarded: unlinked, never handed out again
        names = {n for n, _ in pool.segs}
        assert len(names) == 1 and pool.total == 4 << 20
    finally:
        pool.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name.decode()))
    assert not os.path.exists(os.path.join(shm.SHM_DIR, name2.decode()))


def test_pool_bound_returns_none_when_full() -> None:
    pool = shm.ShmPool(8 << 20)
    try:
        keep = pool.take(6 << 20)                                  # an 8 MB segment: the whole pool
        assert keep is not None and pool.total == 8 << 20
        assert pool.take(1 << 20) is None                          # no idle segment to drop: use the socket
        name = keep[0]
        del keep
        assert pool.take(9 << 20) is None                          # larger than the pool
        again = pool.take(1 << 20)
        assert again is not None and again[0] == name              # idle now: reused, nothing new
        del again
        assert pool.take(9 << 20) is None and pool.take(4 << 20)[0] == name
    finally:
        pool.close()


def test_attacher_sees_the_clients_bytes_and_checks_size() -> None:
    pool = shm.ShmPool(16 << 20)
    try:
        name, a = pool.take(2 << 20)
        a[:8] = np.arange(8, dtype=np.uint8)
        att = shm.ShmAttacher(max_entries=1)
        view = att.attach(name, 1 << 20)
        assert view.nbytes == 1 << 20 and view[:8].tolist() == list(range(8))
        view[8] = 99                                               # the shard writes: the client sees it
        assert a[8] == 99
        with pytest.raises(ValueError, match="the request needs"):
            att.attach(name, 4 << 20)
    finally:
        pool.close()


@pytest.mark.parametrize("name", [b"../etc/passwd", b"recsys-ps-XYZ0000000000000000", b"recsys-ps-12",
                                  b"recsys-ps-0123456789abcdef/x"])
def test_attacher_refuses_names_that_are_not_segments(name: bytes) -> None:
    with pytest.raises(ValueError, match="is not recsys-ps-00000000-<hex>"):
        shm.ShmAttacher().attach(name, 8)


def test_attacher_opens_only_its_own_jobs_segments() -> None:
    """A shard takes a segment only when its name carries the shard's job tag (#28): an authenticated
    client of another job, or a name made up by someone else, is refused before anything is opened."""
    pool = shm.ShmPool(16 << 20, job="0123abcd")
    try:
        name, _ = pool.take(2 << 20)
        assert name.startswith(b"recsys-ps-0123abcd-") and shm.owner_pid(name.decode()) == os.getpid()
        assert shm.ShmAttacher(job="0123abcd").attach(name, 1 << 20).nbytes == 1 << 20
        for other in (shm.NO_JOB, "ffffffff"):
            with pytest.raises(ValueError, match=f"is not recsys-ps-{other}-<hex> .this job's"):
                shm.ShmAttacher(job=other).attach(name, 1 << 20)
    finally:
        pool.close()


def test_attacher_refuses_links_and_missing_segments(tmp_path) -> None:
    name = "recsys-ps-00000000-" + "ab" * 12
    link = os.path.join(shm.SHM_DIR, name)
    target = tmp_path / "secret"
    target.write_bytes(bytes(64))
    os.symlink(target, link)
    try:
        with pytest.raises(OSError):                               # O_NOFOLLOW
            shm.ShmAttacher().attach(name.encode(), 8)
    finally:
        os.unlink(link)
    with pytest.raises(FileNotFoundError):
        shm.ShmAttacher().attach(name.encode(), 8)


def test_is_local() -> None:
    for a in ("tcp://127.0.0.1:5555", "tcp://127.3.0.1:1", "tcp://localhost:9", "tcp://[::1]:7", "ipc:///tmp/x"):
        assert shm.is_local(a), a
    for a in ("tcp://10.0.0.1:5555", "tcp://ps-0.cluster:9", "tcp://[fe80::1]:7", "inproc://x"):
        assert not shm.is_local(a), a


def test_full_shm_falls_back_to_the_socket(monkeypatch) -> None:
    """A /dev/shm without room (containers: 64 MB) must not SIGBUS later: no segment, the socket instead."""
    def no_room(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    pool = shm.ShmPool(64 << 20)
    assert pool.take(2 << 20) is None and pool.failed
    monkeypatch.undo()
    assert pool.take(2 << 20) is None                              # not tried again
    mine = [n for n in os.listdir(shm.SHM_DIR) if (m := shm.NAME_RE.fullmatch(n)) and int(m["pid"], 16) == os.getpid()]
    assert not mine                                                 # the file made for it is gone


def test_auto_is_the_default_and_tries_loopback_shards_only() -> None:
    from embedding_ps.wire.config import PSConfig

    assert PSConfig().shared_memory == "auto"
    local, remote = "tcp://127.0.0.1:5555", "tcp://10.0.0.7:5555"
    assert shm.client_uses("auto", local) and not shm.client_uses("auto", remote)
    assert shm.client_uses(True, local) and shm.client_uses(True, remote)       # explicit true: every shard
    assert not shm.client_uses(False, local)
    assert shm.shard_accepts("auto", "127.0.0.1") and shm.shard_accepts("auto", "::1")
    assert not shm.shard_accepts("auto", "0.0.0.0") and not shm.shard_accepts("auto", "10.0.0.7")
    assert shm.shard_accepts(True, "10.0.0.7") and not shm.shard_accepts(False, "127.0.0.1")
    segs = ClientSegments([local, remote], "auto")
    try:
        assert segs.local == {0}
        assert segs.take(1, 2 << 20) is None                  # the other node's shard: the socket
        assert segs.take(0, 2 << 20) is not None
    finally:
        segs.close()
    assert ClientSegments([local], False).pool is None   # off: not even a pool


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_shared_memory_setting_is_validated(value) -> None:
    from embedding_ps.wire.config import PSConfig

    with pytest.raises(ValueError, match=r"ps.shared_memory must be true, false or 'auto', got"):
        PSConfig(shared_memory=value)


def test_refused_shard_falls_back_once_with_one_warning(caplog) -> None:
    segs = ClientSegments(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], True)
    try:
        with caplog.at_level("WARNING", logger="embedding_ps.wire.shm"):
            segs.refused(0, "segment not opened here")
            segs.refused(0, "segment not opened here")
        assert len(caplog.records) == 1 and "ps shard 0 at tcp://127.0.0.1:1" in caplog.text
        assert segs.take(0, 2 << 20) is None and segs.take(1, 2 << 20) is not None
    finally:
        segs.close()


@pytest.fixture
def segs():
    """A client's segments for one shard on this host (shared memory on), closed afterwards."""
    segments = ClientSegments(["tcp://127.0.0.1:1"], True)
    try:
        yield segments
    finally:
        segments.close()


def _release_later(holder: list, delay_s: float) -> threading.Thread:
    """Drop the caller's view of a segment after delay_s (as the I/O thread does once the reply is in)."""
    t = threading.Thread(target=lambda: (time.sleep(delay_s), holder.clear()))
    t.start()
    return t


def test_a_settling_segment_is_waited_for_and_reused(segs: ClientSegments) -> None:
    # back-to-back requests: the last one's caller has its result (notify), its reply is still being
    # handled; the next request waits for that segment instead of making (and alternating with) a second
    segs.settle_s = 30.0                   # a wait far longer than the release takes, even on a loaded machine
    name, view = segs.take(0, 3 << 20)
    holder = [view]                        # what the in-flight reply holds
    del view
    segs.settle({0: holder[0]})
    t = _release_later(holder, 0.0005)
    name2, _ = segs.take(0, 3 << 20)
    t.join(timeout=5)
    assert name2 == name and len(segs.pool.segs) == 1


# NO_WAIT_S: these tests set settle_s to WAIT_S, so a take() that waited shows (a new segment's
# creation may take milliseconds on a loaded machine: SETTLE_S itself would be a flaky bound)
WAIT_S, NO_WAIT_S = 10.0, 5.0


def test_a_segment_not_settling_is_not_waited_for(segs: ClientSegments) -> None:
    segs.settle_s = WAIT_S
    name, held = segs.take(0, 3 << 20)     # the caller keeps its rows: busy, not settling
    t0 = time.monotonic()
    name2, _ = segs.take(0, 3 << 20)
    assert name2 != name and time.monotonic() - t0 < NO_WAIT_S


def test_the_wait_for_a_settling_segment_is_bounded(segs: ClientSegments) -> None:
    # the caller kept the result it had through the segment: after SETTLE_S another segment is used
    name, held = segs.take(0, 3 << 20)
    segs.settle({0: held})
    t0 = time.monotonic()
    name2, _ = segs.take(0, 3 << 20)
    waited = time.monotonic() - t0
    assert name2 != name and waited < 1.0      # bounded (SETTLE_S; generous for a loaded machine)
    assert not segs.settling                   # the expired mark is gone


def test_a_handled_reply_shortens_the_wait(segs: ClientSegments) -> None:
    # done(): the reply was handled; if the segment is still busy after SETTLE_GRACE_S the caller holds it
    name, held = segs.take(0, 3 << 20)
    segs.settle({0: held})
    fut: Future = Future()
    fut.set_result(None)
    segs.done(fut, {0: held}, [])
    until, _ = segs.settling[id(shm.root(held))]
    assert until <= time.monotonic() + shm.SETTLE_GRACE_S


def test_a_settling_segment_whose_result_the_caller_holds_is_not_waited_for(segs: ClientSegments) -> None:
    # a trainer keeps the rows it pulled (fast path) while it asks for the next batch: no wait
    segs.settle_s = WAIT_S
    name, view = segs.take(0, 3 << 20)
    rows = torch.from_numpy(view).view(torch.float32)     # the caller's result, viewing the segment
    segs.settle({0: view}, rows)
    del view
    t0 = time.monotonic()
    name2, _ = segs.take(0, 3 << 20)
    assert name2 != name and time.monotonic() - t0 < NO_WAIT_S
    del rows


def test_a_taken_segment_is_no_longer_waited_for() -> None:
    # a request to two shards: the first takes the segment the last request settled; the second must
    # not wait for it (it is busy with this very request), but take another at once
    segs = ClientSegments(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], True)
    try:
        segs.settle_s = WAIT_S
        name, view = segs.take(0, 3 << 20)
        segs.settle({0: view})
        del view                                   # the last request's reply was handled: idle
        again, mine = segs.take(0, 3 << 20)        # this request's first shard reuses it
        assert again == name
        t0 = time.monotonic()
        other, _ = segs.take(1, 3 << 20)
        assert other != name and time.monotonic() - t0 < NO_WAIT_S
    finally:
        segs.close()


# ---------------------------------------------------------------------------- segments of dead processes (#28 item 3)
_MAKER = ("import sys, time; from embedding_ps.wire import shm; "
          "name, view, lock = shm._create(1 << 20); print(name.decode(), flush=True); time.sleep(60)")


def _dead_segment() -> str:
    """The name of a 1 MiB segment whose maker was killed with SIGKILL (it never unlinked it)."""
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", _MAKER], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert shm.NAME_RE.fullmatch(name), name
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.path.exists(os.path.join(shm.SHM_DIR, name))      # left behind by the kill
    return name


def test_sweep_removes_only_segments_of_dead_processes() -> None:
    dead = _dead_segment()
    mine, _view, lock = shm._create(1 << 20)                    # a live one: kept
    try:
        assert shm.sweep_dead(min_age_s=3600) == (0, 0)       # too young to tell from one being made
        count, size = shm.sweep_dead(min_age_s=0)
        assert count >= 1 and size >= 1 << 20
        assert not os.path.exists(os.path.join(shm.SHM_DIR, dead))
        assert os.path.exists(os.path.join(shm.SHM_DIR, mine.decode()))
    finally:
        os.close(lock)
        shm._unlink(mine)


def test_an_idle_shard_reaps_the_segments_of_clients_that_are_gone() -> None:
    dead = _dead_segment()
    attacher = shm.ShmAttacher()
    attacher.attach(dead.encode(), 1 << 20)
    mine, _view, lock = shm._create(1 << 20)
    try:
        attacher.attach(mine, 1 << 20)
        assert attacher.reap() == 1
        assert list(attacher.maps) == [mine] and not os.path.exists(os.path.join(shm.SHM_DIR, dead))
    finally:
        os.close(lock)
        shm._unlink(mine)
