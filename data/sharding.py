"""Which rows a rank reads in an epoch, and in which order: units -> rank stream -> windows.

A *unit* is one non-empty row group of one file; units are listed in file order, then row-group
order. Each epoch the unit list is permuted (when shuffling) by a generator seeded with
(seed, epoch) - the same on every rank - and laid end to end as one row space [0, N). Rank r of W
reads the contiguous range [r N / W, (r + 1) N / W): every row once per epoch across ranks, row
counts within one of each other, and also when there are fewer files or row groups than ranks
(a unit on a boundary is split into row ranges).

A rank's range, its *stream*, is cut into windows of at most S rows (S = the shuffle buffer),
made of whole row groups where they fit. The loader decodes one window at a time and shuffles the
rows inside it by a permutation seeded with (seed, epoch, rank, window), so any position (window,
offset) can be rebuilt from the files alone: that is what makes an exact resume possible without
storing rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

DEFAULT_WINDOW_ROWS = 65536
"""Decode window when rows are not shuffled (only memory and speed depend on it)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [start, stop) of row group `row_group` of file `source` (an index into the sources)."""

    source: int
    row_group: int
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start

    def part(self, a: int, b: int) -> Piece:
        """Its rows [a, b) (0: its first row)."""
        return Piece(self.source, self.row_group, self.start + a, self.start + b)


def cut(spans: Sequence[Any], lo: int, hi: int) -> list[Any]:
    """The parts of `spans` (`Piece`s, or elastic `Segment`s) that hold rows [lo, hi) of them laid end
    to end, in order."""
    out, base = [], 0
    for s in spans:
        if base >= hi:
            break
        a, b = max(lo, base), min(hi, base + s.num_rows)
        if a < b:
            out.append(s.part(a - base, b - base))
        base += s.num_rows
    return out


def list_units(row_group_rows: list[tuple[int, ...]]) -> list[Piece]:
    """Every non-empty row group of every file, whole, in (file, row group) order."""
    return [Piece(s, g, 0, n) for s, rgs in enumerate(row_group_rows) for g, n in enumerate(rgs) if n > 0]


def epoch_seed(seed: int, *parts: int) -> np.random.Generator:
    """A generator determined by (seed, *parts) only (non-negative ints for SeedSequence)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed % (1 << 64), *parts])))


def rank_stream(units: list[Piece], *, epoch: int, seed: int, shuffle: bool, rank: int,
                world_size: int) -> list[Piece]:
    """The pieces rank `rank` reads in epoch `epoch`, in reading order."""
    order = epoch_seed(seed, epoch, 0).permutation(len(units)) if shuffle else range(len(units))
    total = sum(u.num_rows for u in units)
    return cut([units[i] for i in order], rank * total // world_size, (rank + 1) * total // world_size)


class Windows:
    """A rank stream cut into windows of at most `window_rows` rows.

    Windows hold whole pieces where they can (consecutive pieces while they fit), so a window is
    usually one row group and needs no concatenation; a piece longer than `window_rows` is cut
    into ceil(rows / window_rows) near-equal parts first.
    """

    def __init__(self, pieces: list[Piece], window_rows: int) -> None:
        self.windows: list[list[Piece]] = []
        """window w: the (parts of) pieces it is made of, in stream order"""
        cur: list[Piece] = []
        cur_rows = 0
        for p in pieces:
            k = -(-p.num_rows // window_rows)
            for i in range(k):
                part = p.part(i * p.num_rows // k, (i + 1) * p.num_rows // k)
                if cur and cur_rows + part.num_rows > window_rows:
                    self.windows.append(cur)
                    cur, cur_rows = [], 0
                cur.append(part)
                cur_rows += part.num_rows
        if cur:
            self.windows.append(cur)
        self.starts = [0, *accumulate(sum(p.num_rows for p in win) for win in self.windows)]
        """[num_windows + 1]: window w holds rows [starts[w], starts[w + 1]) of the stream"""
        self.num_rows, self.num_windows = self.starts[-1], len(self.windows)
