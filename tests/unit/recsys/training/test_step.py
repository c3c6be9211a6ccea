"""SyncStep / AsyncStep against a fake store: what is waited for, when, and that errors surface."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from recsys.training.step import AsyncStep, SyncStep


class FakeStore:
    """Records calls; barrier_async returns a Future the test completes (or fails) itself."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.barriers: list[Future] = []

    def barrier(self, step: int) -> None:
        self.calls.append(("barrier", step))

    def barrier_async(self, step: int) -> Future:
        self.calls.append(("barrier_async", step))
        f: Future = Future()
        self.barriers.append(f)
        return f


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def test_sync_step_waits_for_pushes_not_for_the_barrier_reply() -> None:
    store = FakeStore()
    step = SyncStep(store)
    pushes = [_done(), _done()]
    step.after_backward(pushes, 0)               # returns although the barrier has no reply yet
    assert store.calls == [("barrier_async", 0)]
    assert not store.barriers[0].done()
    store.barriers[0].set_result([{}])
    step.after_backward([_done()], 1)            # step 0's barrier is waited for first
    assert store.calls == [("barrier_async", 0), ("barrier_async", 1)]
    store.barriers[1].set_result([{}])
    step.drain()


def test_sync_step_sends_no_barrier_before_its_pushes_are_acknowledged() -> None:
    store = FakeStore()
    failed: Future = Future()
    failed.set_exception(RuntimeError("push to shard 0 failed"))
    with pytest.raises(RuntimeError, match="push to shard 0 failed"):
        SyncStep(store).after_backward([failed], 0)
    assert store.calls == []                     # a failed push: no barrier for its step


def test_sync_step_surfaces_a_failed_barrier_at_the_next_step_or_drain() -> None:
    store = FakeStore()
    step = SyncStep(store)
    step.after_backward([], 0)
    store.barriers[0].set_exception(RuntimeError("barrier refused"))
    with pytest.raises(RuntimeError, match="barrier refused"):
        step.after_backward([], 1)
    step = SyncStep(store)
    step.after_backward([], 2)
    store.barriers[-1].set_exception(RuntimeError("barrier refused again"))
    with pytest.raises(RuntimeError, match="barrier refused again"):
        step.drain()
    step.drain()                                 # nothing left in flight


def test_async_step_keeps_one_step_in_flight() -> None:
    store = FakeStore()
    step = AsyncStep(store)
    push: Future = Future()
    step.after_backward([push], 0)
    assert store.calls == [("barrier_async", 0)] and not push.done()
    push.set_result(None)
    store.barriers[0].set_result([{}])
    step.after_backward([_done()], 1)
    store.barriers[1].set_result([{}])
    step.drain()
