"""One PS shard process: a ZeroMQ ROUTER socket in front of a `ShardState`.

    python -m embedding_ps.server --config job.toml --shard I [--bind ADDR] [--port P] [--ready-file F]

The server only decodes requests and encodes replies (wire format: `embedding_ps.protocol`); rows,
optimizer state and save/load live in `embedding_ps.shard.ShardState`. It is one thread and never
blocks: a request that must wait (a sync-mode pull for a step whose predecessor is not applied yet)
is parked and answered when a later barrier unblocks it. Every request is validated and a bad one
gets an error reply; the loop never dies on input.

Sync contract (ps.mode = "sync", W = ps.num_workers), per worker and step t = 0, 1, 2, ...::

    pull(table, ids, step=t)          waits on each shard until no step < t is still pending there
    push(table, ids, grads, step=t)   buffered per step; any number, every table; all acknowledged
    barrier(t)                        "worker w is done with step t", sent to every shard

When all W workers have sent barrier(t), each shard concatenates step t's buffered pushes of each
table (in worker order, then arrival order) and calls `state.push` once per table: the step's
gradients are summed and applied once, exactly as one process pushing the concatenation. A push or
barrier for a step the shard already applied is refused (STALE_STEP). A LOAD forgets every step
(trainers restarted from a checkpoint count again from its step). Steps need not be contiguous
(a resumed job may start at step 1000), but they are applied in increasing order.

Async mode: each push is applied on arrival. If the workers also send barrier(t), a pull for step s
waits while s is more than ps.max_staleness steps ahead of the slowest worker's last barrier + 1.

Saves: SAVE (in sync mode, for step t: once no step < t is pending) writes the shard's files
before replying; with protocol.FLAG_BACKGROUND a thread first faults in memory for a copy (the SAVE
is parked meanwhile), then the shard copies its state into it, replies, and a thread writes the
copy while the loop keeps serving (`embedding_ps.saver`; SAVE_STATUS reports the write). While a
save is prepared or written, new SAVE and LOAD requests are parked and retried when that ends.

Pushes (PUSH, PUSH_MULTI) and barriers are not idempotent: the shard keeps the replies of the last
REPLAY_ENTRIES (client, request id) pairs and answers a retried request from that cache without
applying it twice. PULL_MULTI / PUSH_MULTI (one request for several tables) live in `multi_server`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import inspect
import socket
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from embedding_ps import multi_server
from embedding_ps import protocol as P
from embedding_ps.auth import AuthConfigError, check_bind_auth, load_token, setup_server_curve, token_matches
from embedding_ps.config import PSConfig, PSConfigError, TableConfig, load_ps_config
from embedding_ps.saver import BackgroundSaver
from embedding_ps.snapshot import shard_dir

logger = logging.getLogger(__name__)

REPLAY_ENTRIES = 16384
"""Replies of non-idempotent requests remembered for retries (each ~100 bytes)."""
POLL_MS = 200
"""The loop wakes at least this often to notice a stop request (SIGTERM, stop())."""
BUSY_POLL_MS = 2
"""... and this often while a background save is prepared or written."""

DEFERRED = object()
"""What `ShardServer.handle` returns for a request parked until a later barrier."""
StateFactory = Callable[[PSConfig, int], Any]
_NOT_IDEMPOTENT = (P.Op.PUSH, P.Op.PUSH_MULTI, P.Op.BARRIER)


# ---------------------------------------------------------------------------------------------
# sync mode: per-step buffers


@dataclass
class _Step:
    pushes: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    arrived: set[int] = field(default_factory=set)


class StepBuffer:
    """Sync mode: each step's pushes, held until all `num_workers` workers sent its barrier."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.steps: dict[int, _Step] = {}
        self.last_applied = -1

    def pending_before(self, step: int) -> bool:
        """True while a step < `step` has pushes or barriers not applied yet."""
        return any(t < step for t in self.steps)

    def _open(self, step: int, what: str) -> _Step:
        if step <= self.last_applied:
            raise P.ProtocolError(f"{what} for step {step}, but step {self.last_applied} is already "
                                  f"applied", P.Status.STALE_STEP)
        return self.steps.setdefault(step, _Step())

    def add_push(self, step: int, worker: int, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Buffer ids [N] and grads float32 [N, D] of one push."""
        self._open(step, f"push of worker {worker}").pushes.setdefault(table, []).append((worker, ids, grads))

    def arrive(self, step: int, worker: int) -> None:
        self._open(step, f"barrier of worker {worker}").arrived.add(worker)

    def pop_ready(self) -> tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None:
        """The lowest step if every worker arrived: (step, {table: (ids [M], grads [M, D])})."""
        if not self.steps:
            return None
        step = min(self.steps)
        if len(self.steps[step].arrived) < self.num_workers:
            return None
        entry = self.steps.pop(step)
        self.last_applied = step
        merged = {}
        for table, parts in entry.pushes.items():
            parts = sorted(parts, key=lambda p: p[0])      # worker order; stable: arrival within one
            merged[table] = (torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts]))
        return step, merged


# ---------------------------------------------------------------------------------------------
# reply buffers


class ReplyBuffers:
    """Reusable byte buffers for PULL replies, which zmq sends without a copy.

    A fresh [N, D] allocation per pull is a fresh mmap on glibc: every page faults again (~2-3
    ms for 25 MB). A buffer is free again once zmq has released the frame viewing it (CPython
    reference counts: only this pool still refers to it). Sizes are rounded up to a power of two
    so that requests of similar sizes share buffers; at most `max_bytes` are kept.
    """

    MIN_BYTES = 1 << 16          # smaller frames are copied by pyzmq anyway

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self.bufs: list[np.ndarray] = []
        self.total = 0

    def take(self, nbytes: int) -> np.ndarray:
        """uint8 [nbytes], not initialized, not referred to by anything else."""
        best = None
        for i in range(len(self.bufs)):
            if self.bufs[i].nbytes >= nbytes and self._idle(i) and (
                    best is None or self.bufs[i].nbytes < self.bufs[best].nbytes):
                best = i
        if best is not None:
            return self.bufs[best][:nbytes]
        size = max(self.MIN_BYTES, 1 << max(nbytes - 1, 1).bit_length())
        if size > self.max_bytes:
            return torch.empty(nbytes, dtype=torch.uint8).numpy()
        while self.total + size > self.max_bytes:     # drop idle buffers (smallest first) to make room
            idle = [i for i in range(len(self.bufs)) if self._idle(i)]
            if not idle:
                return torch.empty(nbytes, dtype=torch.uint8).numpy()
            i = min(idle, key=lambda i: self.bufs[i].nbytes)
            self.total -= self.bufs.pop(i).nbytes
        # torch's allocation, viewed by numpy: numpy itself would madvise(MADV_HUGEPAGE) a large
        # array, and huge pages made each send slower here (more sys time, pages faulting again)
        a = torch.empty(size, dtype=torch.uint8).numpy()
        self.bufs.append(a)
        self.total += size
        return a[:nbytes]

    def _idle(self, i: int) -> bool:
        # references: the list and getrefcount's argument; more while a frame (a view) is alive
        return sys.getrefcount(self.bufs[i]) <= 2

    def tensor(self, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """An uninitialized contiguous tensor backed by a pool buffer."""
        n = shape[0] * shape[1]
        item = torch.empty(0, dtype=dtype).element_size()
        if n * item < self.MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        raw = torch.from_numpy(self.take(n * item))
        return raw.view(dtype).view(shape)


# ---------------------------------------------------------------------------------------------
# the shard server


class ShardServer:
    """Decodes requests for one shard, calls its `state`, encodes replies. No sockets here."""

    def __init__(self, config: PSConfig, shard_index: int, state: Any, token: bytes | None = None) -> None:
        self.config, self.shard, self.state, self.token = config, shard_index, state, token
        self.sync = StepBuffer(config.num_workers) if config.mode == "sync" else None
        self.progress = [-1] * config.num_workers      # async: last barrier step of each worker
        self.max_pull_lead = 0                         # async: most steps a served pull ran ahead
        self.replay: OrderedDict[tuple[int, int], list] = OrderedDict()
        self.counts: dict[str, int] = {op.name.lower(): 0 for op in P.Op}
        self.errors = 0
        self.stopping = False
        self._handlers = {P.Op.PULL: self._pull, P.Op.PUSH: self._push, P.Op.BARRIER: self._barrier,
                          P.Op.STATS: self._stats, P.Op.HEALTH: self._health, P.Op.SAVE: self._save,
                          P.Op.LOAD: self._load, P.Op.SHUTDOWN: self._shutdown, P.Op.SWEEP: self._sweep,
                          P.Op.SAVE_STATUS: self._save_status,
                          P.Op.PUSH_MULTI: lambda h, p: multi_server.push_multi(self, h, p),
                          P.Op.PULL_MULTI: lambda h, p: multi_server.pull_multi(self, h, p) or DEFERRED}
        self.buffers = ReplyBuffers()
        self.saver = BackgroundSaver(self.name, shard_index)
        try:
            self._pull_out = "out" in inspect.signature(state.pull).parameters
        except (TypeError, ValueError, AttributeError):
            self._pull_out = False

    @property
    def name(self) -> str:
        return f"ps shard {self.shard}"

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
            if self.token is not None and not token_matches(self.token, _buf(frames[1])):
                raise P.ProtocolError("authentication failed: wrong or missing token", P.Status.UNAUTHORIZED)
            key = (header.client, header.request)
            if op in _NOT_IDEMPOTENT and key in self.replay:
                logger.info("%s: replayed reply of retried %s request %d", self.name, op.name, header.request)
                return self.replay[key]
            reply = self._handlers[op](header, [_buf(f) for f in frames[2:]])
            if reply is not DEFERRED:
                self.counts[op.name.lower()] += 1
                if op in _NOT_IDEMPOTENT:
                    self._remember(key, reply)
            return reply
        except P.ProtocolError as e:
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
        return [header.reply(status, dtype=P.DType.BYTES, count=0, dim=0).pack(), P.text_frame(text)]

    def _remember(self, key: tuple[int, int], reply: list) -> None:
        self.replay[key] = reply
        if len(self.replay) > REPLAY_ENTRIES:
            self.replay.popitem(last=False)

    # -- validation helpers -------------------------------------------------------------------

    def _table(self, h: P.Header) -> TableConfig:
        if h.table >= len(self.config.tables):
            raise P.ProtocolError(f"{P.Op(h.op).name}: unknown table {h.table} (this job has "
                                  f"{len(self.config.tables)} tables)", P.Status.BAD_VALUE)
        table = self.config.tables[h.table]
        if h.dim != table.dim:
            raise P.ProtocolError(f"{P.Op(h.op).name}: table {h.table} ({table.name}) has dim {table.dim}, "
                                  f"request says {h.dim}", P.Status.BAD_VALUE)
        return table

    def _worker(self, h: P.Header) -> None:
        if h.worker >= self.config.num_workers:
            raise P.ProtocolError(f"{P.Op(h.op).name}: worker {h.worker} is outside 0.."
                                  f"{self.config.num_workers - 1} (ps.num_workers)", P.Status.BAD_VALUE)

    def _ids(self, h: P.Header, buf: memoryview) -> torch.Tensor:
        P.expect_bytes(f"{P.Op(h.op).name} ids", len(buf), h.count, 8, self.config.max_frame_bytes)
        return P.frame_tensor(buf, P.DType.INT64, h.count)

    def _must_wait(self, step: int) -> bool:
        if self.sync is not None:
            return self.sync.pending_before(step)
        slowest_next = min(self.progress) + 1
        return step - slowest_next > self.config.max_staleness

    def _path(self, h: P.Header, payload: list) -> str:
        P.expect_bytes(f"{P.Op(h.op).name} path", len(payload[0]), h.count, 1, 1 << 16)
        path = P.frame_text(payload[0], f"{P.Op(h.op).name} path")
        if not path:
            raise P.ProtocolError(f"{P.Op(h.op).name}: empty directory", P.Status.BAD_VALUE)
        return path

    def _json(self, h: P.Header, obj: Any) -> list:
        body = json.dumps(_jsonable(obj)).encode()
        return [h.reply(dtype=P.DType.BYTES, count=len(body), dim=0).pack(), body]

    # -- ops ------------------------------------------------------------------------------------

    def pull_may_go(self, h: P.Header, rows: int, dim: int, dtype: P.DType) -> bool:
        """PULL / PULL_MULTI of `rows` rows: refuse a reply over ps.max_frame_bytes; False while the
        step must wait (sync: earlier steps pending; async: too far ahead), else note its lead."""
        reply_bytes = rows * dim * P.ITEM_SIZE[dtype]
        if reply_bytes > self.config.max_frame_bytes:
            raise P.ProtocolError(f"{P.Op(h.op).name} of {rows} rows of dim {dim} = {reply_bytes} bytes exceeds "
                                  f"ps.max_frame_bytes = {self.config.max_frame_bytes}", P.Status.BAD_VALUE)
        if self._must_wait(h.step):
            return False
        if self.sync is None:
            self.max_pull_lead = max(self.max_pull_lead, h.step - (min(self.progress) + 1))
        return True

    def _pull(self, h: P.Header, payload: list) -> Any:
        table = self._table(h)
        dtype = P.row_dtype(h.dtype, "PULL reply")
        ids = self._ids(h, payload[0])
        if not self.pull_may_go(h, h.count, table.dim, dtype):
            return DEFERRED
        shape = (h.count, table.dim)
        if self._pull_out and h.count:
            if dtype == P.DType.FP32:       # rows straight into a reused buffer: no fresh pages
                rows = self.state.pull(h.table, ids, h.step, out=self.buffers.tensor(torch.float32, shape))
                return [h.reply().pack(), P.tensor_frame(rows)]
            rows = self.state.pull(h.table, ids, h.step)                 # float32 [N, D]
            wire = self.buffers.tensor(P.TORCH_DTYPES[dtype], shape)
            return [h.reply().pack(), P.tensor_frame(wire.copy_(rows))]
        rows = self.state.pull(h.table, ids, h.step)                     # float32 [N, D]
        return [h.reply().pack(), P.tensor_frame(P.to_wire(rows, dtype))]

    def _push(self, h: P.Header, payload: list) -> list:
        table = self._table(h)
        dtype = P.row_dtype(h.dtype, "PUSH grads")
        ids = self._ids(h, payload[0])
        P.expect_bytes("PUSH grads", len(payload[1]), h.count * table.dim, P.ITEM_SIZE[dtype],
                       self.config.max_frame_bytes)
        grads = P.frame_tensor(payload[1], dtype, h.count, table.dim).float()   # [N, D]
        if self.sync is not None:
            self._worker(h)
            self.sync.add_push(h.step, h.worker, h.table, ids, grads)
        else:
            self.state.push(h.table, ids, grads, h.step)
        return [h.reply().pack()]

    def _barrier(self, h: P.Header, payload: list) -> list:
        self._worker(h)
        if self.sync is None:
            self.progress[h.worker] = max(self.progress[h.worker], h.step)
            return [h.reply().pack()]
        self.sync.arrive(h.step, h.worker)
        while (ready := self.sync.pop_ready()) is not None:
            step, merged = ready
            for table, (ids, grads) in sorted(merged.items()):
                self.state.push(table, ids, grads, step)
            logger.debug("%s: applied step %d (%d tables)", self.name, step, len(merged))
        return [h.reply().pack()]

    def _stats(self, h: P.Header, payload: list) -> list:
        info = {"shard": self.shard, "num_shards": self.config.num_shards, "mode": self.config.mode,
                "requests": self.counts, "errors": self.errors, "replay_entries": len(self.replay),
                "state": self.state.stats(), "save": self.saver.status()}
        if self.sync is not None:
            info["last_applied_step"] = self.sync.last_applied
            info["pending_steps"] = sorted(self.sync.steps)
        else:
            info["max_pull_lead"] = self.max_pull_lead
            info["worker_progress"] = list(self.progress)
        return self._json(h, info)

    def _health(self, h: P.Header, payload: list) -> list:
        return self._json(h, {"shard": self.shard, "ok": True, "pid": os.getpid(), "mode": self.config.mode,
                              "last_applied_step": self.sync.last_applied if self.sync else None})

    def _save(self, h: P.Header, payload: list) -> Any:
        path = shard_dir(self._path(h, payload), self.shard)
        if h.flags & P.FLAG_PREPARE:    # ahead of a background save: its memory, while training goes on
            prepared = self.saver.phase == "idle" and callable(getattr(self.state, "snapshot_buffers", None))
            if prepared:
                self.saver.prepare(self.state)
            return self._json(h, {"shard": self.shard, "prepared": prepared, "phase": self.saver.phase})
        if self._must_wait(h.step) or self.saver.busy:    # busy: retried when the saver's phase ends
            return DEFERRED
        if h.flags & P.FLAG_BACKGROUND:
            if not callable(getattr(self.state, "snapshot", None)):
                raise P.ProtocolError("SAVE: this shard's state cannot take snapshots (no background saves)",
                                      P.Status.BAD_VALUE)
            if self.saver.phase == "idle" and callable(getattr(self.state, "snapshot_buffers", None)):
                self.saver.prepare(self.state)            # fault in the copy's memory on a thread first
                return DEFERRED
            return self._json(h, self.saver.start(self.state, path, h.step))
        reply = self.saver.save(self.state, path, h.step)
        logger.info("%s: saved to %s", self.name, path)
        return self._json(h, reply)

    def _save_status(self, h: P.Header, payload: list) -> list:
        return self._json(h, self.saver.status())

    def wakeup(self) -> bool:
        """True once after a background write ended: parked SAVE / LOAD requests may go on now."""
        return self.saver.take_finished()

    def close(self, timeout_s: float | None = None) -> None:
        """Let a running background write finish (a SHUTDOWN does not lose a checkpoint)."""
        if not self.saver.wait(timeout_s):
            logger.error("%s: background save still writing after %s s; abandoning it", self.name, timeout_s)

    def _load(self, h: P.Header, payload: list) -> Any:
        path = shard_dir(self._path(h, payload), self.shard)
        if self.saver.busy:
            return DEFERRED
        self.saver.drop_buffers()
        self.state.load(path)
        # the trainers restart from the loaded state: forget the steps and progress of the old run
        self.sync = StepBuffer(self.config.num_workers) if self.config.mode == "sync" else None
        self.progress = [-1] * self.config.num_workers
        self.max_pull_lead = 0
        logger.info("%s: loaded from %s", self.name, path)
        return self._json(h, {"shard": self.shard, "directory": path})

    def _sweep(self, h: P.Header, payload: list) -> list:
        return self._json(h, self.state.sweep(h.step))

    def _shutdown(self, h: P.Header, payload: list) -> list:
        logger.info("%s: shutdown requested by worker %d", self.name, h.worker)
        self.stopping = True
        return [h.reply().pack()]


def _buf(frame: Any) -> memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "item"):        # numpy scalars
        return obj.item()
    return str(obj)


# ---------------------------------------------------------------------------------------------
# the socket loop


def run_loop(server: ShardServer, sock: zmq.Socket, stop: threading.Event) -> None:
    """Serve until a SHUTDOWN request or `stop` is set. Parked requests are retried after barriers."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deferred: list[list] = []
    while not (server.stopping or stop.is_set()):
        if deferred and server.wakeup():      # the saver's phase ended: a parked SAVE / LOAD goes on
            deferred = _retry(server, sock, deferred)
        # while the saver works, wake often to notice the end of its phase
        if not poller.poll(BUSY_POLL_MS if server.saver.busy else POLL_MS):
            continue
        while not server.stopping:
            try:
                msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            reply = server.handle(msg[1:])
            if reply is DEFERRED:
                deferred.append(msg)
                continue
            sock.send_multipart([msg[0], *reply], copy=False)
            reply = None      # zmq holds the frames now: the reply buffer is free once it is sent
            if deferred and (_op_of(msg) == P.Op.BARRIER or server.wakeup()):
                deferred = _retry(server, sock, deferred)


def _op_of(msg: list) -> int:
    buf = _buf(msg[1]) if len(msg) > 1 else b""
    return buf[6] if len(buf) == P.HEADER_SIZE else -1


def _retry(server: ShardServer, sock: zmq.Socket, deferred: list[list]) -> list[list]:
    still = []
    for msg in deferred:
        reply = server.handle(msg[1:])
        if reply is DEFERRED:
            still.append(msg)
        else:
            sock.send_multipart([msg[0], *reply], copy=False)
        reply = None
    return still


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port or '*'}" if ":" in host else f"tcp://{host}:{port or '*'}"


