"""Elastic resume: the rows of an epoch that the ranks of a previous run left unread, split anew.

A *stream* is what rank r of W reads in an epoch (data/sharding.py), in its own order: its windows
one after the other, the rows of a window in their shuffled order. Row i of a stream is the i-th in
that order; window w holds rows [starts[w], starts[w + 1]). Under on_bad_rows = "skip" a window's
kept rows take its first places and the dropped ones its last, so a row range still names a set of
examples: read the whole window, shuffle its kept rows, take the places in the range.

A *plan* is a list of segments - rows [lo, hi) of stream (world, rank) - read one after the other,
and a position in it is the number of its rows done. A rank stopped at (window, offset) of its own
stream leaves [starts[window] + offset, end) unread. When the world size changes, the *remainder*
(old rank 0's unread segments, then old rank 1's, ...) of R rows is cut like a row space in
rank_stream: new rank r of W' reads rows [r R / W', (r + 1) R / W') of it, in that order. Since a
plan's state is (segments, rows done), the remainder of a remainder is found the same way, so
chains of world sizes (2 -> 1 -> 2 -> 3) still read every example of the epoch exactly once.

    unread = [seg for st in old_states for seg in after(plan_of(st), done_of(st))]
    plan = share(unread, rank=r, world_size=W)     # this rank's segments
    parts = plan_parts(plan, 0, windows_of)         # what to decode, window by window
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from data.sharding import Windows

__all__ = ["Segment", "Part", "after", "share", "plan_rows", "plan_parts", "plan_to_json", "plan_from_json",
           "stream_rows", "check_same_epoch"]


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows [lo, hi) of the stream of rank `rank` of `world` ranks, in that stream's own order."""

    world: int
    rank: int
    lo: int
    hi: int

    @property
    def num_rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class Part:
    """Places [a, c) of window `window` of stream (world, rank): one decode step of a plan.

    `base` is the plan row of the window's place 0 (negative when the segment starts inside the
    window), `end` the plan row just after the part; a position inside is base + place.
    """

    world: int
    rank: int
    window: int
    a: int
    c: int
    base: int
    end: int


def stream_rows(total_rows: int, world: int, rank: int) -> int:
    """Rows of rank `rank`'s stream when `total_rows` rows are split over `world` ranks."""
    return (rank + 1) * total_rows // world - rank * total_rows // world


def plan_rows(plan: Sequence[Segment]) -> int:
    return sum(s.num_rows for s in plan)


def merge(plan: Sequence[Segment]) -> list[Segment]:
    """`plan` without empty segments, neighbours that continue each other's stream joined."""
    out: list[Segment] = []
    for s in plan:
        if s.num_rows <= 0:
            continue
        if out and (out[-1].world, out[-1].rank, out[-1].hi) == (s.world, s.rank, s.lo):
            out[-1] = Segment(s.world, s.rank, out[-1].lo, s.hi)
        else:
            out.append(s)
    return out


def after(plan: Sequence[Segment], done: int) -> list[Segment]:
    """The segments of `plan` left once its first `done` rows are read."""
    out = []
    for s in plan:
        skip = min(done, s.num_rows)
        done -= skip
        if skip < s.num_rows:
            out.append(Segment(s.world, s.rank, s.lo + skip, s.hi))
    return out


def share(plan: Sequence[Segment], *, rank: int, world_size: int) -> list[Segment]:
    """Rank `rank`'s contiguous part of `plan`: rows [rank R / W, (rank + 1) R / W) of its R rows."""
    total = plan_rows(plan)
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    out, base = [], 0
    for s in plan:
        a, b = max(lo, base), min(hi, base + s.num_rows)
        if a < b:
            out.append(Segment(s.world, s.rank, s.lo + a - base, s.lo + b - base))
        base += s.num_rows
    return merge(out)


def plan_parts(plan: Sequence[Segment], done: int, windows_of: Callable[[int, int], Windows]) -> list[Part]:
    """The window parts that hold rows [done, end) of `plan`, in reading order.

    `windows_of(world, rank)` gives the windows of a stream of the plan's epoch.
    """
    parts, base = [], 0
    for s in plan:
        windows = windows_of(s.world, s.rank)
        starts = windows.starts
        lo = s.lo + max(0, done - base)
        w = bisect_right(starts, lo) - 1                 # the window holding row lo
        while lo < s.hi and w < windows.num_windows and starts[w] < s.hi:
            stop = min(s.hi, starts[w + 1])
            parts.append(Part(s.world, s.rank, w, max(lo, starts[w]) - starts[w], stop - starts[w],
                              base + starts[w] - s.lo, base + stop - s.lo))
            w += 1
        base += s.num_rows
    return parts


# -- state ------------------------------------------------------------------------------------------

def plan_to_json(plan: Sequence[Segment]) -> list[list[int]]:
    """[[world, rank, lo, hi], ...]: plain ints, JSON-able."""
    return [[s.world, s.rank, s.lo, s.hi] for s in plan]


def plan_from_json(value: Any, done: Any, total_rows: int, where: str) -> list[Segment]:
    """The plan of a state's 'segments' with its 'done' checked against it; ValueError naming the key."""
    if not isinstance(value, list):
        raise ValueError(f"{where} 'segments' must be a list of [world, rank, lo, hi], got {value!r}")
    plan = []
    for i, v in enumerate(value):
        ok = isinstance(v, list) and len(v) == 4 and all(type(x) is int for x in v)
        if ok:
            world, rank, lo, hi = v
            ok = world >= 1 and 0 <= rank < world and 0 <= lo <= hi <= stream_rows(total_rows, world, rank)
        if not ok:
            raise ValueError(f"{where} 'segments'[{i}] must be [world, rank, lo, hi] with 0 <= rank < world "
                             f"and 0 <= lo <= hi <= the stream's rows (of {total_rows} in all), got {v!r}")
        plan.append(Segment(*v))
    if type(done) is not int or not 0 <= done <= plan_rows(plan):
        raise ValueError(f"{where} 'done' must be an int in [0, {plan_rows(plan)}] (the rows of its "
                         f"segments), got {done!r}")
    return plan


def check_same_epoch(states: Sequence[dict[str, Any]]) -> int:
    """The epoch all `states` are at; ValueError listing which ranks are at which epoch otherwise."""
    ranks: dict[Any, list[int]] = {}
    for i, s in enumerate(states):
        ranks.setdefault(s.get("epoch"), []).append(i)
    if len(ranks) != 1:
        where = "; ".join(f"epoch {e!r}: ranks {r}" for e, r in ranks.items())
        raise ValueError(f"the old ranks' loader states are at different epochs ({where}); "
                         f"take the states of all ranks at the same point")
    return states[0]["epoch"]
