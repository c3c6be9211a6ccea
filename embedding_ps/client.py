"""PS client: scatter ids by shard -> one request per shard, all in flight -> gather in caller order.

    with PSClient(config, addresses, worker_id=rank) as ps:
        rows = ps.pull(0, ids)                 # ids int64 [N] (duplicates fine) -> float32 [N, D]
        fut = ps.pull_async(0, next_ids)       # prefetch: a Future of float32 [N', D]
        ps.push(0, ids, grads)                 # grads float32 [N, D]; duplicates are summed
        ps.barrier(step)                       # sync mode: "this worker is done with `step`"

A background I/O thread owns one DEALER socket per shard (zmq sockets are not thread-safe): the
caller's thread deduplicates (`torch.unique`), routes (`sharding.route`, argsort + bincount, no
loop per id) and encodes; the I/O thread sends, matches replies by request id, retries and
assembles the result. Rows and gradients travel as ps.wire_dtype (fp32, fp16 or bf16).

Timeouts and retries: a request unanswered for ps.timeout_s is sent again, up to ps.retries
times, then its future fails with ShardUnavailableError naming the shard index and address. A
retried push or barrier keeps its request id, and the shard answers a repeat from its replay cache,
so it is never applied twice. A shard's error reply fails the future with PSRequestError at once
(no retry). In sync mode a pull may be held by the shard until the slowest worker's barrier: set
ps.timeout_s above the longest step of the slowest worker.

Step: every request carries the client's step (`step`, default 0); `barrier(t)` sets it to t + 1,
so a trainer that calls pull/push/barrier in order needs no step arguments (see embedding_ps.server
for the sync contract).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from embedding_ps import protocol as P
from embedding_ps.auth import load_token, setup_client_curve
from embedding_ps.config import PSConfig
from embedding_ps.multi_client import MultiTableOps
from embedding_ps.sharding import route
from embedding_ps.snapshot import shard_dir

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0


class ShardUnavailableError(ConnectionError):
    """A shard did not answer within ps.timeout_s after ps.retries retries."""

    def __init__(self, shard: int, address: str, message: str) -> None:
        super().__init__(f"ps shard {shard} at {address}: {message}")
        self.shard, self.address = shard, address


class PSRequestError(RuntimeError):
    """A shard refused or failed a request (an error reply); the message is the shard's."""

    def __init__(self, shard: int, address: str, op: str, status: int, message: str) -> None:
        try:
            name = P.Status(status).name
        except ValueError:
            name = str(status)
        super().__init__(f"{op} to ps shard {shard} at {address} failed ({name}): {message}")
        self.shard, self.address, self.status = shard, address, status


class SaveFailedError(RuntimeError):
    """A shard's save failed (or its last save is not the one waited for); names shard and address."""

    def __init__(self, shard: int, address: str, message: str) -> None:
        super().__init__(f"ps shard {shard} at {address}: {message}")
        self.shard, self.address = shard, address


class SaveTimeoutError(TimeoutError):
    """A shard still wrote its background save when `wait_saved` gave up; names shard and address."""

    def __init__(self, shard: int, address: str, message: str) -> None:
        super().__init__(f"ps shard {shard} at {address}: {message}")
        self.shard, self.address = shard, address


@dataclass(eq=False)
class _Call:
    """One client operation: a request to each of several shards, one future."""

    op: P.Op
    future: Future
    finish: Callable[[dict[int, tuple[P.Header, list]]], Any]
    waiting: int = 0
    parts: dict[int, tuple[P.Header, list]] = field(default_factory=dict)


@dataclass(eq=False)
class _Request:
    call: _Call
    shard: int
    request: int
    frames: list
    attempts: int = 0
    deadline: float = 0.0


