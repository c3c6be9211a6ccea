"""Background SAVE through `ShardServer.handle` (no sockets): reply at once after the snapshot, status
writing -> done / failed, the shard serves while the write runs, a second SAVE or a LOAD waits for it,
and in sync mode the (copy-on-write) snapshot is exactly the state after the steps before the SAVE's
step, with the steps after it applied while it is written."""

import json
import threading

import torch

from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.server import DEFERRED, ShardServer
from embedding_ps.shard.state import ShardState, verify_shard
from embedding_ps.shard.snapshot import shard_dir
from tests.unit.embedding_ps.test_protocol import StateStubs

D = 4
TIMEOUT_S = 20.0


class GatedSnapshot:
    prepare_s = 0.0

    def __init__(self, state: "GatedState") -> None:
        self.state, self.snapshot_s, self.nbytes = state, 0.001, 123

    def stats(self) -> dict:
        return {}

    def write(self, directory: str) -> dict:
        self.state.writing.set()
        if not self.state.gate.wait(TIMEOUT_S):
            raise TimeoutError("test gate never opened")
        if self.state.fail:
            raise OSError(28, "No space left on device")
        self.state.written.append(directory)
        return {"directory": directory, "bytes": 123, "write_s": 0.5}


class GatedState(StateStubs):
    """Rows are zeros; a snapshot's write blocks until `gate` is set (and raises if `fail`)."""

    def __init__(self) -> None:
        self.gate, self.writing = threading.Event(), threading.Event()
        self.fail = False
        self.written: list[str] = []
        self.pushes = 0

    def pull(self, table, ids, step=0, out=None):
        return torch.zeros(ids.numel(), D) if out is None else out.zero_()

    def push(self, table, ids, grads, step):
        self.pushes += 1

    def snapshot(self):
        return GatedSnapshot(self)

    def load(self, directory):
        self.loaded = directory

    def stats(self):
        return {}


def request(op, text=None, step=0, request=1, flags=0, worker=0):
    payload = [] if text is None else [text.encode()]
    h = P.Header(op=op, dtype=P.DType.BYTES if text else P.DType.NONE, count=len(payload[0]) if text else 0,
                 step=step, request=request, flags=flags, client=7, worker=worker)
    return [h.pack(), b"", *payload]


def body(reply) -> dict:
    h = P.unpack_header(reply[0])
    assert h.status == P.Status.OK, bytes(reply[1])
    return json.loads(bytes(reply[1]))


def save_bg(server, path, **kw):
    return server.handle(request(P.Op.SAVE, path, flags=P.FLAG_BACKGROUND, **kw))


def save_bg_ready(server, path, **kw):
    """A background SAVE of an idle shard: replies at once (nothing is prepared ahead)."""
    reply = save_bg(server, path, **kw)
    assert reply is not DEFERRED
    return reply


def status(server) -> dict:
    return body(server.handle(request(P.Op.SAVE_STATUS)))


def push(ids, step=0, worker=0, request=1, grad=1.0):
    ids = torch.tensor(ids, dtype=torch.int64)
    h = P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=1, dim=D, step=step, worker=worker, client=7,
                 request=request)
    index = torch.tensor([[0, ids.numel()]], dtype=torch.int64).numpy().tobytes()      # one part: table 0
    return [h.pack(), b"", index, ids.numpy().tobytes(), torch.full((ids.numel(), D), grad).numpy().tobytes()]


def pull(ids, step=0):
    ids = torch.tensor(ids, dtype=torch.int64)
    h = P.Header(op=P.Op.PULL, dtype=P.DType.FP32, count=1, dim=D, step=step, client=7)
    index = torch.tensor([[0, ids.numel()]], dtype=torch.int64).numpy().tobytes()
    return [h.pack(), b"", index, ids.numpy().tobytes()]


def gated_server() -> tuple[ShardServer, GatedState]:
    cfg = PSConfig(mode="async", tables=(TableConfig(name="t", dim=D),))
    state = GatedState()
    return ShardServer(cfg, 0, state), state


def test_background_save_replies_at_once_serves_while_writing_and_parks_the_next_save(tmp_path):
    server, state = gated_server()
    try:
        assert status(server)["state"] == "none"
        reply = body(save_bg_ready(server, "/ckpt/a", step=1))
        assert reply == {"shard": 0, "directory": "/ckpt/a/shard0", "snapshot_s": 0.001, "background": True}
        assert state.writing.wait(TIMEOUT_S)
        st = status(server)
        assert (st["state"], st["directory"], st["step"], st["background"]) == ("writing", "/ckpt/a/shard0", 1, True)
        assert P.unpack_header(server.handle(pull([1, 2]))[0]).status == P.Status.OK    # served meanwhile
        assert P.unpack_header(server.handle(push([1, 2]))[0]).status == P.Status.OK and state.pushes == 1
        assert save_bg(server, "/ckpt/b", request=2) is DEFERRED       # one write at a time
        assert server.handle(request(P.Op.LOAD, "/ckpt/a", request=3)) is DEFERRED
        assert not server.wakeup()
        state.gate.set()
        server.close(TIMEOUT_S)
        assert server.wakeup() and not server.wakeup()                 # once per finished write
        st = status(server)
        assert (st["state"], st["error"], st["bytes"], st["write_s"]) == ("done", None, 123, 0.5)
        assert body(save_bg_ready(server, "/ckpt/b", request=2))["directory"] == "/ckpt/b/shard0"   # the retry
        server.close(TIMEOUT_S)
        assert state.written == ["/ckpt/a/shard0", "/ckpt/b/shard0"]
        assert body(server.handle(request(P.Op.STATS)))["save"]["directory"] == "/ckpt/b/shard0"
    finally:
        state.gate.set()
        server.close(TIMEOUT_S)


