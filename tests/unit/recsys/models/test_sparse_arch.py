"""Sparse arch against a dense nn.EmbeddingBag reference, with a fake in-memory store."""

from concurrent.futures import Future

import pytest
import torch
import torch.nn.functional as F

from data.batch import Batch, KeyedJagged
from embedding_ps.wire.config import TableConfig
from recsys.models.sparse_arch import SparseArch, plan_tables

V = 50  # ids are 0..V-1 so a dense [V, D] table is the reference


class DictStore:
    """Rows of every table as dense [V, D] tensors; pushes are recorded, not applied (the sparse
    arch's part of the EmbeddingStore contract: one multi-table pull and push per group)."""

    def __init__(self, tables: dict[int, torch.Tensor]) -> None:
        self.tables = tables
        self.pushed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.many_calls = 0

    def pull_many_async(self, tables: list[int], ids: list[torch.Tensor], step: int | None = None) -> Future:
        self.many_calls += 1
        f: Future = Future()
        f.set_result(torch.cat([self.tables[t][i].clone() for t, i in zip(tables, ids)]))
        return f

    def push_many_async(self, tables: list[int], ids: list[torch.Tensor], grads: torch.Tensor,
                        step: int | None = None) -> Future:
        for t, i, g in zip(tables, ids, grads.split([x.numel() for x in ids])):
            self.pushed[t] = (i.clone(), g.clone())
        f: Future = Future()
        f.set_result(None)
        return f


def make_batch(B: int, keys: tuple[str, ...], seed: int, weights: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=g, dtype=torch.int32)
    values = torch.randint(0, V, (int(lengths.sum()),), generator=g, dtype=torch.int64)
    w = torch.rand(values.numel(), generator=g) if weights else None
    return Batch(dense=torch.randn(B, 3, generator=g), sparse=KeyedJagged(keys, values, lengths),
                 labels=torch.randint(0, 2, (B,), generator=g).float(), weights=w)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_pooled_and_row_grads_match_dense_embedding_bag(pooling: str, weighted: bool, shared) -> None:
    if weighted and pooling == "mean":
        pytest.skip("per-id weights need sum pooling")
    keys = ("a", "b", "c")
    # shared: features a and c share table t0 (bags feature-major, then stacked); else c reads
    # t2 and the features are in table order (pooled example-major straight into [B, F, D])
    tables = (TableConfig(name="t0", dim=4), TableConfig(name="t1", dim=4), TableConfig(name="t2", dim=4))
    feature_table = {0: 0, 1: 1, 2: 0 if shared else 2}
    plans = plan_tables(keys, tables, {k: f"t{feature_table[f]}" for f, k in enumerate(keys)}, {},
                        {"t0": pooling, "t1": pooling, "t2": pooling})
    g = torch.Generator().manual_seed(0)
    dense = {t: torch.randn(V, 4, generator=g) for t in range(3)}
    store = DictStore(dense)
    B = 7
    batch = make_batch(B, keys, seed=1, weights=weighted)
    lookup = SparseArch(plans).lookup(batch, store)
    pooled, linear = lookup.wait()
    assert pooled.shape == (B, 3, 4) and linear is None

    # reference: one dense EmbeddingBag per feature over leaf copies of the tables
    ref_tables = {t: w.clone().requires_grad_(True) for t, w in dense.items()}
    lengths = batch.sparse.lengths.view(3, B).long()
    starts = torch.cumsum(lengths.sum(1), 0) - lengths.sum(1)
    ref = []
    for f in range(3):
        vals = batch.sparse.values[starts[f]: starts[f] + lengths[f].sum()]
        offs = torch.cumsum(lengths[f], 0) - lengths[f]
        psw = batch.weights[starts[f]: starts[f] + lengths[f].sum()] if weighted else None
        ref.append(F.embedding_bag(vals, ref_tables[feature_table[f]], offs, mode=pooling, per_sample_weights=psw))
    ref_pooled = torch.stack(ref, dim=1)
    torch.testing.assert_close(pooled, ref_pooled)

    w = torch.randn(B, 3, 4, generator=g)
    (pooled * w).sum().backward()
    (ref_pooled * w).sum().backward()
    lookup.push(scale=0.5)
    for t in sorted(set(feature_table.values())):
        ids, grads = store.pushed[t]
        assert torch.unique(ids).numel() == ids.numel(), "pushed ids must be unique"
        torch.testing.assert_close(grads, 0.5 * ref_tables[t].grad[ids])
        untouched = torch.ones(V, dtype=torch.bool)
        untouched[ids] = False
        assert torch.all(ref_tables[t].grad[untouched] == 0)


