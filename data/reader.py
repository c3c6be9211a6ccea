"""The rank's read plan: (file, row group) units -> shuffled windows of rows -> `Batch`es, each in an
`Item` with the position after it; `Reader` is what `data.loader.ParquetLoader` runs (on its prefetch
thread) over the rank's stream (data/sharding.py) or an elastic plan (data/elastic.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from data.batch import Batch, validate_batch
from data.config import DataConfig
from data.elastic import Part, Segment, plan_parts, plan_row_groups, plan_rows
from data.parquet import DataError, Decoder, ParquetSource, read_row_group, resolve_paths, scan_files
from data.remote import parquet_file
from data.rows import Index, Rows, gather
from data.sharding import DEFAULT_WINDOW_ROWS, Windows, epoch_seed, list_units, rank_stream

logger = logging.getLogger(__name__)

_MAX_OPEN_FILES = 8


@dataclass(frozen=True, slots=True)
class Item:
    """One step of the stream: a batch (None at the end of the epoch) and the position after it:
    (window, offset) in the rank stream, or (0, rows done) in an elastic plan."""

    batch: Batch | None
    window: int
    offset: int
    bad_rows: int
    """rows dropped in the windows this item entered first"""


class _Files:
    """Reads the row groups of a stream in order, with `readahead` one row group ahead on a worker thread.

    `keys` is the order the producer will ask for (source, row group); the open Parquet files (a
    few, LRU) are used by the worker thread only (or by the caller's thread without readahead).
    """

    def __init__(self, sources: list[ParquetSource], columns: tuple[str, ...], keys: list[tuple[int, int]],
                 readahead: bool) -> None:
        self.sources, self.columns = sources, columns
        self.open: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        self.keys = deque(keys)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="parquet-read") if readahead else None
        self.ahead: deque[tuple[tuple[int, int], Future[pa.Table]]] = deque()
        self.key: tuple[int, int] | None = None
        self.table: pa.Table | None = None

    def _read(self, src: int, rg: int) -> pa.Table:
        source = self.sources[src]
        pf = self.open.pop(src, None)
        if pf is None:
            try:
                pf = parquet_file(source.path, metadata=source.metadata)
            except Exception as e:
                raise DataError(f"{source.path}: row group {rg}: cannot open ({type(e).__name__}: {e})") from e
        self.open[src] = pf
        if len(self.open) > _MAX_OPEN_FILES:
            self.open.popitem(last=False)[1].close()
        return read_row_group(source, pf, rg, self.columns)

    def row_group(self, src: int, rg: int) -> pa.Table:
        """The `columns` of row group `rg` of source `src` (the last one is kept)."""
        key = (src, rg)
        if self.key == key:
            return self.table
        self.key, self.table = None, None                # drop the previous row group first
        if self.keys and self.keys[0] == key:            # asked in `keys` order (or again after a failure)
            self.keys.popleft()
        if self.pool is None:
            table = self._read(src, rg)
        else:
            fut = self.ahead.popleft()[1] if self.ahead and self.ahead[0][0] == key else \
                self.pool.submit(self._read, src, rg)
            for nxt in islice(self.keys, len(self.ahead), 1):
                self.ahead.append((nxt, self.pool.submit(self._read, *nxt)))
            table = fut.result()
        self.key, self.table = key, table
        return table

    def close(self) -> None:
        self.key, self.table = None, None
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        self.ahead.clear()
        while self.open:
            self.open.popitem()[1].close()


class Reader:
    """The immutable part of a loader: what to read and how; produces a rank's stream of `Item`s."""

    def __init__(self, cfg: DataConfig, paths: Sequence[str], rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.sources, is_list, self.skipped = scan_files(cfg, resolve_paths(paths))
        self.decoder = Decoder(cfg, is_list)
        self.units = list_units([s.row_group_rows for s in self.sources])
        self.row_shuffle = cfg.shuffle and cfg.shuffle_buffer_rows > 0
        self.window_rows = cfg.shuffle_buffer_rows if self.row_shuffle else DEFAULT_WINDOW_ROWS
        self.pin = cfg.pin_memory and torch.cuda.is_available()
        self.fingerprint = hashlib.sha1("".join(
            f"{os.path.basename(s.path.partition('?')[0])}:{','.join(map(str, s.row_group_rows))};"
            for s in self.sources).encode()).hexdigest()

    def windows(self, epoch: int, world: int | None = None, rank: int | None = None) -> Windows:
        """The windows of the stream of `rank` of `world` ranks (default: this loader's) in `epoch`."""
        pieces = rank_stream(self.units, epoch=epoch, seed=self.cfg.seed, shuffle=self.cfg.shuffle,
                             rank=self.rank if rank is None else rank,
                             world_size=self.world_size if world is None else world)
        return Windows(pieces, self.window_rows)

    def _window(self, files: _Files, windows: Windows, w: int) -> tuple[Rows | None, int]:
        """(the kept rows of window w in file order - None if none, rows dropped)."""
        parts, dropped = [], 0
        for p in windows.windows[w]:
            path = self.sources[p.source].path
            try:
                table = files.row_group(p.source, p.row_group)
            except DataError as e:
                if self.cfg.on_bad_rows == "error":
                    raise
                logger.warning("skipping %d rows: %s", p.num_rows, e)
                dropped += p.num_rows
                continue
            rows, n_bad, why = self.decoder.decode(table.slice(p.start, p.num_rows),
                                                   f"{path}: row group {p.row_group}", p.start)
            if n_bad:
                logger.warning("%s: row group %d rows %d..%d: skipped %d bad rows (%s)", path, p.row_group,
                               p.start, p.stop - 1, n_bad, ", ".join(f"{k}: {v}" for k, v in why.items()))
            dropped += n_bad
            if len(rows):
                parts.append(rows)
        return (Rows.concat(parts) if parts else None), dropped

    def _batch(self, segments: list[tuple[Rows, Index]]) -> Batch:
        batch = gather(segments, self.decoder.layout)
        if self.cfg.validate_batches:
            validate_batch(batch)
        return batch.pin_memory() if self.pin else batch

    def stream(self, epoch: int, window: int, offset: int) -> Iterator[Item]:
        """Items of `epoch` from position (window, offset) to the end (a final item with batch None)."""
        windows, key = self.windows(epoch), (self.world_size, self.rank)
        parts = [Part(*key, w, offset if w == window else 0, windows.starts[w + 1] - windows.starts[w], 0, 0)
                 for w in range(window, windows.num_windows)]                   # (base, end: unused here)
        yield from self._items(epoch, parts, {key: windows}, (max(windows.num_windows, window), 0),
                               lambda p, pos, stop: (p.window, pos) if pos < stop else (p.window + 1, 0), strict=True)

    def plan_stream(self, epoch: int, plan: list[Segment], done: int) -> Iterator[Item]:
        """Items of `epoch` over rows [done, end) of an elastic plan (data/elastic.py), at positions
        (0, rows of the plan done); a final item with batch None."""
        streams = {(s.world, s.rank): self.windows(epoch, s.world, s.rank) for s in plan}
        yield from self._items(epoch, plan_parts(plan, done, streams), streams, (0, plan_rows(plan)),
                               lambda p, pos, stop: (0, p.base + pos if pos < stop else p.end), strict=False)

    def _items(self, epoch: int, parts: list[Part], streams: dict[tuple[int, int], Windows], end: tuple[int, int],
               at: Callable[[Part, int, int], tuple[int, int]], strict: bool) -> Iterator[Item]:
        """Batches of the places of `parts` in order, each at position at(part, place after it, the part's
        stop), then the last (partial) batch and the final item (batch None) at position `end`.

        The whole window is decoded, as its kept rows and their order depend on all of it; a window
        that two parts in a row need is decoded once. A window's dropped rows count once: in the part
        that starts at its place 0. A part that starts past its window's kept rows (under "skip") is
        empty, or with `strict` (a resumed rank-stream position) a ValueError.
        """
        files = _Files(self.sources, self.decoder.columns, plan_row_groups(parts, streams),
                       self.cfg.prefetch_batches > 0)
        B, carry, filled, bad = self.cfg.batch_size, [], 0, 0   # carry: (rows, index) of the next batch's `filled` rows
        try:
            for i, p in enumerate(parts):
                if i == 0 or not p.same_window(parts[i - 1]):
                    rows, dropped = self._window(files, streams[p.world, p.rank], p.window)
                    n = 0 if rows is None else len(rows)
                    order = epoch_seed(self.cfg.seed, epoch, 1, p.rank, p.window).permutation(n) \
                        if self.row_shuffle else None
                if p.a == 0:
                    bad += dropped             # counted by the item that enters the window
                if strict and p.a > n:
                    raise ValueError(f"resume position (window {p.window}, offset {p.a}) is past the "
                                     f"window's {n} rows: the data changed since the state was saved")
                pos, stop = min(p.a, n), min(p.c, n)
                while pos < stop:
                    take = min(B - filled, stop - pos)
                    carry.append((rows, slice(pos, pos + take) if order is None else order[pos:pos + take]))
                    filled, pos = filled + take, pos + take
                    if filled == B:
                        yield Item(self._batch(carry), *at(p, pos, stop), bad)
                        carry, filled, bad = [], 0, 0
            if filled and not self.cfg.drop_last:
                yield Item(self._batch(carry), *end, bad)
                bad = 0
            yield Item(None, *end, bad)
        finally:
            files.close()
