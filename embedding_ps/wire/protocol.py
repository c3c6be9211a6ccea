"""The PS wire format: explicit binary frames, never pickle. A request is the ZeroMQ frames
[header, auth, payload...], a reply [header, payload...]; the header is HEADER_FORMAT (60 bytes,
little-endian). Ops, payloads, flags, replies and versions: docs/wire.md, "Frames".
"""

from __future__ import annotations

import enum
import struct
import sys
from dataclasses import dataclass, replace

import torch

if sys.byteorder != "little":  # tensors go on the wire as their native bytes
    raise ImportError("embedding_ps.wire.protocol needs a little-endian machine (the wire is little-endian)")

MAGIC = 0x31535045  # b"EPS1" read as a little-endian u32
VERSION = 3
HEADER_FORMAT = "<IHBBHHIIQIIqQQ"
HEADER_SIZE = struct.calcsize(HEADER_FORMAT)
_HEADER = struct.Struct(HEADER_FORMAT)


class Op(enum.IntEnum):
    BARRIER = 3
    STATS = 4
    HEALTH = 5
    SAVE = 6
    LOAD = 7
    SHUTDOWN = 8
    SWEEP = 9
    SAVE_STATUS = 10
    PULL = 11   # multi-table (ops 1 and 2: version 1's single-table ones, docs/wire.md)
    PUSH = 12


FLAG_BACKGROUND = 1
"""SAVE request flag: snapshot now, reply at once, write the files on a background thread."""
FLAG_SHM = 4
"""PULL / PUSH request flag: the rows are in the client's shared-memory segment named by the last frame."""
FLAG_GRADS_LATE = 8
"""PUSH request flag (with FLAG_SHM): the grads come into the segment after the request (docs/wire.md)."""
FLAG_NOTIFY = 16
"""PULL / PUSH request flag (with FLAG_SHM): the shard sets the trailer's done word first (docs/wire.md)."""


class Status(enum.IntEnum):
    OK = 0
    BAD_FRAME = 1        # malformed message: frame count, header size, magic, version, byte sizes
    BAD_VALUE = 2        # well-formed but wrong: unknown table, wrong dim, dtype, worker, too large
    UNAUTHORIZED = 3     # missing or wrong token
    STALE_STEP = 4       # sync mode: a push or barrier for a step that was already applied
    INTERNAL = 5         # the shard failed to carry out a valid request
    NO_SHM = 6           # FLAG_SHM: the shard cannot use the client's segment (off there, another host,
                         # another /dev/shm); nothing was applied: the client resends over the socket


class DType(enum.IntEnum):
    NONE = 0
    INT64 = 1
    FP32 = 2
    FP16 = 3
    BF16 = 4
    BYTES = 5


TORCH_DTYPES = {DType.INT64: torch.int64, DType.FP32: torch.float32, DType.FP16: torch.float16,
                DType.BF16: torch.bfloat16}
ITEM_SIZE = {DType.INT64: 8, DType.FP32: 4, DType.FP16: 2, DType.BF16: 2, DType.BYTES: 1}
ROW_DTYPES = (DType.FP32, DType.FP16, DType.BF16)
WIRE_DTYPES = {"fp32": DType.FP32, "fp16": DType.FP16, "bf16": DType.BF16}
"""ps.wire_dtype -> DType of rows and gradients on the wire."""

# payload frames after [header, auth] per op (requests)
REQUEST_PAYLOADS = {Op.PULL: 2, Op.PUSH: 3, Op.BARRIER: 0, Op.STATS: 0, Op.HEALTH: 0, Op.SAVE: 1,
                    Op.LOAD: 1, Op.SHUTDOWN: 0, Op.SWEEP: 0, Op.SAVE_STATUS: 0}


class ProtocolError(ValueError):
    """A message that does not follow the wire format; `status` is the reply status it earns."""

    def __init__(self, message: str, status: Status = Status.BAD_FRAME) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Header:
    """The fixed-size header of every request and reply (docs/wire.md, "Frames")."""

    op: int
    table: int = 0
    dtype: int = DType.NONE
    count: int = 0
    dim: int = 0
    step: int = 0
    worker: int = 0
    client: int = 0
    request: int = 0
    status: int = Status.OK
    flags: int = 0
    magic: int = MAGIC
    version: int = VERSION

    def pack(self) -> bytes:
        """The HEADER_SIZE bytes of this header. Raises struct.error for a field out of its range."""
        return _HEADER.pack(self.magic, self.version, self.op, self.dtype, self.status, self.flags,
                            self.table, self.worker, self.count, self.dim, 0, self.step, self.client,
                            self.request)

    def reply(self, status: Status = Status.OK, **fields: int) -> "Header":
        """The header of the reply to this request: op, client and request echoed."""
        if not fields:      # the common case, without dataclasses.replace's generic overhead
            return Header(self.op, self.table, self.dtype, self.count, self.dim, self.step, self.worker,
                          self.client, self.request, int(status), 0, self.magic, self.version)
        return replace(self, status=int(status), flags=0, **fields)


