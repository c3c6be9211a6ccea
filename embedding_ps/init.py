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
from embedding_ps.wire.sharding import splitmix64_reference


def init_rows(keys: torch.Tensor, dim: int, seed: int, init: str, scale: float) -> torch.Tensor:
    """int64 [N] keys -> float32 [N, D]: the initial rows of these keys."""
    n = keys.shape[0]
    if init == "zeros" or n == 0:
        return torch.zeros(n, dim, dtype=torch.float32)
    # float32 [N, D] in (-1, 1), per the module docstring (`native.init_bits`: a shard initialises
    # every new id's row, on its pull and again when admitted on its push)
    v = torch.from_numpy(native.init_bits(keys.contiguous().numpy(), dim, seed_mix(seed)))
    if init == "uniform":
        return v.mul_(scale)
    if init == "normal":
        return v.erfinv_().mul_(math.sqrt(2.0) * scale)
    raise ValueError(f"init must be one of uniform, normal, zeros; got {init!r}")


def init_row_reference(key: int, dim: int, seed: int, init: str, scale: float) -> list[float]:
    """Plain-Python reference of one row (for tests): the docstring's formulas, integer by integer."""
    m64, m32 = 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFF

    sm64 = splitmix64_reference

    def fmix32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & m32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & m32
        return x ^ (x >> 16)

    stream = sm64((key & m64) ^ sm64(seed))
    a, b = stream & m32, stream >> 32
    out = []
    for c in range(dim):
        v = (2 * (fmix32(((a + (c + 1) * 0x9E3779B9) & m32) ^ b) >> 8) + 1 - 2**24) / 2**24
        if init == "uniform":
            out.append(v * scale)
        elif init == "normal":
            out.append(math.sqrt(2.0) * _erfinv(v) * scale)
        else:
            out.append(0.0)
    return out


def _erfinv(y: float) -> float:
    """erfinv by Newton steps on math.erf (reference only)."""
    x = 0.0
    for _ in range(60):
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return x
