"""How a shard orders pushes and pulls: `SyncGate` (ps.mode = "sync") or `AsyncGate` ("async").

The server picks one at start (`make_gate`) and a fresh one at every LOAD; it never tests the
mode itself. Both have the same small interface:

    must_wait(step)                  a pull (or a save) for `step` must be parked for now
    pulled(step)                     a pull for `step` is served now (async: its lead is noted)
    push(worker, step, parts)        parts [(table, ids [N], grads float32 [N, D])] of one request
    barrier(worker, step)            "worker is done with step"
    stats()                          the mode's part of the shard's STATS / HEALTH
    holds_pushes                     pushes outlive their request (sync: until the step's last
                                     barrier): the server copies them out of the client's shared
                                     memory, and does not look their slots up ahead

Sync contract (W = ps.num_workers), per worker and step t = 0, 1, 2, ...: pulls for t wait until no
step < t is pending; pushes for t are buffered (any number, every table); when all W workers sent
barrier(t), step t's pushes of each table are concatenated (in worker order, then arrival order)
and applied with one `state.push` per table, exactly as one process pushing the concatenation. A
push or barrier for a step already applied is refused (STALE_STEP). Steps need not be contiguous
(a resumed job may start at step 1000), but they are applied in increasing order.

Async: each push is applied on arrival; barriers report progress, and a pull for step s waits while
s is more than ps.max_staleness steps ahead of the slowest worker's last barrier + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig

Part = tuple[int, torch.Tensor, torch.Tensor]
"""(table, ids int64 [N], grads float32 [N, D]) of one push."""


class RowSink(Protocol):
    """What a gate applies pushes to (the shard's state)."""

    def push(self, table: int, ids: torch.Tensor, grads: torch.Tensor, step: int) -> None: ...


def check_worker(config: PSConfig, worker: int, what: str) -> None:
    if worker >= config.num_workers:
        raise P.ProtocolError(f"{what}: worker {worker} is outside 0..{config.num_workers - 1} (ps.num_workers)",
                              P.Status.BAD_VALUE)


@dataclass
class _Step:
    pushes: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)


class StepBuffer:
    """Each step's pushes, held until all `num_workers` workers sent its barrier."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.steps: dict[int, _Step] = {}
        self.last_applied = -1

    def pending_before(self, step: int) -> bool:
        """True while a step < `step` has pushes or barriers not applied yet."""
        return any(t < step for t in self.steps)

    def open(self, step: int, what: str) -> _Step:
        """The buffer of `step`; STALE_STEP if that step was applied already."""
        if step <= self.last_applied:
            raise P.ProtocolError(f"{what} for step {step}, but step {self.last_applied} is already "
                                  f"applied", P.Status.STALE_STEP)
        return self.steps.setdefault(step, _Step())

    def add_push(self, step: int, worker: int, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Buffer ids [N] and grads float32 [N, D] of one push."""
        self.open(step, f"push of worker {worker}").pushes.setdefault(table, []).append((worker, ids, grads))

    def arrive(self, step: int, worker: int) -> None:
        self.open(step, f"barrier of worker {worker}").arrived.add(worker)

    def pop_ready(self) -> tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None:
        """The lowest step if every worker arrived: (step, {table: (ids [M], grads [M, D])})."""
        step = min(self.steps, default=None)
        if step is None or len(self.steps[step].arrived) < self.num_workers:
            return None
        entry = self.steps.pop(step)
        self.last_applied = step
        merged = {}
        for table, parts in entry.pushes.items():
            parts = sorted(parts, key=lambda p: p[0])      # worker order; stable: arrival within one
            merged[table] = (torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))
        return step, merged


class SyncGate:
    """ps.mode = "sync": a step's pushes are summed and applied once, at its last barrier."""

    holds_pushes = True

    def __init__(self, config: PSConfig, state: RowSink) -> None:
        self.config, self.state = config, state
        self.buffer = StepBuffer(config.num_workers)

    @property
    def last_applied(self) -> int:
        return self.buffer.last_applied

    def must_wait(self, step: int) -> bool:
        return self.buffer.pending_before(step)

    def pulled(self, step: int) -> None:
        pass

    def push(self, worker: int, step: int, parts: list[Part]) -> None:
        check_worker(self.config, worker, "PUSH")
        self.buffer.open(step, f"push of worker {worker}")      # STALE_STEP before any part is kept
        for table, ids, grads in parts:
            self.buffer.add_push(step, worker, table, ids, grads)

    def barrier(self, worker: int, step: int) -> None:
        check_worker(self.config, worker, "BARRIER")
        self.buffer.arrive(step, worker)
        while (ready := self.buffer.pop_ready()) is not None:
            applied, merged = ready
            for table, (ids, grads) in sorted(merged.items()):
                self.state.push(table, ids, grads, applied)

    def stats(self) -> dict:
        return {"last_applied_step": self.buffer.last_applied, "pending_steps": sorted(self.buffer.steps)}


class AsyncGate:
    """ps.mode = "async": pushes apply on arrival; pulls are held to ps.max_staleness."""

    holds_pushes = False

    def __init__(self, config: PSConfig, state: RowSink) -> None:
        self.config, self.state = config, state
        self.progress = [-1] * config.num_workers      # last barrier step of each worker
        self.max_pull_lead = 0                         # most steps a served pull ran ahead

    def _lead(self, step: int) -> int:
        return step - (min(self.progress) + 1)

    def must_wait(self, step: int) -> bool:
        return self._lead(step) > self.config.max_staleness

    def pulled(self, step: int) -> None:
        self.max_pull_lead = max(self.max_pull_lead, self._lead(step))

    def push(self, worker: int, step: int, parts: list[Part]) -> None:
        for table, ids, grads in parts:
            self.state.push(table, ids, grads, step)

    def barrier(self, worker: int, step: int) -> None:
        check_worker(self.config, worker, "BARRIER")
        self.progress[worker] = max(self.progress[worker], step)

    def stats(self) -> dict:
        return {"max_pull_lead": self.max_pull_lead, "worker_progress": list(self.progress)}


Gate = SyncGate | AsyncGate
"""A gate of either mode: the interface the module doc lists."""


def make_gate(config: PSConfig, state: RowSink) -> Gate:
    """The gate of ps.mode (a fresh one: no steps, no progress)."""
    return SyncGate(config, state) if config.mode == "sync" else AsyncGate(config, state)


__all__ = ["Gate", "SyncGate", "AsyncGate", "StepBuffer", "make_gate", "check_worker"]
