"""The shard's reply buffers: a buffer is reused only once nothing views it, the smallest that fits is
taken, idle buffers (smallest first) make room under the bound, and a request over the bound gets a
buffer of its own that the pool does not keep."""

from __future__ import annotations

import numpy as np

from embedding_ps.shard.replybuffers import ReplyBuffers
from embedding_ps.wire.shm import best_fit


def test_best_fit_takes_the_smallest_idle_buffer_that_fits() -> None:
    sizes = [64, 16, 32, 16]
    assert best_fit(sizes, 20, lambda i: True) == 2
    assert best_fit(sizes, 20, lambda i: i != 2) == 0
    assert best_fit(sizes, 0, lambda i: i != 1) == 3          # 0: the smallest idle one
    assert best_fit(sizes, 65, lambda i: True) is None
    assert best_fit([], 1, lambda i: True) is None


def test_buffers_are_reused_only_when_nothing_views_them() -> None:
    pool = ReplyBuffers(max_bytes=1 << 20)
    a = pool.take(100_000)                        # rounded up to 128 KiB
    assert a.nbytes == 100_000 and pool.total == 1 << 17
    b = pool.take(100_000)                        # `a` still lives: a second buffer
    assert not np.shares_memory(a, b) and pool.total == 2 << 17
    base = b.base
    del a, b
    c = pool.take(70_000)                         # both idle: one of them, no new one
    assert pool.total == 2 << 17 and len(pool.bufs) == 2
    assert any(np.shares_memory(c, buf) for buf in pool.bufs)
    del c, base


def test_idle_buffers_make_room_under_the_bound_and_big_requests_are_not_kept() -> None:
    pool = ReplyBuffers(max_bytes=1 << 18)        # 256 KiB
    small = pool.take(1 << 16)                    # 64 KiB, kept alive
    idle = pool.take(1 << 17)                     # 128 KiB
    del idle
    big = pool.take(1 << 17)                      # reuses the idle 128 KiB one
    assert pool.total == (1 << 16) + (1 << 17)
    del big
    other = pool.take(150_000)                    # 256 KiB: the idle 128 KiB goes, still over: not kept
    assert other.nbytes == 150_000
    assert len(pool.bufs) == 1 and pool.bufs[0].nbytes == 1 << 16 and pool.total == 1 << 16
    huge = pool.take(1 << 19)                     # over the bound: a buffer of its own
    assert huge.nbytes == 1 << 19 and pool.total == 1 << 16
    del small
