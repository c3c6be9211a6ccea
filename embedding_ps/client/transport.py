"""The PS client's transport: one I/O thread owning a DEALER socket per shard.

The caller's thread builds the requests (`embedding_ps.client.client.PSClient`); `IOThread` sends them,
matches replies by request id, retries or fails them (the client's module docstring, "Timeouts and
retries"), and completes a `Call` (one future over requests to several shards) once every shard
answered. A request through shared memory that its shard answers with NO_SHM is sent again, once,
as its `fallback` builds it (the rows in a frame).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from embedding_ps.wire import protocol as P
from embedding_ps.wire.auth import setup_client_curve, setup_client_plain
from embedding_ps.wire.config import PSConfig

logger = logging.getLogger("embedding_ps.client.client")

HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)


class ShardError(Exception):
    """Base of the errors that name one shard: "ps shard {shard} at {address}: {message}", with
    .shard and .address. Each subclass also keeps its own builtin base (RuntimeError, TimeoutError,
    ConnectionError) for `except` clauses."""

    def __init__(self, shard: int, address: str, message: str) -> None:
        super().__init__(f"ps shard {shard} at {address}: {message}")
        self.shard, self.address = shard, address


class ShardUnavailableError(ShardError, ConnectionError):
    """A shard did not answer within ps.timeout_s after ps.retries retries."""


class PSRequestError(RuntimeError):
    """A shard refused or failed a request (an error reply); the message is the shard's."""

    def __init__(self, shard: int, address: str, op: str, status: int, message: str) -> None:
        try:
            name = P.Status(status).name
        except ValueError:
            name = str(status)
        super().__init__(f"{op} to ps shard {shard} at {address} failed ({name}): {message}")
        self.shard, self.address, self.status = shard, address, status


@dataclass(eq=False)
class Call:
    """One client operation: a request to each of several shards, one future."""

    op: P.Op
    future: Future
    finish: Callable[[dict[int, tuple[P.Header, list]]], Any]
    waiting: int = 0
    parts: dict[int, tuple[P.Header, list]] = field(default_factory=dict)
    retried: bool = False  # a request was sent again: the shard may answer an attempt late


@dataclass(eq=False)
class Request:
    call: Call
    shard: int
    request: int
    frames: list
    attempts: int = 0
    deadline: float = 0.0
    # FLAG_SHM requests: fallback(shard's message) -> (request id, frames) of the same request through the socket
    fallback: Callable[[str], tuple[int, list]] | None = None


