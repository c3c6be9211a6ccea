"""The shard's side of the multi-table ops: PULL_MULTI and PUSH_MULTI (wire: `embedding_ps.protocol`).

One request carries the parts of several tables (a trainer's whole step for this shard), so a
step costs one request per shard instead of one per table. Each part does what the single-table
PULL / PUSH would; every part is validated before any is applied (a bad request changes nothing).
`ShardServer` registers these as the handlers of the two ops.
"""

from __future__ import annotations

from typing import Any

import torch

from embedding_ps import protocol as P

_MAX_STEP = 2**31 - 1


def parse_parts(server: Any, h: P.Header, index_buf: memoryview,
                ids_buf: memoryview) -> tuple[list[int], list[int], torch.Tensor]:
    """(tables [T], counts [T], ids int64 [M]) of a multi request; ProtocolError naming what is wrong."""
    name = P.Op(h.op).name
    limit = server.config.max_frame_bytes
    if h.count < 1:
        raise P.ProtocolError(f"{name}: count (parts) must be >= 1, got {h.count}", P.Status.BAD_VALUE)
    P.expect_bytes(f"{name} index", len(index_buf), 2 * h.count, 8, limit)
    index = P.frame_tensor(index_buf, P.DType.INT64, 2 * h.count).view(h.count, 2)
    tables, counts = index[:, 0].tolist(), index[:, 1].tolist()
    num_tables = len(server.config.tables)
    for i, (t, n) in enumerate(zip(tables, counts)):
        if not 0 <= t < num_tables:
            raise P.ProtocolError(f"{name}: part {i}: unknown table {t} (this job has {num_tables} tables)",
                                  P.Status.BAD_VALUE)
        cfg = server.config.tables[t]
        if cfg.dim != h.dim:
            raise P.ProtocolError(f"{name}: part {i}: table {t} ({cfg.name}) has dim {cfg.dim}, request says "
                                  f"{h.dim}", P.Status.BAD_VALUE)
        if n < 0:
            raise P.ProtocolError(f"{name}: part {i}: count must be >= 0, got {n}", P.Status.BAD_VALUE)
    total = sum(counts)
    P.expect_bytes(f"{name} ids", len(ids_buf), total, 8, limit)
    return tables, counts, P.frame_tensor(ids_buf, P.DType.INT64, total)


def pull_multi(server: Any, h: P.Header, payload: list) -> Any:
    """Reply frames: rows wire dtype [M, D] of every part's ids, back to back; None while the step must wait."""
    dtype = P.row_dtype(h.dtype, "PULL_MULTI reply")
    tables, counts, ids = parse_parts(server, h, payload[0], payload[1])
    total = ids.shape[0]
    if not server.pull_may_go(h, total, h.dim, dtype):
        return None
    out = server.buffers.tensor(torch.float32, (total, h.dim))        # [M, D], a reused reply buffer
    start = 0
    for t, n in zip(tables, counts):
        if n:
            part = out[start:start + n]                                # contiguous rows of `out`
            if server._pull_out:
                server.state.pull(t, ids[start:start + n], h.step, out=part)
            else:
                part.copy_(server.state.pull(t, ids[start:start + n], h.step))
        start += n
    if dtype != P.DType.FP32:
        out = server.buffers.tensor(P.TORCH_DTYPES[dtype], (total, h.dim)).copy_(out)
    return [h.reply().pack(), P.tensor_frame(out)]


def push_multi(server: Any, h: P.Header, payload: list) -> list:
    """Apply (async) or buffer for the step's barrier (sync) every part's grads."""
    dtype = P.row_dtype(h.dtype, "PUSH_MULTI grads")
    tables, counts, ids = parse_parts(server, h, payload[0], payload[1])
    total = ids.shape[0]
    P.expect_bytes("PUSH_MULTI grads", len(payload[2]), total * h.dim, P.ITEM_SIZE[dtype],
                   server.config.max_frame_bytes)
    if h.step > _MAX_STEP:     # checked here so that no part is applied before a later one fails
        raise P.ProtocolError(f"PUSH_MULTI: step must be <= {_MAX_STEP}, got {h.step}", P.Status.BAD_VALUE)
    grads = P.frame_tensor(payload[2], dtype, total, h.dim).float()   # [M, D]
    if server.sync is not None:
        server._worker(h)
        server.sync._open(h.step, f"push of worker {h.worker}")    # STALE_STEP before any part
    start = 0
    for t, n in zip(tables, counts):
        if n:
            i, g = ids[start:start + n], grads[start:start + n]
            if server.sync is not None:
                server.sync.add_push(h.step, h.worker, t, i, g)
            else:
                server.state.push(t, i, g, h.step)
        start += n
    return [h.reply().pack()]

