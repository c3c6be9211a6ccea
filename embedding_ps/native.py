"""Loader of the shard's native fast path (`_native.c`), compiled on first use and called with ctypes.

The C file has no Python or torch headers. On first use it is compiled with the system C
compiler (`cc`, else `gcc`, else `clang`; `-O3 -shared -fPIC -ffp-contract=off`, never
`-march=native`: the cached library may move between machines) into the directory given to
`set_cache_dir` (the `recsys` entry points pass `$XDG_CACHE_HOME/recsys-hybrid/`), else
`~/.cache/recsys-hybrid/`, else a per-user temp directory, named by a hash of the source, the
flags and the machine, and written atomically (compiled to a temporary name, then renamed). If there is no compiler
or anything fails, one
warning is logged and `lib()` returns None: every caller then keeps its numpy/torch path,
which stays the reference (tests compare the two).

`set_enabled(False)` forces the pure numpy/torch paths (a plain setting: embedding_ps reads no
environment variables; the `recsys` entry points turn `EMBEDDING_PS_NATIVE=0` into this call).

Wrappers here check dtypes, contiguity and sizes before passing raw pointers.

Threads: `map_find`, `gather` and `update` take `threads` (ps.threads of the
shard): the C side splits the items into contiguous chunks, one per thread, and ctypes releases
the GIL for the call. Results are the same for every thread count (tests compare them).
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

logger = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("_native.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-pthread", "-ffp-contract=off", "-fno-fast-math")
_ABI = 8

_lock = threading.Lock()
_state: dict = {"loaded": False, "lib": None, "enabled": True, "cache_dir": None}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGS = {
    "ps_abi_version": ([], ctypes.c_int),
    "ps_map_find": ([_P, _P, _I64, _P, _I64, _P, _P, ctypes.c_int], ctypes.c_int),
    "ps_map_place": ([_P, _P, _I64, _P, _P, _I64], _I64),
    "ps_has_duplicates": ([_P, _I64, _P], ctypes.c_int),
    "ps_gather": ([_P, ctypes.c_int, _I64, _P, _I64, _P, ctypes.c_int], _I64),
    "ps_gather_decayed": ([_P, ctypes.c_int, _I64, _P, _I64, _P, _P, _I64, ctypes.c_float, ctypes.c_int], _I64),
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
}
OPTIMIZERS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2}


def set_enabled(enabled: bool) -> bool:
    """Turn the native path on or off for this process; returns the previous setting."""
    prev = _state["enabled"]
    _state["enabled"] = bool(enabled)
    return prev


def set_cache_dir(path: str | Path | None) -> None:
    """Where to cache the compiled library first (None: only the defaults, ~/.cache or temp)."""
    _state["cache_dir"] = None if path is None else Path(path)


def lib():
    """The loaded ctypes library, or None (disabled, no compiler, or the build failed)."""
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


def cached_library(src: Path, prefix: str, flags: tuple[str, ...], libs: tuple[str, ...] = ()) -> Path:
    """The shared library built from C file `src` with `flags` (and `libs`): the cached
    `<prefix>-<hash of source, flags, machine>.so` of the first cache directory that has it, else
    compiled now into the first writable one. RuntimeError: no compiler, failed build, no directory.
    `load_library` loads it (this module's `_native.c` and `recsys.serving.native_pool`'s kernel)."""
    key = src.read_bytes() + repr((flags, libs, platform.machine(), platform.system()) if libs else
                                  (flags, platform.machine(), platform.system())).encode()
    name = f"{prefix}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    for d in _cache_dirs():
        if (d / name).is_file():
            return d / name
    return _compile(src, name, flags, libs)


def load_library(src: Path, prefix: str, flags: tuple[str, ...], sigs: dict, abi_symbol: str, abi: int,
                 libs: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`cached_library(src, ...)` loaded with ctypes, each function of `sigs` {name: (argtypes,
    restype)} typed, and its `abi_symbol()` checked to be `abi`. RuntimeError on any mismatch."""
    so = cached_library(src, prefix, flags, libs)
    lib = ctypes.CDLL(str(so))
    for fn, (args, res) in sigs.items():
        f = getattr(lib, fn)
        f.argtypes, f.restype = args, res
    got = getattr(lib, abi_symbol)()
    if got != abi:
        raise RuntimeError(f"{so}: ABI version {got}, expected {abi}")
    logger.debug("native library: %s", so)
    return lib


