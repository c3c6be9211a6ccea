"""The client's request plan (`plan_call`): every table's ids of a call routed at once, each shard
sent exactly the ids of its parts (routed by `sharding.route`), and its `assemble` and `to_sent`
put rows and grads at their caller positions. Shards are simulated: a shard's reply row for an id
is a function of (shard, id), so a row at the wrong place or from the wrong shard shows."""

from __future__ import annotations

import itertools

import pytest
import torch

from embedding_ps.wire import protocol as P
from embedding_ps.client.plan import plan_call
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.wire.sharding import route

D = 3


def config(shards: int) -> PSConfig:
    return PSConfig(num_shards=shards, tables=(TableConfig(name="a", dim=D), TableConfig(name="b", dim=D),
                                              TableConfig(name="h", dim=D, kind="hashed", num_embeddings=50)))


def replies(shards: dict[int, list[tuple[int, torch.Tensor]]], dtype=torch.float32) -> dict:
    """Each shard answers row [id, shard, id * 0.5] (in the wire dtype) for each id it got."""
    out = {}
    for s, parts in shards.items():
        x = torch.cat([c for _, c in parts]).double()
        rows = torch.stack([x, torch.full_like(x, s), x * 0.5], dim=1).to(dtype).contiguous()
        out[s] = (P.Header(op=P.Op.PULL, dtype=P.DType.FP32 if dtype == torch.float32 else P.DType.FP16),
                  [rows.numpy().tobytes() if dtype == torch.float32 else rows.view(torch.int16).numpy().tobytes()])
    return out


def distinct(*xs: int) -> torch.Tensor:
    return torch.tensor(sorted(set(xs)), dtype=torch.int64)


CALLS = [
    ([0, 1, 2], [distinct(5, 9, 2**62, -7), distinct(1, 2, 3, 4, 5, 6), distinct(10, 11, 60, 61)]),
    ([0, 0, 1], [distinct(8, 3), torch.empty(0, dtype=torch.int64), distinct(-1, 0, 1)]),   # a table twice, an empty part
    ([1], [torch.arange(-40, 200, 3)]),
    ([2, 0], [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]),
]


@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("call", range(len(CALLS)))
def test_each_shard_gets_its_ids_part_by_part_and_rows_and_grads_come_back_in_place(shards: int, call: int) -> None:
    cfg = config(shards)
    tables, ids = CALLS[call]
    plan = plan_call(cfg, True, tables, ids)
    assert plan.gather is None                                  # distinct ids: nothing to gather
    new = plan.by_shard(plan.sent)
    for p, (t, x) in enumerate(zip(tables, ids)):               # each part's ids, each on its shard, in order
        want = {s: x[route(x, cfg.tables[t], shards) == s] for s in range(shards)}
        got = {s: c for s, parts in new.items() for i, c in parts if i == p}
        assert {s for s, w in want.items() if w.numel()} == got.keys()
        for s, c in got.items():
            assert torch.equal(c, want[s]), (p, s)
    for s, parts in new.items():
        assert [i for i, _ in parts] == sorted(i for i, _ in parts)      # parts in call order
    if not new:
        return
    counts = {s: [c.numel() for _, c in parts] for s, parts in new.items()}
    got = plan.assemble(counts, replies(new), D)
    assert torch.equal(got[:, 0], torch.cat(ids).double().float())      # every row at its caller position
    for s, parts in new.items():                                        # ... from the shard that owns it
        for i, x in parts:
            start = sum(y.numel() for y in ids[:i])
            pos = {int(v): k for k, v in enumerate(ids[i])}
            assert bool((got[start + torch.tensor([pos[int(v)] for v in x]), 1] == s).all())
    # grads: caller order -> sent order, then split per shard and part as the ids were
    grads = torch.randn(sum(x.numel() for x in ids), D)
    g_parts = plan.by_shard(plan.to_sent(grads))
    for s, parts in new.items():
        for (i, x), (j, g) in zip(parts, g_parts[s]):
            assert i == j and g.shape == (x.numel(), D)
            start = sum(y.numel() for y in ids[:i])
            pos = {int(v): k for k, v in enumerate(ids[i])}
            assert torch.equal(g, grads[start + torch.tensor([pos[int(v)] for v in x], dtype=torch.int64)])


