"""The project's 64-bit hash of string ids: FNV-1a 64 over the UTF-8 bytes, then the splitmix64 finalizer.

    h = 0xcbf29ce484222325
    for byte in s.encode("utf-8"): h = ((h ^ byte) * 0x100000001b3) mod 2**64
    z = h; z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9; z = (z ^ (z >> 27)) * 0x94d049bb133111eb; z ^= z >> 31
    id = z & (2**63 - 1)                       (non-negative int64, so it passes the negative-id check)

Vectorized over an Arrow string array: no Python loop per row. The loop runs over byte positions:
rows are ordered by length (longest first) so the rows still active at byte p are a prefix, and
each step is one numpy pass over that prefix. Total work is O(total bytes + N log N).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

FNV_OFFSET = np.uint64(0xCBF29CE484222325)
FNV_PRIME = np.uint64(0x100000001B3)
GOLDEN = 0x9E3779B97F4A7C15
"""SplitMix64's increment (the generator's n-th output is the finalizer of n * GOLDEN)."""
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
MASK63 = np.uint64((1 << 63) - 1)


def splitmix64_finalize(z: np.ndarray) -> np.ndarray:
    """The splitmix64 output function on uint64 [N] (returns a new uint64 [N]; wraps mod 2**64).

    The one Python copy in data/ (data may not import embedding_ps, whose `sharding.splitmix64_np`
    is the other); tests/unit/test_splitmix64.py pins both, and the C one, to the same values."""
    z = z.astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def string_buffers(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(data uint8 [bytes], offsets [N + 1]) of a string / binary array, zero-copy, slice-aware."""
    t = arr.type
    if pa.types.is_string_view(t) or pa.types.is_binary_view(t):
        arr = arr.cast(pa.large_binary())
        t = arr.type
    off_type = np.int64 if (pa.types.is_large_string(t) or pa.types.is_large_binary(t)) else np.int32
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=off_type)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    return data, offsets


def hash_strings(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """int64 [N] non-negative ids of the strings (or binaries) of `arr`.

    A null slot hashes whatever bytes it spans (normally none); the caller masks nulls out.
    Dictionary arrays hash their dictionary once and gather by index.
    """
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        table = hash_strings(arr.dictionary)
        idx = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        return table[idx] if table.size else np.zeros(len(arr), np.int64)
    data, offsets = string_buffers(arr)
    lens = np.diff(offsets).astype(np.int64)
    h = np.full(lens.size, FNV_OFFSET, dtype=np.uint64)                 # FNV-1a 64 of each row's bytes
    if lens.size and int(lens.max()):
        order = np.argsort(-lens, kind="stable")          # longest first
        sorted_lens = lens[order]
        pos = offsets[order].astype(np.int64)             # [N] byte index of each row's next byte
        hs = h[order]
        # active[p] = rows with more than p bytes = a prefix of the sorted rows
        active = np.searchsorted(-sorted_lens, -np.arange(int(sorted_lens[0])), side="left")
        for k in active.tolist():
            seg = hs[:k]
            seg ^= data[pos[:k]]
            seg *= FNV_PRIME
            pos[:k] += 1
        h[order] = hs
    z = splitmix64_finalize(h)
    z &= MASK63
    return z.view(np.int64)
