"""Checked .npy files: written in pieces and hashed as written, read back against a {size, sha256}.

    info = write_array(path, a)                        # {"size": bytes, "sha256": hex}, fsynced
    with NpyWriter(path, shape, dtype) as w: w.write(rows_part) ...   # the same, streamed
    a = parse_npy(path, read_checked(path, info))      # mmap=True: memory-mapped, no copy

`embedding_ps.shard.snapshot` (the saved shard's format and manifest) writes and reads its data files
through these; any mismatch raises `CorruptShardError` naming the file. No pickle: arrays of
Python objects are refused both ways.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from typing import Any

import numpy as np

CHUNK = 8 << 20  # bytes per write / hash call: large enough that both release the GIL for long


class CorruptShardError(ValueError):
    """A saved shard directory is damaged: a file is missing, truncated, fails its checksum, or the
    manifest is missing or unreadable. The message names the file and what is wrong."""


def write_array(path: str, a: np.ndarray) -> dict:
    """Write `a` as a .npy file (fsynced); returns {"size", "sha256"} of the bytes written."""
    if a.dtype.hasobject:
        raise ValueError(f"{path}: array of dtype {a.dtype} holds Python objects; only plain arrays are saved")
    with NpyWriter(path, a.shape, a.dtype) as w:
        w.write(a)
    return w.result


class NpyWriter:
    """A .npy file of C-order `shape` and `dtype` written in pieces (each the next rows), hashed as
    written; on a clean exit checks the size, fsyncs and sets `result` {"size", "sha256"}."""

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.path, self.dtype = path, np.dtype(dtype)
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            header, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": tuple(shape)})
        self.expect = len(header.getvalue()) + int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        self.h = hashlib.sha256(header.getvalue())
        self.f = open(path, "wb")
        self.f.write(header.getvalue())
        self.size = len(header.getvalue())
        self.result: dict = {}

    def write(self, a: np.ndarray) -> None:
        raw = np.ascontiguousarray(a, dtype=self.dtype).reshape(-1).view(np.uint8)
        for lo in range(0, raw.shape[0], CHUNK):
            chunk = raw[lo : lo + CHUNK]
            self.f.write(chunk)
            self.h.update(chunk)
        self.size += raw.shape[0]

    def __enter__(self) -> "NpyWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                if self.size != self.expect:
                    raise ValueError(f"{self.path}: wrote {self.size} bytes, the header promises {self.expect}")
                self.f.flush()
                os.fsync(self.f.fileno())
                self.result = {"size": self.size, "sha256": self.h.hexdigest()}
        finally:
            self.f.close()


def write_streamed(directory: str, rows: Any) -> dict[str, dict]:
    """Write a `RowStream`'s arrays, one .npy file each, all in one pass over its chunks."""
    with contextlib.ExitStack() as stack:
        writers = {name: stack.enter_context(NpyWriter(os.path.join(directory, f"{name}.npy"), shape, dtype))
                   for name, (shape, dtype) in rows.specs.items()}
        for part in stack.enter_context(contextlib.closing(rows.chunks())):
            for name, a in part.items():
                writers[name].write(a)
    return {name: w.result for name, w in writers.items()}


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checked(path: str, expect: dict, mmap: bool = False) -> np.ndarray:
    """The bytes of `path` as uint8 [size], checked against expect {"size", "sha256"}: read into memory,
    or (`mmap`) memory-mapped read-only and hashed through the mapping."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CorruptShardError(f"{path}: missing (manifest lists {expect['size']} bytes)") from None
    if size < expect["size"]:
        raise CorruptShardError(f"{path}: truncated, {size} bytes, manifest says {expect['size']}")
    if size > expect["size"]:
        raise CorruptShardError(f"{path}: {size} bytes, longer than the {expect['size']} the manifest says")
    if mmap:
        buf = np.memmap(path, dtype=np.uint8, mode="r", shape=(size,))
    else:
        buf = np.empty(size, dtype=np.uint8)
        with open(path, "rb") as f:
            if (n := f.readinto(memoryview(buf))) != size:
                raise CorruptShardError(f"{path}: truncated while reading, {n} bytes, manifest says {size}")
    h = hashlib.sha256()
    for lo in range(0, size, CHUNK):
        h.update(buf[lo : lo + CHUNK])
    if h.hexdigest() != expect["sha256"]:
        raise CorruptShardError(f"{path}: sha256 mismatch, file has {h.hexdigest()}, manifest says {expect['sha256']}")
    return buf


def parse_npy(path: str, buf: np.ndarray) -> np.ndarray:
    """The array stored in .npy bytes `buf` uint8 [size], viewing them (no copy)."""
    head = io.BytesIO(buf[: min(buf.shape[0], 1 << 16)].tobytes())
    try:
        fmt = np.lib.format
        read = fmt.read_array_header_1_0 if fmt.read_magic(head) == (1, 0) else fmt.read_array_header_2_0
        shape, fortran, dtype = read(head)
    except ValueError as e:
        raise CorruptShardError(f"{path}: not a .npy file ({e})") from None
    if dtype.hasobject:
        raise CorruptShardError(f"{path}: holds Python objects (dtype {dtype}); refusing to load")
    start, count = head.tell(), int(np.prod(shape, dtype=np.int64))
    if buf.shape[0] - start != count * dtype.itemsize:
        raise CorruptShardError(f"{path}: {buf.shape[0] - start} data bytes for shape {shape} of {dtype}")
    return buf[start:].view(dtype).reshape(shape, order="F" if fortran else "C")


__all__ = ["CHUNK", "CorruptShardError", "NpyWriter", "fsync_dir", "parse_npy", "read_checked", "write_array",
           "write_streamed"]
