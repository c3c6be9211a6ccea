"""The client's side of the multi-table ops: one request per shard for the ids of several tables.

    rows = ps.pull_many_async([0, 1, 2], [ids0, ids1, ids2]).result()   # float32 [N0 + N1 + N2, D]
    ps.push_many_async([0, 1, 2], [ids0, ids1, ids2], grads)            # grads float32 [N0 + N1 + N2, D]

A trainer's step touches every table: as single-table requests that is one pull and one push per
table and shard, each with a fixed cost on both sides (encode, send, wake, decode, reply). Here each
shard gets one PULL_MULTI / PUSH_MULTI (wire: `embedding_ps.protocol`) whose parts are the tables'
ids routed to it. The tables of one call must share the embedding dim D. Rows and gradients are
in the caller's order: table by table, each table's ids in the order given. A shard request over
ps.max_frame_bytes falls back to the single-table requests (which say what to split).

`MultiTableOps` is a mixin of `PSClient` (it uses its `_plan`, `_chunks`, `_header`, `_submit`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from embedding_ps import protocol as P


class MultiTableOps:
    """pull_many_async / push_many_async for PSClient (see the module docstring)."""

    def pull_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor],
                        step: int | None = None) -> "Future[torch.Tensor]":
        """A Future of float32 rows [sum N_t, D]: the rows of every table's int64 ids [N_t], in order."""
        dim, ids = self._many_args("pull", tables, ids)
        plans = [self._plan(t, x) for t, x in zip(tables, ids)]
        shards = self._by_shard([(p, p.sent) for p in plans])
        if not shards:
            return _done(torch.empty(0, dim))
        if any(self._too_big(parts, dim) for parts in shards.values()):
            return _combine([self.pull_async(t, x, step) for t, x in zip(tables, ids)], torch.cat)
        reqs = []
        for shard, parts in shards.items():
            h = self._header(P.Op.PULL_MULTI, 0, step, dtype=self.wire, count=len(parts), dim=dim)
            reqs.append((shard, h, _frames(tables, parts)))
        counts = {s: [c.numel() for _, c in parts] for s, parts in shards.items()}
        return self._submit(P.Op.PULL_MULTI, reqs, lambda replies: self._assemble_many(plans, counts, replies, dim))

    def push_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor], grads: torch.Tensor,
                        step: int | None = None) -> "Future[None]":
        """Send float32 grads [sum N_t, D] of every table's ids [N_t] (rows in pull_many's order)."""
        dim, ids = self._many_args("push", tables, ids)
        total = sum(x.numel() for x in ids)
        if grads.dim() != 2 or grads.shape != (total, dim) or not grads.is_floating_point():
            raise ValueError(f"push to tables {list(tables)}: grads must be float [{total}, {dim}], got "
                             f"{grads.dtype} {list(grads.shape)}")
        grads = grads.detach().to("cpu", torch.float32)
        plans = [self._plan(t, x) for t, x in zip(tables, ids)]
        sent, start = [], 0
        for plan, x in zip(plans, ids):
            g = grads[start:start + x.numel()]                                     # [N_t, D]
            start += x.numel()
            if plan.gather is not None:         # sum the grads of duplicates into shard order
                g = torch.zeros(plan.sent.numel(), dim).index_add_(0, plan.gather, g)
            elif plan.place is not None:
                g = g.index_select(0, plan.place)
            sent.append(g)
        shards = self._by_shard([(p, p.sent) for p in plans])
        if not shards:
            return _done(None)
        if any(self._too_big(parts, dim) for parts in shards.values()):
            splits = torch.split(grads, [x.numel() for x in ids])
            return _combine([self.push_async(t, x, g, step) for t, x, g in zip(tables, ids, splits)],
                            lambda _: None)
        grad_parts = self._by_shard(list(zip(plans, sent)))
        reqs = []
        for shard, parts in shards.items():
            g = [c for _, c in grad_parts[shard]]
            wire = P.to_wire(g[0] if len(g) == 1 else torch.cat(g), self.wire)     # [M_s, D]
            h = self._header(P.Op.PUSH_MULTI, 0, step, dtype=self.wire, count=len(parts), dim=dim)
            reqs.append((shard, h, [*_frames(tables, parts), P.tensor_frame(wire)]))
        fut = self._submit(P.Op.PUSH_MULTI, reqs, lambda replies: None)
        with self._lock:
            self._pushes.add(fut)
        fut.add_done_callback(self._push_done)
        return fut

    # -- internals ------------------------------------------------------------------------------

    def _many_args(self, op: str, tables: Sequence[int], ids: Sequence[torch.Tensor]):
        if len(tables) != len(ids) or not tables:
            raise ValueError(f"{op}_many: {len(tables)} tables and {len(ids)} id tensors (need as many, >= 1)")
        dims = {self._table(t).dim for t in tables}
        if len(dims) != 1:
            raise ValueError(f"{op}_many: tables {list(tables)} have dims {sorted(dims)}; one call takes one dim")
        return dims.pop(), [self._check_ids(t, x) for t, x in zip(tables, ids)]

    def _by_shard(self, items: list) -> dict[int, list[tuple[int, torch.Tensor]]]:
        """[(plan, tensor in plan.sent order)] -> {shard: [(part index, the shard's chunk)]}, parts in order."""
        out: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for i, (plan, t) in enumerate(items):
            for shard, chunk in self._chunks(plan, t):
                out.setdefault(shard, []).append((i, chunk))
        return out

    def _too_big(self, parts: list[tuple[int, torch.Tensor]], dim: int) -> bool:
        n = sum(c.numel() for _, c in parts)
        return max(n * dim * P.ITEM_SIZE[self.wire], 16 * len(parts), 8 * n) > self.config.max_frame_bytes

    def _assemble_many(self, plans: list, counts: dict[int, list[int]],
                       replies: dict[int, tuple[P.Header, list]], dim: int) -> torch.Tensor:
        """Every shard's PULL_MULTI reply -> float32 rows [sum N_t, D] in the caller's order."""
        pieces: dict[int, list[torch.Tensor]] = {}          # shard -> rows of each of its parts
        for shard, cs in counts.items():
            header, payload = replies[shard]
            what = f"PULL_MULTI reply of ps shard {shard}"
            if len(payload) != 1:
                raise P.ProtocolError(f"{what} has {len(payload)} payload frames, not 1")
            dtype = P.row_dtype(header.dtype, what)
            P.expect_bytes(what, len(payload[0]), sum(cs) * dim, P.ITEM_SIZE[dtype], 1 << 62)
            rows = P.frame_tensor(payload[0], dtype, sum(cs), dim)
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
        return torch.cat(out) if out else torch.empty(0, dim)


def _frames(tables: Sequence[int], parts: list[tuple[int, torch.Tensor]]) -> list:
    """The index [T, 2] and ids [M] frames of one shard's parts."""
    index = torch.tensor([[tables[i], c.numel()] for i, c in parts], dtype=torch.int64)
    ids = parts[0][1] if len(parts) == 1 else torch.cat([c for _, c in parts])
    return [P.tensor_frame(index), P.tensor_frame(ids)]


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _combine(futures: list[Future], combine: Callable[[list], Any]) -> Future:
    """A Future of combine([f.result() for f in futures]) once all are done (the first error wins)."""
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
            out.set_result(combine([f.result() for f in futures]))
        except Exception as e:
            out.set_exception(e)

    for f in futures:
        f.add_done_callback(one_done)
    return out