class _IOThread(threading.Thread):
    """Owns the sockets: sends requests, receives replies, retries, completes futures."""

    def __init__(self, config: PSConfig, addresses: Sequence[str], num_threads: int) -> None:
        super().__init__(name="ps-client-io", daemon=True)
        self.num_threads = num_threads
        self.config, self.addresses = config, list(addresses)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.pending: dict[int, _Request] = {}
        self.dead: BaseException | None = None

    def submit(self, item: Any) -> None:
        if self.dead is not None:
            raise RuntimeError(f"PSClient I/O thread is gone: {self.dead!r}")
        self.inbox.put(item)
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass   # the pipe is full: the thread is going to wake up anyway

    def _socket(self, shard: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        if self.config.auth == "curve":
            setup_client_curve(sock, self.config)
        sock.connect(self.addresses[shard])
        return sock

    def run(self) -> None:
        # OpenMP's thread count is per thread: without this a new thread uses every core
        torch.set_num_threads(self.num_threads)
        self.ctx = zmq.Context()
        self.socks = [self._socket(s) for s in range(len(self.addresses))]
        try:
            self._loop()
        except BaseException as e:  # never leave a caller waiting on a future forever
            self.dead = e
            logger.exception("PSClient I/O thread failed")
        finally:
            self.dead = self.dead or RuntimeError("PSClient closed")
            self._fail_all(self.dead)
            for sock in self.socks:
                sock.close(linger=0)
            self.ctx.term()
            os.close(self.wake_r)
            os.close(self.wake_w)

    def _loop(self) -> None:
        while True:
            poller = zmq.Poller()
            poller.register(self.wake_r, zmq.POLLIN)
            for sock in self.socks:
                poller.register(sock, zmq.POLLIN)
            while True:
                deadline = min((r.deadline for r in self.pending.values()), default=None)
                wait = None if deadline is None else max(0, int(1000 * (deadline - time.monotonic())) + 1)
                events = dict(poller.poll(wait))
                if self.wake_r in events:
                    os.read(self.wake_r, 4096)
                    if not self._take_inbox():
                        return
                for shard, sock in enumerate(self.socks):
                    if sock in events:
                        self._receive(shard, sock)
                if self._expire():
                    break   # a socket was replaced: rebuild the poller

    def _take_inbox(self) -> bool:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            for req in item:
                self.pending[req.request] = req
                self._send(req)

    def _send(self, req: _Request) -> None:
        req.attempts += 1
        req.deadline = time.monotonic() + self.config.timeout_s
        try:
            self.socks[req.shard].send_multipart(req.frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("ps shard %d at %s: send queue full; will retry %s", req.shard,
                           self.addresses[req.shard], req.call.op.name)

    def _receive(self, shard: int, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                header = P.unpack_header(frames[0].buffer)
            except P.ProtocolError as e:
                logger.warning("ps shard %d at %s: dropped a malformed reply: %s", shard,
                               self.addresses[shard], e)
                continue
            req = self.pending.pop(header.request, None)
            if req is None or req.shard != shard or req.call.future.done():
                continue   # the late answer to a retried request
            call = req.call
            if header.status != P.Status.OK:
                text = bytes(frames[1].buffer).decode("utf-8", "replace") if len(frames) > 1 else ""
                self._fail(call, PSRequestError(shard, self.addresses[shard], call.op.name, header.status, text))
                continue
            call.parts[shard] = (header, [f.buffer for f in frames[1:]])
            call.waiting -= 1
            if call.waiting == 0:
                try:
                    call.future.set_result(call.finish(call.parts))
                except Exception as e:   # a reply that does not fit its request
                    call.future.set_exception(e)

    def _expire(self) -> bool:
        now = time.monotonic()
        replaced = False
        for req in [r for r in self.pending.values() if r.deadline <= now]:
            if req.call.future.done():
                self.pending.pop(req.request, None)
            elif req.attempts <= self.config.retries:
                logger.warning("ps shard %d at %s: no reply to %s in %g s; retry %d of %d", req.shard,
                               self.addresses[req.shard], req.call.op.name, self.config.timeout_s,
                               req.attempts, self.config.retries)
                self._send(req)
            else:
                err = ShardUnavailableError(
                    req.shard, self.addresses[req.shard],
                    f"no reply to {req.call.op.name} after {req.attempts} attempt(s) of {self.config.timeout_s:g} s "
                    f"(ps.timeout_s = {self.config.timeout_s:g}, ps.retries = {self.config.retries})")
                self._fail(req.call, err)
                # drop what is queued for the dead peer so it is not delivered if the shard returns
                self.socks[req.shard].close(linger=0)
                self.socks[req.shard] = self._socket(req.shard)
                replaced = True
        return replaced

    def _fail(self, call: _Call, err: BaseException) -> None:
        for key in [k for k, r in self.pending.items() if r.call is call]:
            del self.pending[key]
        if not call.future.done():
            call.future.set_exception(err)

    def _fail_all(self, err: BaseException) -> None:
        calls = {id(r.call): r.call for r in self.pending.values()}
        self.pending.clear()
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            for req in item or ():
                calls[id(req.call)] = req.call
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(err)


@dataclass(frozen=True, slots=True)
class _Plan:
    """How a request's ids [N] travel: the ids sent, grouped by shard, and the way back.

    With dedup, `gather` [N] maps each caller position to its unique id's position in `sent`
    (rows come back with one index_select; grads are summed with one index_add_). Without,
    `place` [N] is the caller position of each sent id (None: the same order, one shard).
    """

    sent: torch.Tensor                 # int64 [U] ids grouped by shard (U = N without dedup)
    counts: list[int]                  # [S] ids per shard
    gather: torch.Tensor | None        # int64 [N] (dedup) or None
    place: torch.Tensor | None         # int64 [U] (no dedup, several shards) or None


class PSClient(MultiTableOps):
    """Pull rows from / push gradients to every PS shard. See the module docstring.

    pull_many_async / push_many_async (from MultiTableOps): several tables in one request per shard.

    addresses: `tcp://host:port` of shard 0..S-1. worker_id: this trainer's rank (sync mode).
    dedup: deduplicate ids before sending (sort + inverse). A caller whose ids are already unique
    (the sparse arch) passes False and saves a sort per request; duplicates stay correct either way
    (the shard sums duplicate gradients), they only cost wire bytes.
    """

    def __init__(self, config: PSConfig, addresses: Sequence[str], worker_id: int = 0, *,
                 dedup: bool = True) -> None:
        if len(addresses) != config.num_shards:
            raise ValueError(f"PSClient: {len(addresses)} addresses for ps.num_shards = {config.num_shards}")
        if not 0 <= worker_id < 2**32:
            raise ValueError(f"PSClient: worker_id must be in [0, 2**32), got {worker_id}")
        self.config, self.addresses, self.worker_id = config, list(addresses), worker_id
        self.step = 0
        self.dedup = dedup
        self.wire = P.WIRE_DTYPES[config.wire_dtype]
        self._token = load_token(config) if config.auth == "token" else b""
        self._client = secrets.randbits(64)
        self._ids = itertools.count(1)
        self._pushes: set[Future] = set()
        self._lock = threading.Lock()
        self._io = _IOThread(config, self.addresses, torch.get_num_threads())
        self._io.start()
        self._closed = False

    # -- rows -----------------------------------------------------------------------------------

    def pull_async(self, table: int, ids: torch.Tensor, step: int | None = None) -> "Future[torch.Tensor]":
        """A Future of float32 rows [N, D] of int64 ids [N] (any order, duplicates fine)."""
        dim = self._table(table).dim
        ids = self._check_ids(table, ids)
        if ids.numel() == 0:
            return _done(torch.empty(0, dim))
        plan = self._plan(table, ids)
        reqs = []
        for shard, chunk in self._chunks(plan, plan.sent):
            self._check_size("pull", table, shard, chunk.numel(), dim)
            h = self._header(P.Op.PULL, table, step, dtype=self.wire, count=chunk.numel(), dim=dim)
            reqs.append((shard, h, [P.tensor_frame(chunk)]))
        return self._submit(P.Op.PULL, reqs, lambda parts: self._assemble(plan, parts, dim))

    def pull(self, table: int, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """float32 rows [N, D] of int64 ids [N]."""
        return self._wait(self.pull_async(table, ids, step))

    def push_async(self, table: int, ids: torch.Tensor, grads: torch.Tensor,
                   step: int | None = None) -> "Future[None]":
        """Send float32 grads [N, D] of ids [N]; rows of duplicate ids get the sum. Future of None."""
        dim = self._table(table).dim
        ids = self._check_ids(table, ids)
        if grads.dim() != 2 or grads.shape != (ids.numel(), dim) or not grads.is_floating_point():
            raise ValueError(f"push to table {table}: grads must be float [{ids.numel()}, {dim}], got "
                             f"{grads.dtype} {list(grads.shape)}")
        if ids.numel() == 0:
            return _done(None)
        plan = self._plan(table, ids)
        grads = grads.detach().to("cpu", torch.float32)
        if plan.gather is not None:        # sum the grads of duplicates into shard order
            sent = torch.zeros(plan.sent.numel(), dim).index_add_(0, plan.gather, grads)   # [U, D]
        else:
            sent = grads if plan.place is None else grads.index_select(0, plan.place)       # [N, D]
        wire = P.to_wire(sent, self.wire)
        reqs = []
        for (shard, chunk), (_, g) in zip(self._chunks(plan, plan.sent), self._chunks(plan, wire)):
            self._check_size("push", table, shard, chunk.numel(), dim)
            h = self._header(P.Op.PUSH, table, step, dtype=self.wire, count=chunk.numel(), dim=dim)
            reqs.append((shard, h, [P.tensor_frame(chunk), P.tensor_frame(g)]))
        fut = self._submit(P.Op.PUSH, reqs, lambda parts: None)
        with self._lock:
            self._pushes.add(fut)
        fut.add_done_callback(self._push_done)
        return fut

    def push(self, table: int, ids: torch.Tensor, grads: torch.Tensor, step: int | None = None) -> None:
        self._wait(self.push_async(table, ids, grads, step))

    # -- whole-shard operations -----------------------------------------------------------------

    def barrier(self, step: int) -> None:
        """Wait for this client's pushes, tell every shard this worker is done with `step`.

        Sets `self.step = step + 1`. Sync mode: the shards apply step `step` once every worker
        has called barrier(step); async mode: reports progress (for ps.max_staleness).
        """
        with self._lock:
            pushes = list(self._pushes)
        for fut in pushes:
            self._wait(fut)
        self._broadcast(P.Op.BARRIER, step=step)
        self.step = step + 1

    def barrier_async(self, step: int) -> "Future[list]":
        """`barrier(step)` without waiting for this client's pushes or the shards' replies.

        For async mode, where the barrier only reports progress: each shard serves one
        connection's requests in order, so it sees this worker's pushes of `step` before the
        barrier (unless a push had to be retried after a timeout). Sets `self.step = step + 1`.
        """
        fut = self._broadcast_async(P.Op.BARRIER, step=step)
        self.step = step + 1
        return fut

    def stats(self) -> list[dict]:
        """Per shard (in shard order): request counts, errors, sync state and `ShardState.stats()`."""
        return self._broadcast(P.Op.STATS)

    def health(self) -> list[dict]:
        return self._broadcast(P.Op.HEALTH)

    def save(self, directory: str, step: int | None = None, background: bool = False) -> list[dict]:
        """Every shard saves its state under `directory`/shard<i> (a path on the shards' machine).

        step: the request's step (default `self.step`); in sync mode each shard first applies
        every step < `step`. background=False: returns once every shard has written its files,
        [{"shard", "directory", "background": False, "write_s", "bytes"}, ...]. background=True:
        returns once every shard has copied its state (the consistent cut; pushes after it are
        not in the save): [{"shard", "directory", "snapshot_s", "background": True}, ...], while
        the shards write in the background: `wait_saved(directory, timeout_s)` before relying on it.
        A shard still writing an earlier background save finishes that one first.
        """
        flags = P.FLAG_BACKGROUND if background else 0
        return self._broadcast(P.Op.SAVE, step=step, text=directory, flags=flags)

    def prepare_save(self) -> "Future[list]":
        """Ask every shard to fault in the memory of its next background snapshot now, on a thread
        (replies at once: [{"shard", "prepared", "phase"}, ...]), so that the save itself only copies."""
        return self._broadcast_async(P.Op.SAVE, text="prepare", flags=P.FLAG_PREPARE)

    def save_status(self) -> list[dict]:
        """Per shard, the last save: {"shard", "directory", "state": "none" | "writing" | "done" |
        "failed", "error", "write_s", "bytes", "snapshot_s", "background", "step"}."""
        return self._broadcast(P.Op.SAVE_STATUS)

    def wait_saved(self, directory: str, timeout_s: float) -> list[dict]:
        """Poll `save_status` until every shard's last save is `directory` and done; returns the statuses.

        Raises SaveFailedError naming the shard index and address if a shard's write failed or its
        last save is another directory, SaveTimeoutError if one still writes after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            statuses = self.save_status()
            writing = []
            for s, st in enumerate(statuses):
                want = shard_dir(directory, s)
                if st["directory"] != want:
                    raise SaveFailedError(s, self.addresses[s], f"its last save is {st['directory']!r} "
                                          f"({st['state']}), not {want!r}")
                if st["state"] == "failed":
                    raise SaveFailedError(s, self.addresses[s], f"save to {want} failed: {st['error']}")
                if st["state"] != "done":
                    writing.append(s)
            if not writing:
                return statuses
            left = deadline - time.monotonic()
            if left <= 0:
                s = writing[0]
                raise SaveTimeoutError(s, self.addresses[s], f"save to {shard_dir(directory, s)} still "
                                       f"{statuses[s]['state']} after {timeout_s:g} s")
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.25)

    def load(self, directory: str) -> list[dict]:
        """Every shard loads its state from `directory`."""
        return self._broadcast(P.Op.LOAD, text=directory)

    def sweep(self, step: int) -> list[dict]:
        """Every shard drops rows past their TTL as of `step`; returns `ShardState.sweep` per shard."""
        return self._broadcast(P.Op.SWEEP, step=step)

    def shutdown(self) -> None:
        """Ask every shard process to exit (after replying)."""
        self._broadcast(P.Op.SHUTDOWN)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._io.is_alive():
            self._io.submit(None)
            self._io.join(CLOSE_TIMEOUT_S)
            if self._io.is_alive():
                logger.warning("PSClient I/O thread did not stop within %g s", CLOSE_TIMEOUT_S)

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _table(self, table: int):
        if not 0 <= table < len(self.config.tables):
            raise ValueError(f"table {table} is outside 0..{len(self.config.tables) - 1} (ps.tables)")
        return self.config.tables[table]

    @staticmethod
    def _check_ids(table: int, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"table {table}: ids must be int64 [N], got {ids.dtype} {list(ids.shape)}")
        return ids.detach().cpu()

    def _plan(self, table: int, ids: torch.Tensor) -> _Plan:
        """Dedup ids [N] (if self.dedup) and group them by shard: argsort + bincount, no loop."""
        n = self.config.num_shards
        if self.dedup:
            ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)   # [U], [N]
        if n == 1:
            return _Plan(ids, [ids.numel()], inverse if self.dedup else None, None)
        shard = route(ids, self.config.tables[table], n)                        # [U]
        order = torch.argsort(shard, stable=True)                               # [U]
        counts = torch.bincount(shard, minlength=n).tolist()
        if not self.dedup:
            return _Plan(ids[order], counts, None, order)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel())                                # unique index -> sent position
        return _Plan(ids[order], counts, pos[inverse], None)

    @staticmethod
    def _chunks(plan: _Plan, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        parts = torch.split(t, plan.counts)
        return [(s, part) for s, part in enumerate(parts) if part.shape[0] > 0]

    def _assemble(self, plan: _Plan, parts: dict[int, tuple[P.Header, list]], dim: int) -> torch.Tensor:
        """Replies of every shard -> float32 rows [N, D] in the caller's order."""
        replies = []                                                            # (shard, rows [n_s, D])
        for shard, count in enumerate(plan.counts):
            if count == 0:
                continue
            header, payload = parts[shard]
            what = f"PULL reply of ps shard {shard}"
            if len(payload) != 1:
                raise P.ProtocolError(f"{what} has {len(payload)} payload frames, not 1")
            dtype = P.row_dtype(header.dtype, what)
            P.expect_bytes(what, len(payload[0]), count * dim, P.ITEM_SIZE[dtype], 1 << 62)
            replies.append(P.frame_tensor(payload[0], dtype, count, dim))
        if len(replies) == 1 and plan.place is None:
            rows = replies[0].float()                          # one shard: no copy for fp32 (the frame)
        elif plan.place is None:
            rows = torch.cat(replies).float()                  # [U, D] in sent order
        else:                                                  # no dedup: straight to caller order
            rows = torch.empty(plan.sent.numel(), dim)
            for place, part in zip(torch.split(plan.place, [c for c in plan.counts if c]), replies):
                rows.index_copy_(0, place, part.float())
            return rows
        return rows if plan.gather is None else rows.index_select(0, plan.gather)   # [N, D]

    def _check_size(self, op: str, table: int, shard: int, count: int, dim: int) -> None:
        """Refuse a request whose rows frame would pass ps.max_frame_bytes (the shard drops those)."""
        size = count * dim * P.ITEM_SIZE[self.wire]
        if size > self.config.max_frame_bytes:
            raise ValueError(f"{op} of {count} rows of table {table} (dim {dim}) to ps shard {shard} at "
                             f"{self.addresses[shard]} is {size} bytes, over ps.max_frame_bytes = "
                             f"{self.config.max_frame_bytes}; split the ids")

    def _header(self, op: P.Op, table: int = 0, step: int | None = None, **fields: int) -> P.Header:
        return P.Header(op=op, table=table, step=self.step if step is None else step, worker=self.worker_id,
                        client=self._client, request=next(self._ids), **fields)

    def _submit(self, op: P.Op, reqs: list[tuple[int, P.Header, list]],
                finish: Callable[[dict], Any]) -> Future:
        if self._closed:
            raise RuntimeError("PSClient is closed")
        call = _Call(op, Future(), finish, waiting=len(reqs))
        items = [_Request(call, shard, h.request, [h.pack(), self._token, *payload]) for shard, h, payload in reqs]
        self._io.submit(items)
        return call.future

    def _broadcast(self, op: P.Op, step: int | None = None, text: str | None = None, flags: int = 0) -> list:
        return self._wait(self._broadcast_async(op, step, text, flags))

    def _broadcast_async(self, op: P.Op, step: int | None = None, text: str | None = None,
                         flags: int = 0) -> Future:
        payload = [] if text is None else [P.text_frame(text)]
        reqs = [(s, self._header(op, step=step, dtype=P.DType.BYTES if text else P.DType.NONE,
                                 count=len(payload[0]) if text else 0, flags=flags), payload)
                for s in range(self.config.num_shards)]

        def finish(parts: dict[int, tuple[P.Header, list]]) -> list:
            return [json.loads(bytes(parts[s][1][0])) if parts[s][1] else None for s in range(len(reqs))]

        return self._submit(op, reqs, finish)

    def _wait(self, fut: Future) -> Any:
        # the I/O thread fails every future by its deadline; this bound only guards against a bug
        return fut.result(timeout=self.config.timeout_s * (self.config.retries + 1) + 30.0)

    def _push_done(self, fut: Future) -> None:
        with self._lock:
            self._pushes.discard(fut)


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


__all__ = ["PSClient", "ShardUnavailableError", "PSRequestError", "SaveFailedError", "SaveTimeoutError"]
