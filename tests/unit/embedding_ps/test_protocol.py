"""Wire format, request validation, replay cache and sync-mode buffering, without sockets.

`ShardServer.handle(frames)` is the whole request path minus the socket, so malformed frames
are fed to it directly here; tests/integration/test_ps_protocol.py sends the same through a
real DEALER socket to a shard process.
"""

import ast
import json
import struct
from pathlib import Path

import pytest
import torch

from embedding_ps.wire import protocol as P
from embedding_ps.wire import shm
from embedding_ps.wire.auth import AuthConfigError, check_bind_auth, is_loopback
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.gates import StepBuffer
from embedding_ps.shard.server import DEFERRED, ShardServer

ROOT = Path(__file__).resolve().parents[3]
D = 4


class StateStubs:
    """The ShardStateLike members a test double has no use for: global decay's clock (advance) and the
    slot hints of late-grads pushes (hint_slots, clear_hints), as no-ops."""

    def advance(self, step):
        pass

    def hint_slots(self, table, ids):
        pass

    def clear_hints(self):
        pass


class DictState(StateStubs):
    """Stand-in ShardState: rows from (table, id), plain SGD with lr 1, records calls."""

    def __init__(self, config: PSConfig, shard: int = 0) -> None:
        self.config = config
        self.rows: dict[tuple[int, int], torch.Tensor] = {}
        self.pushes: list[tuple[int, list[int], torch.Tensor, int]] = []

    def _row(self, t: int, i: int) -> torch.Tensor:
        dim = self.config.tables[t].dim
        return self.rows.setdefault((t, i), torch.arange(dim, dtype=torch.float32) + 10 * i + 1000 * t)

    def pull(self, table, ids, step=0, out=None):
        dim = self.config.tables[table].dim
        rows = torch.stack([self._row(table, i) for i in ids.tolist()]) if ids.numel() else torch.empty(0, dim)
        return rows if out is None else out.copy_(rows)

    def push(self, table, ids, grads, step):
        self.pushes.append((table, ids.tolist(), grads.clone(), step))
        for i, g in zip(ids.tolist(), grads):
            self.rows[(table, i)] = self._row(table, i) - g

    def stats(self):
        return {"rows": len(self.rows)}

    def sweep(self, step):
        return {"dropped": 0, "step": step}

    def save(self, directory):
        self.saved = directory

    def load(self, directory):
        self.loaded = directory


def make(mode="async", workers=1, token=None, **kw) -> tuple[ShardServer, DictState]:
    cfg = PSConfig(mode=mode, num_workers=workers, tables=(TableConfig(name="a", dim=D),
                                                           TableConfig(name="b", dim=2)), **kw)
    state = DictState(cfg)
    return ShardServer(cfg, 0, state, token), state


def index_frame(parts) -> bytes:
    """The [T, 2] (table, count) index frame of a PULL / PUSH."""
    return torch.tensor(parts, dtype=torch.int64).numpy().tobytes()


def pull_req(ids, table=0, dim=D, step=0, request=1, dtype=P.DType.FP32, auth=b""):
    """A one-part PULL (one table)."""
    ids = torch.tensor(ids, dtype=torch.int64)
    h = P.Header(op=P.Op.PULL, dtype=dtype, count=1, dim=dim, step=step, client=7, request=request)
    return [h.pack(), auth, index_frame([[table, ids.numel()]]), ids.numpy().tobytes()]


def push_req(ids, grads, table=0, step=0, worker=0, request=1, dtype=P.DType.FP32):
    """A one-part PUSH (one table)."""
    ids = torch.tensor(ids, dtype=torch.int64)
    g = P.tensor_frame(grads.to(P.TORCH_DTYPES[dtype]))
    h = P.Header(op=P.Op.PUSH, dtype=dtype, count=1, dim=grads.shape[1], step=step, worker=worker, client=7,
                 request=request)
    return [h.pack(), b"", index_frame([[table, ids.numel()]]), ids.numpy().tobytes(), bytes(g)]


