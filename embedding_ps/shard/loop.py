"""The shard's socket loop: `serve`, the code behind `recsys ps --config job.toml --shard I [--bind ADDR]
[--port P] [--ready-file F]`, binds a ZeroMQ ROUTER socket and runs `run_loop` over a `ShardServer`
(`embedding_ps.shard.server`: decodes requests and encodes replies; no sockets there). The loop is one
thread and never blocks on a request: one that must wait (a sync-mode pull for a step whose predecessor
is not applied yet, an async pull too far ahead, a SAVE / LOAD during a background write) is parked and
handled again after a barrier or once the write ended.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import torch
import zmq

from embedding_ps.wire import protocol as P
from embedding_ps.wire.auth import check_bind_auth, is_loopback, load_token, setup_server_curve, setup_server_plain
from embedding_ps.wire.shm import REAP_S
from embedding_ps.wire.config import PSConfig
from embedding_ps.shard.server import DEFERRED, ShardServer, StateFactory, _buf
from embedding_ps.shard.state import ShardState

logger = logging.getLogger("embedding_ps.shard.server")

POLL_MS = 200
"""The loop wakes at least this often to notice a stop request (SIGTERM, stop())."""
BUSY_POLL_MS = 2
"""... and this often while a background save is written."""


def run_loop(server: ShardServer, sock: zmq.Socket, stop: threading.Event) -> None:
    """Serve until a SHUTDOWN request or `stop` is set. Parked requests are retried after barriers."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deferred: list[list] = []
    reaped = time.monotonic()
    while not (server.stopping or stop.is_set()):
        if deferred and server.wakeup():      # the background write ended: a parked SAVE / LOAD goes on
            deferred = _retry(server, sock, deferred)
        # while the saver works, wake often to notice the end of its write
        if not poller.poll(BUSY_POLL_MS if server.saver.busy else POLL_MS):
            if server.shm is not None and time.monotonic() - reaped > REAP_S:   # idle: segments of dead clients
                reaped = time.monotonic()
                if n := server.shm.reap():
                    logger.info("%s: removed %d shared-memory segments of clients that are gone", server.name, n)
            continue
        while not server.stopping:
            try:
                msg = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if not _serve(server, sock, msg):
                deferred.append(msg)
            elif deferred and (_op_of(msg) == P.Op.BARRIER or server.wakeup()):
                deferred = _retry(server, sock, deferred)


def _op_of(msg: list) -> int:
    buf = _buf(msg[1]) if len(msg) > 1 else b""
    return buf[6] if len(buf) == P.HEADER_SIZE else -1


def _serve(server: ShardServer, sock: zmq.Socket, msg: list) -> bool:
    """Handle request `msg` and send its reply; False when it is parked (DEFERRED) instead."""
    reply = server.handle(msg[1:])
    if reply is DEFERRED:
        return False
    sock.send_multipart([msg[0], *reply], copy=False)
    # zmq holds the frames now: the reply buffer is free once `reply` goes (on return)
    return True


def _retry(server: ShardServer, sock: zmq.Socket, deferred: list[list]) -> list[list]:
    """The parked requests that are still parked after one more try each."""
    return [msg for msg in deferred if not _serve(server, sock, msg)]


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port or '*'}" if ":" in host else f"tcp://{host}:{port or '*'}"


def _advertised(endpoint: str, host: str) -> str:
    """The address clients use: a wildcard bind is advertised under a name of this machine that is
    not a loopback one (its FQDN, else its host name, else an address its name resolves to), as
    clients on other hosts must reach it."""
    if host not in ("0.0.0.0", "*", "::"):
        return endpoint
    port = endpoint.rsplit(":", 1)[1]
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and not _loopback_name(name):
            return f"tcp://{name}:{port}"
    try:
        addrs = [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        addrs = []
    for addr in addrs:
        if not _loopback_name(addr):
            return f"tcp://{addr}:{port}"
    logger.warning("bound to %s, but this machine has no name or address other than a loopback one: clients "
                   "on other hosts cannot reach %s (bind a routable address instead)", host, endpoint)
    return f"tcp://127.0.0.1:{port}"


def _loopback_name(name: str) -> bool:
    """A loopback address (`auth.is_loopback`) or a local host name (`localhost.localdomain`, `ip6-localhost`)."""
    return is_loopback(name) or name.split(".")[0] in ("localhost", "ip6-localhost")


def _write_ready(path: str, address: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


def _prime_malloc() -> None:
    """Free one large block so glibc raises its mmap threshold (to ~30 MB) now, as it does after the
    first such free if one comes along. Below that threshold, request-sized blocks (zmq's receive
    buffers, push temporaries) come from the heap and are reused; above it each is a fresh mmap whose
    every page faults in again (the cost for a 100k-row d64 push: benchmarks/history/figures-from-the-code.md)."""
    torch.empty(30 << 20, dtype=torch.uint8)      # freed at once


class BindError(OSError):
    """The shard's address cannot be bound (a port in use, a host that is not this machine's); the
    message names the endpoint."""


def serve(config: PSConfig, shard_index: int, *, bind: str | None = None, port: int = 0,
          ready_file: str | None = None, state_factory: StateFactory | None = None,
          stop: threading.Event | None = None) -> None:
    """Serve shard `shard_index` of every table until SHUTDOWN, SIGTERM or `stop` is set (SIGTERM
    only without a `stop` of the caller's, who then handles signals).

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
    state = (state_factory or ShardState)(config, shard_index)
    _prime_malloc()
    server = ShardServer(config, shard_index, state, token, bind=host)
    own_stop = stop is None              # a caller's `stop` comes with the caller's signal handling
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
        elif token is not None:
            authenticator = setup_server_plain(ctx, sock, token)
        try:
            sock.bind(_endpoint(host, port))
        except zmq.ZMQError as e:      # e.g. "Address already in use": one line naming it, not a traceback
            raise BindError(f"ps shard {shard_index}: cannot bind {_endpoint(host, port)}: {e} "
                            f"(--port / --bind, ps.bind)") from None
        address = _advertised(sock.getsockopt_string(zmq.LAST_ENDPOINT), host)
        if own_stop and threading.current_thread() is threading.main_thread():
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


__all__ = ["BUSY_POLL_MS", "POLL_MS", "BindError", "run_loop", "serve"]
