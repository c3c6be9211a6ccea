"""The row init's test oracle in plain Python (`init_row_reference`), what `embedding_ps.init.init_rows`
and the C `ps_init_bits` are compared with."""

from __future__ import annotations

import math

from embedding_ps.wire.sharding import splitmix64_reference


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
