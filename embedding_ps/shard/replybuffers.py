"""Reusable reply buffers of the shard server (PULL replies go out through zmq without a copy)."""

from __future__ import annotations

import numpy as np
import torch

from embedding_ps.wire.shm import BufferPool


class ReplyBuffers(BufferPool):
    """Reusable byte buffers for PULL replies, which zmq sends without a copy (a `shm.BufferPool`: a
    buffer is free again once zmq has released the frame viewing it).

    A fresh [N, D] allocation per pull is a fresh mmap on glibc: every page faults again (the cost
    for a 25 MB reply: benchmarks/history/figures-from-the-code.md). Power-of-two sizes let requests
    of similar sizes share buffers.
    """

    MIN_BYTES = 1 << 16          # smaller frames are copied by pyzmq anyway

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        super().__init__(max_bytes, self.MIN_BYTES)

    def take(self, nbytes: int) -> np.ndarray:
        """uint8 [nbytes], not initialized, not referred to by anything else (no room: one not kept)."""
        i = self.index(nbytes)
        return self._make(nbytes) if i is None else self.bufs[i][:nbytes]

    def _make(self, size: int) -> np.ndarray:
        # torch's allocation, viewed by numpy: numpy itself would madvise(MADV_HUGEPAGE) a large
        # array, and huge pages made each send slower here (more sys time, pages faulting again)
        return torch.empty(size, dtype=torch.uint8).numpy()

    def tensor(self, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """An uninitialized contiguous tensor backed by a pool buffer."""
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if nbytes < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(self.take(nbytes)).view(dtype).view(shape)


__all__ = ["ReplyBuffers"]
