"""`ParquetLoader`: Parquet files -> `Batch`es for one rank, shuffled, prefetched, exactly resumable.

    loader = ParquetLoader(cfg.data, cfg.data.train_paths, rank=r, world_size=W)
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:            # Batch of cfg.batch_size rows (the last may be smaller)
            ...
        state = loader.state_dict()     # JSON-able; into the checkpoint
    loader.close()

Order: data/sharding.py. The position is (epoch, window, offset inside the window; under
on_bad_rows = "skip" the offset counts the rows kept), so `state_dict()` after any batch and
`load_state_dict()` into a new loader continue with exactly the rows an uninterrupted read would
have given, without storing rows; then iterate epochs from `state["epoch"]`. Ranks read within one
row of each other; `num_batches` lets a DDP trainer agree on a common step count. Another number
of ranks: `resume_from` (data/elastic.py), with `remaining_batches` for that epoch.

A daemon thread decodes `prefetch_batches` batches ahead; its exceptions are raised in the
consumer. The position reported is that of the batches the consumer has received.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import Any

from data.batch import Batch
from data.config import DataConfig
from data.elastic import (STATE_VERSION, Segment, check_old_states, check_state, plan_rows, share, stream_rows,
                          unread_segments)
from data.parquet import DataError
from data.reader import Item, Reader

__all__ = ["DataError", "ParquetLoader"]

logger = logging.getLogger(__name__)

class _Prefetcher:
    """Runs an item generator on a daemon thread, at most `depth` items ahead of the consumer."""

    def __init__(self, items: Iterator[Item], depth: int) -> None:
        self._q: queue.Queue[Any] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(items,), name="parquet-prefetch", daemon=True)
        self._thread.start()

    def _run(self, items: Iterator[Item]) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
        except BaseException as e:       # handed to the consumer, raised there
            self._put(e)
        finally:
            items.close()

    def _put(self, x: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(x, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def __next__(self) -> Item:
        while True:
            try:
                x = self._q.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._q.empty():
                    raise RuntimeError("the Parquet prefetch thread ended without a result") from None
                continue
            if isinstance(x, BaseException):
                raise x
            return x

    def close(self) -> None:
        self._stop.set()
        if threading.current_thread() is self._thread:     # (a garbage collection ran on the thread)
            return
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            logger.warning("the Parquet prefetch thread did not stop within 60 s")


class ParquetLoader:
    """Batches of one rank from Parquet files, directories or globs (also a context manager: `close()`
    on exit); see the module docstring."""

    def __init__(self, config: DataConfig, paths: Sequence[str], *, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if not paths:
            raise DataError("no data paths given")
        self._reader = Reader(config, paths, rank, world_size)
        self.config = config
        self._active: weakref.ref[Generator[Batch, None, None]] | None = None
        self._epoch = self._window = self._offset = self._batches = self._bad = 0
        self._resume = False
        self._plan: list[Segment] | None = None
        """an elastic plan (data/elastic.py) for this epoch, with _offset its rows done; None: the rank stream"""

    # -- sizes --------------------------------------------------------------------------------

    @property
    def files(self) -> list[str]:
        """The files read (after expanding directories and globs, minus skipped ones)."""
        return [s.path for s in self._reader.sources]

    @property
    def skipped_files(self) -> list[str]:
        """Files left out as empty or unreadable under on_bad_rows = "skip"."""
        return list(self._reader.skipped)

    @property
    def total_rows(self) -> int:
        """Rows in all readable files (all ranks)."""
        return sum(u.num_rows for u in self._reader.units)

    @property
    def num_rows(self) -> int:
        """Rows this rank reads per epoch (the same every epoch; fewer if bad rows are skipped)."""
        return stream_rows(self.total_rows, self._reader.world_size, self._reader.rank)

    @property
    def num_batches(self) -> int:
        """Batches this rank yields per epoch (fewer if bad rows are skipped)."""
        return self._batches_of(self.num_rows)

    @property
    def remaining_batches(self) -> int:
        """Batches this rank still yields in the current epoch from the current (or restored)
        position: what the next pass yields after load_state_dict / resume_from / set_epoch (exact
        unless bad rows are skipped). After resume_from, ranks agree on the min over ranks of it."""
        if self._plan is not None:
            left = plan_rows(self._plan) - self._offset
        else:
            windows = self._reader.windows(self._epoch)
            left = windows.num_rows - windows.starts[min(self._window, windows.num_windows)] - self._offset
        return self._batches_of(max(left, 0))

    def _batches_of(self, rows: int) -> int:
        B = self.config.batch_size
        return rows // B if self.config.drop_last else -(-rows // B)

    @property
    def num_bad_rows(self) -> int:
        """Rows dropped so far under on_bad_rows = "skip" (all epochs; restored by load_state_dict)."""
        return self._bad

    # -- iteration ----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` next, from its start - or from a position restored for that epoch."""
        self._stop_active()
        if self._resume and epoch == self._epoch:
            return
        self._epoch, self._window, self._offset, self._batches, self._resume, self._plan = epoch, 0, 0, 0, False, None

    def __iter__(self) -> Iterator[Batch]:
        self._stop_active()
        if not self._resume:
            self._window = self._offset = self._batches = 0
        self._resume = False
        if self._plan is None:
            items = self._reader.stream(self._epoch, self._window, self._offset)
        else:                                   # the rest of an elastic plan (see resume_from)
            items = self._reader.plan_stream(self._epoch, self._plan, self._offset)
        it = self._pass(items)
        self._active = weakref.ref(it)
        return it

    def _pass(self, items: Iterator[Item]) -> Generator[Batch, None, None]:
        """The batches of `items` (decoded on a prefetch thread, started at the first batch asked for, when
        prefetch_batches > 0), the position moved by each one received; closing the pass stops the thread."""
        depth = self.config.prefetch_batches
        source = _Prefetcher(items, depth) if depth > 0 else items
        try:
            while True:
                item = next(source)
                self._window, self._offset = item.window, item.offset
                self._bad += item.bad_rows
                if item.batch is None:
                    if self._bad:
                        logger.info("epoch %d rank %d: %d bad rows skipped so far", self._epoch, self._reader.rank,
                                    self._bad)
                    return
                self._batches += 1
                yield item.batch
        finally:
            source.close()

    def _stop_active(self) -> None:
        if self._active is not None and (it := self._active()) is not None:
            it.close()
        self._active = None

    # -- checkpointing ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the batches received so far; plain ints, strings and lists (JSON-able).

        'epoch', 'window', 'offset' (rows of the window done), 'batches' (this pass), 'num_bad_rows',
        and what the position depends on: 'rank', 'world_size', 'seed', 'shuffle', 'window_rows',
        'dataset'. After resume_from with another world size the position is an elastic plan:
        'elastic' = 1, 'segments' = [[world, rank, lo, hi], ...] (rows [lo, hi) of rank `rank` of
        `world`'s stream, in its order) and 'done' (rows of them read); else 0, [] and 0.
        """
        r, plan = self._reader, self._plan
        return {"version": STATE_VERSION, "epoch": self._epoch, "window": self._window,
                "offset": self._offset if plan is None else 0, "batches": self._batches,
                "num_bad_rows": self._bad, "rank": r.rank, "world_size": r.world_size, "seed": self.config.seed,
                "shuffle": int(self.config.shuffle), "window_rows": r.window_rows, "dataset": r.fingerprint,
                "elastic": int(plan is not None), "segments": [[s.world, s.rank, s.lo, s.hi] for s in plan or ()],
                "done": 0 if plan is None else self._offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from `state_dict()` of a loader over the same data and layout, with
        the same rank and world size; see resume_from for another world size)."""
        plan = self._check_state(state, "loader state")
        for key, mine in (("rank", self._reader.rank), ("world_size", self._reader.world_size)):
            if state.get(key) != mine:
                raise ValueError(f"loader state was saved with {key} = {state.get(key)!r}, this loader has "
                                 f"{mine!r}; the position would not match (resume_from takes the "
                                 f"states of all ranks of another world size)")
        self._stop_active()
        self._epoch, self._batches, self._bad = state["epoch"], state["batches"], state["num_bad_rows"]
        self._resume, self._plan = True, plan
        self._window, self._offset = (state["window"], state["offset"]) if plan is None else (0, state["done"])

    def resume_from(self, states: Sequence[dict[str, Any]]) -> None:
        """Continue an epoch from the `state_dict()`s of every rank of a previous run (index = old
        rank), of any world size W_old, all at the same epoch.

        W_old = this world size: exactly load_state_dict(states[rank]). Otherwise this rank reads its
        share of the rows no old rank has read yet (data/elastic.py); later epochs are ordinary.
        num_bad_rows: rank 0 takes the old ranks' sum.
        """
        epoch = check_old_states(states)
        plans = [self._check_state(st, f"states[{i}]") for i, st in enumerate(states)]
        r = self._reader
        if len(states) == r.world_size:
            self.load_state_dict(states[r.rank])
            return
        unread = [seg for i, st in enumerate(states) for seg in
                  unread_segments(st, plans[i], r.windows(epoch, len(states), i), f"states[{i}]")]
        self._stop_active()
        self._plan = share(unread, rank=r.rank, world_size=r.world_size)
        self._epoch, self._window, self._offset, self._batches, self._resume = epoch, 0, 0, 0, True
        self._bad = sum(st["num_bad_rows"] for st in states) if r.rank == 0 else 0

    def _check_state(self, state: Any, where: str) -> list[Segment] | None:
        """`check_state` against this loader's data and layout."""
        r = self._reader
        return check_state(state, where, {"seed": self.config.seed, "shuffle": int(self.config.shuffle),
                                          "window_rows": r.window_rows, "dataset": r.fingerprint}, self.total_rows)

    def describe_rows(self, before: dict[str, Any], after: dict[str, Any]) -> str:
        """Where the rows of the batch between positions `before` and `after` (state_dicts) come
        from: files and row ranges, e.g. "part-0.parquet rows 800..1600 (row group 1)". With row
        shuffling the batch holds some of those rows, in the window's shuffled order."""
        if before.get("elastic") or after.get("epoch") != before.get("epoch"):
            return f"rows {before.get('done', 0)}..{after.get('done', 0)} of this rank's elastic share"
        windows = self._reader.windows(int(before["epoch"]))
        last = int(after["window"]) - (1 if int(after["offset"]) == 0 else 0)
        parts = []
        for w in range(int(before["window"]), min(last, windows.num_windows - 1) + 1):
            for p in windows.windows[w]:
                src = self._reader.sources[p.source]
                first = sum(src.row_group_rows[: p.row_group])      # the row group's first row in the file
                parts.append(f"{src.path} rows {first + p.start}..{first + p.stop} (row group {p.row_group})")
        shuffled = " (shuffled: the batch holds some of these rows)" if self._reader.row_shuffle else ""
        return "; ".join(parts[:4]) + (f"; and {len(parts) - 4} more" if len(parts) > 4 else "") + shuffled

    # -- resources ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the prefetch thread of an unfinished pass (the loader can still be iterated again)."""
        self._stop_active()

    def __enter__(self) -> ParquetLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
