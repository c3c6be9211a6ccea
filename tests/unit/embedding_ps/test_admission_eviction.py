"""Admission (min_count, admit_probability), TTL sweeps, LFU eviction, bounded memory, eviction log."""

import numpy as np
import pytest
import torch

from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.init import init_rows
from embedding_ps.shard.state import ShardState


def state_with(**kw) -> ShardState:
    kw.setdefault("optimizer", "sgd")
    kw.setdefault("lr", 1.0)
    return ShardState(PSConfig(tables=(TableConfig(name="t", dim=2, **kw),)), 0)


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def init_of(*xs: int) -> torch.Tensor:
    return init_rows(ids(*xs), 2, 0, "uniform", 0.01)


@pytest.mark.parametrize("unadmitted", ["init", "zeros"])
def test_min_count_admits_on_the_nth_sighting(unadmitted: str) -> None:
    s = state_with(min_count=3, unadmitted=unadmitted)
    g = torch.ones(1, 2)
    waiting = init_of(10) if unadmitted == "init" else torch.zeros(1, 2)
    for step in range(2):
        s.push(0, ids(10), g, step)  # sightings 1 and 2: gradient dropped
        torch.testing.assert_close(s.pull(0, ids(10)), waiting)
        assert s.stats()["t/rows"] == 0 and s.stats()["t/pending"] == 1
    s.push(0, ids(10, 10), torch.ones(2, 2), step=2)  # 3rd sighting (one per push): admitted, gradient applied
    torch.testing.assert_close(s.pull(0, ids(10)), init_of(10) - 2.0)
    st = s.stats()
    assert (st["t/rows"], st["t/pending"], st["t/admitted"], st["t/dropped_grads"]) == (1, 0, 1, 2)


def test_admit_probability_is_seeded_and_about_right() -> None:
    many = torch.arange(4000)
    a, b = state_with(admit_probability=0.25), state_with(admit_probability=0.25)
    a.push(0, many, torch.zeros(4000, 2), step=5)
    b.push(0, many.flip(0), torch.zeros(4000, 2), step=5)  # other order, same coins
    ka, kb = a.dump_table(0)[0], b.dump_table(0)[0]
    assert torch.equal(ka, kb)
    assert 850 < len(ka) < 1150
    a.push(0, many, torch.zeros(4000, 2), step=6)  # a new step flips new coins: more get in
    assert len(ka) + 600 < a.stats()["t/rows"] < len(ka) + 900


def test_min_count_with_probability_counts_only_lucky_sightings() -> None:
    s = state_with(min_count=2, admit_probability=0.5)
    many = torch.arange(2000)
    for step in range(2):
        s.push(0, many, torch.zeros(2000, 2), step)
    rows = s.stats()["t/rows"]
    assert 350 < rows < 650  # both coins must come up: ~1/4 of the ids


def test_pending_counts_are_bounded() -> None:
    s = state_with(min_count=2, max_pending=500)
    for step in range(20):
        s.push(0, torch.arange(step * 300, step * 300 + 300), torch.zeros(300, 2), step)
        assert s.stats()["t/pending"] <= 500
    assert s.stats()["t/rows"] == 0 and s.stats()["t/pending_dropped"] > 0


def test_ttl_sweep_drops_rows_unseen_for_ttl_steps_and_logs_them() -> None:
    s = state_with(ttl_steps=3, min_count=2)
    s.push(0, ids(1, 2), torch.zeros(2, 2), step=0)
    s.push(0, ids(1, 2), torch.zeros(2, 2), step=1)  # both admitted at step 1
    s.push(0, ids(2, 9), torch.ones(2, 2), step=2)  # 2 seen again, 9 waits
    assert s.sweep(3) == {"evicted_ttl": 0, "pending_dropped": 0, "t/evicted_ttl": 0, "t/pending_dropped": 0}
    out = s.sweep(4)  # 4 - 1 >= 3: id 1 goes; id 2 (seen at 2) stays; pending 9 (seen at 2) stays
    assert (out["evicted_ttl"], out["pending_dropped"]) == (1, 0)
    assert s.dump_table(0)[0].tolist() == [2]
    torch.testing.assert_close(s.pull(0, ids(1)), init_of(1))  # back to its init row
    out = s.sweep(5)  # now id 2 (seen at 2) and pending id 9 (seen at 2) go too
    assert (out["evicted_ttl"], out["pending_dropped"]) == (1, 1)
    log_keys, log_steps = s.eviction_log(0)
    assert (log_keys.tolist(), log_steps.tolist()) == ([1, 2], [4, 5])
    s.truncate_eviction_log(0, through_step=4)
    assert [t.tolist() for t in s.eviction_log(0)] == [[2], [5]]
    assert s.stats()["t/rows"] == 0 and s.stats()["t/evicted_ttl"] == 2