def test_linear_tables_give_first_order_terms() -> None:
    keys = ("a", "b")
    tables = (TableConfig(name="a", dim=2), TableConfig(name="b", dim=2), TableConfig(name="a1", dim=1),
              TableConfig(name="b1", dim=1))
    plans = plan_tables(keys, tables, {}, {"a": "a1", "b": "b1"}, {})
    g = torch.Generator().manual_seed(3)
    store = DictStore({i: torch.randn(V, t.dim, generator=g) for i, t in enumerate(tables)})
    batch = make_batch(5, keys, seed=4)
    pooled, linear = SparseArch(plans).lookup(batch, store).wait()
    assert pooled.shape == (5, 2, 2) and linear.shape == (5, 2)
    lengths = batch.sparse.lengths.view(2, 5).long()
    a_vals = batch.sparse.values[: lengths[0].sum()]
    expect = F.embedding_bag(a_vals, store.tables[2], torch.cumsum(lengths[0], 0) - lengths[0], mode="sum")[:, 0]
    torch.testing.assert_close(linear[:, 0], expect)


def test_plan_errors_name_feature_and_table() -> None:
    tables = (TableConfig(name="t", dim=4),)
    with pytest.raises(ValueError, match="feature 'x' reads table 'x', which is not in ps.tables"):
        plan_tables(("x",), tables, {}, {}, {})
    with pytest.raises(ValueError, match="linear table 't' must have dim 1, got 4"):
        plan_tables(("x",), tables, {"x": "t"}, {"x": "t"}, {})


def test_weights_apply_only_to_sum_pooled_tables() -> None:
    keys = ("a", "b")
    tables = (TableConfig(name="a", dim=4), TableConfig(name="b", dim=4))
    plans = plan_tables(keys, tables, {}, {}, {"a": "sum", "b": "mean"})
    g = torch.Generator().manual_seed(7)
    store = DictStore({0: torch.randn(V, 4, generator=g), 1: torch.randn(V, 4, generator=g)})
    batch = make_batch(6, keys, seed=8, weights=True)
    pooled, _ = SparseArch(plans).lookup(batch, store).wait()
    n_a = int(batch.sparse.lengths[:6].sum())
    la, lb = batch.sparse.lengths[:6].long(), batch.sparse.lengths[6:].long()
    ref_a = F.embedding_bag(batch.sparse.values[:n_a], store.tables[0], torch.cumsum(la, 0) - la, mode="sum",
                            per_sample_weights=batch.weights[:n_a])
    ref_b = F.embedding_bag(batch.sparse.values[n_a:], store.tables[1], torch.cumsum(lb, 0) - lb, mode="mean")
    torch.testing.assert_close(pooled[:, 0], ref_a)
    torch.testing.assert_close(pooled[:, 1], ref_b)


@pytest.mark.parametrize("lengths", [[1, 1, 1, 1], [0, 1, 1, 0], [0, 2, 1, 1], [3, 0, 0, 1], [0, 0]])
@pytest.mark.parametrize("weighted", [False, True])
def test_sum_pool_backward_matches_embedding_bag(lengths, weighted) -> None:
    from recsys.models.sparse_arch import _SumPool

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(5, 3, generator=g, requires_grad=True)
    ref_rows = rows.detach().clone().requires_grad_(True)
    lens = torch.tensor(lengths)
    idx = torch.randint(0, 5, (int(lens.sum()),), generator=g)
    offs = torch.cumsum(lens, 0) - lens
    w = torch.rand(idx.numel(), generator=g) if weighted else None
    out = _SumPool.apply(rows, idx, offs, lens, w)
    ref = F.embedding_bag(idx, ref_rows, offs, mode="sum", per_sample_weights=w)
    torch.testing.assert_close(out, ref)
    up = torch.randn(out.shape, generator=g)
    (out * up).sum().backward()
    (ref * up).sum().backward()
    torch.testing.assert_close(rows.grad, ref_rows.grad)


