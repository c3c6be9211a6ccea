"""A live shard process answers malformed raw frames with error replies and keeps serving;
a client facing a dead address fails with ShardUnavailableError naming shard and address."""

import dataclasses
import socket
import time

import pytest
import torch
import zmq

from embedding_ps.wire import protocol as P
from embedding_ps.client.client import PSClient, PSRequestError, ShardUnavailableError
from embedding_ps.wire.config import PSConfig, TableConfig

pytestmark = pytest.mark.integration

D = 4
CFG = PSConfig(num_shards=1, mode="async", timeout_s=20.0, retries=0, max_frame_bytes=1 << 20,
               tables=(TableConfig(name="t", dim=D, optimizer="sgd", lr=0.5),))


def _pull(ids: list[int], table: int = 0, n: int | None = None, **kw) -> list[bytes]:
    """A one-part PULL of `ids` from `table` (`n`: the count the index claims, default len(ids))."""
    fields = dict(op=P.Op.PULL, dtype=P.DType.FP32, count=1, dim=D, request=1)
    fields.update(kw)
    index = torch.tensor([[table, len(ids) if n is None else n]], dtype=torch.int64).numpy().tobytes()
    return [P.Header(**fields).pack(), b"", index, torch.tensor(ids, dtype=torch.int64).numpy().tobytes()]


BAD = [
    ("truncated header", lambda: [_pull([1])[0][:40], b"", bytes(16), bytes(8)], P.Status.BAD_FRAME, "60 bytes"),
    ("one frame", lambda: _pull([1])[:1], P.Status.BAD_FRAME, ">= 2 frames"),
    ("truncated ids", lambda: _pull([1, 2])[:3] + [bytes(12)], P.Status.BAD_FRAME, "frame has 12"),
    ("wrong magic", lambda: [b"ABCD" + _pull([1])[0][4:], b"", bytes(16), bytes(8)], P.Status.BAD_FRAME, "bad magic"),
    ("version 1 peer", lambda: _pull([1], version=1), P.Status.BAD_FRAME, "version 1 not supported (this side speaks 3)"),
    ("single-table op of version 1", lambda: [P.Header(op=1, dtype=P.DType.FP32, count=1, dim=D).pack(), b"",
                                              bytes(8)], P.Status.BAD_FRAME, "unknown op 1"),
    ("unknown op", lambda: [P.Header(op=99).pack(), b""], P.Status.BAD_FRAME, "unknown op 99"),
    ("unknown table", lambda: _pull([1], table=3), P.Status.BAD_VALUE, "unknown table 3"),
    ("wrong dim", lambda: _pull([1], dim=D + 2), P.Status.BAD_VALUE, "request says 6"),
    ("huge count", lambda: _pull([1], n=2**62), P.Status.BAD_VALUE, "max_frame_bytes"),
    ("bad dtype", lambda: _pull([1], dtype=42), P.Status.BAD_VALUE, "dtype code 42"),
    ("push grads short", lambda: [P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=1, dim=D).pack(), b"",
                                  _pull([1])[2], bytes(8), bytes(4 * D - 1)], P.Status.BAD_FRAME, "frame has 15"),
]


