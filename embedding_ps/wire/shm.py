"""Shared-memory row frames between a client and a shard on the same host (ps.shared_memory).

The client owns segments in /dev/shm (`ShmPool`), names one in a request, and the shard reads the
gradients from it (PUSH) or gathers the rows into it (PULL) in place (`ShmAttacher`); the client's
PULL result views the segment (no copy), reused once nothing views it any more (`BufferPool`; the
client's bookkeeping over the pool: `embedding_ps.client.segments`). Layout (rows | ids | trailer),
late grads, notify, the safety rules (names, owner, flock) and the fallback to the socket:
docs/wire.md, "Shared-memory segments".
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch

from embedding_ps.wire import protocol as P
from embedding_ps.wire.auth import NO_JOB, is_loopback

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"recsys-ps-(?:(?P<job>[0-9a-f]{8})-)?(?P<pid>[0-9a-f]{8})[0-9a-f]{8,56}")
"""Segment names: job tag (older releases: none), the creating client's pid, random hex."""
MIN_BYTES = 1 << 20
"""Requests below this many row bytes use the socket: the copy is cheap and a segment costs a file."""
POOL_BYTES = 1 << 30
"""Most bytes of segments one client keeps (a request that finds no room uses the socket)."""
SETTLE_S = 0.002
"""Longest a request waits for a segment whose last request already gave its caller the result
(FLAG_NOTIFY) and is busy only until the client's I/O thread has handled the reply."""
SETTLE_GRACE_S = 0.0005
"""... once that reply was handled (what holds the segment then lets go of it right after)."""


def is_local(address: str) -> bool:
    """Whether a shard address (`tcp://host:port`, `ipc://path`) is on this host by its name (`is_loopback`)."""
    return address.startswith("ipc://") or (address.startswith("tcp://")
                                             and is_loopback(address[len("tcp://"):].rsplit(":", 1)[0]))


def ids_offset(rows_bytes: int) -> int:
    """Where a request's ids int64 [M] start in its segment: after its rows (`rows_bytes`), 8-aligned."""
    return (rows_bytes + 7) & ~7


TRAILER_BYTES = 32
"""A FLAG_GRADS_LATE / FLAG_NOTIFY request's trailer after its ids (protocol): int64 ready, int64 finite,
int32 done, 4 bytes unused, int64 unused."""
DONE_OK = 1
"""The trailer's done word: the shard served the request (protocol.FLAG_NOTIFY)."""
DONE_REPLY = 3
"""... set by the client once the reply is in, whatever it said (wakes a waiting caller)."""


def seg_bytes(rows_bytes: int, m: int, trailer: bool) -> int:
    """The bytes of a segment: rows (rows_bytes) | ids int64 [m] (at ids_offset) [| trailer]."""
    return ids_offset(rows_bytes) + 8 * m + (TRAILER_BYTES if trailer else 0)


def ids_view(seg: np.ndarray, rows_bytes: int, m: int) -> torch.Tensor:
    """The ids int64 [m] after the rows (rows_bytes) of a segment uint8 [>= ...]: a tensor viewing it (no copy)."""
    start = ids_offset(rows_bytes)
    return P.frame_tensor(memoryview(seg[start:start + 8 * m]), P.DType.INT64, m)


def trailer(seg: np.ndarray, rows_bytes: int, m: int) -> np.ndarray:
    """int64 [4] view of the trailer (TRAILER_BYTES) after the ids int64 [m] of a segment's rows_bytes rows."""
    start = seg_bytes(rows_bytes, m, trailer=False)
    return seg[start:start + TRAILER_BYTES].view(np.int64)


def done_word(trailer: np.ndarray) -> np.ndarray:
    """The trailer's done word, int32 [1]."""
    return trailer[2:3].view(np.int32)[:1]


def available() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)


Mode = bool | Literal["auto"]
"""ps.shared_memory."""


def client_uses(mode: Mode, address: str) -> bool:
    """Whether a client tries shared memory with the shard at `address` (ps.shared_memory)."""
    return mode is True or (mode == "auto" and is_local(address))


def shard_accepts(mode: Mode, bind: str) -> bool:
    """Whether a shard bound to host `bind` opens its clients' segments (ps.shared_memory)."""
    return available() and (mode is True or (mode == "auto" and is_loopback(bind)))


_POOLS: weakref.WeakSet = weakref.WeakSet()
"""Every live ShmPool of this process (`_forget_in_child`)."""


def _forget_in_child() -> None:
    """After a fork, in the child: close the inherited segment fds and forget the segments. A fd
    inherited by fork shares its open file description, and with it the client's flock: a child
    living on (a DataLoader worker, say) would keep a dead client looking alive to the shards
    (`writer_alive`). The segments stay the parent's (nothing is unlinked); a pool used in the
    child makes new ones (or, as any PSClient in a forked child, should not be used at all)."""
    for pool in list(_POOLS):
        for fd in pool.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        pool.fds, pool.bufs, pool.names, pool.total = [], [], [], 0


