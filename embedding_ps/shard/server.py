"""One PS shard's requests: `ShardServer` decodes a request, validates it, calls the shard's state
(`embedding_ps.shard.state.ShardState`) and the mode's gate (`embedding_ps.shard.gates`, chosen at
start), and encodes the reply (frames, shared-memory rows, SAVE's flags: docs/wire.md). No sockets
here: the loop that binds, parks the requests that must wait and retries them is
`embedding_ps.shard.loop` (`recsys ps`). A bad request gets an error reply and changes nothing (every
part of a PULL / PUSH is validated before any is applied); the loop never dies on input. A LOAD
forgets every step (trainers restarted from a checkpoint count again from its step); a sync-mode SAVE
for step t waits until no step < t is pending.

Pushes and barriers are not idempotent: the shard keeps the replies of the last REPLAY_ENTRIES
(client, request id) pairs and answers a retried request from that cache without applying it twice.
"""

from __future__ import annotations

import functools
import hmac
import itertools
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import zmq

from embedding_ps import native
from embedding_ps.wire import protocol as P
from embedding_ps import remote
from embedding_ps.wire.auth import job_tag
from embedding_ps.wire.config import PSConfig
from embedding_ps.shard.gates import Gate, RowSink, make_gate
from embedding_ps.shard.replybuffers import ReplyBuffers
from embedding_ps.shard.pushgrads import finite_rows, wait_late
from embedding_ps.shard.saver import BackgroundSaver
from embedding_ps.wire.shm import (DONE_OK, ShmAttacher, done_word, ids_view, seg_bytes, shard_accepts, trailer,
                               writer_alive)
from embedding_ps.shard.snapshot import ShardSnapshot, shard_dir
from embedding_ps.shard.state import MAX_STEP

logger = logging.getLogger(__name__)

REPLAY_ENTRIES = 16384
"""Replies of non-idempotent requests remembered for retries (each ~100 bytes)."""

DEFERRED = object()
"""What `ShardServer.handle` returns for a request parked until a later barrier."""
_NOT_IDEMPOTENT = (P.Op.PUSH, P.Op.BARRIER)


