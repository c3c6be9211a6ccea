"""The numpy/torch bodies of the native library's operations: the reference that tests compare
the C with, and what `embedding_ps.native`'s functions run where the library does not load (no C
compiler, `EMBEDDING_PS_NATIVE=0`). Callers never choose between the two: they call `native`.

Each function computes what its namesake in `native` computes, with the same arguments (no
thread count: numpy and torch ops use their own). Where the C result is defined up to an order
(`unique`: distinct ids in order of first appearance; torch.unique sorts), the docstring says so.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from embedding_ps.wire.sharding import GOLDEN, splitmix64_np

EMPTY = -1
"""An id map's free bucket that ends a probe chain (`idmap.IdMap`'s layout)."""
TOMBSTONE = -2
"""An id map's deleted bucket: probed past, reusable by inserts."""
_GOLDEN = np.uint64(GOLDEN)


def home(keys: np.ndarray, buckets: int) -> np.ndarray:
    """int64 [N] -> int64 [N] in [0, buckets): the first bucket probed for each key (buckets < 2**32)."""
    z = splitmix64_np(keys.view(np.uint64) + _GOLDEN, copy=False)     # the sum is a new array
    z >>= np.uint64(32)
    z *= np.uint64(buckets)                                           # < 2**64: no overflow
    z >>= np.uint64(32)
    return z.view(np.int64)


def map_find(kv: np.ndarray, vv: np.ndarray, keys: np.ndarray, want: str) -> np.ndarray:
    """int64 [N] keys -> int64 [N] bucket of each key (want="pos") or int32 [N] value (want="val"), -1
    where absent; probe rounds over every key still searching, then only those that moved on."""
    nb = kv.shape[0]
    pos = home(keys, nb)
    v = vv[pos]
    hit = kv[pos] == keys
    hit &= v >= 0
    out = np.where(hit, pos if want == "pos" else v, -1)
    idx = np.flatnonzero((v != EMPTY) ^ hit)  # still searching: occupied by another key, or tombstone
    p = pos[idx]
    k = keys[idx]
    while idx.shape[0]:  # later rounds carry (idx, bucket, key) compressed, sequential reads only
        p += 1
        p[p == nb] = 0
        v = vv[p]
        hit = kv[p] == k
        hit &= v >= 0
        out[idx[hit]] = p[hit] if want == "pos" else v[hit]
        keep = (v != EMPTY) ^ hit
        idx, p, k = idx[keep], p[keep], k[keep]
    return out


def map_place(kv: np.ndarray, vv: np.ndarray, keys: np.ndarray, vals: np.ndarray) -> int:
    """Write distinct absent keys int64 [N] -> vals int32 [N] into free buckets (EMPTY or
    TOMBSTONE) by scatter-then-verify; returns the number of tombstones reused."""
    nb = kv.shape[0]
    pos = home(keys, nb)
    reused = 0
    idx = None  # None: all keys (round one, without an arange)
    while idx is None or idx.shape[0]:
        p = pos if idx is None else pos[idx]
        k = keys if idx is None else keys[idx]
        v = vv[p]
        free = np.flatnonzero(v < 0)
        fp = p[free]
        fk = k[free]
        kv[fp] = fk  # several keys on one free bucket: the last write wins ...
        won = kv[fp] == fk  # ... and only that key reads itself back
        wi = free[won]
        reused += int(np.count_nonzero(v[wi] == TOMBSTONE))
        vv[p[wi]] = vals[wi] if idx is None else vals[idx[wi]]
        left = np.ones(p.shape[0], dtype=bool)
        left[wi] = False
        idx = np.flatnonzero(left) if idx is None else idx[left]
        nxt = pos[idx] + 1
        nxt[nxt == nb] = 0
        pos[idx] = nxt
    return reused


