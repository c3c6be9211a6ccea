"""Deterministic row init: a new row is a pure function of (table seed, key, column).

    stream(key)  = splitmix64(uint64(key) ^ splitmix64(uint64(seed)))      a, b = its low, high 32 bits
    bits(key, c) = fmix32(((a + (c + 1) * 0x9E3779B9) mod 2**32) ^ b)     (c = 0 .. D-1)
    v(key, c)    = (2 * (bits(key, c) >> 8) + 1 - 2**24) / 2**24          in (-1, 1), exact in fp32

where fmix32 is MurmurHash3's 32-bit finalizer (a bijection). The per-column hash is 32-bit
because it runs on N x D elements: numpy uint32 is several times faster than a 64-bit
splitmix64 per element (benchmarks/history/figures-from-the-code.md). A row's first value does
not depend on the number of shards, the order ids arrive in, or restarts.
`uniform`: v * init_scale; `normal`: sqrt(2) * erfinv(v) * init_scale; `zeros`: 0.
For a `hashed` table the key is the hashed row index, so every id sharing a row shares its init.
"""

from __future__ import annotations

import math

import torch

from embedding_ps import native
from embedding_ps.reference import seed_mix


def init_rows(keys: torch.Tensor, dim: int, seed: int, init: str, scale: float) -> torch.Tensor:
    """int64 [N] keys -> float32 [N, D]: the initial rows of these keys."""
    n = keys.shape[0]
    if init == "zeros" or n == 0:
        return torch.zeros(n, dim, dtype=torch.float32)
    # float32 [N, D]: the module docstring's v (hot: a new id's row is made on its pull and its admitting push)
    v = torch.from_numpy(native.init_bits(keys.numpy(), dim, seed_mix(seed)))
    if init == "uniform":
        return v.mul_(scale)
    if init == "normal":
        return v.erfinv_().mul_(math.sqrt(2.0) * scale)
    raise ValueError(f"init must be one of uniform, normal, zeros; got {init!r}")
