"""The client's side of the shared-memory segments (`embedding_ps.wire.shm`: their format, pool and
the shard's side; docs/wire.md, "Shared-memory segments"): `ClientSegments` (one pool for the shards on
this host, segments settling before reuse), `LateGrads` (a FLAG_GRADS_LATE push's grads, written after
the request) and `NotifiedFuture` (a result through the done word before the reply, FLAG_NOTIFY)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from embedding_ps import native
from embedding_ps.wire.auth import NO_JOB
from embedding_ps.wire.shm import (DONE_OK, DONE_REPLY, MIN_BYTES, POOL_BYTES, SETTLE_GRACE_S, SETTLE_S, Mode,
                                   ShmPool, available, client_uses, root)

logger = logging.getLogger(__name__)


class ClientSegments:
    """What a PSClient needs: segments for the shards on this host only, from one pool, thread-safe
    (taken on the caller's thread, discarded on the I/O thread)."""

    def __init__(self, addresses: Sequence[str], mode: Mode, job: str = NO_JOB) -> None:
        """`job`: the job's tag. `settle_s`: SETTLE_S, or 0 (never wait; benchmarks/shm_segments.py)."""
        self.addresses = list(addresses)
        self.local = {s for s, a in enumerate(self.addresses) if client_uses(mode, a)}
        self.pool = ShmPool(POOL_BYTES, job) if self.local and available() else None
        self.lock = threading.Lock()
        self.settle_s = SETTLE_S
        # id of a segment -> (until when a request may wait for it, weakref to the caller's result or None)
        self.settling: dict[int, tuple[float, Callable[[], object] | None]] = {}

    def refused(self, shard: int, message: str) -> None:
        """Shard `shard` answered NO_SHM: its requests use the socket from now on (one warning)."""
        with self.lock:
            if shard not in self.local:
                return
            self.local.discard(shard)
        logger.warning("ps shard %d at %s cannot use this client's shared memory (%s); its rows go through "
                       "the socket from now on", shard, self.addresses[shard], message)

    def take(self, shard: int, nbytes: int) -> tuple[bytes, np.ndarray] | None:
        """(name, uint8 [nbytes]) for a request to `shard`, or None: the socket (off, another host, small)."""
        if self.pool is None or shard not in self.local or nbytes < MIN_BYTES:
            return None
        if self.settling:
            self._settle(nbytes)
        with self.lock:
            got = self.pool.take(nbytes)
            if got is not None and self.settling:   # busy with this request now: nothing to wait for
                self.settling.pop(id(root(got[1])), None)
            return got

    def settle(self, segs: dict[int, np.ndarray], result: object = None) -> None:
        """The caller has its `result` from these segments (FLAG_NOTIFY) while their reply is still on
        its way: a request that finds no idle segment waits up to SETTLE_S for one of them, unless the
        caller still holds that result (a tensor viewing the segment: then it stays busy)."""
        if self.settle_s <= 0:
            return
        until = time.monotonic() + self.settle_s
        held = None if result is None else weakref.ref(result)
        with self.lock:                  # _settle iterates the dict under it
            for seg in segs.values():
                self.settling[id(root(seg))] = (until, held)

    def _settle(self, nbytes: int) -> None:
        """Wait (bounded) while no segment of nbytes or more is idle but one is settling: back-to-back
        requests then reuse one segment, whose memory is still in the CPU's cache, instead of
        alternating between two (BENCHMARKS.md, "benchmarks/shm_segments.py")."""
        pool, settling = self.pool, self.settling
        while True:
            now, wait = time.monotonic(), False
            with self.lock:
                for i in range(len(pool.bufs)):    # no variable bound to a segment: it would count as a user
                    if pool.bufs[i].nbytes < nbytes:
                        continue
                    if pool._idle(i):
                        return
                    until, held = settling.get(id(pool.bufs[i]), (0.0, None))
                    wait = wait or (until > now and (held is None or held() is None))
                if not wait:
                    for key in [k for k, (until, _) in settling.items() if until <= now]:
                        del settling[key]
                    return
            time.sleep(0)          # the I/O thread needs the GIL to handle the reply

    def on_done(self, segs: dict[int, np.ndarray], call: list) -> Callable[[Future], None]:
        """The done callback of a request over `segs`: `done`, after which it lets go of the
        segments (a Future keeps its callbacks: a caller holding the future would keep them busy)."""
        box = [segs]

        def callback(fut: Future) -> None:
            self.done(fut, box.pop(), call)

        return callback

    def done(self, fut: Future, segs: dict[int, np.ndarray], call: list) -> None:
        """A failed or retried request's segments are never reused (the shard may still write them).

        `call` holds the request's transport Call; it is emptied here, since the Call refers back
        to the future (a reference cycle would keep the segments busy until a garbage collection)."""
        retried = bool(call) and call[0].retried
        call.clear()
        if self.settling:
            until = time.monotonic() + SETTLE_GRACE_S
            with self.lock:
                for seg in segs.values():
                    key = id(root(seg))
                    if key in self.settling:
                        was, held = self.settling[key]
                        self.settling[key] = (min(was, until), held)
        if fut.exception() is not None or retried:
            with self.lock:
                for seg in segs.values():
                    self.pool.discard(seg)

    def close(self) -> None:
        if self.pool is not None:
            with self.lock:
                self.pool.close()       # unlinks the segments; mappings live on while a tensor views them


class LateGrads:
    """The grads of one FLAG_GRADS_LATE push (protocol): written into the shards' segments after the
    requests are handed to the I/O thread, so that their way to the shards overlaps the copy. Each
    shard's grads are copied and checked finite in one pass (`native.copy_finite`), then its
    trailer's ready word is published (`native.publish`); the shard waits for it."""

    def __init__(self) -> None:
        self.items: list[tuple[int, list, object, np.ndarray]] = []   # (request, grads [M_i, D] fp32, dst, trailer)
        self.done = threading.Event()
        self.ok = False

    def add(self, request: int, grads: list, dst, trailer: np.ndarray) -> None:
        """Grads float32 [M_i, D] parts to copy into dst float32 [sum M_i, D] (a segment) for `request`."""
        trailer[:] = 0                     # not ready (the segment's last request left its own id)
        self.items.append((request, grads, dst, trailer))

    def write(self, wake_fd: int = -1, wake=None) -> None:
        """Copy every shard's grads and publish ready = request id, or -request id for a shard whose
        copy did not happen (an exception: the shard applies nothing and answers an error).
        wake_fd: written to by the first copy's C call (the I/O thread's wake-up); `wake()` is called
        instead if no copy got to do it."""
        published = 0
        try:
            for request, grads, dst, trailer in self.items:
                finite, start = True, 0
                for g in grads:
                    finite &= native.copy_finite(g.contiguous(), dst[start:start + g.shape[0]], wake_fd)
                    wake_fd, wake = -1, None
                    start += g.shape[0]
                trailer[1] = int(finite)
                native.publish(trailer[0:1], request)
                published += 1
            self.ok = True
        finally:
            if wake is not None:
                wake()
            for request, _, _, trailer in self.items[published:]:
                native.publish(trailer[0:1], -request)
            self.done.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether every shard's grads were written (waits up to timeout_s for `write`)."""
        return self.done.wait(timeout_s) and self.ok


class NotifiedFuture(Future):
    """A Future whose `result()` may come before the reply (protocol.FLAG_NOTIFY): once every shard set
    its segment's done word to DONE_OK, `fast()` builds the result from the segments (what the reply
    would give). Anything else (an error, NO_SHM, a timeout) ends in the reply's result; the client
    sets the words to DONE_REPLY when the future completes, to wake a waiting caller."""

    def __init__(self, words: list[np.ndarray], fast, on_fast=None) -> None:
        super().__init__()
        self.words, self.fast, self.on_fast = words, fast, on_fast
        self.add_done_callback(_wake)      # a function, not a bound method: no cycle through self

    def result(self, timeout: float | None = None):
        words, fast = self.words, self.fast     # _wake lets go of them once the reply is in
        if fast is not None and not self.done():
            deadline = None if timeout is None else time.monotonic() + timeout
            for word in words:
                left = 1e9 if deadline is None else deadline - time.monotonic()
                if native.wait_word(word, left) != DONE_OK:
                    break
            else:
                out = fast()
                on_fast = self.on_fast          # read once: _wake (the I/O thread) may clear it
                if on_fast is not None:
                    on_fast(out)
                return out
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return super().result(timeout)


def _wake(fut: NotifiedFuture) -> None:
    """The reply is in: wake a caller still waiting on the done words, and let go of the segments."""
    for word in fut.words:
        if word[0] == 0:
            native.notify(word, DONE_REPLY)
    fut.words, fut.fast, fut.on_fast = [], None, None


__all__ = ["ClientSegments", "LateGrads", "NotifiedFuture"]
