"""Protocol fuzz: >= 100,000 random and mutated frames at a live shard, which then still answers a
normal pull with exactly the rows it had.

Most frames are mutations of valid requests (PULL, PUSH, BARRIER, STATS, HEALTH, SWEEP, SAVE_STATUS):
bit flips, random bytes, truncation, extension, wrong counts in the index frame, header fields set
at random, frames dropped or repeated; the rest is noise (random frame counts and bytes). Seeded,
and bounded in time: the test fails if the frames take more than FUZZ_BUDGET_S.

What is left out on purpose: a well-formed SHUTDOWN (op 8) stops the shard by design, so a frame
list whose header says op 8 is not sent. Mutated requests that are still well formed are applied, so
the rows checked are ids no fuzz frame can name: the checked ids have their six high bytes set to
0x3C, fuzz ids to 0x5A (no bit flip or byte change turns one into the other), and the small numbers
of index frames (tables, counts), which a dropped or repeated frame can turn into ids, are far
from both.
"""

from __future__ import annotations

import random
import struct
import time

import pytest
import torch
import zmq

from embedding_ps.wire import protocol as P
from embedding_ps.client.client import PSClient
from embedding_ps.wire.config import PSConfig, TableConfig

pytestmark = pytest.mark.integration

D = 8
FRAMES = 100_000
SEED = 1234
FUZZ_BUDGET_S = 60.0
WINDOW = 256                       # requests in flight before the replies are read
CFG = PSConfig(num_shards=1, mode="async", num_workers=2, max_staleness=(1 << 63) - 1, timeout_s=30.0,
               retries=0, max_frame_bytes=1 << 20,
               tables=(TableConfig(name="a", dim=D, optimizer="sgd", lr=0.1),
                       TableConfig(name="b", dim=D, optimizer="adagrad", lr=0.1)))
CHECKED = (0x3C3C3C3C3C3C << 16) + torch.arange(0, 1000, dtype=torch.int64)   # ids whose rows must not change
FUZZ_BASE = 0x5A5A5A5A5A5A << 16


def _index(parts: list[tuple[int, int]]) -> bytes:
    return struct.pack(f"<{2 * len(parts)}q", *[x for p in parts for x in p])


def _ids(rng: random.Random, n: int) -> bytes:
    return struct.pack(f"<{n}q", *[FUZZ_BASE | rng.randrange(1 << 16) for _ in range(n)])


