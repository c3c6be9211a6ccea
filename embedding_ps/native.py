"""The native library: one self-choosing function per hot operation, each running C when the
library loads and its numpy/torch body (`embedding_ps.reference`) otherwise, with the same values
(tests compare the two paths; `update` is the one that can decline, see its docstring). The
`sv_*` functions wrap the serving kernel, which has no per-operation twin.

The library (`csrc/`, see `csrc/native.h`) is built by `embedding_ps.native_build` on first use
(docs/performance.md, "The native library"). `threads` is the shard's ps.threads (how the C splits
the items: `csrc/ps.c`'s header); ctypes releases the GIL for the call.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from embedding_ps import reference as ref
from embedding_ps.native_build import build, set_cache_dir  # noqa: F401  (re-exported: callers say native.build)
from embedding_ps.wire.config import FUSED_OPTIMIZERS

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict = {"loaded": False, "lib": None, "enabled": True}

OPTIMIZERS = {name: code for code, name in enumerate(FUSED_OPTIMIZERS)}
"""The optimizers `update` runs in C, by ps.c's enum value (the others: `optim.apply_update`'s torch ops)."""


def set_enabled(enabled: bool) -> bool:
    """Turn the native path on or off for this process (False: the reference bodies); returns the
    previous setting. embedding_ps reads no environment variables: the `recsys` entry points turn
    `EMBEDDING_PS_NATIVE=0` into this call."""
    prev = _state["enabled"]
    _state["enabled"] = bool(enabled)
    return prev


def lib():
    """The loaded ctypes library, or None (disabled, no compiler, or the build failed); only this
    module calls it (callers ask `available()`)."""
    if not _state["enabled"]:
        return None
    if not _state["loaded"]:
        with _lock:
            if not _state["loaded"]:
                try:
                    _state["lib"] = build()
                except Exception as e:  # noqa: BLE001 - any failure means: the reference bodies run
                    logger.warning("embedding_ps: native library unavailable, using numpy/torch (%s)", e)
                _state["loaded"] = True
    return _state["lib"]


def available() -> bool:
    return lib() is not None


# ---------------------------------------------------------------------------- the operations
def _require(ok: bool, what: str) -> None:
    """The shapes a C function relies on (out-of-bounds writes otherwise): a ValueError, not an
    assert, so that `python -O` keeps the check."""
    if not ok:
        raise ValueError(f"native: {what}")


def _check(a, dtype, name: str) -> None:
    ok = a.flags.c_contiguous if isinstance(a, np.ndarray) else a.is_contiguous() and a.is_cpu
    if not (ok and a.dtype == dtype):
        raise TypeError(f"native: {name} must be a contiguous {dtype} array, got {a.dtype}")


def map_find(kv: np.ndarray, vv: np.ndarray, keys: np.ndarray, want: str, threads: int = 1) -> np.ndarray:
    """An id map's probe (`idmap.IdMap`'s layout: keys kv int64 [C], values vv int32 [C]): int64 [N]
    keys -> int32 values (want="val") or int64 buckets (want="pos"), -1 where absent."""
    _check(kv, np.int64, "map keys"), _check(vv, np.int32, "map vals"), _check(keys, np.int64, "keys")
    _require(kv.shape[0] == vv.shape[0] and 0 < kv.shape[0] < 1 << 32,
             "map_find: keys and values of one size in [1, 2**32)")
    c = lib()
    if c is None:
        return ref.map_find(kv, vv, keys, want)
    n, nb = keys.shape[0], kv.shape[0]
    out = np.empty(n, dtype=np.int32 if want == "val" else np.int64)
    vals, pos = (out.ctypes.data, None) if want == "val" else (None, out.ctypes.data)
    if c.ps_map_find(kv.ctypes.data, vv.ctypes.data, nb, keys.ctypes.data, n, vals, pos, threads) != 0:
        raise RuntimeError("IdMap: probe chain without an empty bucket (corrupt map)")
    return out


def map_place(kv: np.ndarray, vv: np.ndarray, keys: np.ndarray, vals: np.ndarray) -> int:
    """Insert distinct absent keys int64 [N] -> vals int32 [N] into an id map; returns the number
    of tombstones reused. The C places one key at a time (the first free bucket of its chain), the
    reference by rounds of scatter-then-verify: the same keys found, buckets may differ."""
    _check(kv, np.int64, "map keys"), _check(vv, np.int32, "map vals")
    _check(keys, np.int64, "keys"), _check(vals, np.int32, "vals")
    _require(kv.shape[0] == vv.shape[0] and 0 < kv.shape[0] < 1 << 32 and keys.shape == vals.shape,
             "map_place: keys and values of one size in [1, 2**32), as many new keys as values")
    c = lib()
    if c is None:
        return ref.map_place(kv, vv, keys, vals)
    r = c.ps_map_place(kv.ctypes.data, vv.ctypes.data, kv.shape[0], keys.ctypes.data, vals.ctypes.data, keys.shape[0])
    if r < 0:
        raise RuntimeError("IdMap: no free bucket (map full)")
    return int(r)


def unique(ids: torch.Tensor, counts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ids [N] -> (uniq [U]: each distinct id once, inverse int64 [N]: uniq[inverse] == ids, counts
    int64 [U] of occurrences or None): the dedup of the trainer (`recsys.models.sparse_arch`), the
    row cache and the PS client. In C (int64 ids on the CPU): one hash pass, distinct ids in order
    of first appearance (benchmarks/shard_ops.py: dedup_c_ms against dedup_torch_ms); otherwise
    torch.unique's sort (sorted distinct ids)."""
    c = lib()
    if c is None or ids.dtype != torch.int64 or not ids.is_cpu:
        return ref.unique(ids, counts)
    ids = ids.contiguous()
    n = ids.shape[0]
    _require(ids.dim() == 1 and n < 1 << 31, f"unique: ids must be 1-D, fewer than 2**31, got {list(ids.shape)}")
    uniq = torch.empty(n, dtype=torch.int64)
    inverse = torch.empty(n, dtype=torch.int64)
    cnt = torch.empty(n, dtype=torch.int64) if counts else None
    u = c.ps_unique(ids.data_ptr(), n, uniq.data_ptr(), inverse.data_ptr(), cnt.data_ptr() if cnt is not None else None)
    if u < 0:
        raise MemoryError(f"native unique of {n} ids: out of memory")
    return uniq[:u], inverse, (cnt[:u] if cnt is not None else None)