os.register_at_fork(after_in_child=_forget_in_child)


def best_fit(sizes: list[int], nbytes: int, idle: Callable[[int], bool]) -> int | None:
    """Index of the smallest idle buffer of at least `nbytes` (0: the smallest idle one), or None.
    `idle(i)` tells whether buffer i is free (reference counts)."""
    fits = [i for i, size in enumerate(sizes) if size >= nbytes and idle(i)]
    return min(fits, key=sizes.__getitem__, default=None)


class BufferPool:
    """Byte buffers of power-of-two sizes (at least `min_bytes`), reused once nothing views them any
    more (reference counts: only the pool still refers to one), at most `max_bytes` in all: the
    client's segments (`ShmPool`) and the shard's PULL reply buffers (`replybuffers.ReplyBuffers`).
    A subclass makes a buffer, `_make(size)` -> uint8 [size] or None (`failed`: no new ones from then on)."""

    def __init__(self, max_bytes: int, min_bytes: int) -> None:
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self.bufs: list[np.ndarray] = []                      # uint8 [size] each
        self.total = 0
        self.failed = False

    def index(self, nbytes: int) -> int | None:
        """The index of an idle buffer of at least `nbytes` (the smallest), made if none is, idle
        ones dropped (smallest first) to make room; None: no room (too big, nothing idle to drop)."""
        best = best_fit([a.nbytes for a in self.bufs], nbytes, self._idle)
        if best is not None:
            return best
        size = max(self.min_bytes, 1 << max(nbytes - 1, 1).bit_length())
        if size > self.max_bytes or self.failed:
            return None
        while self.total + size > self.max_bytes:
            idle = best_fit([a.nbytes for a in self.bufs], 0, self._idle)
            if idle is None:
                return None
            self._drop(idle)
        a = self._make(size)
        if a is None:
            self.failed = True
            return None
        self.bufs.append(a)
        self.total += size
        return len(self.bufs) - 1

    def _drop(self, i: int) -> None:
        self.total -= self.bufs.pop(i).nbytes

    def _idle(self, i: int) -> bool:
        # references: the list and getrefcount's argument; more while a view (a tensor, a frame) lives
        return sys.getrefcount(self.bufs[i]) <= 2


class ShmPool(BufferPool):
    """The client's segments (a `BufferPool` of MIN_BYTES or more): `bufs[i]` is segment `names[i]`."""

    def __init__(self, max_bytes: int, job: str = NO_JOB) -> None:
        super().__init__(max_bytes, MIN_BYTES)
        self.job = job
        self.names: list[bytes] = []
        self.fds: list[int] = []                              # open fds holding a shared flock
        _POOLS.add(self)

    @property
    def segs(self) -> list[tuple[bytes, np.ndarray]]:
        """(name, uint8 [size] viewing the mapping) of every segment."""
        return list(zip(self.names, self.bufs))

    def take(self, nbytes: int) -> tuple[bytes, np.ndarray] | None:
        """(name, uint8 [nbytes] view) of an idle segment, or None (too big for the pool: use the socket)."""
        i = self.index(nbytes)
        return None if i is None else (self.names[i], self.bufs[i][:nbytes])

    def _make(self, size: int) -> np.ndarray | None:
        try:
            name, a, fd = _create(size, self.job)
        except OSError as e:       # e.g. a small /dev/shm (containers): ENOSPC from posix_fallocate
            logger.warning("shared memory segment of %d bytes not created (%s): rows go through the "
                           "socket from now on", size, e)
            return None
        self.names.append(name)
        self.fds.append(fd)
        return a

    def _drop(self, i: int) -> None:
        super()._drop(i)
        _unlink(self.names.pop(i))
        os.close(self.fds.pop(i))       # drops the flock: a shard waiting on it stops waiting

    def discard(self, view: np.ndarray) -> None:
        """Never reuse the segment under `view` (a request on it failed or was retried); unlink it."""
        base = root(view)
        for i in range(len(self.bufs)):
            if self.bufs[i] is base:
                self._drop(i)
                return

    def close(self) -> None:
        while self.bufs:
            self._drop(len(self.bufs) - 1)


class ShmAttacher:
    """The shard's mappings of its clients' segments by name (most recently used `max_entries`); only
    segments of its own job (`job`: its tag, `auth.job_tag`)."""

    def __init__(self, max_entries: int = 256, job: str = NO_JOB) -> None:
        self.max_entries, self.job = max_entries, job
        self.maps: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def reap(self) -> int:
        """Unlink and forget the mapped segments whose client is gone (`writer_alive`: it died, or
        closed without unlinking); the shard's loop calls this when idle, at most every REAP_S.
        Returns how many."""
        gone = [name for name in self.maps if not writer_alive(name)]
        for name in gone:
            del self.maps[name]
            _unlink(name)
        return len(gone)

    def attach(self, name: bytes, nbytes: int) -> np.ndarray:
        """uint8 [nbytes] view of segment `name`; ValueError naming what is wrong."""
        a = self.maps.get(name)
        if a is None:
            a = _open(name, self.job)
            self.maps[name] = a
            if len(self.maps) > self.max_entries:     # dropped mappings unmap once no view is left
                self.maps.popitem(last=False)
        else:
            self.maps.move_to_end(name)
        if a.nbytes < nbytes:
            raise ValueError(f"shared memory segment {name.decode()!r} has {a.nbytes} bytes, "
                             f"the request needs {nbytes}")
        return a[:nbytes]


