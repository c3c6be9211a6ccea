"""The serving kernel's wrappers (`embedding_ps/csrc/pool.c`, part of the one native library that
`embedding_ps.native` builds, caches and loads): each checks dtypes, contiguity and sizes, then
calls the C with raw pointers. The kernel has no per-operation torch twin: the Predictor's
per-table path is its reference as a whole, and `native_fused.make_pooling` chooses between the
two once, when a predictor is built (the per-table path where the library does not load or the
layout is unsupported).
`set_enabled(False)` forces that choice here (tests use it); `EMBEDDING_PS_NATIVE=0`, through
`embedding_ps.native.set_enabled(False)`, turns the kernel off too.
"""

from __future__ import annotations

import torch

from embedding_ps import native as ps_native

SLOT_FIELDS = 16            # columns of the slot descriptor (see pool.c)
MAX_DIM = 1024             # widest row the kernel pools (SV_DMAX)

_state: dict = {"enabled": True}


def set_enabled(enabled: bool) -> bool:
    """Turn the native serving kernel on or off for this process; returns the previous setting."""
    prev = _state["enabled"]
    _state["enabled"] = bool(enabled)
    return prev


def lib():
    """The native library, or None (disabled here or in embedding_ps.native, no compiler, failed build)."""
    return ps_native.lib() if _state["enabled"] else None


def build(extra_flags: tuple[str, ...] = ()):
    """The library built with `extra_flags` added (`embedding_ps.native.build`), e.g. ("-DSV_PORTABLE",):
    the kernel without its AVX2 / F16C path, as on a CPU other than x86 (tests compare the two)."""
    return ps_native.build(tuple(extra_flags))


# ---------------------------------------------------------------------------- checked wrappers
def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise TypeError(f"native_pool: {name} must be a contiguous CPU {dtype} tensor, got {t.dtype}")


def map_build(native, buckets: torch.Tensor, keys: torch.Tensor) -> None:
    """Insert keys int64 [n] -> 0..n-1 into one table's map int64 [2**bits, 2] (values -1: empty)."""
    _check(buckets, torch.int64, "map"), _check(keys, torch.int64, "keys")
    cap = buckets.shape[0]
    if cap & (cap - 1) or cap < 2 * keys.shape[0] or buckets.shape[1] != 2:
        raise ValueError(f"native_pool: map of {cap} buckets for {keys.shape[0]} keys (a power of two >= 2 n)")
    dup = native.sv_map_build(buckets.data_ptr(), cap.bit_length() - 1, keys.data_ptr(), keys.shape[0])
    if dup != 0:
        raise ValueError(f"native_pool: {dup} duplicate keys in a table's ids")


def lookup(native, buckets: torch.Tensor, slots: torch.Tensor, B: int, values: torch.Tensor, offsets: torch.Tensor,
           rows: torch.Tensor, threads: int) -> int:
    """rows int32 [N] <- each id's row, or its slot's code of unknown ids (-1, -2, -3); returns the
    number of ids given -3 (those whose default rows the caller computes)."""
    _check(buckets, torch.int64, "map"), _check(slots, torch.int64, "slots"), _check(values, torch.int64, "values")
    _check(offsets, torch.int64, "offsets"), _check(rows, torch.int32, "rows")
    S = slots.shape[0]
    assert slots.shape[1] == SLOT_FIELDS and offsets.shape[0] == S * B + 1
    assert values.shape[0] == rows.shape[0] == int(offsets[-1])
    return int(native.sv_lookup(buckets.data_ptr(), slots.data_ptr(), S, B, values.data_ptr(), offsets.data_ptr(),
                                rows.data_ptr(), threads))


def misses(native, rows: torch.Tensor, offsets: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64 [M], bags int64 [M]) of the rows -3, in order; `count`: M, as `lookup` returned it."""
    _check(rows, torch.int32, "rows"), _check(offsets, torch.int64, "offsets")
    assert rows.shape[0] == int(offsets[-1])
    where, bag = torch.empty(count, dtype=torch.int64), torch.empty(count, dtype=torch.int64)
    m = native.sv_misses(rows.data_ptr(), offsets.data_ptr(), offsets.shape[0] - 1, where.data_ptr(), bag.data_ptr())
    if m != count:
        raise RuntimeError(f"native_pool: {m} rows -3, the lookup counted {count}")
    return where, bag


def pool(native, rows: torch.Tensor, buckets: torch.Tensor | None, values: torch.Tensor,
         weights: torch.Tensor | None, defaults: torch.Tensor | None, offsets: torch.Tensor, slots: torch.Tensor,
         B: int, out0: torch.Tensor, out1: torch.Tensor | None, threads: int) -> None:
    """Pool every bag into out0 / out1 (float32, laid out as the slots' columns and strides say);
    rows -2 are the uniform default rows of their keys (from `values`), rows <= -4 read float32
    `defaults` at offset -row - 4. `buckets`: None when `rows` holds the rows (`lookup`), else
    the hash maps: the kernel fills `rows` block by block as it pools (no slot of code -3)."""
    _check(rows, torch.int32, "rows"), _check(offsets, torch.int64, "offsets"), _check(slots, torch.int64, "slots")
    _check(values, torch.int64, "values")
    assert values.shape == rows.shape
    if buckets is not None:
        _check(buckets, torch.int64, "map")
        assert not bool((slots[:, 12] == -3).any()), "slots whose unknown ids need the caller's default rows"
    _check(out0, torch.float32, "out0")
    if weights is not None:
        _check(weights, torch.float32, "weights")
        assert weights.shape[0] == rows.shape[0]
    if defaults is not None:
        _check(defaults, torch.float32, "defaults")
    if out1 is not None:
        _check(out1, torch.float32, "out1")
    S = slots.shape[0]
    assert offsets.shape[0] == S * B + 1 and rows.shape[0] == int(offsets[-1])
    native.sv_pool(rows.data_ptr(), None if buckets is None else buckets.data_ptr(), values.data_ptr(),
                   None if weights is None else weights.data_ptr(),
                   None if defaults is None else defaults.data_ptr(), offsets.data_ptr(), slots.data_ptr(), S, B,
                   out0.data_ptr(), None if out1 is None else out1.data_ptr(), threads)
