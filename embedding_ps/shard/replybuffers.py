"""Reusable reply buffers of the shard server (PULL replies go out through zmq without a copy)."""

from __future__ import annotations

import sys

import numpy as np
import torch

from embedding_ps.wire.shm import best_fit


class ReplyBuffers:
    """Reusable byte buffers for PULL replies, which zmq sends without a copy.

    A fresh [N, D] allocation per pull is a fresh mmap on glibc: every page faults again (the cost
    for a 25 MB reply: benchmarks/history/figures-from-the-code.md). A buffer is free again
    once zmq has released the frame viewing it (CPython
    reference counts: only this pool still refers to it). Sizes are rounded up to a power of two
    so that requests of similar sizes share buffers; at most `max_bytes` are kept.
    """

    MIN_BYTES = 1 << 16          # smaller frames are copied by pyzmq anyway

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self.bufs: list[np.ndarray] = []
        self.total = 0

    def take(self, nbytes: int) -> np.ndarray:
        """uint8 [nbytes], not initialized, not referred to by anything else."""
        best = best_fit([a.nbytes for a in self.bufs], nbytes, self._idle)
        if best is not None:
            return self.bufs[best][:nbytes]
        size = max(self.MIN_BYTES, 1 << max(nbytes - 1, 1).bit_length())
        if size > self.max_bytes:
            return torch.empty(nbytes, dtype=torch.uint8).numpy()
        while self.total + size > self.max_bytes:     # drop idle buffers (smallest first) to make room
            idle = best_fit([a.nbytes for a in self.bufs], 0, self._idle)
            if idle is None:
                return torch.empty(nbytes, dtype=torch.uint8).numpy()
            self.total -= self.bufs.pop(idle).nbytes
        # torch's allocation, viewed by numpy: numpy itself would madvise(MADV_HUGEPAGE) a large
        # array, and huge pages made each send slower here (more sys time, pages faulting again)
        a = torch.empty(size, dtype=torch.uint8).numpy()
        self.bufs.append(a)
        self.total += size
        return a[:nbytes]

    def _idle(self, i: int) -> bool:
        # references: the list and getrefcount's argument; more while a frame (a view) is alive
        return sys.getrefcount(self.bufs[i]) <= 2

    def tensor(self, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """An uninitialized contiguous tensor backed by a pool buffer."""
        n = shape[0] * shape[1]
        item = torch.empty(0, dtype=dtype).element_size()
        if n * item < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(self.take(n * item))
        return raw.view(dtype).view(shape)


__all__ = ["ReplyBuffers"]
