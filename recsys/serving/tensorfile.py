"""The safetensors file format, written and memory-mapped with numpy (no `safetensors` package).

Layout (https://github.com/huggingface/safetensors, the format the package reads)::

    u64 little-endian N | N bytes of JSON header | data
    header = {"NAME": {"dtype": "F32", "shape": [R, D], "data_offsets": [begin, end]}, ...,
              "__metadata__": {"key": "string value", ...}}

Offsets are relative to the start of the data, tensors are C-contiguous, little-endian, and cover
the data without holes. The header is padded with spaces to a multiple of 8 bytes, and writers
here put 8-byte types first, so a memory-mapped int64 or float32 tensor is aligned.

A file that is truncated, has a broken header or offsets outside the file raises `ExportError`
naming the file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np


class ExportError(ValueError):
    """An export directory or file is missing, corrupt or does not fit; the message names it."""


DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (in the given order) with string `metadata`; streams each array's bytes."""
    header: dict = {}
    offset = 0
    arrays = {}
    for name, a in tensors.items():
        dt = np.dtype(a.dtype).newbyteorder("<") if a.dtype.byteorder == ">" else np.dtype(a.dtype)
        if dt not in _NAMES:
            raise ExportError(f"{path}: tensor {name!r} has unsupported dtype {a.dtype}")
        arrays[name] = np.ascontiguousarray(a, dtype=dt)
        header[name] = {"dtype": _NAMES[dt], "shape": list(a.shape),
                        "data_offsets": [offset, offset + arrays[name].nbytes]}
        offset += arrays[name].nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for a in arrays.values():
            f.write(memoryview(a.reshape(-1)).cast("B") if a.size else b"")
        f.flush()
        os.fsync(f.fileno())


def read_header(path: str | Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data) of a safetensors file; checks it against the file size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ExportError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, _MAX_HEADER):
            raise ExportError(f"{path}: corrupt safetensors header length {n} in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ExportError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ExportError(f"{path}: corrupt safetensors header (not a JSON object)")
    start, end = 8 + n, 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dt = DTYPES[spec["dtype"]]
            b, e = (int(x) for x in spec["data_offsets"])
            count = int(np.prod(spec["shape"], dtype=np.int64))
        except (KeyError, TypeError, ValueError):
            raise ExportError(f"{path}: corrupt safetensors entry for tensor {name!r}: {spec!r}") from None
        if e - b != count * dt.itemsize or b < 0:
            raise ExportError(f"{path}: tensor {name!r} offsets {[b, e]} do not fit its shape {spec['shape']}")
        end = max(end, e)
    if start + end != size:
        raise ExportError(f"{path}: safetensors data is {size - start} bytes, the header describes {end} "
                          f"(truncated or padded file)")
    return header, start


def read_safetensors(path: str | Path, mmap: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: array}, metadata). With mmap the arrays are read-only views of the file (no copy)."""
    header, start = read_header(path)
    size = os.path.getsize(path)
    data = None
    if size > start:
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=start) if mmap else \
            np.fromfile(path, dtype=np.uint8, offset=start)
    out: dict[str, np.ndarray] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        b, e = spec["data_offsets"]
        dt = DTYPES[spec["dtype"]]
        raw = data[b:e] if data is not None else np.zeros(0, np.uint8)
        out[name] = raw.view(dt).reshape(spec["shape"])
    return out, dict(header.get("__metadata__", {}))


