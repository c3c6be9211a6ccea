"""The PS client's bookkeeping around a request (`embedding_ps.client.client`): how its ids travel and
how the rows come back.

    plan_ids       ids [N] -> Plan: deduplicated (optional) and grouped by shard (argsort + bincount)
    plan_many      every table's ids of one call -> ManyPlan: routed and grouped by shard together, in
                   a few whole-call ops instead of a few per table (when no part needs dedup)
    index_frame    a shard's parts -> the index frame int64 [T, 2] (table, count); `frames` adds the ids
    assemble_rows  every shard's PULL reply (a frame, or rows in its shared-memory segment) -> float32
                   rows [sum N_t, D] in the caller's order (`ManyPlan.assemble`: the same for a ManyPlan)
    combine        futures -> one future of their combined results (a call split per table)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from embedding_ps import native
from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig
from embedding_ps.wire.sharding import keys_of, route, shard_of


@dataclass(frozen=True, slots=True)
class Plan:
    """How a request's ids [N] travel: the ids sent, grouped by shard, and the way back.

    With dedup, `gather` [N] maps each caller position to its unique id's position in `sent`
    (rows come back with one index_select; grads are summed with one index_add_); None when the
    ids were distinct already. Without (or distinct), `place` [N] is the caller position of each
    sent id (None: the same order, one shard).
    """

    sent: torch.Tensor                 # int64 [U] ids grouped by shard (U = N without dedup)
    counts: list[int]                  # [S] ids per shard
    gather: torch.Tensor | None        # int64 [N] (dedup) or None
    place: torch.Tensor | None         # int64 [U] (no dedup, several shards) or None

    def chunks(self, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """t [U, ...] in `sent` order -> [(shard, its rows of t)] for the shards with ids."""
        parts = torch.split(t, self.counts)
        return [(s, part) for s, part in enumerate(parts) if part.shape[0] > 0]


def plan_ids(config: PSConfig, dedup: bool, table: int, ids: torch.Tensor) -> Plan:
    """Dedup ids [N] (if `dedup`) and group them by shard: argsort + bincount, no loop."""
    n = config.num_shards
    if dedup:
        ids, inverse = dedup_ids(ids)                                        # [U], [N] or None
        dedup = inverse is not None
    if n == 1:
        return Plan(ids, [ids.numel()], inverse if dedup else None, None)
    shard = route(ids, config.tables[table], n)                              # [U]
    order = torch.argsort(shard, stable=True)                                # [U]
    counts = torch.bincount(shard, minlength=n).tolist()
    if not dedup:
        return Plan(ids[order], counts, None, order)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel())                                 # unique index -> sent position
    return Plan(ids[order], counts, pos[inverse], None)


def dedup_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids int64 [N] -> (distinct ids [U], inverse [N]: distinct[inverse] == ids) by
    `native.unique`; inverse None when the ids are distinct already and come back in their own
    order (then `ids` itself comes back): always with the C pass, which keeps first appearances."""
    uniq, inverse, _ = native.unique(ids)
    return (ids, None) if uniq.numel() == ids.numel() and torch.equal(uniq, ids) else (uniq, inverse)


def plans_by_shard(items: list[tuple[Plan, torch.Tensor]]) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """[(plan, tensor in plan.sent order)] -> {shard: [(part index, the shard's chunk)]}, parts in order."""
    out: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for i, (plan, t) in enumerate(items):
        for shard, chunk in plan.chunks(t):
            out.setdefault(shard, []).append((i, chunk))
    return out