def test_lfu_evicts_least_frequent_then_oldest_then_smallest_id() -> None:
    s = state_with(max_rows=3)
    z = lambda n: torch.zeros(n, 2)  # noqa: E731
    s.push(0, ids(1, 2, 3), z(3), step=0)
    s.push(0, ids(1, 2), z(2), step=1)  # counts 1:2, 2:2, 3:1
    s.push(0, ids(4), z(1), step=2)  # 4 rows: evict count 1 & oldest -> 3
    assert s.dump_table(0)[0].tolist() == [1, 2, 4]
    s.push(0, ids(6, 5), z(2), step=3)  # 5 rows: 4 (count 1, step 2) goes, then 5 vs 6 tie -> smaller id 5
    assert s.dump_table(0)[0].tolist() == [1, 2, 6]
    keys, steps = s.eviction_log(0)
    assert keys.tolist() == [3, 4, 5] and steps.tolist() == [2, 3, 3]
    st = s.stats()
    assert (st["t/evicted_lfu"], st["t/rows"], st["t/slots_used"], st["t/free_slots"]) == (3, 3, 5, 2)
    s.push(0, ids(7), z(1), step=4)  # a freed slot is reused: no new slot
    assert (s.stats()["t/slots_used"], s.stats()["t/free_slots"]) == (5, 2)


def test_memory_stays_bounded_under_a_flood_of_new_ids() -> None:
    s = state_with(max_rows=2000, eviction_log_max=50_000)
    batch = 20_000
    seen_bytes = []
    for i in range(50):  # 1e6 distinct new ids
        s.push(0, torch.arange(i * batch, (i + 1) * batch), torch.zeros(batch, 2), step=i)
        st = s.stats()
        assert st["t/rows"] <= 2000 and st["t/eviction_log"] <= 50_000
        seen_bytes.append(st["t/bytes_reserved"])
    assert st["t/evicted_lfu"] == 1_000_000 - 2000
    assert st["t/capacity"] <= 2 * (2000 + batch)
    assert max(seen_bytes[10:]) == seen_bytes[10]  # no growth after warm-up
    assert seen_bytes[-1] < 4_000_000  # a few MB, not 1e6 rows' worth
    assert s.tables[0].evlog_lost_through >= 0  # old log entries were dropped, and that is recorded


def test_pending_memory_bounded_under_flood_with_min_count() -> None:
    s = state_with(min_count=2, max_pending=10_000)
    for i in range(50):
        s.push(0, torch.arange(i * 20_000, (i + 1) * 20_000), torch.zeros(20_000, 2), step=i)
        assert s.stats()["t/pending"] <= 10_000
    assert s.stats()["t/bytes"] < 2_000_000
    assert np.isfinite(s.stats()["t/bytes"])


def test_reused_slots_start_from_init_row_and_fresh_optimizer_state() -> None:
    from tests.optim_reference import ReferenceTable

    cfg = TableConfig(name="t", dim=2, optimizer="rowwise_adagrad", lr=0.5, ttl_steps=1, initial_accumulator=0.25)
    s = ShardState(PSConfig(tables=(cfg,)), 0)
    g = torch.Generator().manual_seed(0)
    old = torch.arange(100, 140)
    s.push(0, old, torch.randn(40, 2, generator=g), step=0)
    s.sweep(1)  # all 40 rows evicted, their slots freed
    assert s.stats()["t/free_slots"] == 40
    ref = ReferenceTable(cfg, lambda k: init_rows(torch.tensor([k]), 2, 0, "uniform", 0.01)[0])
    new = torch.cat([torch.arange(0, 30), old[:20]])  # 50 ids: 40 reuse freed slots, 10 fresh
    for step in (2, 3):
        grads = torch.randn(50, 2, generator=g)
        s.push(0, new, grads, step)
        ref.push(new, grads)
    assert s.stats()["t/slots_used"] == 50
    keys, rows, st = s.dump_table(0)
    assert keys.tolist() == sorted(ref.rows)
    torch.testing.assert_close(rows, torch.stack([ref.rows[k][0] for k in keys.tolist()]))
    torch.testing.assert_close(st["sum_sq"], torch.stack([ref.rows[k][1]["sum_sq"] for k in keys.tolist()]))
    assert st["count"].tolist() == [2] * 50
