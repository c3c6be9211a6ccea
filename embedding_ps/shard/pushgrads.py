"""A PUSH's gradients on the shard: waiting for those a client writes late (FLAG_GRADS_LATE: docs/wire.md),
and the finite check. Both run before any row changes, so a refused push applies nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from embedding_ps import native
from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig

GRADS_WAIT_S = 10.0
"""Longest a shard waits for a FLAG_GRADS_LATE push's grads (the copy itself takes milliseconds;
this bound only matters if the client hangs mid-copy: the shard serves no one meanwhile; a
client that died is seen within WRITER_CHECK_S)."""

WRITER_CHECK_S = 0.05
"""How often a shard waiting for late grads asks whether their writer still lives (`alive`)."""


def wait_late(request: int, trailer: np.ndarray, timeout_s: float, alive: Callable[[], bool]) -> bool:
    """Wait until the client wrote request `request`'s grads (trailer int64 [2]: ready, finite),
    and tell whether it found them all finite. ProtocolError (nothing applied) if it gave up, took
    longer than min(timeout_s, GRADS_WAIT_S), or `alive()` (asked every WRITER_CHECK_S while it
    waits: `shm.writer_alive`) says it is gone: a client killed mid-copy costs the shard about
    WRITER_CHECK_S, not the whole bound."""
    if not 0 < request < 2**63:
        raise P.ProtocolError(f"PUSH with late grads: request id {request} out of range", P.Status.BAD_VALUE)
    wait = min(timeout_s, GRADS_WAIT_S)
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        slice_s = max(0.0, min(left, WRITER_CHECK_S))
        got = native.wait_flag(trailer[0:1], request, slice_s)
        if got in (request, -request) or left <= slice_s:
            break
        if not alive():
            got = int(trailer[0])         # written just before it went: take it
            if got not in (request, -request):
                raise P.ProtocolError("PUSH: the client is gone (it died or closed its shared memory) before "
                                      "it wrote its grads; nothing applied", P.Status.BAD_VALUE)
            break
    if got == -request:
        raise P.ProtocolError("PUSH: the client gave up writing its grads into shared memory; nothing applied",
                              P.Status.BAD_VALUE)
    if got != request:
        raise P.ProtocolError(f"PUSH: grads not written into shared memory within {wait:g} s; nothing applied",
                              P.Status.BAD_VALUE)
    return int(trailer[1]) == 1


def finite_rows(config: PSConfig, tables: list[int], counts: list[int], grads: torch.Tensor
                ) -> torch.Tensor | None:
    """None if every gradient of grads [M, D] is finite (one sum first: NaN and inf propagate through it); else,
    under ps.on_nonfinite = "skip", a bool [M] of the finite rows; under "error" a BAD_VALUE ProtocolError naming
    them (part, table, row)."""
    if grads.numel() == 0 or math.isfinite(float(grads.sum())):
        return None
    finite = torch.isfinite(grads).all(dim=1)                          # [M]
    if bool(finite.all()):                                             # the sum overflowed, no row did
        return None
    if config.on_nonfinite == "skip":
        return finite
    bad = ~finite
    first = int(bad.nonzero()[0])
    part = int(np.searchsorted(np.cumsum(counts), first, side="right"))     # the part holding row `first`
    raise P.ProtocolError(f"PUSH: {int(bad.sum())} row(s) with NaN or infinite gradients (first: part {part}, table "
                          f"{config.tables[tables[part]].name!r}, row {first - sum(counts[:part])}); nothing "
                          "applied (ps.on_nonfinite = 'error')", P.Status.BAD_VALUE)


__all__ = ["GRADS_WAIT_S", "WRITER_CHECK_S", "finite_rows", "wait_late"]