class IOThread(threading.Thread):
    """Owns the sockets: sends requests, receives replies, retries, completes futures."""

    def __init__(self, config: PSConfig, addresses: Sequence[str], token: bytes) -> None:
        super().__init__(name="ps-client-io", daemon=True)
        self.num_threads, self.token = torch.get_num_threads(), token   # the creating thread's
        self.config, self.addresses = config, list(addresses)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.pending: dict[int, Request] = {}
        self.dead: BaseException | None = None

    def submit(self, item: Any, wake: bool = True) -> None:
        """Queue `item` (requests, or None: stop). wake=False: the caller writes a byte to `wake_w`
        itself, soon (e.g. from C with the GIL released, `native.copy_finite`)."""
        if self.dead is not None:
            raise RuntimeError(f"PSClient I/O thread is gone: {self.dead!r}")
        self.inbox.put(item)
        if wake:
            self.wake()

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:
            pass   # the pipe is full: the thread is going to wake up anyway

    def _socket(self, shard: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        if self.config.auth == "curve":
            setup_client_curve(sock, self.config)
        elif self.token:
            setup_client_plain(sock, self.token)
        # a refused handshake (wrong token or keys, or none where the shard wants them) fails the
        # shard's requests at once with a line saying so, instead of timing out on silence
        self.monitors[shard] = sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self.refused[shard] = None
        sock.connect(self.addresses[shard])
        return sock

    def _close_socket(self, shard: int) -> None:
        self.socks[shard].disable_monitor()
        self.monitors[shard].close(linger=0)
        self.socks[shard].close(linger=0)

    def _handshake(self, shard: int) -> None:
        """Note whether `shard` accepted the last handshake; when it refused it, fail the requests waiting
        on it (and, until a handshake succeeds, those sent to it: `_send`)."""
        while True:
            try:
                event = recv_monitor_message(self.monitors[shard], zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused[shard] = self.failed_handshake[shard] = None
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # also a shard going away mid-handshake: only said if its requests then time out
                self.failed_handshake[shard] = (f"; its last handshake failed: does it require ps.auth = 'token' "
                                                f"or 'curve' (this client: {self.config.auth!r})?")
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = ("it refused this client's credentials (a wrong token in ps.token_file, or CURVE keys "
                       "it does not accept)")
            else:
                why = (f"the handshake failed (ZMTP error {int(event['value']):#x}): the shard and this client "
                       f"disagree on ps.auth (this client: {self.config.auth!r})")
            self.refused[shard] = why
            for req in [r for r in self.pending.values() if r.shard == shard]:
                self._refuse(req)

    def _refuse(self, req: Request) -> None:
        self._fail(req.call, PSRequestError(req.shard, self.addresses[req.shard], req.call.op.name,
                                            P.Status.UNAUTHORIZED, self.refused[req.shard]))

    def run(self) -> None:
        # OpenMP's thread count is per thread: without this a new thread uses every core
        torch.set_num_threads(self.num_threads)
        self.ctx = zmq.Context()
        self.monitors: list[zmq.Socket | None] = [None] * len(self.addresses)
        self.refused: list[str | None] = [None] * len(self.addresses)
        self.failed_handshake: list[str | None] = [None] * len(self.addresses)
        self.socks = [self._socket(s) for s in range(len(self.addresses))]
        try:
            self._loop()
        except BaseException as e:  # never leave a caller waiting on a future forever
            self.dead = e
            logger.exception("PSClient I/O thread failed")
        finally:
            self.dead = self.dead or RuntimeError("PSClient closed")
            self._fail_all(self.dead)
            for shard in range(len(self.socks)):
                self._close_socket(shard)
            self.ctx.term()
            os.close(self.wake_r)
            os.close(self.wake_w)

    def _loop(self) -> None:
        while True:
            poller = zmq.Poller()
            for polled in [self.wake_r, *self.socks, *self.monitors]:
                poller.register(polled, zmq.POLLIN)
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
                    if self.monitors[shard] in events:
                        self._handshake(shard)
                if self._expire():
                    break   # a socket was replaced: rebuild the poller

    def _take_inbox(self) -> bool:
        while not self.inbox.empty():       # this thread alone takes from it
            item = self.inbox.get_nowait()
            if item is None:
                return False
            for req in item:
                self._send(req)
        return True

    def _send(self, req: Request) -> None:
        self.pending[req.request] = req
        if self.refused[req.shard] is not None:
            self._refuse(req)
            return
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
            if header.status == P.Status.NO_SHM and req.fallback is not None:
                # resent under a new request id: a late NO_SHM of a retry of the old one is dropped
                try:
                    req.request, req.frames = req.fallback(_reply_text(frames))
                except Exception as e:  # noqa: BLE001 - never leave the caller waiting
                    self._fail(call, e)
                    continue
                req.fallback, req.attempts = None, 0
                self._send(req)
                continue
            if header.status != P.Status.OK:
                self._fail(call, PSRequestError(shard, self.addresses[shard], call.op.name, header.status,
                                                _reply_text(frames)))
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
                req.call.retried = True
                self._send(req)
            else:
                err = ShardUnavailableError(
                    req.shard, self.addresses[req.shard],
                    f"no reply to {req.call.op.name} after {req.attempts} attempt(s) of {self.config.timeout_s:g} s "
                    f"(ps.timeout_s = {self.config.timeout_s:g}, ps.retries = {self.config.retries})"
                    f"{self.failed_handshake[req.shard] or ''}")
                self._fail(req.call, err)
                # drop what is queued for the dead peer so it is not delivered if the shard returns
                self._close_socket(req.shard)
                self.socks[req.shard] = self._socket(req.shard)
                replaced = True
        return replaced

    def _fail(self, call: Call, err: BaseException) -> None:
        for key in [k for k, r in self.pending.items() if r.call is call]:
            del self.pending[key]
        if not call.future.done():
            call.future.set_exception(err)

    def _fail_all(self, err: BaseException) -> None:
        calls = {r.call for r in self.pending.values()}     # a Call hashes by identity (eq=False)
        self.pending.clear()
        while not self.inbox.empty():
            calls.update(req.call for req in self.inbox.get_nowait() or ())
        for call in calls:
            self._fail(call, err)


def _reply_text(frames: list) -> str:
    """The text of an error reply (its frame after the header; "" without one)."""
    return bytes(frames[1].buffer).decode("utf-8", "replace") if len(frames) > 1 else ""


__all__ = ["IOThread", "Call", "Request", "ShardError", "ShardUnavailableError", "PSRequestError"]
