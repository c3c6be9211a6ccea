"""Building the native library: `csrc/` compiled with the system C compiler (never `-march=native`:
the cached library may move between machines) into a cache directory named by `set_cache_dir` (the
`recsys` entry points pass `$XDG_CACHE_HOME/recsys-hybrid/`), else `~/.cache/recsys-hybrid/`, else a
per-user temp directory (`cached_library`), then loaded and checked (`build`). `embedding_ps.native`
loads it once per process (`native.lib()`) and owns the operations.
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
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("ps.c", "pool.c")
_HEADERS = ("native.h",)
_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu99", "-pthread", "-ffp-contract=off", "-fno-fast-math")
_LIBS = ("-lm",)
ABI = 11

_state: dict = {"cache_dir": None}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGS = {
    "ps_abi_version": ([], ctypes.c_int),
    "ps_map_find": ([_P, _P, _I64, _P, _I64, _P, _P, ctypes.c_int], ctypes.c_int),
    "ps_map_place": ([_P, _P, _I64, _P, _P, _I64], _I64),
    "ps_has_duplicates": ([_P, _I64, _P], ctypes.c_int),
    "ps_gather": ([_P, ctypes.c_int, _I64, _P, _I64, _P, _P, _I64, ctypes.c_float, ctypes.c_int], _I64),
    "ps_update": ([ctypes.c_int, _P, ctypes.c_int, _P, _I64, _P, _I64, _P, ctypes.c_float, ctypes.c_float, _P, _I64,
                   ctypes.c_int, ctypes.c_float, ctypes.c_float, _P, ctypes.c_int, ctypes.c_int], ctypes.c_int),
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
    # the serving kernel (pool.c), wrapped by native.sv_*
    "sv_map_build": ([_P, _I64, _P, _I64], _I64),
    "sv_lookup": ([_P, _P, _I64, _I64, _P, _P, _P, ctypes.c_int], _I64),
    "sv_misses": ([_P, _P, _I64, _P, _P], _I64),
    "sv_pool": ([_P, _P, _P, _P, _P, _P, _P, _I64, _I64, _P, _P, ctypes.c_int], None),
}


def set_cache_dir(path: str | Path | None) -> None:
    """Where to cache the compiled library first (None: only the defaults, ~/.cache or temp)."""
    _state["cache_dir"] = None if path is None else Path(path)


def _cache_dirs() -> list[Path]:
    dirs = [] if _state["cache_dir"] is None else [_state["cache_dir"]]
    try:
        dirs.append(Path.home() / ".cache" / "recsys-hybrid")
    except RuntimeError:  # no home directory
        pass
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    dirs.append(Path(tempfile.gettempdir()) / f"recsys-hybrid-{uid}")
    return dirs


def _compiler() -> str | None:
    return next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


def cached_library(flags: tuple[str, ...]) -> Path:
    """The shared library built from `csrc/` with `flags`: the cached `_native-<hash of sources,
    flags, machine>.so` of the first cache directory that has it, else compiled now into the first
    writable one. RuntimeError: no compiler, failed build, no directory."""
    key = b"".join((_CSRC / f).read_bytes() for f in _SOURCES + _HEADERS)
    key += repr((flags, _LIBS, platform.machine(), platform.system())).encode()
    name = f"_native-{hashlib.sha256(key).hexdigest()[:16]}.so"
    dirs = _cache_dirs()
    for d in dirs:
        if (d / name).is_file():
            return d / name
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
    errors = []
    for d in dirs:
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


def build(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """`cached_library` with `extra_flags` added, loaded with ctypes, each function of `_SIGS`
    typed and `ps_abi_version()` checked; e.g. ("-DSV_PORTABLE",): the serving kernel without its
    AVX2 / F16C path, as on a CPU other than x86 (tests compare the two). Raises on any failure;
    `native.lib()` is the process's build."""
    so = cached_library(_FLAGS + tuple(extra_flags))
    loaded = ctypes.CDLL(str(so))
    for fn, (args, res) in _SIGS.items():
        f = getattr(loaded, fn)
        f.argtypes, f.restype = args, res
    got = loaded.ps_abi_version()
    if got != ABI:
        raise RuntimeError(f"{so}: ABI version {got}, expected {ABI}")
    logger.debug("native library: %s", so)
    return loaded
