"""Graceful stop of a training process: the first signal asks (`install`; the trainer then stops with a
checkpoint once `StopAgreement.after_step` says so), a second one stops at once.

The handler only sets a flag (a signal may arrive in the middle of a collective or a PS call; the
step that is running finishes normally). Ranks see a signal at different moments, so the flags are
combined over the process group (MAX): every rank stops after the same step, which is what a
consistent checkpoint needs (`StopAgreement`; `stop_agreed`, the blocking form, is one more sync
point a step). A second signal stops the process at once, without a checkpoint (`stop_handler`).
Who sends which signal: docs/operations.md "Graceful stop", `recsys.training.worker.worker_main`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from recsys.dist import all_reduce, collective_device

logger = logging.getLogger(__name__)

_requested = threading.Event()
requested = _requested.is_set       # whether this process was asked to stop
request = _requested.set            # ask it to stop at the next step boundary (what the first signal does)
reset = _requested.clear            # forget a request (tests run several trainings in one process)

DUPLICATE_WINDOW_S = 1.0
"""A signal this soon after the first is the same request delivered twice (under torchrun a Ctrl-C
reaches each worker from the terminal and again from the agent), not a second one."""


def stop_handler(event: threading.Event, message: str, window_s: float = DUPLICATE_WINDOW_S,
                 log: logging.Logger = logger) -> Callable[[int, object], None]:
    """A signal handler: the first signal sets `event` and logs `<SIGNAL>: message` (a warning on
    `log`); a second one, more than `window_s` after the first, restores the default action and
    re-sends itself: the process dies by it at once. (`recsys ps` / `recsys serve` pass window_s=0.)"""
    first_at = [0.0]

    def handle(signum: int, frame: object) -> None:
        if event.is_set():                     # the second signal: stop at once, by the signal itself
            if time.monotonic() - first_at[0] < window_s:
                return
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        first_at[0] = time.monotonic()
        event.set()
        log.warning("%s: %s", signal.Signals(signum).name, message)

    return handle


_handler = stop_handler(_requested, "stopping after the current step with a checkpoint (signal again to stop at once)")


def install(*signals: signal.Signals) -> None:
    """Handle `signals` as stop requests in this process (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in signals:
        signal.signal(sig, _handler)


def stop_agreed(world_size: int) -> bool:
    """Whether any rank was asked to stop; the same answer on every rank (collective when W > 1)."""
    if world_size == 1:
        return requested()
    return bool(all_reduce(torch.tensor([int(requested())]), dist.ReduceOp.MAX).item())


class StopAgreement:
    """The ranks' stop requests combined one step behind: step t's flags are reduced (async_op) while
    step t + 1 trains, so no rank waits at the step boundary for a slower one.

    after_step() at every step boundary, on every rank: True when some rank had asked to stop at the
    previous boundary (one process: this process's request, at once). close() waits for the reduction
    in flight (call it on every rank when training ends, before other collectives)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._pending: tuple[dist.Work, torch.Tensor] | None = None   # the previous boundary's reduction

    def after_step(self) -> bool:
        if self.world_size == 1:
            return requested()
        if self._pending is not None:
            work, flag = self._pending
            self._pending = None
            work.wait()
            if flag.item():
                return True
        flag = torch.tensor([int(requested())], device=collective_device())
        self._pending = (dist.all_reduce(flag, dist.ReduceOp.MAX, async_op=True), flag)
        return False

    def close(self) -> None:
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


__all__ = ["StopAgreement", "install", "requested", "request", "reset", "stop_agreed", "stop_handler"]