def unique(ids: torch.Tensor, counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """torch.unique's sort: (sorted distinct ids [U], inverse [N], occurrences [U] or None); the C
    gives the distinct ids in order of first appearance instead."""
    out = torch.unique(ids, return_inverse=True, return_counts=counts)
    return out if counts else (*out, None)


def to_example_major(indices: torch.Tensor, lengths: torch.Tensor, B: int, weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Bags feature-major -> example-major with torch ops (any device): see `native.to_example_major`."""
    F_ = lengths.numel() // B
    N = indices.numel()
    em_lengths = lengths.view(F_, B).t().reshape(-1)                        # [B * F]
    em_offsets = torch.cumsum(em_lengths, 0) - em_lengths                  # [B * F]
    fm_offsets = torch.cumsum(lengths, 0) - lengths                        # [F * B]
    shift = em_offsets.view(B, F_).t().reshape(-1) - fm_offsets            # [F * B]: new start - old start
    dest = torch.arange(N, device=indices.device) + torch.repeat_interleave(shift, lengths, output_size=N)   # [N]
    out = torch.empty_like(indices).index_copy_(0, dest, indices)
    if weights is not None:
        weights = torch.empty_like(weights).index_copy_(0, dest, weights)
    return out, em_offsets, em_lengths, weights


def has_duplicates(slots: np.ndarray) -> bool:
    """Whether int32 slots (or any values) repeat (one sort: numpy's vectorized sort)."""
    srt = np.sort(slots)
    return bool(srt.shape[0] > 1 and (srt[1:] == srt[:-1]).any())


def merge_rows(slots: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """slots int32 [N], grads float32 [N, D] -> (unique slots int32 [U] in order of first arrival,
    each slot's grads summed in arrival order [U, D]): index_add_ into zeros."""
    uniq, first, inv = np.unique(slots, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")                 # the distinct slots by first arrival
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    summed = torch.zeros(uniq.shape[0], grads.shape[1], dtype=torch.float32)
    summed.index_add_(0, torch.from_numpy(rank[inv.reshape(-1)].astype(np.int64, copy=False)), grads)
    return uniq[order].astype(np.int32, copy=False), summed


def seed_mix(seed: int) -> int:
    """splitmix64(uint64(seed)): what every key of a table with this seed is xor-ed with."""
    return int(splitmix64_np(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0])


def init_bits(keys: np.ndarray, dim: int, mix: int) -> np.ndarray:
    """int64 [N] -> float32 [N, D] in (-1, 1): `embedding_ps.init`'s symmetric bits of each key
    (mix: `seed_mix(seed)`), in ~15 numpy passes over N x D uint32."""
    stream = splitmix64_np(keys.view(np.uint64) ^ np.uint64(mix & 0xFFFFFFFFFFFFFFFF))  # uint64 [N]
    a = stream.astype(np.uint32)  # low 32 bits
    b = (stream >> np.uint64(32)).astype(np.uint32)
    steps = (np.arange(1, dim + 1, dtype=np.uint64) * np.uint64(0x9E3779B9)).astype(np.uint32)  # [D]
    x = np.add(a[:, None], steps[None, :])  # uint32 [N, D], wraps
    x ^= b[:, None]
    t = np.empty_like(x)
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):     # fmix32 (t: the shifted copy)
        x ^= np.right_shift(x, np.uint32(shift), out=t)
        x *= np.uint32(mul)
    x ^= np.right_shift(x, np.uint32(16), out=t)
    x >>= np.uint32(8)
    x <<= np.uint32(1)
    v = x.view(np.int32)
    v -= np.int32((1 << 24) - 1)  # odd integers in (-2**24, 2**24): exact in float32
    out = v.astype(np.float32)
    out *= np.float32(2.0**-24)
    return out


def decay_scales(decay: float, behind: np.ndarray) -> torch.Tensor:
    """float32 [K] factors decay^k of k steps behind int64 [K] (in float64, rounded once)."""
    return torch.from_numpy(np.power(decay, behind.astype(np.float64)).astype(np.float32))


def scale_behind(rows: torch.Tensor, behind: np.ndarray, decay: float) -> None:
    """rows [N, D] (fp32, or fp16: scaled in fp32) in place: each row behind[i] = k > 0 steps behind times decay^k."""
    late = np.flatnonzero(behind > 0)
    if late.shape[0]:
        i = torch.from_numpy(late)
        rows.index_copy_(0, i, rows.index_select(0, i).mul_(decay_scales(decay, behind[late]).unsqueeze(1)))


def gather(weights: torch.Tensor, slots: np.ndarray, out: torch.Tensor, decay_steps: torch.Tensor | None = None,
           target: int = 0, decay: float = 1.0) -> int:
    """out[i] = weights[slots[i]] widened to float32 where slots[i] >= 0 (others untouched), scaled
    by decay^k for a row k = target - decay_steps[slot] > 0 steps behind; the number of slots < 0."""
    s = torch.from_numpy(slots)
    hit = s >= 0
    missing = s.shape[0] - int(hit.sum())
    if missing == 0:
        out.copy_(weights.index_select(0, s))
    elif missing < s.shape[0]:
        out[hit] = weights.index_select(0, s[hit]).float()
    if decay_steps is not None and missing < s.shape[0]:
        k = target - decay_steps.numpy()[np.maximum(slots, 0)].astype(np.int64)       # [N]
        k[slots < 0] = 0
        scale_behind(out, k, decay)
    return missing


def copy_finite(src: torch.Tensor, dst: torch.Tensor, wake_fd: int = -1) -> bool:
    """dst = src; whether every value is finite. wake_fd >= 0: a byte is written to it first."""
    if wake_fd >= 0:
        os.write(wake_fd, b"\0")
    dst.copy_(src)
    return bool(torch.isfinite(src).all())


def publish(flag: np.ndarray, value: int) -> None:
    """flag int64 [1] = value (a plain store: ordered after earlier stores on x86's TSO); as `notify`,
    word int32 [1] = value: no futex to wake, a waiter sees it on its next poll."""
    flag[0] = value


notify = publish


def wait_flag(flag: np.ndarray, want: int, timeout_s: float) -> int:
    """Poll (yielding the CPU) until flag int64 [1] is `want` or `-want`, at most timeout_s; the value last read."""
    end = time.monotonic() + timeout_s
    while (got := int(flag[0])) not in (want, -want) and time.monotonic() < end:
        os.sched_yield()
    return got


def wait_word(word: np.ndarray, timeout_s: float) -> int:
    """Poll (sleeping 50 us between reads) until word int32 [1] is not 0, at most timeout_s; the value."""
    end = time.monotonic() + max(timeout_s, 0.0)
    while (got := int(word[0])) == 0 and time.monotonic() < end:
        time.sleep(5e-5)
    return got
