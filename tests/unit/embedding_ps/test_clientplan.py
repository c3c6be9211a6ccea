"""The client's request plans: `plan_many` (every table's ids of a call routed at once) sends each
shard exactly the ids, parts and counts that the per-table `plan_ids` sends it, and its `assemble`
and `to_sent` put rows and grads where the per-table path puts them. Shards are simulated: a
shard's reply row for an id is a function of (shard, id), so a row at the wrong place or from the
wrong shard shows."""

from __future__ import annotations

import pytest
import torch

from embedding_ps import protocol as P
from embedding_ps.clientplan import assemble_rows, plan_ids, plan_many, plans_by_shard
from embedding_ps.config import PSConfig, TableConfig
from embedding_ps.sharding import route

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