def test_bad_frames_get_error_replies_and_shard_keeps_serving(shard_processes):
    shards = shard_processes(CFG)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 20_000
    sock.connect(shards.addresses[0])
    try:
        for name, frames, status, text in BAD:
            sock.send_multipart(frames())
            reply = sock.recv_multipart()
            h = P.unpack_header(reply[0])
            assert h.status == status, name
            assert text in reply[1].decode(), (name, reply[1])
        sock.send_multipart(_pull([7, 7, 8], request=77))
        reply = sock.recv_multipart()
        h = P.unpack_header(reply[0])
        assert (h.status, h.request, len(reply[1])) == (P.Status.OK, 77, 3 * D * 4)
        rows = torch.frombuffer(bytearray(reply[1]), dtype=torch.float32).view(3, D)
        assert torch.equal(rows[0], rows[1]) and not torch.equal(rows[0], rows[2])
        with PSClient(CFG, shards.addresses) as client:
            assert torch.equal(client.pull(0, torch.tensor([8, 7])), rows[[2, 0]])
            with PSClient(CFG, shards.addresses, dedup=False) as raw:   # duplicates sent as they are
                assert torch.equal(raw.pull(0, torch.tensor([8, 7, 8])), rows[[2, 0, 2]])
            assert client.stats()[0]["errors"] == len(BAD)
            with pytest.raises(PSRequestError, match="PULL to ps shard 0 at .* failed \\(BAD_VALUE\\)"):
                _bad_dim(client)
            for wire, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
                with PSClient(dataclasses.replace(CFG, wire_dtype=wire), shards.addresses) as half:
                    assert torch.equal(half.pull(0, torch.tensor([8, 7])), rows[[2, 0]].to(dtype).float())
            for wire in ("fp16", "bf16"):
                with PSClient(dataclasses.replace(CFG, wire_dtype=wire), shards.addresses) as half:
                    half.push(0, torch.tensor([8]), torch.full((1, D), 1.0 / 3.0))
            g = torch.tensor(1.0 / 3.0).to(torch.bfloat16).float() + torch.tensor(1.0 / 3.0).half().float()
            torch.testing.assert_close(client.pull(0, torch.tensor([8]))[0], rows[2] - 0.5 * g)   # sgd, lr 0.5
            client.shutdown()
        assert shards.wait_exit() == [0]
    finally:
        sock.close()
        ctx.term()


def _bad_dim(client: PSClient) -> None:
    """A client whose config disagrees with the shard's gets the shard's error."""
    wrong = PSConfig(num_shards=1, tables=(TableConfig(name="t", dim=D + 1),))
    with PSClient(wrong, client.addresses) as other:
        other.pull(0, torch.tensor([1, 2]))


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"tcp://127.0.0.1:{port}"


def test_dead_shard_raises_shard_unavailable_naming_it():
    cfg = PSConfig(num_shards=2, timeout_s=0.3, retries=1, tables=CFG.tables)
    dead = [_dead_address(), _dead_address()]
    with PSClient(cfg, dead, worker_id=0) as client:
        t0 = time.monotonic()
        with pytest.raises(ShardUnavailableError) as info:
            client.pull(0, torch.arange(100))
        elapsed = time.monotonic() - t0
        err = info.value
        assert err.shard in (0, 1) and err.address == dead[err.shard]
        assert f"ps shard {err.shard} at {dead[err.shard]}" in str(err)
        assert "2 attempt(s) of 0.3 s" in str(err)
        assert elapsed < 10.0   # ~0.6 s: the deadline, not a hang
        with pytest.raises(ShardUnavailableError, match="no reply to HEALTH"):
            client.health()


def test_retry_resends_the_same_request_and_late_replies_are_dropped():
    """A push unanswered for ps.timeout_s is sent again with the same request id (the shard's
    replay cache then answers it without applying it twice); a second, late reply is ignored."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.rcvtimeo = 10_000
    port = router.bind_to_random_port("tcp://127.0.0.1")
    cfg = PSConfig(num_shards=1, timeout_s=0.3, retries=3, tables=CFG.tables, max_frame_bytes=1000)
    try:
        with PSClient(cfg, [f"tcp://127.0.0.1:{port}"], worker_id=0) as client:
            fut = client.push_async(0, torch.tensor([5, 6]), torch.ones(2, D))
            first, second = router.recv_multipart(), router.recv_multipart()   # no reply to the first
            assert first == second
            h = P.unpack_header(first[1])
            assert (h.op, h.count, h.dim) == (P.Op.PUSH, 1, D)                  # one part: table 0
            assert torch.frombuffer(bytearray(first[3]), dtype=torch.int64).tolist() == [0, 2]
            for _ in range(2):
                router.send_multipart([first[0], h.reply().pack()])
            assert fut.result(timeout=10) is None
            with pytest.raises(ValueError, match="over ps.max_frame_bytes = 1000"):
                client.pull(0, torch.arange(100))
    finally:
        router.close()
        ctx.term()
