"""A batch's ids and a step's rows between the host and the training device (issue #32): what crosses,
when, on which stream and where the host waits: docs/performance.md, "Training on a GPU".

Pinned buffers come from torch's caching host allocator (`pin_memory()` / `pin_memory=True`): a block
is reused once the copies that used it have finished (torch records their events), so no step
allocates page-locked memory anew. The compute stream waits for the side stream by events
(`wait_stream`), never by a host synchronization. With device = cpu the same code runs (tests run it
so): no streams, no pinning, the copies are the tensors themselves. `dedup_tables` gives the rows,
pooled sums and row gradients of the CPU trainer's `embedding_ps.native.unique` (one hash pass a table,
faster on the host than sorting) in another order of the unique ids (sorted).
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from embedding_ps.store import cat


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device | None) -> torch.cuda.Stream | None:
    """The copy / ids stream of a CUDA device (one a process and device), None elsewhere."""
    if device is None or device.type != "cuda":
        return None
    if device.index is None:                  # "cuda": the current device, by index (one key per GPU)
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]


def on_stream(stream: torch.cuda.Stream | None):
    """`torch.cuda.stream(stream)`, or nothing without one (CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def to_device(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`t` (host) on `device`: through a pinned block and a non-blocking copy on the current stream
    for CUDA; `t` itself for the CPU (or no device). A tensor already on a GPU is moved as `.to` does."""
    if device is None or device.type != "cuda" or t.device.type != "cpu":
        return t if device is None else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def compute_waits(stream: torch.cuda.Stream | None, tensors) -> None:  # noqa: ANN001 (tensors: an iterable)
    """Make the current (compute) stream wait for `stream`'s work so far, and keep the memory of the
    `tensors` that `stream` made from being reused before the compute stream is done with them."""
    if stream is None:
        return
    current = torch.cuda.current_stream(stream.device)
    current.wait_stream(stream)
    for t in tensors:
        if t is not None and t.device.type == "cuda":
            t.record_stream(current)


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """(host copy, event) of device tensor `t`: a pinned block filled on the side stream once the
    compute stream's work so far (e.g. backward) is done; wait for the event before reading it. A
    CPU tensor is returned as it is, with no event."""
    if t.device.type != "cuda":
        return t, None
    stream = side_stream(t.device)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event(blocking=True)     # its waiter sleeps (a spinning one takes a shard's core)
        event.record(stream)
    t.record_stream(stream)
    return host, event


def dedup_tables(values: list[torch.Tensor], counts: bool = False
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    """Every table's ids deduplicated at once, where they are (the GPU: a handful of kernels, not one
    `torch.unique` a table).

    values: per table, ids int64 [N_t] (one device) -> (uniq: per table its distinct ids [U_t],
    sorted, ON THE HOST; inverse: per table int64 [N_t] on the ids' device, uniq[t][inverse[t]] ==
    values[t]; counts: per table int64 [U_t] on the host, each unique id's occurrences, or None).
    The ids are sorted by (table, id) with two stable sorts; the host gets the unique ids, the
    tables' unique counts (and the occurrences) in one copy.
    """
    P = len(values)
    sizes = [v.numel() for v in values]
    N = sum(sizes)
    device = values[0].device if values else torch.device("cpu")
    empty_host = torch.zeros(0, dtype=torch.int64)
    if N == 0:
        return ([empty_host] * P, [torch.zeros(0, dtype=torch.int64, device=device)] * P,
                [empty_host] * P if counts else None)
    ids = cat(values)                                                                         # [N]
    table = torch.repeat_interleave(torch.arange(P, device=device), torch.tensor(sizes).to(device),
                                    output_size=N)                                            # [N]
    by_id = torch.argsort(ids, stable=True)
    order = by_id.index_select(0, torch.argsort(table.index_select(0, by_id), stable=True))  # [N] by (table, id)
    sid, stab = ids.index_select(0, order), table.index_select(0, order)
    new = torch.ones(N, dtype=torch.bool, device=device)
    new[1:] = (sid[1:] != sid[:-1]) | (stab[1:] != stab[:-1])                                 # first of its run
    rank = torch.cumsum(new, 0) - 1                                                           # [N] unique index
    inverse = torch.empty_like(rank).index_copy_(0, order, rank)                             # [N] in input order
    first = new.nonzero().squeeze(1)                                                          # [U]
    per_table = torch.zeros(P, dtype=torch.int64, device=device).index_add_(
        0, stab.index_select(0, first), torch.ones_like(first))                               # [P] U_t
    parts = [per_table, sid.index_select(0, first)]
    if counts:
        ends = torch.cat([first[1:], torch.tensor([N], device=device)])
        parts.append(ends - first)                                                            # [U] occurrences
    host = torch.cat(parts).cpu()                                                             # ONE copy to the host
    u_sizes = host[:P].tolist()
    U = sum(u_sizes)
    uniq = list(host[P:P + U].split(u_sizes))
    occ = list(host[P + U:].split(u_sizes)) if counts else None
    starts = itertools.accumulate(u_sizes, initial=0)                   # a table's offset in the unique ids
    inv = [piece - s if s else piece for piece, s in zip(inverse.split(sizes), starts)]
    return uniq, inv, occ
