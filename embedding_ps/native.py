"""The native library: one self-choosing function per hot operation, each running C when the
library loads and its numpy/torch body (`embedding_ps.reference`) otherwise. Callers never ask
which: they call `gather`, `map_find`, `update`, ... here and get the same values either way
(tests compare the two paths; `update` is the one that can decline, see its docstring).

The library is built from `csrc/` (`ps.c`: the shard's and client's operations, `pool.c`: the
serving kernel that `recsys.serving.native_pool` wraps, `native.h`: their shared parallel-for,
SplitMix64, fp16 conversion and default-row formula), with no Python or torch headers. On first
use it is compiled with the system C compiler (`cc`, else `gcc`, else `clang`; `-O3 -shared
-fPIC -ffp-contract=off`, never `-march=native`: the cached library may move between machines)
into the directory given to `set_cache_dir` (the `recsys` entry points pass
`$XDG_CACHE_HOME/recsys-hybrid/`), else `~/.cache/recsys-hybrid/`, else a per-user temp
directory, named by a hash of the sources, the flags and the machine, and written atomically
(compiled to a temporary name, then renamed); its `ps_abi_version()` must be `_ABI`. If there is
no compiler or anything fails, one warning is logged and the reference bodies run.

`set_enabled(False)` forces the reference bodies (a plain setting: embedding_ps reads no
environment variables; the `recsys` entry points turn `EMBEDDING_PS_NATIVE=0` into this call).

The C paths check dtypes, contiguity and sizes before passing raw pointers.

Threads: `map_find`, `gather`, `init_bits` and `update` take `threads` (ps.threads of the shard;
how the C splits the items: `csrc/ps.c`'s header), and ctypes releases the GIL for the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from embedding_ps import reference as ref
from embedding_ps.wire.config import FUSED_OPTIMIZERS

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("ps.c", "pool.c")
_HEADERS = ("native.h",)
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu99", "-pthread", "-ffp-contract=off", "-fno-fast-math")
_LIBS = ("-lm",)
_ABI = 10

_lock = threading.Lock()
_state: dict = {"loaded": False, "lib": None, "enabled": True, "cache_dir": None}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGS = {
    "ps_abi_version": ([], ctypes.c_int),
    "ps_map_find": ([_P, _P, _I64, _P, _I64, _P, _P, ctypes.c_int], ctypes.c_int),
    "ps_map_place": ([_P, _P, _I64, _P, _P, _I64], _I64),
    "ps_has_duplicates": ([_P, _I64, _P], ctypes.c_int),
    "ps_gather": ([_P, ctypes.c_int, _I64, _P, _I64, _P, _P, _I64, ctypes.c_float, ctypes.c_int], _I64),
    "ps_update": ([ctypes.c_int, _P, ctypes.c_int, _P, _I64, _P, _I64, _P, ctypes.c_float, ctypes.c_float, _P, _I64,
                   ctypes.c_int, ctypes.c_float, ctypes.c_float, _P, ctypes.c_int, ctypes.c_int], None),
    "ps_f2h_array": ([_P, _P, _I64], None),
    "ps_copy_finite": ([_P, _P, _I64, ctypes.c_int], ctypes.c_int),
    "ps_publish": ([_P, _I64], None),
    "ps_wait_flag": ([_P, _I64, _I64], _I64),
    "ps_notify": ([_P, ctypes.c_int32], None),
    "ps_wait_word": ([_P, _I64], ctypes.c_int32),
    "ps_h2f_array": ([_P, _P, _I64], None),
    "ps_init_bits": ([_P, _I64, _I64, ctypes.c_uint64, _P, ctypes.c_int], None),
    "ps_merge_rows": ([_P, _P, _I64, _I64, _P, _P], _I64),
    "ps_unique": ([_P, _I64, _P, _P, _P], _I64),
    "ps_to_example_major": ([_P, _I64, _I64, _P, _P, _P, _P, _P, _P], None),
    # the serving kernel (pool.c), wrapped by recsys.serving.native_pool
    "sv_map_build": ([_P, _I64, _P, _I64], _I64),
    "sv_lookup": ([_P, _P, _I64, _I64, _P, _P, _P, ctypes.c_int], _I64),
    "sv_misses": ([_P, _P, _I64, _P, _P], _I64),
    "sv_pool": ([_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _P, _P, ctypes.c_int], None),
}
OPTIMIZERS = {name: code for code, name in enumerate(FUSED_OPTIMIZERS)}
"""The optimizers `update` runs in C, by ps.c's enum value (the others: `optim.apply_update`'s torch ops)."""


def set_enabled(enabled: bool) -> bool:
    """Turn the native path on or off for this process; returns the previous setting."""
    prev = _state["enabled"]
    _state["enabled"] = bool(enabled)
    return prev


def set_cache_dir(path: str | Path | None) -> None:
    """Where to cache the compiled library first (None: only the defaults, ~/.cache or temp)."""
    _state["cache_dir"] = None if path is None else Path(path)


def lib():
    """The loaded ctypes library, or None (disabled, no compiler, or the build failed). Only the
    serving kernel's wrappers (`recsys.serving.native_pool`) take it: every other operation is a
    function of this module that chooses for itself."""
    if not _state["enabled"]:
        return None
    if not _state["loaded"]:
        with _lock:
            if not _state["loaded"]:
                _state["lib"] = _load()
                _state["loaded"] = True
    return _state["lib"]


def available() -> bool:
    return lib() is not None


def _cache_dirs() -> list[Path]:
    dirs = []
    if _state["cache_dir"] is not None:
        dirs.append(_state["cache_dir"])
    try:
        dirs.append(Path.home() / ".cache" / "recsys-hybrid")
    except RuntimeError:  # no home directory
        pass
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    dirs.append(Path(tempfile.gettempdir()) / f"recsys-hybrid-{uid}")
    return dirs


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def cached_library(flags: tuple[str, ...] = _FLAGS) -> Path:
    """The shared library built from `csrc/` with `flags`: the cached `_native-<hash of sources,
    flags, machine>.so` of the first cache directory that has it, else compiled now into the first
    writable one. RuntimeError: no compiler, failed build, no directory."""
    key = b"".join((_CSRC / f).read_bytes() for f in _SOURCES + _HEADERS)
    key += repr((flags, _LIBS, platform.machine(), platform.system())).encode()
    name = f"_native-{hashlib.sha256(key).hexdigest()[:16]}.so"
    for d in _cache_dirs():
        if (d / name).is_file():
            return d / name
    return _compile(name, flags)


def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`cached_library` with `extra_flags` added, loaded with ctypes, each function of `_SIGS`
    typed and `ps_abi_version()` checked; e.g. ("-DSV_PORTABLE",): the serving kernel without its
    AVX2 / F16C path, as on a CPU other than x86 (tests compare the two). Raises on any failure;
    `lib()` is the process's build."""
    so = cached_library(_FLAGS + tuple(extra_flags))
    loaded = ctypes.CDLL(str(so))
    for fn, (args, res) in _SIGS.items():
        f = getattr(loaded, fn)
        f.argtypes, f.restype = args, res
    got = loaded.ps_abi_version()
    if got != _ABI:
        raise RuntimeError(f"{so}: ABI version {got}, expected {_ABI}")
    logger.debug("native library: %s", so)
    return loaded