def barrier_req(step, worker, request):
    return [P.Header(op=P.Op.BARRIER, step=step, worker=worker, client=7, request=request).pack(), b""]


def status_of(reply) -> tuple[int, str]:
    h = P.unpack_header(reply[0])
    return h.status, bytes(reply[1]).decode() if h.status else ""


def rows_of(reply, count, dim=D) -> torch.Tensor:
    h = P.unpack_header(reply[0])
    assert h.status == P.Status.OK, bytes(reply[1])
    return P.frame_tensor(bytearray(reply[1]), P.DType(h.dtype), count, dim).float()


# ---------------------------------------------------------------------------------------------


def test_header_round_trip_and_size():
    h = P.Header(op=P.Op.PUSH, table=3, dtype=P.DType.BF16, count=2**40, dim=64, step=-5, worker=9,
                 client=2**64 - 1, request=12345, status=P.Status.BAD_VALUE, flags=1)
    b = h.pack()
    assert len(b) == P.HEADER_SIZE == 60
    assert P.unpack_header(b) == h
    assert b[:4] == b"EPS1"


@pytest.mark.parametrize("dtype", [P.DType.FP32, P.DType.FP16, P.DType.BF16, P.DType.INT64])
def test_tensor_frames_round_trip(dtype):
    t = (torch.randn(5, 3) * 100).to(P.TORCH_DTYPES[dtype])
    buf = bytearray(P.tensor_frame(t))
    assert len(buf) == t.numel() * P.ITEM_SIZE[dtype]
    assert torch.equal(P.frame_tensor(buf, dtype, 5, 3), t)


def test_header_errors():
    good = P.Header(op=P.Op.PULL).pack()
    with pytest.raises(P.ProtocolError, match="60 bytes, got 59"):
        P.unpack_header(good[:-1])
    with pytest.raises(P.ProtocolError, match="bad magic"):
        P.unpack_header(b"XXXX" + good[4:])
    with pytest.raises(P.ProtocolError, match="version 9 not supported"):
        P.unpack_header(good[:4] + struct.pack("<H", 9) + good[6:])


def test_a_version_1_peer_gets_a_clear_error():
    """Since version 2 one row path (multi-table PULL / PUSH); a version-1 request names both versions.
    Version 3 (late grads, notify): a version-2 peer is refused the same way."""
    assert P.VERSION == 3 and not hasattr(P.Op, "PULL_MULTI") and {int(P.Op.PULL), int(P.Op.PUSH)} == {11, 12}
    server, state = make()
    v1 = pull_req([1])[0][:4] + struct.pack("<H", 1) + pull_req([1])[0][6:]
    status, text = status_of(server.handle([v1, b"", bytes(16), bytes(8)]))
    assert status == P.Status.BAD_FRAME
    assert "protocol version 1 not supported (this side speaks 3)" in text and "same release" in text
    v2 = pull_req([1])[0][:4] + struct.pack("<H", 2) + pull_req([1])[0][6:]
    assert "protocol version 2 not supported (this side speaks 3)" in status_of(server.handle([v2, b"", bytes(16),
                                                                                              bytes(8)]))[1]
    old_pull = P.Header(op=1, dtype=P.DType.FP32, count=1, dim=D).pack()      # version 1's single-table op
    assert "unknown op 1" in status_of(server.handle([old_pull, b"", bytes(8)]))[1]


def test_pull_returns_rows_in_order_with_duplicates():
    server, state = make()
    rows = rows_of(server.handle(pull_req([5, 1, 5])), 3)
    assert torch.equal(rows, torch.stack([state._row(0, 5), state._row(0, 1), state._row(0, 5)]))


@pytest.mark.parametrize("wire", [P.DType.FP16, P.DType.BF16])
def test_pull_and_push_in_half_precision(wire):
    server, state = make()
    rows = rows_of(server.handle(pull_req([2, 3], dtype=wire)), 2)
    assert torch.equal(rows, state.pull(0, torch.tensor([2, 3]), 0).to(P.TORCH_DTYPES[wire]).float())
    g = torch.full((1, D), 0.5)
    assert status_of(server.handle(push_req([2], g, dtype=wire)))[0] == P.Status.OK
    assert torch.equal(state.pushes[0][2], g)