def _advertised(endpoint: str, host: str) -> str:
    """The address clients use: a wildcard bind is advertised under this machine's name."""
    if host in ("0.0.0.0", "*", "::"):
        return f"tcp://{socket.getfqdn()}:{endpoint.rsplit(':', 1)[1]}"
    return endpoint


def _write_ready(path: str, address: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


def _default_state(config: PSConfig, shard_index: int) -> Any:
    from embedding_ps.shard import ShardState

    return ShardState(config, shard_index)


def _prime_malloc() -> None:
    """Free one large block so glibc raises its mmap threshold (to ~30 MB) now.

    Below that threshold, request-sized blocks (zmq's receive buffers, push temporaries) come
    from the heap and are reused; above it each is a fresh mmap whose every page faults in again
    (measured: ~900 faults and ~1-2 ms per 100k-row d64 push). glibc raises the threshold
    itself after the first such free, but only if one happens to come along.
    """
    block = torch.empty(30 << 20, dtype=torch.uint8)
    del block


def serve(config: PSConfig, shard_index: int, *, bind: str | None = None, port: int = 0,
          ready_file: str | None = None, state_factory: StateFactory | None = None,
          stop: threading.Event | None = None) -> None:
    """Serve shard `shard_index` of every table until SHUTDOWN, SIGTERM or `stop` is set.

    bind: host to bind (default ps.bind); a non-loopback host needs ps.auth (AuthConfigError,
    raised before anything is bound). port 0: an ephemeral port. The address clients should use is
    logged and written to `ready_file` (atomically) once the shard serves.
    state_factory(config, shard_index) builds the shard state (default: ShardState).
    """
    if not 0 <= shard_index < config.num_shards:
        raise ValueError(f"shard index {shard_index} is outside 0..{config.num_shards - 1} (ps.num_shards)")
    host = bind or config.bind
    check_bind_auth(config, host, shard_index)
    token = load_token(config) if config.auth == "token" else None
    state = (state_factory or _default_state)(config, shard_index)
    _prime_malloc()
    server = ShardServer(config, shard_index, state, token)
    stop = stop or threading.Event()
    ctx = zmq.Context()
    authenticator = None
    sock = ctx.socket(zmq.ROUTER)
    old_handler = None
    try:
        sock.linger = 1000
        sock.maxmsgsize = config.max_frame_bytes + P.HEADER_SIZE
        sock.ipv6 = ":" in host
        if config.auth == "curve":
            authenticator = setup_server_curve(ctx, sock, config)
        sock.bind(_endpoint(host, port))
        address = _advertised(sock.getsockopt_string(zmq.LAST_ENDPOINT), host)
        if threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        logger.info("ps shard %d/%d serving at %s (%s mode, %d tables, auth %s, pid %d)", shard_index,
                    config.num_shards, address, config.mode, len(config.tables), config.auth, os.getpid())
        if ready_file:
            _write_ready(ready_file, address)
        run_loop(server, sock, stop)
        logger.info("ps shard %d stopping", shard_index)
    finally:
        server.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
        sock.close()
        if authenticator is not None:
            authenticator.stop()
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embedding_ps.server", description="serve one PS shard")
    parser.add_argument("--config", required=True, help="job config (TOML); its [ps] section is read")
    parser.add_argument("--shard", type=int, required=True, help="shard index in 0..ps.num_shards-1")
    parser.add_argument("--bind", default=None, help="address to bind (default ps.bind)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (0: an ephemeral one)")
    parser.add_argument("--ready-file", default=None, help="write the shard's address here once it serves")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format=f"%(asctime)s %(levelname)s ps{args.shard}: %(message)s")
    try:
        config = load_ps_config(Path(args.config))
        serve(config, args.shard, bind=args.bind, port=args.port, ready_file=args.ready_file)
    except (PSConfigError, AuthConfigError, ValueError) as e:
        logger.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