@dataclass(frozen=True, slots=True)
class ManyPlan:
    """How one call's ids travel when every table's part is routed at once.

    The parts' ids, concatenated in call order (X [N]), are sent grouped by shard, each shard's ids
    in call order (so part after part): `sent` = X[order]. A shard's reply holds its rows in that
    order, so one index_copy_ per shard puts every row back at its caller position.
    """

    sent: torch.Tensor                  # int64 [N] X grouped by shard
    order: torch.Tensor | None          # int64 [N] caller position of each sent id; None: X itself (1 shard)
    counts: list[list[int]]             # [S][P] ids of part p sent to shard s

    def by_shard(self, t: torch.Tensor) -> dict[int, list[tuple[int, torch.Tensor]]]:
        """t [N, ...] in `sent` order -> {shard: [(part index, its rows of t)]}, parts in call order."""
        flat = [(s, p, c) for s, row in enumerate(self.counts) for p, c in enumerate(row) if c]
        pieces = torch.split(t, [c for _, _, c in flat])
        out: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (s, p, _), piece in zip(flat, pieces):
            out.setdefault(s, []).append((p, piece))
        return out

    def to_sent(self, t: torch.Tensor) -> torch.Tensor:
        """t [N, ...] in caller order -> in `sent` order."""
        return t if self.order is None else t.index_select(0, self.order)

    def assemble(self, counts: dict[int, list[int]], replies: dict[int, tuple[P.Header, list]], dim: int,
                 segs: dict | None = None, call: list | None = None, pin: bool = False) -> torch.Tensor:
        """Every shard's PULL reply -> float32 rows [N, D] in the caller's order; with `pin`, rows that
        are copied here are copied into page-locked memory (a GPU trainer's next copy is then a DMA)."""
        n = self.sent.numel()
        if self.order is None and len(counts) == 1:           # one shard: the frame itself (fp32)
            (shard, cs), = counts.items()
            return _reply_rows(shard, cs, replies, dim, segs, call).float()
        out = torch.empty(n, dim, pin_memory=pin)
        start = 0
        for shard in sorted(counts):                          # sent order is shard order
            m = sum(counts[shard])
            rows = _reply_rows(shard, counts[shard], replies, dim, segs, call)
            out.index_copy_(0, self.order[start:start + m], rows if rows.dtype == torch.float32 else rows.float())
            start += m
        return out


def plan_many(config: PSConfig, dedup: bool, tables: Sequence[int], ids: Sequence[torch.Tensor]) -> ManyPlan | None:
    """Route every part's ids [N_t] of one call at once: one shard_of over all N ids, one stable
    argsort, one bincount of (shard, part). None when `dedup` and a part's ids are not strictly
    increasing (sorted unique ids, e.g. torch.unique's output); then plan_ids dedups part by part.
    (The sparse arch's ids are unique in order of first appearance: its clients have dedup off.)"""
    lens = [x.numel() for x in ids]
    x = torch.cat(ids) if len(ids) > 1 else ids[0]                                    # [N]
    n, S, P_ = x.numel(), config.num_shards, len(ids)
    if dedup and n > 1:
        up = x[1:] > x[:-1]                                                            # [N - 1]
        starts = torch.tensor(lens[:-1], dtype=torch.int64).cumsum(0) - 1             # last id of parts 0..P-2
        starts = starts[(starts >= 0) & (starts < n - 1)]
        up[starts] = True                                                              # a part may start lower
        if not bool(up.all()):
            return None
    if S == 1:
        return ManyPlan(x, None, [lens])
    if any(config.tables[t].kind == "hashed" for t in tables):
        keys = torch.cat([keys_of(part, config.tables[t]) for t, part in zip(tables, ids)]) if n else x
    else:
        keys = x
    shard = shard_of(keys, S)                                                          # [N]
    part = torch.repeat_interleave(torch.arange(P_), torch.tensor(lens), output_size=n)   # [N]
    counts = torch.bincount(shard * P_ + part, minlength=S * P_).view(S, P_).tolist()
    order = torch.argsort(shard, stable=True)                                          # [N]
    return ManyPlan(x.index_select(0, order), order, counts)