def to_example_major(indices: torch.Tensor, lengths: torch.Tensor, B: int, weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Bags feature-major -> example-major: indices [N] and lengths [F * B] of bag (f, b) at f * B + b
    (weights [N] or None) -> (indices [N], offsets [B * F], lengths [B * F], weights [N] | None) of bag
    (f, b) at b * F + f. In C for int64 CPU tensors (float32 weights): one pass, the same values as
    the torch ops (benchmarks/shard_ops.py: example_major_c_ms against example_major_torch_ms)."""
    c = lib()
    if (c is None or not indices.is_cpu or indices.dtype != torch.int64 or lengths.dtype != torch.int64
            or (weights is not None and weights.dtype != torch.float32)):
        return ref.to_example_major(indices, lengths, B, weights)
    indices, lengths = indices.contiguous(), lengths.contiguous()
    weights = None if weights is None else weights.contiguous()
    n, fb = indices.shape[0], lengths.shape[0]
    _require(indices.dim() == 1 and lengths.dim() == 1 and B > 0 and fb % B == 0,
             f"to_example_major: 1-D indices and lengths, F * B lengths, got {fb} for B = {B}")
    _require(weights is None or weights.shape == indices.shape, "to_example_major: weights must match indices")
    out = torch.empty_like(indices)
    out_w = torch.empty_like(weights) if weights is not None else None
    em_lengths, em_offsets = torch.empty_like(lengths), torch.empty_like(lengths)
    if fb and (int(lengths.min()) < 0 or int(lengths.max()) > n) or int(lengths.sum()) != n:   # max <= n: no wrap
        raise ValueError(f"to_example_major: lengths must be >= 0 and sum to the {n} indices, got sum "
                         f"{int(lengths.sum())}")
    c.ps_to_example_major(lengths.data_ptr(), fb // B, B, indices.data_ptr(),
                          weights.data_ptr() if weights is not None else None, out.data_ptr(),
                          out_w.data_ptr() if out_w is not None else None, em_lengths.data_ptr(), em_offsets.data_ptr())
    return out, em_offsets, em_lengths, out_w


def has_duplicates(slots: np.ndarray, bitmap: np.ndarray) -> bool:
    """Whether int32 slots (each in [0, 8 * bitmap.size)) repeat; bitmap: uint8, zero, left zero
    (the C marks a bit per slot; the reference sorts)."""
    _check(slots, np.int32, "slots"), _check(bitmap, np.uint8, "bitmap")
    c = lib()
    if c is None:
        return ref.has_duplicates(slots)
    return bool(c.ps_has_duplicates(slots.ctypes.data, slots.shape[0], bitmap.ctypes.data))


def merge_rows(slots: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """slots int32 [N] with duplicates, grads float32 [N, D] -> (unique slots int32 [U] in order of first
    arrival, grads summed in arrival order [U, D]), bit for bit the reference's index_add_."""
    _check(slots, np.int32, "slots"), _check(grads, torch.float32, "grads")
    c = lib()
    if c is None:
        return ref.merge_rows(slots, grads)
    n, d = grads.shape
    _require(slots.shape[0] == n and n < 1 << 31, f"merge_rows: {slots.shape[0]} slots for {n} rows (< 2**31)")
    out_slots = np.empty(n, dtype=np.int32)
    out = torch.empty(n, d, dtype=torch.float32)
    u = c.ps_merge_rows(slots.ctypes.data, grads.data_ptr(), n, d, out_slots.ctypes.data, out.data_ptr())
    if u < 0:
        raise MemoryError(f"native merge of {n} rows: out of memory")
    return out_slots[:u], out[:u]


def init_bits(keys: np.ndarray, dim: int, seed_mix: int, threads: int = 1) -> np.ndarray:
    """embedding_ps.init's symmetric bits: int64 [N] keys -> float32 [N, D] in (-1, 1), the same
    bits in C (one pass) and in numpy (~15 passes; benchmarks/shard_ops.py: init_c_ms against
    init_numpy_ms). seed_mix: `reference.seed_mix(seed)`."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    c = lib()
    if c is None:
        return ref.init_bits(keys, dim, seed_mix)
    out = np.empty((keys.shape[0], dim), dtype=np.float32)
    c.ps_init_bits(keys.ctypes.data, keys.shape[0], dim, seed_mix & 0xFFFFFFFFFFFFFFFF, out.ctypes.data, threads)
    return out


def gather(weights: torch.Tensor, slots: np.ndarray, out: torch.Tensor, threads: int = 1,
           decay_steps: torch.Tensor | None = None, target: int = 0, decay: float = 1.0) -> int:
    """out float32 [N, D] = weights[slots] (fp32 or fp16 weights), slots int32 [N] < len(weights);
    rows with slot < 0 are left untouched. Returns how many there were.

    decay_steps (int32 [C], global weight decay, `embedding_ps.shard.decay`): a row k = target -
    decay_steps[slot] > 0 steps behind comes scaled by decay^k."""
    _check(slots, np.int32, "slots"), _check(out, torch.float32, "out")
    half = weights.dtype == torch.float16
    _check(weights, torch.float16 if half else torch.float32, "weights")
    n, d = out.shape
    _require(slots.shape[0] == n and weights.shape[1] == d, f"{slots.shape[0]} slots for {n} rows of width {d}")
    if decay_steps is not None:
        _check(decay_steps, torch.int32, "decay_steps")
        _require(decay_steps.shape[0] == weights.shape[0], "gather: decay_steps needs a step per weights row")
    c = lib()
    if c is None:
        return ref.gather(weights, slots, out, decay_steps, target, decay)
    return c.ps_gather(weights.data_ptr(), half, d, slots.ctypes.data, n, out.data_ptr(),
                       None if decay_steps is None else decay_steps.data_ptr(), int(target), decay, threads)


def copy_finite(src: torch.Tensor, dst: torch.Tensor, wake_fd: int = -1) -> bool:
    """dst = src (float32, same shape, both contiguous) in one pass; whether every value is finite.
    wake_fd >= 0: a byte is written to that fd first, inside the same call (no GIL held in C)."""
    _check(src, torch.float32, "src"), _check(dst, torch.float32, "dst")
    _require(src.shape == dst.shape, f"copy_finite: src {list(src.shape)} and dst {list(dst.shape)} differ")
    c = lib()
    if c is None:
        return ref.copy_finite(src, dst, wake_fd)
    return bool(c.ps_copy_finite(src.data_ptr(), dst.data_ptr(), src.numel(), int(wake_fd)))


def publish(flag: np.ndarray, value: int) -> None:
    """flag int64 [1] = value, after every earlier store of this thread (a release store with a fence)."""
    _check(flag, np.int64, "flag")
    c = lib()
    if c is None:
        return ref.publish(flag, value)
    c.ps_publish(flag.ctypes.data, int(value))


def wait_flag(flag: np.ndarray, want: int, timeout_s: float) -> int:
    """Spin (then yield) until flag int64 [1] is `want` or `-want`, at most timeout_s; the value last read."""
    _check(flag, np.int64, "flag")
    c = lib()
    if c is None:
        return ref.wait_flag(flag, want, timeout_s)
    return int(c.ps_wait_flag(flag.ctypes.data, int(want), int(timeout_s * 1e9)))


def notify(word: np.ndarray, value: int) -> None:
    """word int32 [1] = value (release), then wake whoever waits on it in any process (`wait_word`)."""
    _check(word, np.int32, "word")
    c = lib()
    if c is None:
        return ref.notify(word, value)
    c.ps_notify(word.ctypes.data, int(value))


def wait_word(word: np.ndarray, timeout_s: float) -> int:
    """Sleep until word int32 [1] is not 0 (a futex on Linux; the reference polls), at most
    timeout_s; the value (0: timed out)."""
    _check(word, np.int32, "word")
    c = lib()
    if c is None:
        return ref.wait_word(word, timeout_s)
    return int(c.ps_wait_word(word.ctypes.data, int(max(timeout_s, 0.0) * 1e9)))


WEIGHT_DECAY_MODES = {"none": 0, "l2": 1, "decoupled": 2, "global": 3}


def update(optimizer: str, weights: torch.Tensor, state: torch.Tensor | None, slots: np.ndarray,
           grads: torch.Tensor, lr: float, eps: float, meta: torch.Tensor | None, step: int,
           weight_decay: float = 0.0, weight_decay_mode: str = "l2", threads: int = 1, sort: bool = True,
           decay_steps: torch.Tensor | None = None) -> bool:
    """The fused update of unique rows slots int32 [U] from grads float32 [U, D] (ps_update in
    csrc/ps.c), if C runs it: False (nothing done) without the library or for an optimizer outside
    `OPTIMIZERS`; the caller then runs `optim.apply_update`, the torch reference that every
    optimizer has.

    `threads` > 1 splits the rows between threads: the slots must be unique (`TableShard` merges
    duplicates first), or two threads would update one row. `sort`: from 2048 rows on, update them in
    increasing slot order (a radix sort in C; same results, faster on large tables: benchmarks/
    ps_table.py); False: arrival order (tests compare the two).

    weight_decay > 0: `weight_decay_mode` "l2" or "decoupled" as `optim.apply_update`, or "global" (with
    `decay_steps`, int32 [C], each row's decayed-through step): `GlobalDecay.touch`'s catch-up, then the
    update without decay. `meta` (int64 [C], count << 32 | last_seen): the row counters as
    `TableShard.push` updates them."""
    c = lib()
    if c is None or optimizer not in OPTIMIZERS:
        return False
    half = weights.dtype == torch.float16
    _check(weights, torch.float16 if half else torch.float32, "weights")
    _check(slots, np.int32, "slots"), _check(grads, torch.float32, "grads")
    n, d = grads.shape
    _require(slots.shape[0] == n and weights.shape[1] == d, f"{slots.shape[0]} slots for {n} rows of width {d}")
    opt = OPTIMIZERS[optimizer]
    sp = mp = dp = None
    if opt != OPTIMIZERS["sgd"]:
        _check(state, torch.float32, "optimizer state")
        _require(state.shape[0] == weights.shape[0], "update: state needs a row per weights row")
        sp = state.data_ptr()
    if meta is not None:
        _check(meta, torch.int64, "meta")
        mp = meta.data_ptr()
    mode = weight_decay_mode if weight_decay else "none"
    if mode == "global":
        _require(decay_steps is not None, "update: weight_decay_mode 'global' needs decay_steps")
        _check(decay_steps, torch.int32, "decay_steps")
        _require(decay_steps.shape[0] == weights.shape[0], "update: decay_steps needs a step per weights row")
        dp = decay_steps.data_ptr()
    if c.ps_update(opt, weights.data_ptr(), half, sp, d, slots.ctypes.data, n, grads.data_ptr(), -lr, eps, mp,
                   int(step), WEIGHT_DECAY_MODES[mode], weight_decay, 1.0 - lr * weight_decay, dp, threads, sort) != 0:
        raise MemoryError(f"native update of {n} rows of width {d}: out of memory (some rows were not updated)")
    return True


# ---------------------------------------------------------------------------- the serving kernel (pool.c)
# No per-operation torch twin: the Predictor's per-table path is its reference as a whole, and
# `recsys.serving.native_fused.make_pooling` takes that path where `available()` is False. `kernel`:
# a library from `build(...)` (tests pass a -DSV_PORTABLE one), else the process's.
SV_SLOT_FIELDS = 16         # columns of the slot descriptor (see pool.c)
SV_MAX_DIM = 1024           # widest row the kernel pools (SV_DMAX)


def _kernel(kernel):
    c = kernel if kernel is not None else lib()
    if c is None:
        raise RuntimeError("native: the library is not loaded (callers check available() first)")
    return c


def sv_map_build(buckets: torch.Tensor, keys: torch.Tensor, kernel=None) -> None:
    """Insert keys int64 [n] -> 0..n-1 into one table's map int64 [2**bits, 2] (values -1: empty)."""
    _check(buckets, torch.int64, "map"), _check(keys, torch.int64, "keys")
    cap = buckets.shape[0]
    _require(not cap & (cap - 1) and cap >= 2 * keys.shape[0] and buckets.shape[1] == 2,
             f"map of {cap} buckets for {keys.shape[0]} keys (a power of two >= 2 n)")
    dup = _kernel(kernel).sv_map_build(buckets.data_ptr(), cap.bit_length() - 1, keys.data_ptr(), keys.shape[0])
    _require(dup == 0, f"{dup} duplicate keys in a table's ids")


def sv_lookup(buckets: torch.Tensor, slots: torch.Tensor, B: int, values: torch.Tensor, offsets: torch.Tensor,
              rows: torch.Tensor, threads: int, kernel=None) -> int:
    """rows int32 [N] <- each id's row, or its slot's code of unknown ids (-1, -2, -3); returns the
    number of ids given -3 (those whose default rows the caller computes)."""
    _check(buckets, torch.int64, "map"), _check(slots, torch.int64, "slots"), _check(values, torch.int64, "values")
    _check(offsets, torch.int64, "offsets"), _check(rows, torch.int32, "rows")
    S = slots.shape[0]
    _require(slots.shape[1] == SV_SLOT_FIELDS and offsets.shape[0] == S * B + 1, "sv_lookup: slots or offsets")
    _require(values.shape[0] == rows.shape[0] == int(offsets[-1]), "sv_lookup: values, rows and offsets differ")
    return int(_kernel(kernel).sv_lookup(buckets.data_ptr(), slots.data_ptr(), S, B, values.data_ptr(),
                                         offsets.data_ptr(), rows.data_ptr(), threads))


def sv_misses(rows: torch.Tensor, offsets: torch.Tensor, count: int, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64 [M], bags int64 [M]) of the rows -3, in order; `count`: M, as `sv_lookup` returned it."""
    _check(rows, torch.int32, "rows"), _check(offsets, torch.int64, "offsets")
    _require(rows.shape[0] == int(offsets[-1]), "sv_misses: rows and offsets differ")
    where, bag = torch.empty(count, dtype=torch.int64), torch.empty(count, dtype=torch.int64)
    m = _kernel(kernel).sv_misses(rows.data_ptr(), offsets.data_ptr(), offsets.shape[0] - 1, where.data_ptr(),
                                  bag.data_ptr())
    if m != count:
        raise RuntimeError(f"native: {m} rows -3, the lookup counted {count}")
    return where, bag


def sv_pool(rows: torch.Tensor, buckets: torch.Tensor | None, values: torch.Tensor, weights: torch.Tensor | None,
            defaults: torch.Tensor | None, offsets: torch.Tensor, slots: torch.Tensor, B: int, out0: torch.Tensor,
            out1: torch.Tensor | None, threads: int, kernel=None) -> None:
    """Pool every bag into out0 / out1 (float32, laid out as the slots' columns and strides say);
    rows -2 are the uniform default rows of their keys (from `values`), rows <= -4 read float32
    `defaults` at offset -row - 4. `buckets`: None when `rows` holds the rows (`sv_lookup`), else
    the hash maps: the kernel fills `rows` block by block as it pools (no slot of code -3)."""
    _check(rows, torch.int32, "rows"), _check(offsets, torch.int64, "offsets"), _check(slots, torch.int64, "slots")
    _check(values, torch.int64, "values"), _check(out0, torch.float32, "out0")
    if buckets is not None:
        _check(buckets, torch.int64, "map")
        _require(not bool((slots[:, 12] == -3).any()), "sv_pool: slots whose unknown ids need the caller's rows")
    if weights is not None:
        _check(weights, torch.float32, "weights")
    if defaults is not None:
        _check(defaults, torch.float32, "defaults")
    if out1 is not None:
        _check(out1, torch.float32, "out1")
    S, n = slots.shape[0], rows.shape[0]
    _require(values.shape[0] == n and (weights is None or weights.shape[0] == n) and offsets.shape[0] == S * B + 1
             and n == int(offsets[-1]), "sv_pool: rows, values, weights and offsets differ")
    _kernel(kernel).sv_pool(rows.data_ptr(), None if buckets is None else buckets.data_ptr(), values.data_ptr(),
                            None if weights is None else weights.data_ptr(),
                            None if defaults is None else defaults.data_ptr(), offsets.data_ptr(), slots.data_ptr(),
                            S, B, out0.data_ptr(), None if out1 is None else out1.data_ptr(), threads)