def _load():
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - any failure means: the reference bodies run
        logger.warning("embedding_ps: native library unavailable, using numpy/torch (%s)", e)
        return None


def _compile(name: str, flags: tuple[str, ...]) -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
    errors = []
    for d in _cache_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp.so", dir=d)
            os.close(fd)
        except OSError as e:
            errors.append(f"{d}: {e}")
            continue
        try:
            srcs = [str(_CSRC / f) for f in _SOURCES]
            proc = subprocess.run([cc, *flags, "-o", tmp, *srcs, *_LIBS], capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, d / name)  # atomic: a concurrent process sees no library or a whole one
            return d / name
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("no writable cache directory: " + "; ".join(errors))


# ---------------------------------------------------------------------------- the operations
def _require(ok: bool, what: str) -> None:
    """The shapes a C function relies on (out-of-bounds writes otherwise): a ValueError, not an
    assert, so that `python -O` keeps the check."""
    if not ok:
        raise ValueError(f"native: {what}")


def _check(a, dtype, name: str) -> None:
    if isinstance(a, np.ndarray):
        ok = a.dtype == dtype and a.flags.c_contiguous
    else:
        ok = a.dtype == dtype and a.is_contiguous() and a.device.type == "cpu"
    if not ok:
        raise TypeError(f"native: {name} must be a contiguous {dtype} array, got {a.dtype}")


def map_find(kv: np.ndarray, vv: np.ndarray, keys: np.ndarray, want: str, threads: int = 1) -> np.ndarray:
    """An id map's probe (`idmap.IdMap`'s layout: keys kv int64 [C], values vv int32 [C]): int64 [N]
    keys -> int32 values (want="val") or int64 buckets (want="pos"), -1 where absent."""
    _check(kv, np.int64, "map keys"), _check(vv, np.int32, "map vals"), _check(keys, np.int64, "keys")
    _require(kv.shape[0] == vv.shape[0] and 0 < kv.shape[0] < 1 << 32,
             "map_find: keys and values of one size in [1, 2**32)")
    c = lib()
    if c is None:
        out = ref.map_find(kv, vv, keys, want)
        return out.astype(np.int32, copy=False) if want == "val" else out
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
    if c is None or ids.dtype != torch.int64 or ids.device.type != "cpu":
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
    if (c is None or indices.device.type != "cpu" or indices.dtype != torch.int64 or lengths.dtype != torch.int64
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
    em_lengths = torch.empty_like(lengths)
    em_offsets = torch.empty_like(lengths)
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
    decay_steps[slot] > 0 steps behind comes scaled by decay^k (`GlobalDecay.pulled`'s math)."""
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
    return c.ps_gather(weights.data_ptr(), int(half), d, slots.ctypes.data, n, out.data_ptr(),
                       None if decay_steps is None else decay_steps.data_ptr(), int(target), float(np.float32(decay)),
                       threads)


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
        ref.publish(flag, value)
    else:
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
        ref.notify(word, value)
    else:
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
    sp = None
    if opt != OPTIMIZERS["sgd"]:
        _check(state, torch.float32, "optimizer state")
        _require(state.shape[0] == weights.shape[0], "update: state needs a row per weights row")
        sp = state.data_ptr()
    mp = None
    if meta is not None:
        _check(meta, torch.int64, "meta")
        mp = meta.data_ptr()
    mode = weight_decay_mode if weight_decay else "none"
    dp = None
    if mode == "global":
        _require(decay_steps is not None, "update: weight_decay_mode 'global' needs decay_steps")
        _check(decay_steps, torch.int32, "decay_steps")
        _require(decay_steps.shape[0] == weights.shape[0], "update: decay_steps needs a step per weights row")
        dp = decay_steps.data_ptr()
    c.ps_update(opt, weights.data_ptr(), int(half), sp, d, slots.ctypes.data, n, grads.data_ptr(),
                float(np.float32(-lr)), float(np.float32(eps)), mp, int(step), WEIGHT_DECAY_MODES[mode],
                float(np.float32(weight_decay)), float(np.float32(1.0 - lr * weight_decay)), dp, threads, int(sort))
    return True
