"""Global weight decay (`weight_decay_mode = "global"`): every row decays every step, applied lazily.

What such a table equals (the eager form, f = 1 - lr * weight_decay every step): docs/models.md,
"Sparse regularization"; fbgemm TBE calls it DECOUPLED_GLOBAL.

Lazily: each row keeps `decay_step` (int32, slot-major beside the weights, so it is regrown, saved,
re-sharded and kept copy-on-write with them): the step through which its decay is applied. The
table keeps `clock`, the latest step whose decay is due (a push of step s: s; a pull or a SAVE of
step s: s - 1, as step s's own decay comes with step s's push). A row k steps behind is scaled by
f^k (f rounded to float32 first, as the eager fp32 loop multiplies by it):

    pull of step s     rows returned scaled through s - 1 (a copy: a pull writes nothing), in
                       one pass of `native.gather` with decay steps
    push of step s     the touched rows are caught up through s in place, then updated without
                       decay: in the C update's pass (`native.update`, wd_mode "global"), or by
                       `touch` before the torch / fbgemm update (`TableShard.ucfg`: wd = 0)
    new row at step s  its init value at the start of step s (decay_step = s - 1): step s decays
                       it like every other row, so a one-step run equals `decoupled`
    save / dump        the rows written caught up through `clock`, chunk by chunk on copies
                       (`CaughtUpRows`): a checkpoint and an export equal the eager table

A request never decays a row backwards: rows are caught up to max(decay_step, the request's target).
In sync mode every request of step s comes after all of step s - 1, so that is the eager table; in
async mode each worker's request uses its own step (a push of a stale step s on a row that a
later step already reached only adds its update).

Load: a saved shard holds every row caught up through its `decay_clock` (meta) and its decay steps
(`decay_step.npy`); loading restores both, so steps stay absolute: a run resumed from a save
continues its step count (as the trainer does, from the checkpoint's step), and a shard that sees no
request for a few steps after the resume still owes its rows those steps. Re-sharding carries the
decay steps (`SavedShard.dump_table`, `TableShard.load_rows`). A save without decay steps (an older
version, or the table saved in another mode) leaves the clock unset: pulls return the rows as saved
until the first push (or SAVE with a step), whose target t - 1 the rows then count as caught up at.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from embedding_ps.reference import decay_scales, scale_behind
from embedding_ps.wire.config import TableConfig

def is_global(cfg: TableConfig) -> bool:
    """True if the table decays every row every step (a weight decay of mode "global")."""
    return bool(cfg.weight_decay) and cfg.weight_decay_mode == "global"


class GlobalDecay:
    """The clock of one table shard's global decay and the catch-up of its rows (see the module doc).

    Not thread-safe: the shard's lock serializes calls, as for `TableShard`. The rows' decay steps
    live in the table (`TableShard.decay_step`, int32 [C]); methods take them as arguments.
    """

    def __init__(self, cfg: TableConfig) -> None:
        self.factor = float(np.float32(1.0 - cfg.lr * cfg.weight_decay))   # the eager fp32 loop's factor
        self.clock: int | None = None
        """Latest step whose decay is due; None (unset) until the first step after creation, or after
        loading rows without decay steps (theirs are 0 then, fixed by that first step)."""

    # -- the clock -------------------------------------------------------------------------------
    def advance(self, dstep: torch.Tensor, hwm: int, target: int) -> None:
        """The decay of steps <= target is due (a push of target + 1, a SAVE of target + 1). An unset
        clock is fixed here: the rows [0, hwm) count as caught up through `target`."""
        if self.clock is None:
            dstep[:hwm] = target
            self.clock = target
        elif target > self.clock:
            self.clock = target

    def loaded_rows(self, dstep: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor | None) -> None:
        """Rows `slots` int64 [R] inserted by re-sharding, with their decay steps int [R] (None: unknown:
        caught up through the clock, or at the first step while it is unset)."""
        if steps is None:
            dstep.index_fill_(0, slots, 0 if self.clock is None else self.clock)
            return
        dstep.index_copy_(0, slots, steps.to(torch.int32))
        if steps.numel():
            top = int(steps.max())
            self.clock = top if self.clock is None else max(self.clock, top)

    # -- catch-up --------------------------------------------------------------------------------
    def touch(self, weights: torch.Tensor, dstep: torch.Tensor, slots: np.ndarray, step: int) -> None:
        """After `advance` to `step`, before its update of rows `slots` int32 [N] (duplicates fine): catch them up
        through `step` in place (step's own decay included). The C update does this in its own pass
        (`native.update` with decay steps); this is the path of the torch and fbgemm updates."""
        d = dstep.numpy()
        k = step - d[slots].astype(np.int64)                                   # [N] steps behind
        late = k > 0
        if not late.all():
            slots, k = slots[late], k[late]
        if slots.shape[0]:
            s = torch.from_numpy(slots).long()
            rows = weights.index_select(0, s).float().mul_(decay_scales(self.factor, k).unsqueeze(1))    # [K, D]
            weights.index_copy_(0, s, rows.to(weights.dtype))
            d[slots] = step

    def pull_target(self, step: int) -> int | None:
        """The step a pull of `step` returns rows caught up through: step - 1, noted on the clock; None
        while the clock is unset (rows as stored)."""
        if self.clock is None:
            return None
        self.clock = max(self.clock, step - 1)
        return step - 1

    def catch_up_chunk(self, chunk: dict[str, np.ndarray], target: int | None) -> dict[str, np.ndarray]:
        """A save's chunk or a dump's rows {"weights": [n, D], "decay_step": int32 [n], ...} (writable copies)
        with the weights caught up through `target` in place. None (an unset clock): the rows as they are, with
        the decay steps they had then (0; a push after a snapshot may have fixed the live ones since)."""
        d = chunk["decay_step"]
        if target is None:
            d[:] = 0
        else:      # fp16 rows are scaled in fp32 and rounded once
            scale_behind(torch.from_numpy(chunk["weights"]), target - d.astype(np.int64), self.factor)
            np.maximum(d, target, out=d)
        return chunk


class CaughtUpRows:
    """What `TableSnapshot.rows` takes (`specs`, `chunks()`), with the weights caught up through `target`.

    `source`: a copy-on-write `cow.RowStream` (its chunks are copies already), or a blocking save's
    `snapshot.LiveRows` that copies the arrays `CHANGED` chunk by chunk (the live rows are not modified,
    and the copy stays one chunk).
    """

    CHANGED = ("weights", "decay_step")
    """The arrays of a chunk that `GlobalDecay.catch_up_chunk` writes."""

    def __init__(self, source, decay: GlobalDecay, target: int | None) -> None:
        self.source, self.decay, self.target, self.specs = source, decay, target, source.specs

    def chunks(self) -> Iterator[dict[str, np.ndarray]]:
        for part in self.source.chunks():
            yield self.decay.catch_up_chunk(part, self.target)


__all__ = ["CaughtUpRows", "GlobalDecay", "is_global"]
