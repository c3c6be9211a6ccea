"""How a training step meets the PS: one strategy a `ps.mode`, chosen once by the Trainer.

Both strategies have the same small interface, called by the Trainer::

    strategy.prefetch                      # pull the next batch's rows while this one computes?
    strategy.after_backward(futures, t)    # the row-gradient pushes of step t were sent
    strategy.drain()                       # every push sent so far is acknowledged
    strategy.resumed(t)                    # a restored run continues at step t

`SyncStep`: wait for step t's pushes, then send `barrier(t)` without waiting for its reply; the
shards apply the step once every worker is there, and a pull for step t + 1 is parked there until
then. The trainer meanwhile runs its dense optimizer step and prepares the next batch (reads it,
finds its unique ids, sends its pulls). The barrier's reply is waited for at the next step (or
`drain`), so its errors still surface.
`AsyncStep`: step t's pushes (and a progress report, `barrier_async(t)`, for ps.max_staleness)
fly while the next batch computes; the previous step's are waited for first, so errors surface
and at most one step of gradients is in flight.

Both rely on a shard serving one connection's requests in order (`PSClient.barrier_async`): a
pull sent after barrier(t) is seen after it. SyncStep still waits for the pushes before the
barrier, so a push that had to be resent (timeout, shared-memory fallback) cannot land after it.
"""

from __future__ import annotations

from concurrent.futures import Future

from embedding_ps.store import EmbeddingStore


class SyncStep:
    """ps.mode = "sync": every step is applied by the shards before the next pull sees it."""

    prefetch = False

    def __init__(self, store: EmbeddingStore) -> None:
        self.store = store
        self._barrier: Future | None = None     # the last step's barrier, reply not yet waited for

    def after_backward(self, futures: list[Future], step: int) -> None:
        self.drain()                    # step t - 1's barrier (its reply came before this step's pull's)
        for fut in futures:
            fut.result()
        self._barrier = self.store.barrier_async(step)

    def drain(self) -> None:
        if self._barrier is not None:
            barrier, self._barrier = self._barrier, None
            barrier.result()

    def resumed(self, step: int) -> None:
        pass


class AsyncStep:
    """ps.mode = "async": one step of pushes in flight; the next batch's pulls overlap this one."""

    prefetch = True

    def __init__(self, store: EmbeddingStore) -> None:
        self.store = store
        self._in_flight: list[Future] = []     # the last step's push and barrier futures

    def after_backward(self, futures: list[Future], step: int) -> None:
        self.drain()
        self._in_flight = [*futures, self.store.barrier_async(step)]

    def drain(self) -> None:
        for fut in self._in_flight:
            fut.result()
        self._in_flight = []

    def resumed(self, step: int) -> None:
        if step > 0:                    # tell the shards this worker's progress (staleness bound)
            self.store.barrier(step - 1)