BAD_CASES = {
    "one frame": lambda: [P.Header(op=P.Op.PULL).pack()],
    "truncated header": lambda: [pull_req([1])[0][:30], b"", b""],
    "wrong magic": lambda: [b"\0\0\0\0" + pull_req([1])[0][4:], b"", bytes(8)],
    "wrong version": lambda: [pull_req([1])[0][:4] + b"\x01\x00" + pull_req([1])[0][6:], b"", bytes(16), bytes(8)],
    "unknown op": lambda: [P.Header(op=77).pack(), b""],
    "missing payload": lambda: pull_req([1, 2])[:2],
    "extra frame": lambda: pull_req([1]) + [b"x"],
    "ids size mismatch": lambda: pull_req([1, 2])[:3] + [bytes(12)],
    "unknown table": lambda: pull_req([1], table=5),
    "wrong dim": lambda: pull_req([1], dim=D + 1),
    "bad dtype": lambda: pull_req([1], dtype=P.DType.INT64),
    "huge count": lambda: [P.Header(op=P.Op.PULL, count=1, dim=D, dtype=P.DType.FP32).pack(), b"",
                           index_frame([[0, 2**60]]), bytes(8)],
    "huge reply": lambda: [P.Header(op=P.Op.PULL, count=1, dim=D, dtype=P.DType.FP32).pack(), b"",
                           index_frame([[0, 2**20]]), bytes(8 * 2**20)],
    "grads size mismatch": lambda: push_req([1], torch.ones(1, D))[:4] + [bytes(4 * D - 4)],
    "push to unknown worker": lambda: push_req([1], torch.ones(1, D), worker=3),
    "save without path": lambda: [P.Header(op=P.Op.SAVE, dtype=P.DType.BYTES).pack(), b"", b""],
    "negative step": lambda: pull_req([1], step=-3),
    "path not utf-8": lambda: [P.Header(op=P.Op.LOAD, dtype=P.DType.BYTES, count=2).pack(), b"", b"\xff\xfe"],
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_request_gets_error_reply_and_server_keeps_serving(case):
    server, state = make(mode="sync", workers=2, max_frame_bytes=4 * 2**20)
    status, text = status_of(server.handle(BAD_CASES[case]()))
    assert status in (P.Status.BAD_FRAME, P.Status.BAD_VALUE), text
    assert text.startswith("ps shard 0: ")
    assert state.pushes == [] and server.errors == 1
    assert rows_of(server.handle(pull_req([1])), 1).shape == (1, D)


def test_error_messages_name_the_values():
    server, _ = make()
    assert "unknown table 5 (this job has 2 tables)" in status_of(server.handle(pull_req([1], table=5)))[1]
    assert "has dim 4, request says 7" in status_of(server.handle(pull_req([1], dim=7)))[1]
    assert "exceeds ps.max_frame_bytes" in status_of(server.handle(BAD_CASES["huge count"]()))[1]


def test_state_failure_is_an_internal_error_not_a_crash():
    server, state = make()
    state.pull = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("disk on fire"))
    status, text = status_of(server.handle(pull_req([1])))
    assert status == P.Status.INTERNAL and "disk on fire" in text


def test_token_auth():
    server, _ = make(token=b"s" * 20)
    assert status_of(server.handle(pull_req([1])))[0] == P.Status.UNAUTHORIZED
    assert status_of(server.handle(pull_req([1], auth=b"s" * 19 + b"t")))[0] == P.Status.UNAUTHORIZED
    assert rows_of(server.handle(pull_req([1], auth=b"s" * 20)), 1).shape == (1, D)