def _load():
    try:
        return load_library(_SRC, "_native", _FLAGS, _SIGS, "ps_abi_version", _ABI)
    except Exception as e:  # noqa: BLE001 - any failure means: keep the numpy/torch path
        logger.warning("embedding_ps: native fast path unavailable, using numpy/torch (%s)", e)
        return None


def _compile(src: Path, name: str, flags: tuple[str, ...], libs: tuple[str, ...]) -> Path:
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
            proc = subprocess.run([cc, *flags, "-o", tmp, str(src), *libs], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, d / name)  # atomic: a concurrent process sees no library or a whole one
            return d / name
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("no writable cache directory: " + "; ".join(errors))


# ---------------------------------------------------------------------------- checked wrappers
def _ptr(a) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


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


def map_find(native, kv: np.ndarray, vv: np.ndarray, keys: np.ndarray, want: str,
             threads: int = 1) -> np.ndarray:
    """IdMap._find in C: int64 [N] keys -> int32 values (want="val") or int64 buckets (want="pos"), -1 absent."""
    _check(kv, np.int64, "map keys"), _check(vv, np.int32, "map vals"), _check(keys, np.int64, "keys")
    _require(kv.shape[0] == vv.shape[0] and 0 < kv.shape[0] < 1 << 32,
             "map_find: keys and values of one size in [1, 2**32)")
    n, nb = keys.shape[0], kv.shape[0]
    if want == "val":
        out = np.empty(n, dtype=np.int32)
        rc = native.ps_map_find(kv.ctypes.data, vv.ctypes.data, nb, keys.ctypes.data, n, out.ctypes.data, None,
                                threads)
    else:
        out = np.empty(n, dtype=np.int64)
        rc = native.ps_map_find(kv.ctypes.data, vv.ctypes.data, nb, keys.ctypes.data, n, None, out.ctypes.data,
                                threads)
    if rc != 0:
        raise RuntimeError("IdMap: probe chain without an empty bucket (corrupt map)")
    return out


def map_place(native, kv: np.ndarray, vv: np.ndarray, keys: np.ndarray, vals: np.ndarray) -> int:
    """IdMap._place in C (sequential inserts); returns the number of tombstones reused."""
    _check(kv, np.int64, "map keys"), _check(vv, np.int32, "map vals")
    _check(keys, np.int64, "keys"), _check(vals, np.int32, "vals")
    _require(kv.shape[0] == vv.shape[0] and 0 < kv.shape[0] < 1 << 32 and keys.shape == vals.shape,
             "map_place: keys and values of one size in [1, 2**32), as many new keys as values")
    r = native.ps_map_place(kv.ctypes.data, vv.ctypes.data, kv.shape[0], keys.ctypes.data, vals.ctypes.data,
                            keys.shape[0])
    if r < 0:
        raise RuntimeError("IdMap: no free bucket (map full)")
    return int(r)