def _reply_rows(shard: int, cs: list[int], replies: dict[int, tuple[P.Header, list]], dim: int,
                segs: dict | None, call: list | None) -> torch.Tensor:
    """One shard's PULL reply (or its rows in shared-memory segment segs[shard]) -> rows [sum cs, D]
    in the wire dtype (a view of the frame or segment, a copy after a retry)."""
    header, payload = replies[shard]
    what = f"PULL reply of ps shard {shard}"
    seg = segs.get(shard) if segs else None
    if len(payload) != (seg is None):
        raise P.ProtocolError(f"{what} has {len(payload)} payload frames, not {int(seg is None)}")
    dtype = P.row_dtype(header.dtype, what)
    buf = memoryview(seg) if seg is not None else payload[0]
    P.expect_bytes(what, len(buf), sum(cs) * dim, P.ITEM_SIZE[dtype], 1 << 62)
    rows = P.frame_tensor(buf, dtype, sum(cs), dim)
    if seg is not None and call and call[0].retried:
        rows = rows.clone()          # an earlier attempt may still write the segment: not the caller's
    return rows


def assemble_rows(plans: list[Plan], counts: dict[int, list[int]], replies: dict[int, tuple[P.Header, list]],
                  dim: int, segs: dict | None = None, call: list | None = None) -> torch.Tensor:
    """Every shard's PULL reply (or its rows in shared-memory segment segs[shard]) -> float32 rows
    [sum N_t, D] in the caller's order. call: [the transport Call] (a retried one: rows are copied)."""
    pieces: dict[int, list[torch.Tensor]] = {}          # shard -> rows of each of its parts
    for shard, cs in counts.items():
        rows = _reply_rows(shard, cs, replies, dim, segs, call)
        if len(counts) == 1 and all(p.gather is None and p.place is None for p in plans):
            return rows.float()           # one shard, no reordering: the frame itself (fp32)
        pieces[shard] = list(torch.split(rows, cs))
    out = []
    for plan in plans:
        if plan.sent.numel() == 0:        # a table without ids
            out.append(torch.empty(0, dim))
            continue
        mine = [pieces[s].pop(0) for s, c in enumerate(plan.counts) if c]   # parts in table order
        if plan.place is not None:
            rows = torch.empty(plan.sent.numel(), dim)
            for place, part in zip(torch.split(plan.place, [c for c in plan.counts if c]), mine):
                rows.index_copy_(0, place, part.float())
        else:
            rows = (torch.cat(mine) if len(mine) != 1 else mine[0]).float()
            if plan.gather is not None:
                rows = rows.index_select(0, plan.gather)
        out.append(rows)
    if len(out) == 1:
        return out[0]                     # one table: no copy into a new tensor
    return torch.cat(out) if out else torch.empty(0, dim)


def index_frame(tables: Sequence[int], parts: list[tuple[int, torch.Tensor]]):
    """The index frame [T, 2] (table, count) of one shard's parts."""
    return P.tensor_frame(torch.tensor([[tables[i], c.numel()] for i, c in parts], dtype=torch.int64))


def frames(tables: Sequence[int], parts: list[tuple[int, torch.Tensor]]) -> list:
    """The index [T, 2] and ids [M] frames of one shard's parts."""
    ids = parts[0][1] if len(parts) == 1 else torch.cat([c for _, c in parts])
    return [index_frame(tables, parts), P.tensor_frame(ids)]


def combine(futures: list[Future], join: Callable[[list], Any]) -> Future:
    """A Future of join([f.result() for f in futures]) once all are done (the first error wins)."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            out.set_exception(errors[0])
            return
        try:
            out.set_result(join([f.result() for f in futures]))
        except Exception as e:
            out.set_exception(e)

    for f in futures:
        f.add_done_callback(one_done)
    return out


__all__ = ["ManyPlan", "Plan", "assemble_rows", "combine", "dedup_ids", "frames", "index_frame", "plan_ids",
           "plan_many", "plans_by_shard"]