@pytest.mark.parametrize("weighted", [False, True])
def test_one_id_per_bag_pools_and_grads_like_embedding_bag(weighted: bool) -> None:
    """Every bag holds exactly one id (the one-hot criteo layout): the example-major order is a
    transpose there, and the row gradients (sorted-embedding_bag backward) match a dense reference,
    duplicate ids across examples included."""
    keys = ("a", "b", "c")
    tables = tuple(TableConfig(name=f"t{i}", dim=4) for i in range(3))
    plans = plan_tables(keys, tables, {k: f"t{i}" for i, k in enumerate(keys)}, {}, {})
    g = torch.Generator().manual_seed(11)
    dense = {t: torch.randn(V, 4, generator=g) for t in range(3)}
    store = DictStore(dense)
    B = 9
    values = torch.randint(0, 6, (3 * B,), generator=g)          # few distinct ids: many duplicates
    w = torch.rand(3 * B, generator=g) if weighted else None
    batch = Batch(dense=torch.randn(B, 3, generator=g),
                  sparse=KeyedJagged(keys, values, torch.ones(3 * B, dtype=torch.int32)),
                  labels=torch.zeros(B), weights=w)
    lookup = SparseArch(plans).lookup(batch, store)
    pooled, _ = lookup.wait()
    ref_tables = {t: x.clone().requires_grad_(True) for t, x in dense.items()}
    ref = torch.stack([ref_tables[f][values[f * B:(f + 1) * B]] * (1 if w is None else w[f * B:(f + 1) * B, None])
                       for f in range(3)], dim=1)                  # [B, F, D]
    torch.testing.assert_close(pooled, ref)
    up = torch.randn(B, 3, 4, generator=g)
    (pooled * up).sum().backward()
    (ref * up).sum().backward()
    lookup.push()
    for t in range(3):
        ids, grads = store.pushed[t]
        torch.testing.assert_close(grads, ref_tables[t].grad[ids])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_the_c_dedup_gives_the_same_rows_pooled_and_grads_as_torch_unique(pooling: str) -> None:
    # the C dedup (embedding_ps.native.unique: ids in order of first appearance) against torch.unique
    # (sorted): the same pooled outputs, and the same gradient per id, bit for bit for sum pooling
    # (_SumPool sums a row's ids in batch order); torch's own mean-pooling backward sums a row's ids
    # in an order that depends on the row's index, so there only up to rounding
    from embedding_ps import native
    if not native.available():
        pytest.skip("native library off or unavailable")
    keys = ("a", "b", "c")
    tables = (TableConfig(name="t0", dim=8), TableConfig(name="t1", dim=8))
    plans = plan_tables(keys, tables, {"a": "t0", "b": "t1", "c": "t0"}, {}, {"t0": pooling, "t1": pooling})
    g = torch.Generator().manual_seed(3)
    dense = {t: torch.randn(V, 8, generator=g) for t in range(2)}
    batch = make_batch(64, keys, seed=4)
    w = torch.randn(64, 3, 8, generator=g)
    got = {}
    for enabled in (True, False):
        native.set_enabled(enabled)
        try:
            store = DictStore(dense)
            lookup = SparseArch(plans).lookup(batch, store)
            pooled, _ = lookup.wait()
            (pooled * w).sum().backward()
            lookup.push()
            got[enabled] = (pooled.detach(), {t: dict(zip(i.tolist(), gr)) for t, (i, gr) in store.pushed.items()},
                            [x.clone() for x in lookup.ids])
        finally:
            native.set_enabled(True)
    assert torch.equal(got[True][0], got[False][0])
    for t in got[False][1]:
        assert got[True][1][t].keys() == got[False][1][t].keys()
        for i, grad in got[False][1][t].items():
            if pooling == "sum":
                assert torch.equal(got[True][1][t][i], grad), (t, i)
            else:
                torch.testing.assert_close(got[True][1][t][i], grad, rtol=1e-6, atol=1e-7)
    # the orders differ (first appearance against sorted): the test compares what does not depend on it
    assert any(not torch.equal(a, b) for a, b in zip(got[True][2], got[False][2]))


@pytest.mark.parametrize("F_,B,high,weighted", [(26, 64, 3, True), (3, 5, 4, False), (1, 7, 2, True),
                                                (4, 1, 3, False), (5, 6, 1, True)])
def test_example_major_in_c_equals_the_torch_ops(F_: int, B: int, high: int, weighted: bool) -> None:
    # embedding_ps.native.to_example_major against _to_example_major's torch ops: the same values,
    # bags of 0..high-1 ids (high 1: every bag empty)
    from embedding_ps import native
    from recsys.models.sparse_arch import _to_example_major
    if not native.available():
        pytest.skip("native library off or unavailable")
    g = torch.Generator().manual_seed(F_ * 100 + B)
    lengths = torch.randint(0, high, (F_ * B,), generator=g, dtype=torch.int64)
    n = int(lengths.sum())
    indices = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int64)
    weights = torch.rand(n, generator=g) if weighted else None
    got = _to_example_major(indices, lengths, B, weights)
    native.set_enabled(False)
    try:
        ref = _to_example_major(indices, lengths, B, weights)
    finally:
        native.set_enabled(True)
    for a, b in zip(got, ref):
        assert (a is None and b is None) or torch.equal(a, b)
    with pytest.raises(ValueError, match="lengths"):
        native.to_example_major(indices, lengths + 1, B)
    if F_ * B >= 4:         # lengths whose int64 sum wraps around to n: refused, not written out of bounds
        huge = torch.zeros(F_ * B, dtype=torch.int64)
        huge[:4] = 2**62
        huge[3] += n
        assert int(huge.sum()) == n
        with pytest.raises(ValueError, match="lengths"):
            native.to_example_major(indices, huge, B)
    with pytest.raises(ValueError, match="weights"):
        native.to_example_major(indices, lengths, B, torch.rand(n + 1))