class ShardStateLike(RowSink, Protocol):
    """What the server needs of a shard's state (a gate's `RowSink` and more): `embedding_ps.shard.state.ShardState`
    (whose methods say what each does), or a test double."""

    def pull(self, table: int, ids: torch.Tensor, step: int = 0, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def sweep(self, step: int) -> dict: ...

    def stats(self) -> dict: ...

    def save(self, directory: str) -> dict: ...

    def load(self, directory: str) -> None: ...

    def snapshot(self) -> ShardSnapshot: ...

    def advance(self, step: int) -> None: ...

    def hint_slots(self, table: int, ids: torch.Tensor) -> None: ...

    def clear_hints(self) -> None: ...


StateFactory = Callable[[PSConfig, int], ShardStateLike]


@dataclass(slots=True)
class RowsRequest:
    """A PULL or a PUSH in the one form the row handlers take, whichever way the client sent it: ids
    and row data in the request's frames, or in its shared-memory segment (protocol.FLAG_SHM), with
    the ids there too when the ids frame is empty (then also a trailer: FLAG_NOTIFY's done word,
    FLAG_GRADS_LATE's ready word; `embedding_ps.wire.shm`)."""

    dtype: P.DType                   # of the rows on the wire: the PULL's reply, the PUSH's grads
    tables: list[int]                # [T] each part's table
    counts: list[int]                # [T] each part's number of ids
    total: int                       # M = sum(counts)
    nbytes: int                      # the row data's bytes: M x dim x item size
    ids: torch.Tensor | None         # int64 [M] (None until `ShardServer._attach` when they are in the segment)
    shm: bool = False                # FLAG_SHM
    ids_in_seg: bool = False
    seg: np.ndarray | None = None    # uint8 [nbytes]: the row data in the client's segment (None: the frames)
    trailer: np.ndarray | None = None  # int64 [4] of the segment (ids in the segment with NOTIFY / GRADS_LATE)
    bounds: list[tuple[int, int, int]] = field(default_factory=list)  # (table, start, n) of each part

    def notify_done(self, h: P.Header) -> None:
        """With FLAG_NOTIFY (and the trailer in the segment): tell the client waiting on the done word
        int32 [1] that its request was served."""
        if h.flags & P.FLAG_NOTIFY and self.trailer is not None:
            native.notify(done_word(self.trailer), DONE_OK)


class ShardServer:
    """Decodes requests for one shard, calls its `state` and `gate`, encodes replies. No sockets here."""

    def __init__(self, config: PSConfig, shard_index: int, state: ShardStateLike, token: bytes | None = None,
                 bind: str | None = None) -> None:
        """bind: the host this shard is bound to (`serve`), for ps.shared_memory = "auto" (None: ps.bind)."""
        self.config, self.shard, self.state, self.token = config, shard_index, state, token
        self.name = f"ps shard {shard_index}"
        self.save_root: str | None = None
        self.gate: Gate = make_gate(config, state)
        self.replay: OrderedDict[tuple[int, int], list] = OrderedDict()
        self.counts: dict[str, int] = {op.name.lower(): 0 for op in P.Op}
        self.errors = 0
        self.nonfinite_skipped = 0        # rows dropped under ps.on_nonfinite = "skip"
        self.stopping = False
        self._handlers = {P.Op.PULL: self._pull, P.Op.PUSH: self._push, P.Op.BARRIER: self._barrier,
                          P.Op.STATS: self._stats, P.Op.HEALTH: self._health, P.Op.SAVE: self._save,
                          P.Op.LOAD: self._load, P.Op.SHUTDOWN: self._shutdown, P.Op.SWEEP: self._sweep,
                          P.Op.SAVE_STATUS: self._save_status}
        self.buffers = ReplyBuffers()
        # clients' shared-memory segments by name (ps.shared_memory; None: FLAG_SHM gets NO_SHM)
        self.shm = (ShmAttacher(job=job_tag(config, token)) if shard_accepts(config.shared_memory, bind or config.bind)
                    else None)
        self.shm_requests = 0             # PULL / PUSH served through shared memory
        self.shm_refused = 0              # ... answered NO_SHM (the client resent them through the socket)
        self.saver = BackgroundSaver(self.name, shard_index)
        # SAVE / LOAD stay under ps.storage_root (resolved once; "": not confined, see PSConfig)
        root = config.storage_root
        self.storage_root = (root if remote.is_uri(root) else os.path.realpath(root)) if root else None

    def handle(self, frames: list) -> Any:
        """Reply frames for request `frames` (zmq.Frame or bytes), or DEFERRED. Never raises."""
        header = None
        try:
            if len(frames) < 2:
                raise P.ProtocolError(f"a request needs >= 2 frames (header, auth), got {len(frames)}")
            header = P.unpack_header(_buf(frames[0]))
            op = P.check_request(header, len(frames))
            if header.step < 0:
                raise P.ProtocolError(f"{op.name}: step must be >= 0, got {header.step}", P.Status.BAD_VALUE)
            if self.token is not None and not hmac.compare_digest(self.token, bytes(_buf(frames[1]))):
                raise P.ProtocolError("authentication failed: wrong or missing token", P.Status.UNAUTHORIZED)
            key = (header.client, header.request)
            if op in _NOT_IDEMPOTENT and key in self.replay:
                logger.info("%s: replayed reply of retried %s request %d", self.name, op.name, header.request)
                return self.replay[key]
            reply = self._handlers[op](header, [_buf(f) for f in frames[2:]])
            if reply is not DEFERRED:
                self.counts[op.name.lower()] += 1
                if op in _NOT_IDEMPOTENT:
                    self.replay[key] = reply
                    if len(self.replay) > REPLAY_ENTRIES:
                        self.replay.popitem(last=False)
            return reply
        except P.ProtocolError as e:
            if e.status == P.Status.NO_SHM:     # not an error: the client falls back to the socket
                self.shm_refused += 1
                logger.debug("%s: %s", self.name, e)
                return _text_reply(header, P.Status.NO_SHM, str(e))
            return self._error(header, frames, e.status, str(e))
        except (ValueError, IndexError) as e:   # the state refused the values (step range, ...)
            return self._error(header, frames, P.Status.BAD_VALUE, f"{type(e).__name__}: {e}")
        except Exception as e:  # the state failed on a valid request: report it, keep serving
            logger.exception("%s: %s failed", self.name, "request" if header is None else P.Op(header.op).name)
            return self._error(header, frames, P.Status.INTERNAL, f"{type(e).__name__}: {e}")

    def _error(self, header: P.Header | None, frames: list, status: P.Status, message: str) -> list:
        self.errors += 1
        text = f"{self.name}: {message}"
        logger.warning("%s", text)
        if header is None:
            client, request = P.peek_ids(_buf(frames[0])) if frames else (0, 0)
            header = P.Header(op=0, client=client, request=request)
        return _text_reply(header, status, text)

    # -- validation helpers -------------------------------------------------------------------

    def _paths(self, h: P.Header, payload: list) -> tuple[str, str]:
        """(the directory a SAVE / LOAD names, this shard's directory under it); BAD_VALUE if that lies
        outside ps.storage_root once '..' and symlinks are resolved."""
        what = P.Op(h.op).name
        P.expect_bytes(f"{what} path", len(payload[0]), h.count, 1, 1 << 16)
        root = P.frame_text(payload[0], f"{what} path")
        if not root:
            raise P.ProtocolError(f"{what}: empty directory", P.Status.BAD_VALUE)
        path = shard_dir(root, self.shard)
        if self.storage_root is None:
            return root, path
        if remote.is_uri(self.storage_root) or remote.is_uri(path):     # a URI root admits URIs under it
            if not remote.within(self.storage_root, path):
                raise P.ProtocolError(f"{what} of {path!r} refused: outside ps.storage_root {self.storage_root!r}",
                                      P.Status.BAD_VALUE)
        elif (real := os.path.realpath(path)) != self.storage_root and not real.startswith(self.storage_root + os.sep):
            raise P.ProtocolError(f"{what} of {path!r} refused: it resolves to {real!r}, outside "
                                  f"ps.storage_root {self.storage_root!r}", P.Status.BAD_VALUE)
        return root, path

    def _json(self, h: P.Header, obj: Any) -> list:
        body = json.dumps(obj, default=_json_default).encode()
        return [h.reply(dtype=P.DType.BYTES, count=len(body), dim=0).pack(), body]

    # -- ops ------------------------------------------------------------------------------------

    def _rows(self, h: P.Header, payload: list, what: str) -> RowsRequest:
        """The PULL / PUSH `h` decoded and validated (`what`: its row data; ProtocolError naming what is
        wrong); its segment is not opened yet (`_attach`): a pull that must wait opens it when it runs."""
        dtype = P.row_dtype(h.dtype, what)
        name = P.Op(h.op).name
        limit = self.config.max_frame_bytes
        if h.count < 1:
            raise P.ProtocolError(f"{name}: count (parts) must be >= 1, got {h.count}", P.Status.BAD_VALUE)
        P.expect_bytes(f"{name} index", len(payload[0]), 2 * h.count, 8, limit)
        index = P.frame_tensor(payload[0], P.DType.INT64, 2 * h.count).view(h.count, 2)
        tables, counts = index[:, 0].tolist(), index[:, 1].tolist()
        num_tables = len(self.config.tables)
        for i, (t, n) in enumerate(zip(tables, counts)):
            if not 0 <= t < num_tables:
                raise P.ProtocolError(f"{name}: part {i}: unknown table {t} (this job has {num_tables} tables)",
                                      P.Status.BAD_VALUE)
            cfg = self.config.tables[t]
            if cfg.dim != h.dim:
                raise P.ProtocolError(f"{name}: part {i}: table {t} ({cfg.name}) has dim {cfg.dim}, request "
                                      f"says {h.dim}", P.Status.BAD_VALUE)
            if n < 0:
                raise P.ProtocolError(f"{name}: part {i}: count must be >= 0, got {n}", P.Status.BAD_VALUE)
        total = sum(counts)
        shm = bool(h.flags & P.FLAG_SHM)
        ids_in_seg = shm and total > 0 and not len(payload[1])     # then they are read at `_attach`
        if not ids_in_seg:
            P.expect_bytes(f"{name} ids", len(payload[1]), total, 8, limit)
        return RowsRequest(dtype, tables, counts, total, total * h.dim * P.ITEM_SIZE[dtype],
                           None if ids_in_seg else P.frame_tensor(payload[1], P.DType.INT64, total),
                           shm=shm, ids_in_seg=ids_in_seg,
                           bounds=list(zip(tables, itertools.accumulate([0, *counts[:-1]]), counts)))

    def _attach(self, h: P.Header, req: RowsRequest, payload: list) -> None:
        """With FLAG_SHM: open the client's segment (named by `payload[2]`); the row data, and the ids
        and the trailer when they travel there too, become views of it. NO_SHM if this shard cannot
        open it (off here, another /dev/shm, another user), BAD_VALUE for a malformed name or size."""
        if not req.shm:
            return
        what = f"{P.Op(h.op).name} with shared memory"
        if self.shm is None:
            raise P.ProtocolError(f"{what} refused: this shard does not take shared memory (ps.shared_memory "
                                  f"is {self.config.shared_memory!r} here, or this host has no /dev/shm)",
                                  P.Status.NO_SHM)
        if len(payload[2]) > 128:
            raise P.ProtocolError(f"{what}: segment name of {len(payload[2])} bytes", P.Status.BAD_VALUE)
        with_trailer = bool(h.flags & (P.FLAG_GRADS_LATE | P.FLAG_NOTIFY))
        # rows [| ids int64 [M] [| trailer]]
        nbytes = seg_bytes(req.nbytes, req.total, with_trailer) if req.ids_in_seg else req.nbytes
        try:
            seg = self.shm.attach(bytes(payload[2]), nbytes)
        except OSError as e:         # e.g. FileNotFoundError: the client's /dev/shm is not this one
            raise P.ProtocolError(f"{what}: segment not opened here ({e})", P.Status.NO_SHM) from None
        except ValueError as e:
            raise P.ProtocolError(f"{what}: {e}", P.Status.BAD_VALUE) from None
        self.shm_requests += 1
        if req.ids_in_seg:
            req.ids = ids_view(seg, req.nbytes, req.total)
            if with_trailer:
                req.trailer = trailer(seg, req.nbytes, req.total)
        req.seg = seg[:req.nbytes]

    def _pull(self, h: P.Header, payload: list) -> Any:
        """Rows wire dtype [M, D] of every part's ids, back to back; DEFERRED while the step must wait."""
        req = self._rows(h, payload, "PULL reply")
        if req.nbytes > self.config.max_frame_bytes:
            raise P.ProtocolError(f"PULL of {req.total} rows of dim {h.dim} = {req.nbytes} bytes exceeds "
                                  f"ps.max_frame_bytes = {self.config.max_frame_bytes}", P.Status.BAD_VALUE)
        if self.gate.must_wait(h.step):
            return DEFERRED
        self._attach(h, req, payload)
        self.gate.pulled(h.step)
        # [M, D] in the wire dtype: the client's segment or a reused reply buffer (fp32: gathered into it)
        wire = (P.frame_tensor(memoryview(req.seg), req.dtype, req.total, h.dim) if req.seg is not None
                else self.buffers.tensor(P.TORCH_DTYPES[req.dtype], (req.total, h.dim)))
        out = wire if req.dtype == P.DType.FP32 else self.buffers.tensor(torch.float32, (req.total, h.dim))
        for t, a, n in req.bounds:
            if n:          # each part straight into its contiguous rows of `out`
                self.state.pull(t, req.ids[a:a + n], h.step, out=out[a:a + n])
        if out is not wire:
            wire.copy_(out)
        req.notify_done(h)     # the caller may take the rows now
        # with shared memory the rows are in the client's segment
        return [h.reply().pack()] if req.seg is not None else [h.reply().pack(), P.tensor_frame(wire)]

    def _push(self, h: P.Header, payload: list) -> list:
        """Every part's grads to the gate: applied now (async) or at the step's last barrier (sync)."""
        req = self._rows(h, payload, "PUSH grads")
        P.expect_bytes("PUSH grads", req.nbytes if req.shm else len(payload[2]), req.total * h.dim,
                       P.ITEM_SIZE[req.dtype], self.config.max_frame_bytes)
        if h.step > MAX_STEP:     # checked here so that no part is applied before a later one fails
            raise P.ProtocolError(f"PUSH: step must be <= {MAX_STEP}, got {h.step}", P.Status.BAD_VALUE)
        late = req.shm and bool(h.flags & P.FLAG_GRADS_LATE)     # the client writes the grads as this runs
        if late and (not req.ids_in_seg or req.dtype != P.DType.FP32):
            raise P.ProtocolError("PUSH: late grads need fp32 grads and the ids in the segment", P.Status.BAD_VALUE)
        self._attach(h, req, payload)
        if req.ids_in_seg and self.gate.holds_pushes:
            req.ids = req.ids.clone()          # kept past the reply: not the client's memory
        part_ids = [req.ids[a:a + n] for _, a, n in req.bounds]
        try:
            # the client still writes the grads: a gate that applies pushes on arrival looks the ids up
            # meanwhile (each table once: `ShardState.hint_slots`), then waits
            if late and not self.gate.holds_pushes and len(set(req.tables)) == len(req.tables):
                for t, i in zip(req.tables, part_ids):
                    if i.numel():
                        self.state.hint_slots(t, i)
            # `checked`: the client's copy found every grad finite
            checked = late and wait_late(h.request, req.trailer, self.config.timeout_s,
                                         functools.partial(writer_alive, bytes(payload[2])))
            raw = memoryview(req.seg) if req.seg is not None else payload[2]
            grads = P.frame_tensor(raw, req.dtype, req.total, h.dim).float()     # [M, D]
            if req.seg is not None and self.gate.holds_pushes and req.dtype == P.DType.FP32:
                grads = grads.clone()          # kept past the reply: not the client's memory
            keep = None if checked else finite_rows(self.config, req.tables, req.counts, grads)
            if keep is not None:               # None: all finite
                self.nonfinite_skipped += int((~keep).sum())
            parts = []
            for (t, a, n), i in zip(req.bounds, part_ids):
                g = grads[a:a + n]
                if keep is not None:
                    i, g = i[keep[a:a + n]], g[keep[a:a + n]]
                if i.numel():
                    parts.append((t, i, g))
            self.gate.push(h.worker, h.step, parts)
        finally:
            if late:
                self.state.clear_hints()
        req.notify_done(h)     # the caller may go on now
        return [h.reply().pack()]

    def _barrier(self, h: P.Header, payload: list) -> list:
        self.gate.barrier(h.worker, h.step)
        return [h.reply().pack()]

    def _stats(self, h: P.Header, payload: list) -> list:
        return self._json(h, {"shard": self.shard, "num_shards": self.config.num_shards, "mode": self.config.mode,
                              "requests": self.counts, "errors": self.errors, "replay_entries": len(self.replay),
                              "state": self.state.stats(), "save": self.saver.status(),
                              "nonfinite_rows_skipped": self.nonfinite_skipped, "shm_requests": self.shm_requests,
                              "shm_refused": self.shm_refused, **self.gate.stats()})

    def _health(self, h: P.Header, payload: list) -> list:
        return self._json(h, {"shard": self.shard, "ok": True, "pid": os.getpid(), "mode": self.config.mode,
                              "num_workers": self.config.num_workers, "num_shards": self.config.num_shards,
                              "last_applied_step": self.gate.stats().get("last_applied_step")})

    def _save(self, h: P.Header, payload: list) -> Any:
        root, path = self._paths(h, payload)
        if self.gate.must_wait(h.step) or self.saver.busy:    # busy: retried when the write ends
            return DEFERRED
        self.save_root = root     # the directory the client named (SAVE_STATUS: "root")
        self.state.advance(h.step)    # global weight decay: the save writes rows decayed through step - 1
        save = self.saver.start if h.flags & P.FLAG_BACKGROUND else self.saver.save
        return self._json(h, save(self.state, path, h.step))

    def _save_status(self, h: P.Header, payload: list) -> list:
        return self._json(h, {**self.saver.status(), "root": self.save_root})

    def wakeup(self) -> bool:
        """True once after a background write ended: parked SAVE / LOAD requests may go on now."""
        return self.saver.take_finished()

    def close(self, timeout_s: float | None = None) -> None:
        """Let a running background write finish (a SHUTDOWN does not lose a checkpoint)."""
        if not self.saver.wait(timeout_s):
            logger.error("%s: background save still writing after %s s; abandoning it", self.name, timeout_s)

    def _load(self, h: P.Header, payload: list) -> Any:
        path = self._paths(h, payload)[1]
        if self.saver.busy:
            return DEFERRED
        self.state.load(path)
        self.gate = make_gate(self.config, self.state)     # a fresh one: a LOAD forgets every step (module doc)
        logger.info("%s: loaded from %s", self.name, path)
        return self._json(h, {"shard": self.shard, "directory": path})

    def _sweep(self, h: P.Header, payload: list) -> list:
        return self._json(h, self.state.sweep(h.step))

    def _shutdown(self, h: P.Header, payload: list) -> list:
        logger.info("%s: shutdown requested by worker %d", self.name, h.worker)
        self.stopping = True
        return [h.reply().pack()]


def _text_reply(header: P.Header, status: P.Status, text: str) -> list:
    """A reply of `status` that carries `text` (an error, or NO_SHM's reason)."""
    return [header.reply(status, dtype=P.DType.BYTES, count=0, dim=0).pack(), P.text_frame(text)]


def _buf(frame: Any) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def _json_default(obj: Any) -> Any:
    """What `json.dumps` writes for a tensor or numpy value (its list or scalar), anything else (its str)."""
    return obj.tolist() if hasattr(obj, "tolist") else str(obj)
