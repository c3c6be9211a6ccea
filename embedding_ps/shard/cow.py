"""A background save with bounded extra memory: a chunked, copy-on-write snapshot of one shard.

What a save must write is the state at one instant (the SAVE; in sync mode the step it names).
Copying everything then holds a second full copy of the rows; this module copies almost nothing:

- At the snapshot (under the shard's lock: the only pause) the small arrays are copied (id map
  items, free stack, admission counters, eviction log: 12 bytes per row plus the waiting ids) and
  each table's slot-major arrays (weights, optimizer state, meta = counters and TTL stamps) are
  frozen *logically* at `hwm` rows: nothing is copied.
- The writer walks those rows in chunks, in order. For each chunk it takes the lock, copies the
  chunk's live rows into one reused chunk buffer, puts back the pre-images saved for rows of that
  chunk (below), moves `done` past the chunk and releases the lock; it writes and hashes the chunk
  without the lock.
- Before the shard modifies a row `s < hwm` with `s >= done` that has no pre-image yet (a push,
  an admitted id taking a reused slot, a re-sharding insert), `before_write` copies the row of
  every slot-major array into a side buffer entry. An entry is freed when the writer passes its
  chunk, so the side buffer holds only rows of chunks not yet written.
- Back-pressure: when a table's side buffer has no room for what an update needs, the update waits
  (the lock released) until the writer has passed enough rows, so the bound holds (but see below).

Accounted extra memory (`extra_bytes`, peak `extra_bytes_peak`): the small copies, one byte per
frozen row (the "saved" flags), the chunk buffer plus one `PIECE_ROWS` temporary, 8 bytes per side
buffer entry (its slot and free-stack place) and the rows of the side buffer's entries in use.
The side buffers' capacity is what `bound_bytes` leaves after the rest (split over the tables by
their rows' bytes). When the rest alone passes the bound (rows of fewer than ~130 bytes: the id map
copy is 12 bytes a row), the side buffers get `SIDE_FLOOR` of the rows' bytes instead (none would
make every update of an unwritten row wait for the writer) and a warning says how much the save
holds. The side buffers are allocated lazily (untouched pages are not resident) and reused
last-in first-out, so resident memory follows the accounted bytes.

Not thread-safe on its own: every method runs under the shard's lock (`cond`), except
`RowStream.chunks`, which takes it per chunk.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
"""Largest chunk the writer copies under the lock (all slot-major arrays of a table together)."""
PIECE_ROWS = 4096
"""Rows gathered per temporary when pre-images move into or out of the side buffer (at most the
chunk's rows: that temporary is accounted with the chunk buffer)."""
WAIT_LOG_S = 10.0
"""An update waiting for the writer logs every this many seconds."""
SIDE_FLOOR = 0.02
"""The side buffers' size, as a fraction of the rows' bytes, when the copies alone pass the bound
(see the module doc)."""
STALL_S = 120.0
"""An update that waited this long for room while the writer did not move on raises RuntimeError
(e.g. `snapshot()` then updates on the thread that was to call `write`: nobody would write)."""


class RowStream:
    """One table's slot-major arrays, frozen at `rows` rows, handed to the writer chunk by chunk: a
    `snapshot.TableSnapshot.rows` whose chunks are views of a reused buffer, valid until the next one."""

    def __init__(self, save: "CowSave", tensors: Callable[[], dict[str, torch.Tensor]], rows: int) -> None:
        self.save, self.tensors, self.rows = save, tensors, rows
        live = tensors()
        self.specs = {n: ((rows, *t.shape[1:]), t.numpy().dtype) for n, t in live.items()}
        self.row_bytes = sum(int(np.prod(t.shape[1:], dtype=np.int64)) * t.element_size() for t in live.values())
        self.entry_bytes = self.row_bytes + 8           # + the entry's slot and free-stack place (int32 each)
        self.done = 0                                   # rows [0, done) are written: no pre-image needed
        self.saved = np.zeros(rows, dtype=bool)         # row has a pre-image (calloc: pages on first touch)
        self._side: dict[str, torch.Tensor] | None = None
        self._slot = np.full(0, -1, dtype=np.int32)     # entry -> row, -1: free
        self._ehwm = 0                                  # entries [0, _ehwm) have been used

    def size(self, capacity: int, chunk_rows: int) -> None:
        """Set the side buffer's entries and the rows per chunk (`CowSave`: its share of the bound)."""
        self.capacity = capacity
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int32)   # stack of free entries, top at the end
        self._nfree = capacity
        self.chunk_rows = chunk_rows
        self.piece = min(chunk_rows, PIECE_ROWS)        # rows per temporary

    def need(self, slots: np.ndarray) -> np.ndarray:
        """Distinct rows int32 [K] of `slots` that still need a pre-image before being modified."""
        s = slots[(slots >= self.done) & (slots < self.rows)]
        return np.unique(s[~self.saved[s]]) if s.shape[0] else s

    def preserve(self, rows: np.ndarray) -> None:
        """Copy rows int32 [K] (from `need`, K <= free entries) of every array into side entries."""
        k = rows.shape[0]
        if k == 0:
            return
        if self._side is None:        # torch.empty: nothing resident until written
            live = self.tensors()
            self._side = {n: torch.empty((self.capacity, *t.shape[1:]), dtype=t.dtype) for n, t in live.items()}
            self._slot = np.full(self.capacity, -1, dtype=np.int32)
        entries = self._free[self._nfree - k : self._nfree][::-1].copy()
        self._nfree -= k
        self._ehwm = max(self._ehwm, int(entries.max()) + 1)
        e, r = torch.from_numpy(entries).long(), torch.from_numpy(rows).long()
        for name, t in self.tensors().items():
            for lo in range(0, k, self.piece):
                self._side[name].index_copy_(0, e[lo : lo + self.piece], t.index_select(0, r[lo : lo + self.piece]))
        self._slot[entries] = rows
        self.saved[rows] = True
        self.save.preserved += k

    def chunks(self) -> Iterator[dict[str, np.ndarray]]:
        """The frozen rows, chunk by chunk (each copied under the shard's lock; see the module doc)."""
        if self.rows == 0:
            with self.save.cond:
                self.release()
            return
        n = max(1, min(self.chunk_rows, self.rows))
        with self.save.cond:
            buf = {name: torch.empty((n, *t.shape[1:]), dtype=t.dtype) for name, t in self.tensors().items()}
            self.save.account_chunk((n + self.piece) * self.row_bytes)
        for lo in range(0, self.rows, n):
            hi = min(lo + n, self.rows)
            with self.save.cond:
                t0 = time.perf_counter()
                self._copy_chunk(buf, lo, hi)
                self.save.held(time.perf_counter() - t0)
            yield {name: b[: hi - lo].numpy() for name, b in buf.items()}
        # no try/finally here: a generator finalized by the GC in a thread holding the lock would
        # deadlock on it. A failed write ends the save through `CowSave.close` instead.
        del buf
        with self.save.cond:
            self.save.account_chunk(0)
            self.release()

    def _copy_chunk(self, buf: dict[str, torch.Tensor], lo: int, hi: int) -> None:
        """Under the lock: buf[:hi-lo] = rows [lo, hi) as of the snapshot; frees their entries."""
        for name, t in self.tensors().items():
            buf[name][: hi - lo].copy_(t[lo:hi])
        if self._ehwm:
            slot = self._slot[: self._ehwm]
            entries = np.flatnonzero((slot >= lo) & (slot < hi)).astype(np.int32)
            if entries.shape[0]:
                e = torch.from_numpy(entries).long()
                at = torch.from_numpy(slot[entries] - lo).long()
                for name, b in buf.items():
                    side = self._side[name]
                    for i in range(0, e.shape[0], self.piece):
                        b.index_copy_(0, at[i : i + self.piece], side.index_select(0, e[i : i + self.piece]))
                slot[entries] = -1
                self._free[self._nfree : self._nfree + entries.shape[0]] = entries
                self._nfree += entries.shape[0]
        self.done = hi
        self.save.changed()

    def release(self) -> None:
        """Drop the side buffer and flags (every row written, or the save ended): waiting updates go on."""
        self._side, self._slot, self.saved = None, np.full(0, -1, dtype=np.int32), np.zeros(0, dtype=bool)
        self._free, self._nfree, self.capacity, self.done = np.zeros(0, dtype=np.int32), 0, 0, self.rows
        self.save.changed()


