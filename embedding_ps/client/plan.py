"""The PS client's bookkeeping around a request (`embedding_ps.client.client`): `plan_call` routes a
call's ids by shard, `Plan.assemble` puts the replies' rows back in the caller's order, `combine`
joins futures (a call split per table)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from embedding_ps import native
from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig
from embedding_ps.store import cat
from embedding_ps.wire.sharding import keys_of, shard_of


@dataclass(frozen=True, slots=True)
class Plan:
    """How one call's ids travel: every table's part routed at once.

    With dedup, each part's ids are made distinct first (`dedup_ids`), and `gather` [N] maps each
    caller position to its distinct id's position in X (rows come back with one index_select, grads
    are summed with one index_add_); None when every part was distinct already. The distinct ids,
    concatenated in call order (X [U]), are sent grouped by shard, each shard's ids in call order (so
    part after part): `sent` = X[order]. A shard's reply holds its rows in that order, so one
    index_copy_ per shard puts every row back at its position in X.
    """

    sent: torch.Tensor                  # int64 [U] X grouped by shard
    order: torch.Tensor | None          # int64 [U] position in X of each sent id; None: X itself (1 shard)
    counts: list[list[int]]             # [S][P] ids of part p sent to shard s
    gather: torch.Tensor | None = None  # int64 [N] caller position -> position in X (dedup), or None

    def by_shard(self, t: torch.Tensor) -> dict[int, list[tuple[int, torch.Tensor]]]:
        """t [U, ...] in `sent` order -> {shard: [(part index, its rows of t)]}, parts in call order."""
        flat = [(s, p, c) for s, row in enumerate(self.counts) for p, c in enumerate(row) if c]
        pieces = torch.split(t, [c for _, _, c in flat])
        out: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for (s, p, _), piece in zip(flat, pieces):
            out.setdefault(s, []).append((p, piece))
        return out

    def to_sent(self, t: torch.Tensor) -> torch.Tensor:
        """grads t [N, D] in caller order -> [U, D] in `sent` order (a duplicate's grads summed in
        arrival order)."""
        if self.gather is not None:
            t = torch.zeros(self.sent.numel(), t.shape[1]).index_add_(0, self.gather, t)
        return t if self.order is None else t.index_select(0, self.order)

    def assemble(self, counts: dict[int, list[int]], replies: dict[int, tuple[P.Header, list]], dim: int,
                 segs: dict | None = None, call: list | None = None, pin: bool = False) -> torch.Tensor:
        """Every shard's PULL reply (or its rows in shared-memory segment segs[shard]) -> float32 rows
        [N, D] in the caller's order. call: [the transport Call] (a retried one: rows are copied).
        With `pin`, rows that are copied here are copied into page-locked memory (a GPU trainer's
        next copy is then a DMA)."""
        if self.order is None and len(counts) == 1:           # one shard: the frame itself (fp32)
            (shard, cs), = counts.items()
            out = _reply_rows(shard, cs, replies, dim, segs, call).float()
        else:
            out = torch.empty(self.sent.numel(), dim, pin_memory=pin)
            start = 0
            for shard in sorted(counts):                      # sent order is shard order
                m = sum(counts[shard])
                rows = _reply_rows(shard, counts[shard], replies, dim, segs, call)
                out.index_copy_(0, self.order[start:start + m], rows.float())
                start += m
        if self.gather is None:
            return out
        return torch.index_select(out, 0, self.gather, out=torch.empty(self.gather.numel(), dim, pin_memory=pin))


def plan_call(config: PSConfig, dedup: bool, tables: Sequence[int], ids: Sequence[torch.Tensor]) -> Plan:
    """Route every part's ids [N_t] of one call at once (each part made distinct first with
    `dedup`): one shard_of over all ids, one stable argsort, one bincount of (shard, part)."""
    ids = [x.detach().cpu() for x in ids]
    gather = None
    if dedup:
        pairs = [dedup_ids(x) for x in ids]
        ids = [u for u, _ in pairs]
        gather = gather_of(ids, [inv for _, inv in pairs])
    lens = [x.numel() for x in ids]
    x = cat(ids)                                                                       # [U]
    n, S, P_ = x.numel(), config.num_shards, len(ids)
    if S == 1:
        return Plan(x, None, [lens], gather)
    keys = x
    if n and any(config.tables[t].kind == "hashed" for t in tables):
        keys = torch.cat([keys_of(part, config.tables[t]) for t, part in zip(tables, ids)])
    shard = shard_of(keys, S)                                                          # [U]
    part = torch.repeat_interleave(torch.arange(P_), torch.tensor(lens), output_size=n)   # [U]
    counts = torch.bincount(shard * P_ + part, minlength=S * P_).view(S, P_).tolist()
    order = torch.argsort(shard, stable=True)                                          # [U]
    return Plan(x.index_select(0, order), order, counts, gather)


def dedup_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids int64 [N] -> (distinct ids [U], inverse [N]: distinct[inverse] == ids) by `native.unique`;
    inverse None when the ids are distinct already and come back in their own order (then `ids`
    itself comes back): always with the C pass, which keeps first appearances (what the sparse arch
    sends: the caller's order is kept)."""
    uniq, inverse, _ = native.unique(ids)
    if uniq.numel() == ids.numel() and torch.equal(uniq, ids):
        return ids, None
    return uniq, inverse


def gather_of(uniq: Sequence[torch.Tensor], inverse: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Every part's distinct ids [U_p] and inverse [N_p] into them (None: the part is its distinct ids)
    -> int64 [sum N_p]: each caller position's row in the parts' distinct ids back to back; None when
    every inverse is."""
    if all(inv is None for inv in inverse):
        return None
    offsets = itertools.accumulate((u.numel() for u in uniq), initial=0)
    parts = [torch.arange(u.numel()) if inv is None else inv for u, inv in zip(uniq, inverse)]
    return cat([p + off if off else p for p, off in zip(parts, offsets)])


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


def index_frame(tables: Sequence[int], parts: list[tuple[int, torch.Tensor]]):
    """The index frame [T, 2] (table, count) of one shard's parts."""
    return P.tensor_frame(torch.tensor([[tables[i], c.numel()] for i, c in parts], dtype=torch.int64))


def frames(tables: Sequence[int], parts: list[tuple[int, torch.Tensor]]) -> list:
    """The index [T, 2] and ids [M] frames of one shard's parts."""
    return [index_frame(tables, parts), P.tensor_frame(cat([c for _, c in parts]))]


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
        try:
            out.set_result(join([f.result() for f in futures]))
        except BaseException as e:
            out.set_exception(e)

    for f in futures:
        f.add_done_callback(one_done)
    return out


__all__ = ["Plan", "combine", "dedup_ids", "frames", "gather_of", "index_frame", "plan_call"]