def test_retried_push_is_applied_once():
    server, state = make()
    req = push_req([3], torch.ones(1, D), request=41)
    first, again = server.handle(req), server.handle(req)
    assert first == again and status_of(first)[0] == P.Status.OK
    assert len(state.pushes) == 1
    server.handle(push_req([3], torch.ones(1, D), request=42))
    assert len(state.pushes) == 2


def test_sync_mode_sums_workers_and_defers_next_pull():
    server, state = make(mode="sync", workers=2)
    g0, g1 = torch.full((2, D), 1.0), torch.full((1, D), 2.0)
    server.handle(push_req([1, 2], g0, worker=0, step=0, request=1))
    server.handle(push_req([2], g1, worker=1, step=0, request=2))
    server.handle(barrier_req(0, worker=0, request=3))
    assert state.pushes == []                                        # worker 1 not done yet
    assert server.handle(pull_req([2], step=1, request=4)) is DEFERRED
    assert rows_of(server.handle(pull_req([2], step=0, request=5)), 1).shape == (1, D)   # step 0: no wait
    server.handle(barrier_req(0, worker=1, request=6))
    assert len(state.pushes) == 1                                    # one push of the concatenation
    table, ids, grads, step = state.pushes[0]
    assert (table, ids, step) == (0, [1, 2, 2], 0) and torch.equal(grads, torch.cat([g0, g1]))
    assert server.handle(pull_req([2], step=1, request=7)) is not DEFERRED
    stale = server.handle(push_req([1], g1, worker=0, step=0, request=8))
    assert status_of(stale)[0] == P.Status.STALE_STEP


def test_step_buffer_applies_steps_in_order_and_skips_gaps():
    buf = StepBuffer(num_workers=1)
    buf.add_push(1000, 0, 0, torch.tensor([1]), torch.ones(1, D))    # a resumed job starts at 1000
    assert buf.pending_before(1001) and not buf.pending_before(1000)
    buf.arrive(1000, 0)
    step, merged = buf.pop_ready()
    assert step == 1000 and list(merged) == [0] and buf.pop_ready() is None
    with pytest.raises(P.ProtocolError, match="step 999, but step 1000 is already applied"):
        buf.arrive(999, 0)


def test_async_staleness_bound():
    server, _ = make(mode="async", workers=2, max_staleness=1)
    assert server.handle(pull_req([1], step=1, request=1)) is not DEFERRED
    assert server.handle(pull_req([1], step=2, request=2)) is DEFERRED   # worker 1 has done nothing
    server.handle(barrier_req(0, worker=0, request=3))
    server.handle(barrier_req(0, worker=1, request=4))
    assert server.handle(pull_req([1], step=2, request=5)) is not DEFERRED


def test_json_ops(tmp_path):
    server, state = make()
    path = str(tmp_path / "ckpt")
    h = P.Header(op=P.Op.SAVE, dtype=P.DType.BYTES, count=len(path), request=9)
    reply = server.handle([h.pack(), b"", path.encode()])
    body = json.loads(bytes(reply[1]))
    assert (body["shard"], body["directory"], body["background"]) == (0, f"{path}/shard0", False)
    assert state.saved == f"{path}/shard0"
    stats = json.loads(bytes(server.handle([P.Header(op=P.Op.STATS).pack(), b""])[1]))
    assert stats["state"] == {"rows": 0} and stats["requests"]["save"] == 1
    assert stats["save"]["state"] == "done" and stats["save"]["directory"] == f"{path}/shard0"


# ---------------------------------------------------------------------------------------------


def test_no_pickle_or_marshal_in_embedding_ps():
    banned = {"pickle", "cPickle", "marshal", "cloudpickle", "dill", "shelve"}
    for f in (ROOT / "embedding_ps").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not {n.split(".")[0] for n in names} & banned, f"{f} imports {names}"


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.3.4.5", True), ("localhost", True),
                                       ("::1", True), ("0.0.0.0", False), ("*", False),
                                       ("10.1.2.3", False), ("example.org", False)])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


def test_non_loopback_bind_without_auth_is_refused():
    with pytest.raises(AuthConfigError, match="refusing to bind '0.0.0.0' without authentication"):
        check_bind_auth(PSConfig(), "0.0.0.0", 0)
    check_bind_auth(PSConfig(), "127.0.0.1", 0)