def unique(native, ids: torch.Tensor, counts: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ids int64 [N] -> (uniq int64 [U]: each distinct id once, in order of first appearance,
    inverse int64 [N]: uniq[inverse] == ids, counts int64 [U] of occurrences or None): what
    torch.unique(ids, return_inverse=True, return_counts=counts) gives up to the order of uniq,
    from one hash pass instead of a sort."""
    _check(ids, torch.int64, "ids")
    n = ids.shape[0]
    _require(ids.dim() == 1 and n < 1 << 31, f"unique: ids must be 1-D, fewer than 2**31, got {list(ids.shape)}")
    uniq = torch.empty(n, dtype=torch.int64)
    inverse = torch.empty(n, dtype=torch.int64)
    cnt = torch.empty(n, dtype=torch.int64) if counts else None
    u = native.ps_unique(ids.data_ptr(), n, uniq.data_ptr(), inverse.data_ptr(),
                         cnt.data_ptr() if cnt is not None else None)
    if u < 0:
        raise MemoryError(f"native unique of {n} ids: out of memory")
    return uniq[:u], inverse, (cnt[:u] if cnt is not None else None)


def unique_ids(ids: torch.Tensor, counts: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`unique` when the C library is loaded (ids int64 on the CPU: distinct ids in order of first
    appearance), else torch.unique's sort (sorted distinct ids): the one choice the trainer's dedup
    (`recsys.models.sparse_arch`), the row cache's and the PS client's make. 26 tables of 4096 Zipf
    ids: 1.1 against 4.5 ms a step (BENCHMARKS.md, "The trainer's dedup in one hash pass"); 100k
    Zipf(1.05) ids 0.73 against 3.3 ms (BENCHMARKS.md, "The client's dedup in one hash pass")."""
    loaded = lib()
    if loaded is not None and ids.dtype == torch.int64 and ids.device.type == "cpu":
        return unique(loaded, ids.contiguous(), counts)
    if counts:
        return torch.unique(ids, return_inverse=True, return_counts=True)
    uniq, inverse = torch.unique(ids, return_inverse=True)
    return uniq, inverse, None


def to_example_major(native, indices: torch.Tensor, lengths: torch.Tensor, B: int,
                     weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Bags feature-major -> example-major in one C pass: indices int64 [N] and lengths int64 [F * B]
    of bag (f, b) at f * B + b (weights float32 [N] or None) -> (indices [N], offsets [B * F],
    lengths [B * F], weights [N] | None) of bag (f, b) at b * F + f: what
    `recsys.models.sparse_arch._to_example_major` computes with torch ops, the same values."""
    _check(indices, torch.int64, "indices"), _check(lengths, torch.int64, "lengths")
    if weights is not None:
        _check(weights, torch.float32, "weights")
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
    native.ps_to_example_major(lengths.data_ptr(), fb // B, B, indices.data_ptr(),
                               weights.data_ptr() if weights is not None else None, out.data_ptr(),
                               out_w.data_ptr() if out_w is not None else None, em_lengths.data_ptr(),
                               em_offsets.data_ptr())
    return out, em_offsets, em_lengths, out_w


def has_duplicates(native, slots: np.ndarray, bitmap: np.ndarray) -> bool:
    """Whether int32 slots (each in [0, 8 * bitmap.size)) repeat; bitmap: uint8, zero, left zero."""
    _check(slots, np.int32, "slots"), _check(bitmap, np.uint8, "bitmap")
    return bool(native.ps_has_duplicates(slots.ctypes.data, slots.shape[0], bitmap.ctypes.data))


def merge_rows(native, slots: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """slots int32 [N] with duplicates, grads float32 [N, D] -> (unique slots int32 [U] in order of first
    arrival, grads summed in arrival order [U, D]): `table._merge_duplicates` in one C pass, bit for bit."""
    _check(slots, np.int32, "slots"), _check(grads, torch.float32, "grads")
    n, d = grads.shape
    _require(slots.shape[0] == n and n < 1 << 31, f"merge_rows: {slots.shape[0]} slots for {n} rows (< 2**31)")
    out_slots = np.empty(n, dtype=np.int32)
    out = torch.empty(n, d, dtype=torch.float32)
    u = native.ps_merge_rows(slots.ctypes.data, grads.data_ptr(), n, d, out_slots.ctypes.data, out.data_ptr())
    if u < 0:
        raise MemoryError(f"native merge of {n} rows: out of memory")
    return out_slots[:u], out[:u]


def init_bits(native, keys: np.ndarray, dim: int, seed_mix: int, threads: int = 1) -> np.ndarray:
    """embedding_ps.init's symmetric bits in C: int64 [N] keys -> float32 [N, D] in (-1, 1), bit for bit
    the numpy reference's (`init._symmetric_bits_np`); one pass instead of ~15 numpy passes."""
    _check(keys, np.int64, "keys")
    out = np.empty((keys.shape[0], dim), dtype=np.float32)
    native.ps_init_bits(keys.ctypes.data, keys.shape[0], dim, seed_mix & 0xFFFFFFFFFFFFFFFF, out.ctypes.data,
                        threads)
    return out


def gather(native, weights: torch.Tensor, slots: np.ndarray, out: torch.Tensor, threads: int = 1,
           decay_steps: torch.Tensor | None = None, target: int = 0, decay: float = 1.0) -> int:
    """out float32 [N, D] = weights[slots] (fp32 or fp16 weights), slots int32 [N] < len(weights);
    rows with slot < 0 are left untouched. Returns how many there were.

    decay_steps (int32 [C], global weight decay, `embedding_ps.decay`): a row k = target -
    decay_steps[slot] > 0 steps behind comes scaled by decay^k (`GlobalDecay.pulled`'s math)."""
    _check(slots, np.int32, "slots"), _check(out, torch.float32, "out")
    half = weights.dtype == torch.float16
    _check(weights, torch.float16 if half else torch.float32, "weights")
    n, d = out.shape
    _require(slots.shape[0] == n and weights.shape[1] == d, f"{slots.shape[0]} slots for {n} rows of width {d}")
    if decay_steps is None:
        return native.ps_gather(weights.data_ptr(), int(half), d, slots.ctypes.data, n, out.data_ptr(), threads)
    _check(decay_steps, torch.int32, "decay_steps")
    _require(decay_steps.shape[0] == weights.shape[0], "gather: decay_steps needs a step per weights row")
    return native.ps_gather_decayed(weights.data_ptr(), int(half), d, slots.ctypes.data, n, out.data_ptr(),
                                    decay_steps.data_ptr(), int(target), float(np.float32(decay)), threads)


def copy_finite(native, src: torch.Tensor, dst: torch.Tensor, wake_fd: int = -1) -> bool:
    """dst = src (float32, same shape, both contiguous) in one pass; whether every value is finite.
    wake_fd >= 0: a byte is written to that fd first, inside the same call (no GIL held)."""
    _check(src, torch.float32, "src"), _check(dst, torch.float32, "dst")
    _require(src.shape == dst.shape, f"copy_finite: src {list(src.shape)} and dst {list(dst.shape)} differ")
    return bool(native.ps_copy_finite(src.data_ptr(), dst.data_ptr(), src.numel(), int(wake_fd)))


def publish(native, flag: np.ndarray, value: int) -> None:
    """flag int64 [1] = value, after every earlier store of this thread (a release store with a fence)."""
    _check(flag, np.int64, "flag")
    native.ps_publish(flag.ctypes.data, int(value))


def wait_flag(native, flag: np.ndarray, want: int, timeout_s: float) -> int:
    """Spin (then yield) until flag int64 [1] is `want` or `-want`, at most timeout_s; the value last read."""
    _check(flag, np.int64, "flag")
    return int(native.ps_wait_flag(flag.ctypes.data, int(want), int(timeout_s * 1e9)))


def notify(native, word: np.ndarray, value: int) -> None:
    """word int32 [1] = value (release), then wake whoever waits on it in any process (`wait_word`)."""
    _check(word, np.int32, "word")
    native.ps_notify(word.ctypes.data, int(value))


def wait_word(native, word: np.ndarray, timeout_s: float) -> int:
    """Sleep until word int32 [1] is not 0 (a futex on Linux), at most timeout_s; the value (0: timed out)."""
    _check(word, np.int32, "word")
    return int(native.ps_wait_word(word.ctypes.data, int(max(timeout_s, 0.0) * 1e9)))


WEIGHT_DECAY_MODES = {"none": 0, "l2": 1, "decoupled": 2, "global": 3}


def update(native, optimizer: str, weights: torch.Tensor, state: torch.Tensor | None, slots: np.ndarray,
           grads: torch.Tensor, lr: float, eps: float, meta: torch.Tensor | None, step: int,
           weight_decay: float = 0.0, weight_decay_mode: str = "l2", threads: int = 1, sort: bool = True,
           decay_steps: torch.Tensor | None = None) -> None:
    """The fused update of unique rows slots int32 [U] from grads float32 [U, D] (see ps_update in _native.c).

    `threads` > 1 splits the rows between threads: the slots must be unique (`TableShard` merges
    duplicates first), or two threads would update one row. `sort`: from 2048 rows on, update them in
    increasing slot order (a radix sort in C; same results, measured ~2x faster on a 2M-row table
    than arrival order, BENCHMARKS.md); False: arrival order (tests compare the two).

    weight_decay > 0: "l2" adds weight_decay * w to each row's gradient, "decoupled" scales the row
    by (1 - lr * weight_decay) before the update (the math of `optim.apply_update`); "global" (with
    `decay_steps`, int32 [C], each row's decayed-through step) first catches a row k = step -
    decay_steps[slot] > 0 steps behind up by (1 - lr * weight_decay)^k and sets its step to `step`
    (`GlobalDecay.touch`'s math), then adds the update without decay."""
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
    native.ps_update(opt, weights.data_ptr(), int(half), sp, d, slots.ctypes.data, n, grads.data_ptr(),
                     float(np.float32(-lr)), float(np.float32(eps)), mp, int(step), WEIGHT_DECAY_MODES[mode],
                     float(np.float32(weight_decay)), float(np.float32(1.0 - lr * weight_decay)), dp, threads,
                     int(sort))