def _create(size: int, job: str = NO_JOB) -> tuple[bytes, np.ndarray, int]:
    """(name, uint8 [size] view, fd): a new segment and a fd of it kept open with a shared flock for
    as long as the client lives (`writer_alive`; the kernel drops the lock when the process dies)."""
    name = f"recsys-ps-{job}-{os.getpid() & 0xFFFFFFFF:08x}{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    lock = -1
    try:
        # the lock first (`sweep_dead` spares unlocked segments only while they are young), on an
        # open file description of its own: the mapping keeps a dup of `fd`, which a forked child
        # inherits, and closing the lock's fd must drop the lock (`_forget_in_child`)
        lock = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        fcntl.flock(lock, fcntl.LOCK_SH)
        # reserve the pages now: on a full tmpfs a sparse segment would SIGBUS at first touch instead
        os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        if lock >= 0:
            os.close(lock)
        raise
    finally:
        os.close(fd)                    # the mapping holds its own descriptor
    return name.encode(), np.frombuffer(m, dtype=np.uint8), lock


def writer_alive(name: bytes) -> bool:
    """Whether the client that made segment `name` may still write it: its shared flock on the file
    is held (`_create`), which the kernel drops when that process dies, however it dies (a PID would
    not do: a client in another PID namespace may share /dev/shm). False also once the segment was
    unlinked (the client closed it). A shard waiting for late grads asks this between waits."""
    text = name.decode("ascii", "replace")
    if not NAME_RE.fullmatch(text):
        return False
    try:
        fd = os.open(os.path.join(SHM_DIR, text), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False                        # unlinked: the client closed it, or never made it
    except OSError:
        return True                         # cannot tell (out of fds, ...): wait for the timeout
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:                         # BlockingIOError: someone holds a lock, the client lives;
        return True                         # else cannot tell: wait for the timeout
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


REAP_S = 5.0
"""How often an idle shard looks for segments of clients that are gone (`ShmAttacher.reap`)."""
SWEEP_MIN_AGE_S = 10.0
"""`sweep_dead` leaves younger segments alone (one being created has no lock for a moment)."""


def sweep_dead(min_age_s: float = SWEEP_MIN_AGE_S) -> tuple[int, int]:
    """Remove every segment of this user whose client is gone (its shared flock was dropped: the
    process died, by kill -9 too, or closed it without unlinking) and that is at least `min_age_s`
    old; returns (segments, bytes) removed. `recsys train` runs it at start, before each restart
    and at exit, so a killed trainer, shard or launcher leaves nothing in /dev/shm for long."""
    if not available():
        return 0, 0
    count = size = 0
    now = time.time()
    for entry in os.scandir(SHM_DIR):
        if not NAME_RE.fullmatch(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or now - st.st_mtime < min_age_s
                or writer_alive(entry.name.encode())):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue
        count, size = count + 1, size + st.st_size
    return count, size


def owner_pid(name: str) -> int | None:
    """The pid of the client that made segment `name` (None: not a segment name)."""
    m = NAME_RE.fullmatch(name)
    return None if m is None else int(m["pid"], 16)


def _open(name: bytes, job: str) -> np.ndarray:
    text = name.decode("ascii", "replace")
    m = NAME_RE.fullmatch(text)
    if m is None or m["job"] != job:
        raise ValueError(f"shared memory segment name {text[:80]!r} is not recsys-ps-{job}-<hex> (this job's)")
    fd = os.open(os.path.join(SHM_DIR, text), os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            # another user's file (a container sharing /dev/shm under another uid): the socket then
            raise PermissionError(f"shared memory segment {text!r} is not a regular file of this user")
        m = mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)
    return np.frombuffer(m, dtype=np.uint8)


def _unlink(name: bytes) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(SHM_DIR, name.decode()))


def root(view: np.ndarray) -> np.ndarray:
    """The array that `view` was cut from (the segment's whole mapping)."""
    while isinstance(view.base, np.ndarray):
        view = view.base
    return view


__all__ = ["MIN_BYTES", "POOL_BYTES", "SETTLE_S", "SETTLE_GRACE_S", "TRAILER_BYTES", "DONE_OK", "DONE_REPLY",
           "trailer", "done_word", "Mode", "ids_offset", "root", "seg_bytes", "ids_view", "ShmAttacher", "ShmPool",
           "BufferPool", "NO_JOB", "best_fit", "available", "owner_pid", "client_uses", "is_local", "shard_accepts",
           "sweep_dead", "writer_alive"]