def test_psclient_implements_the_store_protocol():
    """PSClient is an EmbeddingStore: every Protocol member, with the Protocol's parameters."""
    import inspect

    from embedding_ps.client.client import PSClient
    from embedding_ps.store import EmbeddingStore

    cfg = PSConfig(tables=(TableConfig(name="a", dim=D),))
    client = PSClient(cfg, ["tcp://127.0.0.1:1"])        # connects lazily: no shard needed
    try:
        assert isinstance(client, EmbeddingStore)
        for name, member in vars(EmbeddingStore).items():
            if name.startswith("_") or not callable(member):
                continue
            want = [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()][1:]
            got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(client, name)).parameters.values()]
            assert got == want, name
    finally:
        client.close()


def test_gates_are_chosen_once_by_mode():
    from embedding_ps.shard.gates import AsyncGate, SyncGate

    assert isinstance(make(mode="sync")[0].gate, SyncGate)
    assert isinstance(make(mode="async")[0].gate, AsyncGate)


def _save_req(path: str, op=P.Op.SAVE, request: int = 1) -> list:
    return [P.Header(op=op, dtype=P.DType.BYTES, count=len(path.encode()), request=request).pack(), b"",
            path.encode()]


def test_save_and_load_stay_under_the_storage_root(tmp_path):
    """ps.storage_root: SAVE / LOAD of a directory outside it ('..' and symlinks resolved) are refused."""
    root, outside = tmp_path / "run", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    server, state = make(storage_root=str(root))
    ok = server.handle(_save_req(str(root / "ckpt")))
    assert status_of(ok)[0] == P.Status.OK and state.saved == f"{root}/ckpt/shard0"
    for bad in (str(outside / "ckpt"), f"{root}/../elsewhere/ckpt", str(root / "link" / "ckpt"), "/etc"):
        for op in (P.Op.SAVE, P.Op.LOAD):
            status, text = status_of(server.handle(_save_req(bad, op, request=7)))
            assert status == P.Status.BAD_VALUE and "outside ps.storage_root" in text, (bad, op, text)
    assert state.saved == f"{root}/ckpt/shard0" and not hasattr(state, "loaded")   # nothing happened
    assert status_of(server.handle(_save_req(str(root / "ckpt"), P.Op.LOAD, request=9)))[0] == P.Status.OK


def test_a_token_file_readable_by_others_is_refused(tmp_path):
    from embedding_ps.wire.auth import load_token

    token = tmp_path / "ps.token"
    token.write_text("correct-horse-battery-staple\n")
    token.chmod(0o644)
    with pytest.raises(AuthConfigError, match=rf"readable or writable by group or others \(mode 644\).*chmod 600 {token}"):
        load_token(PSConfig(auth="token", token_file=str(token)))
    token.chmod(0o600)
    assert load_token(PSConfig(auth="token", token_file=str(token))) == b"correct-horse-battery-staple"


def test_nonfinite_gradients_are_refused_and_nothing_is_applied():
    server, state = make(mode="async")
    g = torch.ones(3, D)
    g[1, 2] = float("nan")
    status, text = status_of(server.handle(push_req([4, 5, 6], g, request=1)))
    assert status == P.Status.BAD_VALUE and state.pushes == []
    assert "1 row(s) with NaN or infinite gradients (first: part 0, table 'a', row 1); nothing applied" in text
    g[1, 2] = float("inf")
    assert status_of(server.handle(push_req([4, 5, 6], g, request=2)))[0] == P.Status.BAD_VALUE
    big = torch.full((2, D), 3e38)                    # finite rows whose sum overflows: still applied
    assert status_of(server.handle(push_req([7, 8], big, request=3)))[0] == P.Status.OK
    assert len(state.pushes) == 1