def test_failed_background_write_is_reported_and_the_shard_keeps_serving():
    server, state = gated_server()
    try:
        state.fail = True
        state.gate.set()
        body(save_bg_ready(server, "/ckpt/a"))
        server.close(TIMEOUT_S)
        st = status(server)
        assert st["state"] == "failed" and st["error"] == "OSError: [Errno 28] No space left on device"
        assert P.unpack_header(server.handle(pull([1]))[0]).status == P.Status.OK
        state.fail = False
        body(save_bg_ready(server, "/ckpt/a", request=2))
        server.close(TIMEOUT_S)
        assert status(server)["state"] == "done"
    finally:
        state.gate.set()
        server.close(TIMEOUT_S)


def test_sync_mode_background_save_is_the_state_after_the_steps_before_it(tmp_path):
    """SAVE for step 1 waits until step 0 is applied; step 1, applied while the write may run, is not in it."""
    cfg = PSConfig(mode="sync", num_workers=2, tables=(TableConfig(name="t", dim=D, optimizer="rowwise_adagrad"),))
    state, replica = ShardState(cfg, 0), ShardState(cfg, 0)
    server = ShardServer(cfg, 0, state)
    path = str(tmp_path / "ckpt")
    try:
        for worker in (0, 1):
            reply = server.handle(push([1, 2, 3], step=0, worker=worker, request=10 + worker))
            assert P.unpack_header(reply[0]).status == P.Status.OK
        server.handle(request(P.Op.BARRIER, step=0, worker=0, request=20))
        assert save_bg(server, path, step=1, request=21) is DEFERRED   # step 0 still waits for worker 1
        server.handle(request(P.Op.BARRIER, step=0, worker=1, request=22))
        replica.push(0, torch.tensor([1, 2, 3, 1, 2, 3]), torch.ones(6, D), step=0)
        reply = body(save_bg(server, path, step=1, request=21))       # the parked SAVE, retried
        assert reply["background"] is True and status(server)["prepare_s"] == 0.0
        for worker in (0, 1):                                           # step 1, after the snapshot
            server.handle(push([3, 4], step=1, worker=worker, request=30 + worker, grad=-2.0))
            server.handle(request(P.Op.BARRIER, step=1, worker=worker, request=40 + worker))
        assert server.gate.last_applied == 1
        server.close(TIMEOUT_S)
        assert status(server)["state"] == "done"
        verify_shard(shard_dir(path, 0))
        restored = ShardState(cfg, 0)
        restored.load(shard_dir(path, 0))
        for a, b in zip(restored.dump_table(0), replica.dump_table(0)):
            if isinstance(a, dict):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            else:
                assert torch.equal(a, b)
        three = torch.tensor([3])
        assert not torch.equal(state.pull(0, three), restored.pull(0, three))     # step 1 moved id 3 on
        assert len(state.dump_table(0)[0]) == 4 and len(restored.dump_table(0)[0]) == 3
    finally:
        server.close(TIMEOUT_S)


def test_the_status_reports_the_bounded_memory(tmp_path):
    """A background SAVE replies at once, and its status reports the save's accounted extra memory and
    its bound."""
    cfg = PSConfig(mode="async", tables=(TableConfig(name="t", dim=64, optimizer="rowwise_adagrad"),))
    state, replica = ShardState(cfg, 0), ShardState(cfg, 0)
    server = ShardServer(cfg, 0, state)
    path = str(tmp_path / "ckpt")
    try:
        state.push(0, torch.arange(4000), torch.ones(4000, 64), step=0)
        replica.push(0, torch.arange(4000), torch.ones(4000, 64), step=0)
        reply = save_bg(server, path, step=1, request=4)
        assert reply is not DEFERRED and body(reply)["background"] is True
        server.close(TIMEOUT_S)
        st = status(server)
        assert st["state"] == "done" and st["prepare_s"] == 0.0
        rows_bytes = 4000 * (64 * 4 + 4 + 8)
        assert st["extra_bytes_bound"] == int(0.1 * rows_bytes)
        assert 0 < st["extra_bytes_peak"] <= st["extra_bytes_bound"] and st["push_wait_s"] == 0.0
        restored = ShardState(cfg, 0)
        restored.load(shard_dir(path, 0))
        assert torch.equal(restored.dump_table(0)[1], replica.dump_table(0)[1])
    finally:
        server.close(TIMEOUT_S)


def test_load_forgets_the_old_runs_steps(tmp_path):
    """Trainers restarted from a checkpoint (torchrun) LOAD it and go on from its step, which the
    shard had already applied before: after the LOAD those steps are accepted again."""
    cfg = PSConfig(mode="sync", num_workers=1, tables=(TableConfig(name="t", dim=D),))
    server = ShardServer(cfg, 0, ShardState(cfg, 0))
    path = str(tmp_path / "ckpt")
    body(server.handle(request(P.Op.SAVE, path, step=0, request=1)))
    for step in range(3):
        server.handle(push([1, 2], step=step, request=10 + step))
        server.handle(request(P.Op.BARRIER, step=step, request=20 + step))
    assert server.gate.last_applied == 2
    stale = server.handle(push([1], step=1, request=30))
    assert P.unpack_header(stale[0]).status == P.Status.STALE_STEP
    body(server.handle(request(P.Op.LOAD, path, request=31)))
    assert server.gate.last_applied == -1
    again = server.handle(push([1], step=1, request=32))
    assert P.unpack_header(again[0]).status == P.Status.OK
    server.close(TIMEOUT_S)