def unpack_header(buf: bytes | memoryview) -> Header:
    """Parse and check magic and version. Raises ProtocolError naming what is wrong."""
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(buf)}")
    (magic, version, op, dtype, status, flags, table, worker, count, dim, _reserved, step, client,
     request) = _HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x})")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} not supported (this side speaks {VERSION}): trainers "
                            f"and PS shards must run the same release")
    return Header(op, table, dtype, count, dim, step, worker, client, request, status, flags)


def peek_ids(buf: bytes | memoryview) -> tuple[int, int]:
    """(client, request) of a header that may be broken, for an error reply; (0, 0) if too short."""
    return _HEADER.unpack_from(buf)[12:] if len(buf) >= HEADER_SIZE else (0, 0)


def check_request(h: Header, num_frames: int) -> Op:
    """Check the op and the number of frames (header and auth included). Returns the Op."""
    try:
        op = Op(h.op)
    except ValueError:
        raise ProtocolError(f"unknown op {h.op}") from None
    payload = REQUEST_PAYLOADS[op] + (op == Op.PULL and bool(h.flags & FLAG_SHM))   # + the segment's name
    if num_frames != 2 + payload:
        raise ProtocolError(f"{op.name} request must have {2 + payload} frames (header, auth, "
                            f"{payload} payload), got {num_frames}")
    return op


def expect_bytes(what: str, got: int, count: int, item: int, limit: int) -> None:
    """Check that a payload of `count` items of `item` bytes fits `limit` and has `got` bytes."""
    need = count * item
    if need > limit:
        raise ProtocolError(f"{what}: {count} items of {item} bytes = {need} bytes exceeds "
                            f"ps.max_frame_bytes = {limit}", Status.BAD_VALUE)
    if got != need:
        raise ProtocolError(f"{what}: header says {count} items of {item} bytes = {need} bytes, "
                            f"frame has {got}")


def row_dtype(code: int, what: str) -> DType:
    """The DType of a rows/grads payload; ProtocolError unless fp32, fp16 or bf16."""
    if code not in ROW_DTYPES:
        raise ProtocolError(f"{what}: dtype code {code} is not one of fp32/fp16/bf16 "
                            f"({[int(d) for d in ROW_DTYPES]})", Status.BAD_VALUE)
    return DType(code)


# ---------------------------------------------------------------------------------------------
# tensors <-> frames


def tensor_frame(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (made contiguous) as a buffer zmq can send without a copy; the
    buffer keeps the tensor's memory alive until zmq is done with it."""
    t = t.detach().contiguous()
    if t.numel() == 0:              # memoryview cannot cast a shape with a zero in it
        return memoryview(b"")
    if t.dtype == torch.bfloat16:   # numpy has no bfloat16: ship the same 2 bytes as int16
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def frame_tensor(buf: memoryview | bytes, dtype: DType, count: int, dim: int = 0) -> torch.Tensor:
    """A tensor viewing `buf`: [count] if dim == 0 else [count, dim]. No copy for a writable buffer
    (a received zmq frame); a read-only one (bytes) is copied, since torch tensors are always
    writable. The caller has checked the byte size (`expect_bytes`)."""
    tdtype = TORCH_DTYPES[dtype]
    shape = (count,) if dim == 0 else (count, dim)
    if count == 0 or len(buf) == 0:
        return torch.empty(shape, dtype=tdtype)
    if memoryview(buf).readonly:
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=tdtype).view(shape)


def text_frame(text: str) -> bytes:
    return text.encode("utf-8", errors="replace")


def frame_text(buf: memoryview | bytes, what: str) -> str:
    """Decode a UTF-8 payload; ProtocolError if it is not UTF-8."""
    try:
        return bytes(buf).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"{what}: payload is not UTF-8 ({e})", Status.BAD_VALUE) from None


__all__ = ["MAGIC", "VERSION", "FLAG_BACKGROUND", "FLAG_SHM", "FLAG_GRADS_LATE", "FLAG_NOTIFY",
           "HEADER_SIZE", "HEADER_FORMAT", "Op", "Status", "DType", "Header", "ProtocolError", "WIRE_DTYPES",
           "ITEM_SIZE", "unpack_header", "peek_ids", "check_request", "expect_bytes", "row_dtype", "tensor_frame",
           "frame_tensor", "text_frame", "frame_text"]