def test_nonfinite_rows_can_be_skipped():
    server, state = make(mode="sync", on_nonfinite="skip")
    g = torch.ones(3, D)
    g[0, 0] = float("-inf")
    assert status_of(server.handle(push_req([4, 5, 6], g, request=1)))[0] == P.Status.OK
    server.handle(barrier_req(0, worker=0, request=2))
    assert [(t, ids) for t, ids, _, _ in state.pushes] == [(0, [5, 6])]          # the finite rows only
    stats = json.loads(bytes(server.handle([P.Header(op=P.Op.STATS).pack(), b""])[1]))
    assert stats["nonfinite_rows_skipped"] == 1


@pytest.mark.parametrize("setting,bind", [(False, "127.0.0.1"), ("auto", "10.0.0.7")])
def test_shard_without_shared_memory_answers_no_shm_and_applies_nothing(setting, bind):
    """NO_SHM (the client resends through the socket), not an error, and nothing applied."""
    cfg = PSConfig(shared_memory=setting, tables=(TableConfig(name="a", dim=D),))
    state = DictState(cfg)
    server = ShardServer(cfg, 0, state, bind=bind)
    ids = torch.tensor([1, 2], dtype=torch.int64)
    for op in (P.Op.PUSH, P.Op.PULL):
        h = P.Header(op=op, dtype=P.DType.FP32, count=1, dim=D, client=7, request=int(op), flags=P.FLAG_SHM)
        reply = server.handle([h.pack(), b"", index_frame([[0, 2]]), ids.numpy().tobytes(), b"recsys-ps-" + b"0" * 16])
        status, text = status_of(reply)
        assert status == P.Status.NO_SHM and "does not take shared memory" in text
    assert state.pushes == [] and server.errors == 0 and server.shm_refused == 2
    assert server.replay == {}                  # the socket resend is applied, not answered from the cache


@pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
def test_ids_and_grads_in_the_segment_are_copied_in_sync_mode():
    """FLAG_SHM with an empty ids frame: ids after the rows in the segment. The sync gate applies a
    push at the barrier, after the client may have reused the segment: what it applies must be the
    ids and grads of the push, not what the segment holds by then. A pull reads its ids there too."""
    cfg = PSConfig(mode="sync", shared_memory=True, tables=(TableConfig(name="a", dim=D),))
    state = DictState(cfg)
    server = ShardServer(cfg, 0, state)
    pool = shm.ShmPool(64 << 20)
    try:
        ids, grads = torch.tensor([5, 7, 9]), torch.ones(3, D)
        name, seg = pool.take(shm.ids_offset(grads.numel() * 4) + 8 * 3)
        rows = P.frame_tensor(memoryview(seg[:grads.numel() * 4]), P.DType.FP32, 3, D)
        rows.copy_(grads)
        P.frame_tensor(memoryview(seg[shm.ids_offset(grads.numel() * 4):]), P.DType.INT64, 3).copy_(ids)
        h = P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=1, dim=D, client=7, request=1, flags=P.FLAG_SHM)
        assert status_of(server.handle([h.pack(), b"", index_frame([[0, 3]]), b"", name]))[0] == P.Status.OK
        seg[:] = 0                                        # the client reuses the segment before the barrier
        assert status_of(server.handle(barrier_req(0, 0, 2)))[0] == P.Status.OK
        assert state.pushes[0][1] == [5, 7, 9] and bool((state.pushes[0][2] == 1).all())
        P.frame_tensor(memoryview(seg[shm.ids_offset(grads.numel() * 4):]), P.DType.INT64, 3).copy_(ids)
        h = P.Header(op=P.Op.PULL, dtype=P.DType.FP32, count=1, dim=D, step=1, client=7, request=3,
                     flags=P.FLAG_SHM)
        reply = server.handle([h.pack(), b"", index_frame([[0, 3]]), b"", name])
        assert len(reply) == 1 and P.unpack_header(reply[0]).status == P.Status.OK
        torch.testing.assert_close(rows, state.pull(0, ids), atol=0, rtol=0)   # rows written into the segment
        del rows
    finally:
        pool.close()
