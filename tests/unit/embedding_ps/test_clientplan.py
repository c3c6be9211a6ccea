"""The client's request plans: `plan_many` (every table's ids of a call routed at once) sends each
shard exactly the ids, parts and counts that the per-table `plan_ids` sends it, and its `assemble`
and `to_sent` put rows and grads where the per-table path puts them. Shards are simulated: a
shard's reply row for an id is a function of (shard, id), so a row at the wrong place or from the
wrong shard shows."""

from __future__ import annotations

import pytest
import torch

from embedding_ps.wire import protocol as P
from embedding_ps.client.plan import assemble_rows, plan_ids, plan_many, plans_by_shard
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
def test_plan_many_sends_and_assembles_what_the_per_table_plans_do(shards: int, call: int) -> None:
    cfg = config(shards)
    tables, ids = CALLS[call]
    plans = [plan_ids(cfg, True, t, x) for t, x in zip(tables, ids)]
    old = plans_by_shard([(p, p.sent) for p in plans])
    many = plan_many(cfg, True, tables, ids)
    assert many is not None
    new = many.by_shard(many.sent)
    assert old.keys() == new.keys()
    for s in old:
        assert [i for i, _ in old[s]] == [i for i, _ in new[s]], s
        for (_, a), (_, b) in zip(old[s], new[s]):
            assert torch.equal(a, b), s                       # same ids, same order
            t = tables[[i for i, c in new[s] if c is b][0]]
            assert bool((route(b, cfg.tables[t], shards) == s).all())
    if not new:
        return
    counts = {s: [c.numel() for _, c in parts] for s, parts in new.items()}
    got = many.assemble(counts, replies(new), D)
    want = assemble_rows(plans, counts, replies(old), D)
    assert torch.equal(got, want)
    assert torch.equal(got[:, 0], torch.cat(ids).double().float())      # every row at its caller position
    # grads: caller order -> sent order, then split per shard and part as the ids were
    grads = torch.randn(sum(x.numel() for x in ids), D)
    g_parts = many.by_shard(many.to_sent(grads))
    for s, parts in new.items():
        for (i, x), (j, g) in zip(parts, g_parts[s]):
            assert i == j and g.shape == (x.numel(), D)
            start = sum(y.numel() for y in ids[:i])
            pos = {int(v): k for k, v in enumerate(ids[i])}
            assert torch.equal(g, grads[start + torch.tensor([pos[int(v)] for v in x], dtype=torch.int64)])


def test_fp16_replies_come_back_as_float32() -> None:
    cfg = config(2)
    tables, ids = CALLS[0]
    many = plan_many(cfg, True, tables, ids)
    new = many.by_shard(many.sent)
    counts = {s: [c.numel() for _, c in parts] for s, parts in new.items()}
    got = many.assemble(counts, replies(new, torch.float16), D)
    assert got.dtype == torch.float32
    assert torch.equal(got[:, 0], torch.cat(ids).double().half().float())


def test_a_part_with_duplicate_or_unsorted_ids_is_left_to_the_per_table_plan() -> None:
    cfg = config(2)
    assert plan_many(cfg, True, [0, 1], [distinct(1, 2), torch.tensor([4, 4, 5])]) is None
    assert plan_many(cfg, True, [0], [torch.tensor([9, 3])]) is None
    # parts may each start below the previous part's end
    assert plan_many(cfg, True, [0, 1], [distinct(50, 60), distinct(1, 2)]) is not None
    # without dedup any ids go as they are (the shard sums a duplicate's grads)
    many = plan_many(cfg, False, [0], [torch.tensor([4, 4, 5, 1])])
    assert many is not None and sorted(many.sent.tolist()) == [1, 4, 4, 5]


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
    ids = torch.randint(-20, 40, (300,), generator=g) * 1_000_003      # many duplicates
    plan = plan_ids(cfg, True, 0, ids)
    assert sorted(plan.sent.tolist()) == sorted(set(ids.tolist()))     # each distinct id once
    if native_on == "c" and shards == 1:                                # first appearances, in order
        assert plan.sent.tolist() == list(dict.fromkeys(ids.tolist()))
    shard_parts = plans_by_shard([(plan, plan.sent)])
    counts = {s: [c.numel() for _, c in parts] for s, parts in shard_parts.items()}
    for s, parts in shard_parts.items():
        assert bool((route(parts[0][1], cfg.tables[0], shards) == s).all())
    rows = assemble_rows([plan], counts, replies(shard_parts), D)
    assert torch.equal(rows[:, 0], ids.double().float())                # every row at its caller position
    # the client sums a duplicate's grads (client.push_many_async): what a per-id loop gives
    grads = torch.randn(ids.numel(), D, generator=g)
    summed = torch.zeros(plan.sent.numel(), D).index_add_(0, plan.gather, grads)
    for k, x in enumerate(plan.sent.tolist()):
        want = torch.zeros(D)
        for i in torch.nonzero(ids == x).flatten().tolist():             # in arrival order
            want += grads[i]
        assert torch.equal(summed[k], want), x


def test_dedup_of_distinct_ids_sends_them_as_they_are(native_on: str) -> None:
    # the C pass tells distinct ids in any order; torch.unique's sort only sorted ones
    ids = torch.tensor([9, 3, -5, 2**62, 7]) if native_on == "c" else torch.tensor([-5, 3, 7, 9, 2**62])
    plan = plan_ids(config(1), True, 0, ids)
    assert plan.gather is None and torch.equal(plan.sent, ids)         # no inverse to apply
    many = plan_ids(config(2), True, 0, ids)
    assert many.gather is None and sorted(many.sent.tolist()) == sorted(ids.tolist())