def valid_request(rng: random.Random) -> list[bytes]:
    """A well-formed request of a random kind (never SHUTDOWN, SAVE or LOAD)."""
    kind = rng.random()
    req = rng.randrange(1 << 32)
    if kind < 0.4:                                      # PULL of 1-2 tables
        parts = [(t, rng.randrange(1, 9)) for t in rng.sample(range(2), rng.randrange(1, 3))]
        h = P.Header(op=P.Op.PULL, dtype=P.DType.FP32, count=len(parts), dim=D, request=req,
                     worker=rng.randrange(2), step=rng.randrange(100))
        return [h.pack(), b"", _index(parts), b"".join(_ids(rng, n) for _, n in parts)]
    if kind < 0.8:                                      # PUSH of 1-2 tables
        parts = [(t, rng.randrange(1, 9)) for t in rng.sample(range(2), rng.randrange(1, 3))]
        n = sum(c for _, c in parts)
        grads = struct.pack(f"<{n * D}f", *[rng.uniform(-1, 1) for _ in range(n * D)])
        h = P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=len(parts), dim=D, request=req,
                     worker=rng.randrange(2), step=rng.randrange(100))
        return [h.pack(), b"", _index(parts), b"".join(_ids(rng, c) for _, c in parts), grads]
    op = rng.choice([P.Op.BARRIER, P.Op.STATS, P.Op.HEALTH, P.Op.SWEEP, P.Op.SAVE_STATUS])
    return [P.Header(op=op, worker=rng.randrange(2), step=rng.randrange(100), request=req).pack(), b""]


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """1-3 mutations of a valid frame list."""
    frames = [bytearray(f) for f in frames]
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(frames))
        f = frames[i]
        m = rng.randrange(9)
        if m == 0 and f:                                        # bit flips
            for _ in range(rng.randrange(1, 4)):
                k = rng.randrange(len(f))
                f[k] ^= 1 << rng.randrange(8)
        elif m == 1 and f:                                      # a random byte
            f[rng.randrange(len(f))] = rng.randrange(256)
        elif m == 2:                                            # truncation
            del f[rng.randrange(len(f) + 1):]
        elif m == 3:                                            # extension
            f.extend(rng.randbytes(rng.choice([1, 7, 8, 64])))
        elif m == 4 and len(frames) > 1:                        # a frame dropped
            del frames[i]
        elif m == 5 and len(frames) < 8:                        # a frame repeated
            frames.insert(i, bytearray(f))
        elif m == 6 and i == 2 and len(f) >= 16:                # a wrong count / table in the index
            k = 8 * rng.randrange(len(f) // 8)
            f[k:k + 8] = struct.pack("<q", rng.choice([-1, 0, 1, 2, 3, 9, 1 << 20, 1 << 40, -(1 << 62)]))
        elif m == 7 and len(frames[0]) == P.HEADER_SIZE:        # a header field at random
            h = frames[0]
            k = rng.choice([4, 6, 7, 8, 10, 12, 16, 20, 28, 32, 36, 44])   # version, op, dtype, ..., request
            width = {4: 2, 6: 1, 7: 1, 8: 2, 10: 2}.get(k, 4)
            h[k:k + width] = rng.randbytes(width)
        elif m == 8:                                            # frames swapped
            j = rng.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
    return [bytes(f) for f in frames]


def noise(rng: random.Random) -> list[bytes]:
    n = rng.randrange(1, 6)
    sizes = [rng.choice([0, 1, 8, P.HEADER_SIZE, P.HEADER_SIZE + 1, rng.randrange(200)]) for _ in range(n)]
    frames = [rng.randbytes(s) for s in sizes]
    if rng.random() < 0.5 and frames and len(frames[0]) >= 6:       # a valid magic and version, garbage after
        frames[0] = struct.pack("<IH", P.MAGIC, P.VERSION) + frames[0][6:]
    return frames


def is_shutdown(frames: list[bytes]) -> bool:
    return len(frames[0]) > 6 and frames[0][6] == P.Op.SHUTDOWN


def test_fuzzed_frames_leave_the_shard_serving_the_same_rows(shard_process) -> None:
    shard = shard_process(CFG)
    with PSClient(CFG, [shard.address]) as client:
        before = [client.pull(t, CHECKED) for t in range(2)]
        client.push(0, CHECKED[:10], torch.ones(10, D))          # a trained row among the checked
        before = [client.pull(t, CHECKED) for t in range(2)]
    rng = random.Random(SEED)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(shard.address)
    sent = replied = skipped = 0
    statuses: dict[int, int] = {}
    t0 = time.monotonic()
    try:
        while sent < FRAMES:
            assert time.monotonic() - t0 < FUZZ_BUDGET_S, f"{sent} frames in {FUZZ_BUDGET_S} s"
            batch = 0
            while batch < WINDOW and sent < FRAMES:
                r = rng.random()
                frames = noise(rng) if r < 0.15 else mutate(rng, valid_request(rng)) if r < 0.95 else valid_request(rng)
                if is_shutdown(frames):
                    skipped += 1
                    continue
                sock.send_multipart(frames)
                sent += 1
                batch += 1
            while batch and sock.poll(10_000):
                reply = sock.recv_multipart()
                replied += 1
                batch -= 1
                if len(reply[0]) == P.HEADER_SIZE:
                    status = P.unpack_header(reply[0]).status
                    statuses[status] = statuses.get(status, 0) + 1
            assert shard.proc.poll() is None, f"the shard died after {sent} frames:\n{shard.log()[-3000:]}"
        elapsed = time.monotonic() - t0
    finally:
        sock.close()
        ctx.term()
    assert sent >= FRAMES and replied == sent, (sent, replied)      # every frame got an answer
    assert statuses.get(P.Status.BAD_FRAME, 0) > FRAMES // 10 and statuses.get(P.Status.OK, 0) > FRAMES // 20
    with PSClient(CFG, [shard.address]) as client:
        after = [client.pull(t, CHECKED) for t in range(2)]
        assert client.health()[0]["ok"] if hasattr(client, "health") else True
    for t in range(2):
        assert torch.equal(after[t], before[t]), f"table {t}: rows changed"
    print(f"fuzz: {sent} frames ({skipped} SHUTDOWN mutations not sent) in {elapsed:.1f} s; statuses {statuses}")