class CowSave:
    """The copy-on-write state of one background save of a shard: one `RowStream` per table.

    `cond` is a Condition over the shard's lock; `tables` gives, per table, a callable returning its
    live slot-major tensors {name: [C, ...]} and its frozen row count; `fixed_bytes` are the small
    arrays copied at the snapshot; `extra_memory` the most extra memory the save may hold, as a
    fraction of the frozen rows' bytes (`ps.checkpoint_extra_memory`; `bound_bytes` in bytes).
    """

    def __init__(self, cond: threading.Condition, tables: list[tuple[Callable[[], dict[str, torch.Tensor]], int]],
                 fixed_bytes: int, extra_memory: float, where: str = "") -> None:
        self.cond, self.where = cond, where
        self.closed = False
        self.progress = 0                   # chunks the writer has taken, over all tables
        self.preserved = 0                  # pre-images saved, over all tables
        self.waits, self.wait_s, self.wait_max_s, self.hold_max_s, self.hold_total_s = 0, 0.0, 0.0, 0.0, 0.0
        self._chunk_bytes = 0
        self.streams = [RowStream(self, fn, rows) for fn, rows in tables]
        rows_bytes = [s.rows * s.row_bytes for s in self.streams]
        self.rows_bytes = sum(rows_bytes)
        self.bound_bytes = int(math.floor(extra_memory * self.rows_bytes))
        self.fixed_bytes = int(fixed_bytes) + sum(s.rows for s in self.streams)      # + the "saved" flags
        # the chunk buffer (and its temporary): at most CHUNK_BYTES, and at most an eighth of the bound
        chunk = max(1, min(CHUNK_BYTES, self.bound_bytes // 8))
        chunk_rows = [max(1, chunk // max(s.row_bytes, 1)) for s in self.streams]
        chunk_max = max(((r + min(r, PIECE_ROWS)) * s.row_bytes for r, s in zip(chunk_rows, self.streams)), default=0)
        side = self.bound_bytes - self.fixed_bytes - chunk_max
        if side < 0:                        # the bound cannot hold: pass it by the least that keeps pushes going
            side = int(SIDE_FLOOR * self.rows_bytes)
            logger.warning("%s: a background save needs %d bytes besides its side buffer, more than the bound of "
                           "%d (ps.checkpoint_extra_memory): the side buffer gets %d bytes (%.0f%% of the rows') "
                           "and the save holds up to %d", where, self.fixed_bytes + chunk_max, self.bound_bytes,
                           side, 100 * SIDE_FLOOR, self.fixed_bytes + chunk_max + side)
        for s, rb, r in zip(self.streams, rows_bytes, chunk_rows):
            share = side * rb // self.rows_bytes if self.rows_bytes else 0
            s.size(int(share // s.entry_bytes), r)
        self.extra_bytes_peak = self.extra_bytes

    # -- accounting --------------------------------------------------------------------------------
    @property
    def extra_bytes(self) -> int:
        """Bytes held now for the save (what the module doc's "Accounted extra memory" lists)."""
        return (self.fixed_bytes + self._chunk_bytes
                + sum(s.capacity * s.entry_bytes - s._nfree * s.row_bytes for s in self.streams))

    def _note_peak(self) -> None:
        self.extra_bytes_peak = max(self.extra_bytes_peak, self.extra_bytes)

    def account_chunk(self, nbytes: int) -> None:
        self._chunk_bytes = nbytes
        self._note_peak()

    def held(self, seconds: float) -> None:
        """The writer held the lock `seconds` to copy a chunk."""
        self.hold_total_s += seconds
        self.hold_max_s = max(self.hold_max_s, seconds)

    def changed(self) -> None:
        """The writer moved on: updates waiting for room may go on."""
        self.progress += 1
        self.cond.notify_all()

    def stats(self) -> dict[str, float | int]:
        return {"extra_bytes_peak": self.extra_bytes_peak, "extra_bytes_bound": self.bound_bytes,
                "rows_bytes": self.rows_bytes, "preserved_rows": self.preserved, "push_waits": self.waits,
                "push_wait_s": self.wait_s, "push_wait_max_s": self.wait_max_s,
                "chunk_hold_max_s": self.hold_max_s, "chunk_hold_total_s": self.hold_total_s}

    # -- the update side ---------------------------------------------------------------------------
    def before_write(self, table: int, candidates: Callable[[], np.ndarray]) -> None:
        """Under the lock, before table `table` modifies rows: save the pre-images of the rows
        `candidates()` int32 [N] (every row the update may write) that the writer has not passed.

        Waits (releasing the lock) while the side buffer has no room; `candidates` is called again
        after each wait, as other updates may have run meanwhile. RuntimeError when the writer has
        not moved on for STALL_S.
        """
        stream = self.streams[table]
        t0, logged = None, 0.0
        try:
            while not self.closed:
                rows = stream.need(candidates())
                if rows.shape[0] <= stream._nfree:
                    stream.preserve(rows)
                    self._note_peak()
                    return
                if t0 is None:
                    t0 = time.perf_counter()
                    self.waits += 1
                progress, deadline = self.progress, time.monotonic() + STALL_S
                while self.progress == progress and not self.closed:    # until the writer moves on
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RuntimeError(f"{self.where}: an update of table {table} needs room for {rows.shape[0]} "
                                           f"pre-images ({stream._nfree} free) but the background save's writer has "
                                           f"not moved on for {STALL_S:.0f} s (is `ShardSnapshot.write` running on "
                                           "another thread?)")
                    self.cond.wait(timeout=min(left, 1.0))
                waited = time.perf_counter() - t0
                if waited - logged >= WAIT_LOG_S:
                    logged = waited
                    logger.info("%s: an update of table %d waits for the background save (%.0f s: %d rows need "
                                "room, %d free)", self.where, table, waited, rows.shape[0], stream._nfree)
        finally:
            if t0 is not None:
                waited = time.perf_counter() - t0
                self.wait_s += waited
                self.wait_max_s = max(self.wait_max_s, waited)

    def close(self) -> None:
        """End the save (written or failed): no more pre-images, waiting updates go on. Under the lock."""
        self.closed = True
        for s in self.streams:
            s.release()


__all__ = ["CHUNK_BYTES", "CowSave", "RowStream"]
