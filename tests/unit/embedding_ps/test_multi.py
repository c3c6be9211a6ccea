"""Multi-table PULL / PUSH on the shard, without sockets: each equals its one-part requests in
order, every part is validated before any is applied, and a bad request leaves the state as it was."""

import pytest
import torch

from embedding_ps.wire import protocol as P
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.server import DEFERRED, ShardServer

from tests.unit.embedding_ps.test_protocol import DictState, barrier_req, pull_req, push_req, rows_of, status_of

D = 4


def make(mode="async", workers=1, **kw):
    cfg = PSConfig(mode=mode, num_workers=workers, tables=(TableConfig(name="a", dim=D), TableConfig(name="b", dim=D),
                                                           TableConfig(name="c", dim=2)), **kw)
    state = DictState(cfg)
    return ShardServer(cfg, 0, state), state


def multi_req(op, parts, grads=None, dim=D, step=0, worker=0, request=1, dtype=P.DType.FP32, count=None):
    """parts: [(table, [ids])] -> frames of a PULL (grads None) or PUSH."""
    index = torch.tensor([[t, len(i)] for t, i in parts], dtype=torch.int64).reshape(-1)
    ids = torch.tensor([x for _, i in parts for x in i], dtype=torch.int64)
    h = P.Header(op=op, dtype=dtype, count=len(parts) if count is None else count, dim=dim, step=step,
                 worker=worker, client=7, request=request)
    frames = [h.pack(), b"", index.numpy().tobytes(), ids.numpy().tobytes()]
    if grads is not None:
        frames.append(bytes(P.tensor_frame(grads.to(P.TORCH_DTYPES[dtype]))))
    return frames


PARTS = [(1, [5, 6, 5]), (0, [2]), (1, []), (0, [9, 2])]


def test_pull_multi_is_the_single_pulls_back_to_back():
    server, _ = make()
    got = rows_of(server.handle(multi_req(P.Op.PULL, PARTS)), 6)
    want = torch.cat([rows_of(server.handle(pull_req(i, table=t)), len(i)) for t, i in PARTS])
    assert torch.equal(got, want)
    half = rows_of(server.handle(multi_req(P.Op.PULL, PARTS, dtype=P.DType.BF16)), 6)
    assert torch.equal(half, want.bfloat16().float())


def test_push_multi_applies_the_parts_in_order_and_once_on_retry():
    server, state = make()
    grads = torch.arange(6 * D, dtype=torch.float32).view(6, D)
    req = multi_req(P.Op.PUSH, PARTS, grads, step=3, request=11)
    assert status_of(server.handle(req))[0] == P.Status.OK
    assert status_of(server.handle(req))[0] == P.Status.OK            # a retry: answered from the cache
    assert [(t, i, s) for t, i, _, s in state.pushes] == [(1, [5, 6, 5], 3), (0, [2], 3), (0, [9, 2], 3)]
    assert torch.equal(torch.cat([g for *_, g, _ in state.pushes]), torch.cat([grads[:4], grads[4:]]))


def test_sync_push_multi_is_buffered_like_single_pushes():
    multi, single = make(mode="sync", workers=2), make(mode="sync", workers=2)
    grads = torch.randn(6, D)
    for w in (1, 0):
        assert status_of(multi[0].handle(multi_req(P.Op.PUSH, PARTS, grads * (w + 1), worker=w,
                                                   request=10 + w)))[0] == P.Status.OK
        start = 0
        for t, ids in PARTS:
            g = (grads * (w + 1))[start:start + len(ids)]
            start += len(ids)
            single[0].handle(push_req(ids, g, table=t, worker=w, request=20 + 5 * w + start))
    assert multi[0].handle(multi_req(P.Op.PULL, PARTS, step=1, request=30)) is DEFERRED
    for server, _ in (multi, single):
        server.handle(barrier_req(0, 0, 40))
        server.handle(barrier_req(0, 1, 41))
    for (t1, i1, g1, s1), (t2, i2, g2, s2) in zip(multi[1].pushes, single[1].pushes, strict=True):
        assert (t1, i1, s1) == (t2, i2, s2) and torch.equal(g1, g2)
    stale = multi_req(P.Op.PUSH, PARTS, grads, worker=0, request=50)
    assert status_of(multi[0].handle(stale))[0] == P.Status.STALE_STEP


G = torch.ones(6, D)
BAD = {
    "no parts": lambda: multi_req(P.Op.PULL, PARTS, count=0),
    "index short": lambda: multi_req(P.Op.PULL, PARTS, count=5),
    "unknown table": lambda: multi_req(P.Op.PUSH, [(0, [1]), (7, [2])], G[:2]),
    "negative table": lambda: multi_req(P.Op.PUSH, [(0, [1]), (-1, [2])], G[:2]),
    "dim of a part": lambda: multi_req(P.Op.PUSH, [(0, [1]), (2, [2])], G[:2]),
    "negative count": lambda: multi_req(P.Op.PUSH, PARTS, G)[:2] + [
        torch.tensor([0, -1, 0, 7], dtype=torch.int64).numpy().tobytes()] + multi_req(P.Op.PUSH, PARTS, G)[3:],
    "huge counts": lambda: multi_req(P.Op.PULL, PARTS)[:2] + [
        torch.tensor([0, 2**61, 1, 2**61], dtype=torch.int64).numpy().tobytes(), bytes(8)],
    "ids short": lambda: multi_req(P.Op.PUSH, PARTS, G)[:3] + [bytes(8 * 5)] + [bytes(G.numpy().tobytes())],
    "grads short": lambda: multi_req(P.Op.PUSH, PARTS, G)[:4] + [bytes(4 * 6 * D - 4)],
    "grads missing": lambda: multi_req(P.Op.PUSH, PARTS, G)[:4],
    "bad dtype": lambda: multi_req(P.Op.PUSH, PARTS, G)[:0] + [P.Header(
        op=P.Op.PUSH, dtype=P.DType.INT64, count=4, dim=D).pack()] + multi_req(P.Op.PUSH, PARTS, G)[1:],
    "huge reply": lambda: multi_req(P.Op.PULL, [(0, list(range(2**16))), (1, list(range(2**16)))]),
    "step past int32": lambda: multi_req(P.Op.PUSH, PARTS, G, step=2**31),
    "unknown worker": lambda: multi_req(P.Op.PUSH, PARTS, G, worker=5),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_multi_request_changes_nothing_and_server_keeps_serving(case):
    server, state = make(mode="sync" if case == "unknown worker" else "async", max_frame_bytes=2**20)
    status, text = status_of(server.handle(BAD[case]()))
    assert status in (P.Status.BAD_FRAME, P.Status.BAD_VALUE), text
    assert state.pushes == [] and server.errors == 1
    assert rows_of(server.handle(multi_req(P.Op.PULL, PARTS)), 6).shape == (6, D)
