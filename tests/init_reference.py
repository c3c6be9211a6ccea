"""The row init's test oracle in plain Python (`init_row_reference`), what `embedding_ps.init.init_rows`
and the C `ps_init_bits` are compared with, and the SplitMix64 finalizer's (`splitmix64_reference`),
what `embedding_ps.wire.sharding.splitmix64_np` is."""

from __future__ import annotations

import math

MASK64 = 0xFFFFFFFFFFFFFFFF


def splitmix64_reference(x: int) -> int:
    """Plain-Python reference of the finalizer on one integer (any sign)."""
    z = x & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def init_row_reference(key: int, dim: int, seed: int, init: str, scale: float) -> list[float]:
    """One row: `embedding_ps.init`'s docstring formulas, integer by integer."""
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