def test_fp16_replies_come_back_as_float32() -> None:
    cfg = config(2)
    tables, ids = CALLS[0]
    plan = plan_call(cfg, True, tables, ids)
    new = plan.by_shard(plan.sent)
    counts = {s: [c.numel() for _, c in parts] for s, parts in new.items()}
    got = plan.assemble(counts, replies(new, torch.float16), D)
    assert got.dtype == torch.float32
    assert torch.equal(got[:, 0], torch.cat(ids).double().half().float())


def test_without_dedup_duplicate_ids_go_as_they_are() -> None:
    plan = plan_call(config(2), False, [0], [torch.tensor([4, 4, 5, 1])])
    assert plan.gather is None and sorted(plan.sent.tolist()) == [1, 4, 4, 5]   # the shard sums their grads


@pytest.fixture(params=["c", "torch"])
def native_on(request):
    """The client's dedup with the C library (one hash pass) and without it (torch.unique's sort)."""
    from embedding_ps import native
    if request.param == "c" and not native.available():
        pytest.skip("the C library did not build here")
    prev = native.set_enabled(request.param == "c")
    try:
        yield request.param
    finally:
        native.set_enabled(prev)


@pytest.mark.parametrize("shards", [1, 3])
def test_dedup_sends_each_id_once_and_puts_rows_and_summed_grads_back(native_on: str, shards: int) -> None:
    cfg = config(shards)
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(-20, 40, (300,), generator=g) * 1_000_003,      # many duplicates
           torch.tensor([7, 3, 7, 7]), torch.randint(0, 90, (50,), generator=g)]
    tables = [0, 0, 2]                                                   # a table twice, a hashed one
    plan = plan_call(cfg, True, tables, ids)
    new = plan.by_shard(plan.sent)
    for p, x in enumerate(ids):
        sent = [v for parts in new.values() for i, c in parts if i == p for v in c.tolist()]
        assert sorted(sent) == sorted(set(x.tolist()))                   # each distinct id of a part once
    if native_on == "c" and shards == 1:                                # first appearances, in order
        assert plan.sent.tolist() == [v for x in ids for v in dict.fromkeys(x.tolist())]
    counts = {s: [c.numel() for _, c in parts] for s, parts in new.items()}
    for s, parts in new.items():
        for i, c in parts:
            assert bool((route(c, cfg.tables[tables[i]], shards) == s).all())
    flat = torch.cat(ids)
    rows = plan.assemble(counts, replies(new), D)
    assert torch.equal(rows[:, 0], flat.double().float())               # every row at its caller position
    # the client sums a duplicate's grads (client.push_many_async): what a per-id loop gives
    grads = torch.randn(flat.numel(), D, generator=g)
    g_parts = plan.by_shard(plan.to_sent(grads))
    starts = [0, *itertools.accumulate(x.numel() for x in ids)]
    for s, parts in new.items():
        for (i, x), (_, summed) in zip(parts, g_parts[s]):
            for k, v in enumerate(x.tolist()):
                want = torch.zeros(D)
                for j in torch.nonzero(ids[i] == v).flatten().tolist():     # in arrival order
                    want += grads[starts[i] + j]
                assert torch.equal(summed[k], want), (i, v)


def test_dedup_of_distinct_ids_sends_them_as_they_are(native_on: str) -> None:
    # the C pass tells distinct ids in any order; torch.unique's sort only sorted ones
    ids = torch.tensor([9, 3, -5, 2**62, 7]) if native_on == "c" else torch.tensor([-5, 3, 7, 9, 2**62])
    plan = plan_call(config(1), True, [0], [ids])
    assert plan.gather is None and torch.equal(plan.sent, ids)         # no inverse to apply
    plan = plan_call(config(2), True, [0], [ids])
    assert plan.gather is None and sorted(plan.sent.tolist()) == sorted(ids.tolist())
