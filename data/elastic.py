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
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data.sharding import Windows, cut

__all__ = ["STATE_VERSION", "Segment", "Part", "after", "share", "plan_rows", "plan_parts", "plan_row_groups",
           "stream_rows", "check_state", "check_old_states", "unread_segments"]

STATE_VERSION = 2
"""Of ParquetLoader.state_dict(); 2 added 'elastic', 'segments' and 'done' (a version 1 state loads)."""


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

    def part(self, a: int, b: int) -> Segment:
        """Its rows [a, b) (0: its first row)."""
        return Segment(self.world, self.rank, self.lo + a, self.lo + b)


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

    def same_window(self, other: Part) -> bool:
        return (self.world, self.rank, self.window) == (other.world, other.rank, other.window)


def stream_rows(total_rows: int, world: int, rank: int) -> int:
    """Rows of rank `rank`'s stream when `total_rows` rows are split over `world` ranks."""
    return (rank + 1) * total_rows // world - rank * total_rows // world


def plan_rows(plan: Sequence[Segment]) -> int:
    return sum(s.num_rows for s in plan)


def after(plan: Sequence[Segment], done: int) -> list[Segment]:
    """The segments of `plan` left once its first `done` rows are read."""
    return cut(plan, done, plan_rows(plan))


def share(plan: Sequence[Segment], *, rank: int, world_size: int) -> list[Segment]:
    """Rank `rank`'s part of `plan` (cut as the module docstring says); neighbours that continue one stream joined."""
    total, out = plan_rows(plan), []
    for s in cut(plan, rank * total // world_size, (rank + 1) * total // world_size):    # no part is empty
        if out and (out[-1].world, out[-1].rank, out[-1].hi) == (s.world, s.rank, s.lo):
            out[-1] = Segment(s.world, s.rank, out[-1].lo, s.hi)
        else:
            out.append(s)
    return out


def plan_parts(plan: Sequence[Segment], done: int, streams: Mapping[tuple[int, int], Windows]) -> list[Part]:
    """The window parts that hold rows [done, end) of `plan`, in reading order; `streams` maps
    (world, rank) to the windows of that stream in the plan's epoch."""
    parts, base = [], 0
    for s in plan:
        windows = streams[s.world, s.rank]
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


def plan_row_groups(parts: Sequence[Part], streams: Mapping[tuple[int, int], Windows]) -> list[tuple[int, int]]:
    """(source, row group) in the order reading `parts` needs them (a window two parts in a row
    share is read once; a row group that follows itself is listed once)."""
    keys = [(q.source, q.row_group) for i, p in enumerate(parts) if i == 0 or not p.same_window(parts[i - 1])
            for q in streams[p.world, p.rank].windows[p.window]]
    return [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]


# -- state ------------------------------------------------------------------------------------------

def check_state(state: Any, where: str, expected: dict[str, Any], total_rows: int) -> list[Segment] | None:
    """ValueError naming the key and value unless `state` (a loader's state_dict()) is well formed
    and was saved with the `expected` values; its elastic plan, or None for a rank-stream position."""
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
        got = state.get("version") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{where} must be a dict with version {STATE_VERSION} (or 1), got {got}")
    for key, value in expected.items():
        if state.get(key) != value:
            raise ValueError(f"{where} was saved with {key} = {state.get(key)!r}, this loader has "
                             f"{value!r}; the position would not match")
    for key in ("epoch", "window", "offset", "batches", "num_bad_rows", "rank", "world_size"):
        v = state.get(key)
        if type(v) is not int or v < 0:
            raise ValueError(f"{where} '{key}' must be an int >= 0, got {v!r}")
    elastic, segments, done = state.get("elastic", 0), state.get("segments"), state.get("done")  # (not in version 1)
    if elastic not in (0, 1):
        raise ValueError(f"{where} 'elastic' must be 0 or 1, got {elastic!r}")
    if not elastic:
        return None
    if not isinstance(segments, list):
        raise ValueError(f"{where} 'segments' must be a list of [world, rank, lo, hi], got {segments!r}")
    plan = []
    for i, v in enumerate(segments):
        s = Segment(*v) if isinstance(v, list) and len(v) == 4 and all(type(x) is int for x in v) else None
        if s is None or not (s.world >= 1 and 0 <= s.rank < s.world
                             and 0 <= s.lo <= s.hi <= stream_rows(total_rows, s.world, s.rank)):
            raise ValueError(f"{where} 'segments'[{i}] must be [world, rank, lo, hi] with 0 <= rank < world "
                             f"and 0 <= lo <= hi <= the stream's rows (of {total_rows} in all), got {v!r}")
        plan.append(s)
    if type(done) is not int or not 0 <= done <= plan_rows(plan):
        raise ValueError(f"{where} 'done' must be an int in [0, {plan_rows(plan)}] (the rows of its "
                         f"segments), got {done!r}")
    return plan


def check_old_states(states: Any) -> int:
    """The epoch of the states of all ranks of a run, in rank order; ValueError otherwise (listing
    which ranks are at which epoch when they differ)."""
    if isinstance(states, dict) or not isinstance(states, Sequence) or not states:
        raise ValueError(f"resume_from needs a list of the loader states of all old ranks, got "
                         f"{'an empty ' if isinstance(states, Sequence) else ''}{type(states).__name__}")
    ranks: dict[Any, list[int]] = {}                    # epoch -> the old ranks at it
    for i, st in enumerate(states):
        got = (st.get("rank"), st.get("world_size")) if isinstance(st, dict) else (None, None)
        if got != (i, len(states)):
            raise ValueError(f"states[{i}] has rank = {got[0]!r}, world_size = {got[1]!r}; resume_from "
                             f"needs the states of all {len(states)} old ranks in rank order")
        ranks.setdefault(st.get("epoch"), []).append(i)
    if len(ranks) != 1:
        where = "; ".join(f"epoch {e!r}: ranks {r}" for e, r in ranks.items())
        raise ValueError(f"the old ranks' loader states are at different epochs ({where}); "
                         f"take the states of all ranks at the same point")
    return states[0]["epoch"]


def unread_segments(state: dict[str, Any], plan: list[Segment] | None, windows: Windows,
                    where: str) -> list[Segment]:
    """What a checked state has not read yet, in its order: the rest of its plan, or of its rank
    stream (whose `windows`) from its (window, offset)."""
    if plan is not None:
        return after(plan, state["done"])
    world, rank, w, offset = state["world_size"], state["rank"], state["window"], state["offset"]
    n, starts = windows.num_windows, windows.starts
    if not (w < n and offset <= starts[w + 1] - starts[w] or (w, offset) == (n, 0)):
        raise ValueError(f"{where} position (window {w}, offset {offset}) is not in its stream's "
                         f"{n} windows: the data changed since the state was saved")
    start = starts[w] + offset
    return [Segment(world, rank, start, windows.num_rows)] if start < windows.num_rows else []
