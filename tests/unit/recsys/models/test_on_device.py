"""Ids on the device (`SparseArch.device_ids`, `recsys.models.on_device`), run with device = cpu: the
batched dedup against the per-table C / torch one, and a lookup, a DIN lookup, a replicated table
and a whole training run with it against the host dedup (what the CPU trainer uses)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data.batch import Batch, KeyedJagged
from embedding_ps import native
from embedding_ps.wire.config import TableConfig
from recsys.models.on_device import dedup_tables, to_device, to_host_async
from recsys.models.sequence import SequencePlan, SequenceSparseArch
from recsys.models.sparse_arch import SparseArch, plan_tables
from tests.unit.recsys.models.test_sparse_arch import V, DictStore, make_batch
from tests.unit.recsys.training.test_checkpoint import assert_same_rows, job, train


def test_dedup_tables_equals_one_unique_a_table() -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.tensor([2**62, -2**63, 2**63 - 1, -1, 0], dtype=torch.int64)
    values = [torch.randint(0, 20, (300,), generator=g), torch.zeros(0, dtype=torch.int64),
              torch.cat([big, big[[3, 0, 0]]]), torch.randint(-5, 5, (1,), generator=g),
              torch.randint(0, 20, (50,), generator=g)]       # same ids as table 0: kept apart
    uniq, inverse, counts = dedup_tables(values, counts=True)
    assert len(uniq) == len(inverse) == len(counts) == len(values)
    for v, u, inv, c in zip(values, uniq, inverse, counts):
        want, want_inv, want_counts = torch.unique(v, sorted=True, return_inverse=True, return_counts=True)
        assert u.device.type == "cpu" and c.device.type == "cpu"
        assert torch.equal(u, want) and torch.equal(inv, want_inv) and torch.equal(c, want_counts)
        assert torch.equal(u[inv], v)
        # the C dedup's set of ids and counts (its order: first appearance)
        cu, _, cc = native.unique(v, counts=True)
        assert dict(zip(cu.tolist(), cc.tolist())) == dict(zip(u.tolist(), c.tolist()))
    uniq, inverse, counts = dedup_tables([torch.zeros(0, dtype=torch.int64)] * 2)
    assert [u.numel() for u in uniq] == [0, 0] and counts is None


def test_to_device_and_to_host_on_the_cpu_are_the_tensors() -> None:
    t = torch.arange(5)
    assert to_device(t, None) is t
    assert to_device(t, torch.device("cpu")) is t
    host, event = to_host_async(t)
    assert host is t and event is None


class CountingStore(DictStore):
    """DictStore taking a row cache's `counts` (the lookup's per-id occurrences), kept per table."""

    def pull_many_async(self, tables, ids, step=None, counts=None):  # noqa: ANN001 (the Protocol's)
        self.counts = None if counts is None else {t: dict(zip(i.tolist(), c.tolist()))
                                                   for t, i, c in zip(tables, ids, counts)}
        return super().pull_many_async(tables, ids, step)


def _lookup(plans, batch, dense, device_ids: bool, arch=None, counts: bool = False):
    arch = arch or SparseArch(plans)
    arch.device_ids = device_ids
    store = CountingStore(dense)
    lookup = arch.lookup(batch, store, counts=counts)
    return arch, store, lookup


@pytest.mark.parametrize("pooling, weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_a_lookup_with_ids_on_the_device_pools_and_pushes_what_the_host_dedup_does(
        pooling: str, weighted: bool, one_hot: bool) -> None:
    keys = ("a", "b", "c", "d")
    tables = (TableConfig(name="t0", dim=4), TableConfig(name="t1", dim=4), TableConfig(name="lin", dim=1))
    # a and c share t0 (feature-major then stacked), d reads a linear table: three groups
    plans = plan_tables(keys, tables, {"a": "t0", "b": "t1", "c": "t0", "d": "t1"}, {"a": "lin", "b": "lin"},
                        {"t0": pooling, "t1": pooling, "lin": "sum"})
    g = torch.Generator().manual_seed(1)
    dense = {t: torch.randn(V, tables[t].dim, generator=g) for t in range(3)}
    B = 16
    batch = make_batch(B, keys, seed=2, weights=weighted)
    if one_hot:        # every bag one id: the transposes and _SumPool's one-id path
        batch = Batch(batch.dense, KeyedJagged(keys, torch.randint(0, V, (4 * B,), generator=g),
                                               torch.ones(4 * B, dtype=torch.int32)), batch.labels,
                      torch.rand(4 * B, generator=g) if weighted else None)
    w = torch.randn(B, 4, 4, generator=g)
    got = {}
    for device_ids in (False, True):
        _, store, lookup = _lookup(plans, batch, dense, device_ids, counts=True)
        pooled, linear = lookup.wait()
        ((pooled * w).sum() + linear.sum() * 0.5).backward()
        lookup.push(scale=0.25)
        per_id = {t: dict(zip(i.tolist(), gr)) for t, (i, gr) in store.pushed.items()}
        counts = [dict(zip(i.tolist(), c.tolist())) for i, c in zip(lookup.ids, lookup.counts)]
        got[device_ids] = pooled.detach(), linear.detach(), per_id, counts, lookup.pulled_rows
    host, dev = got[False], got[True]
    assert torch.equal(dev[0], host[0]) and torch.equal(dev[1], host[1])
    assert dev[3] == host[3] and dev[4] == host[4]
    for t in host[2]:
        assert dev[2][t].keys() == host[2][t].keys()
        for i, grad in host[2][t].items():
            if pooling == "sum":        # _SumPool sums a row's ids in batch order: bit-equal
                assert torch.equal(dev[2][t][i], grad), (t, i)
            else:
                torch.testing.assert_close(dev[2][t][i], grad, rtol=1e-6, atol=1e-7)


def test_din_behaviors_with_ids_on_the_device_equal_the_host_dedup() -> None:
    keys = ("item", "hist", "ctx")
    tables = (TableConfig(name="items", dim=4), TableConfig(name="ctx", dim=4))
    plans = plan_tables(keys, tables, {"item": "items", "hist": "items", "ctx": "ctx"}, {},
                        {"items": "sum", "ctx": "sum"})
    g = torch.Generator().manual_seed(5)
    dense = {t: torch.randn(V, 4, generator=g) for t in range(2)}
    batch = make_batch(9, keys, seed=6)
    got = {}
    for device_ids in (False, True):
        arch = SequenceSparseArch(plans, [SequencePlan("hist", 1, 0)], max_len=3)
        _, store, lookup = _lookup(plans, batch, dense, device_ids, arch=arch)
        pooled, _ = lookup.wait()
        behaviors, mask = arch.behaviors(lookup)
        (behaviors.square().sum() + pooled.sum()).backward()
        lookup.push()
        got[device_ids] = (behaviors.detach(), mask, {t: dict(zip(i.tolist(), gr)) for t, (i, gr) in
                                                      store.pushed.items()})
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    for t, rows in got[False][2].items():
        assert got[True][2][t].keys() == rows.keys()
        for i, grad in rows.items():
            torch.testing.assert_close(got[True][2][t][i], grad, rtol=1e-6, atol=1e-7)


def test_a_replicated_table_with_ids_on_the_device(tmp_path: Path) -> None:
    from recsys.models.replicated import ReplicatedTables
    keys = ("a", "b")
    tables = (TableConfig(name="small", dim=4, placement="replicated"), TableConfig(name="big", dim=4))
    plans = plan_tables(keys, tables, {"a": "small", "b": "big"}, {}, {"small": "sum", "big": "sum"})
    vocab = {"small": np.arange(0, V, 2, dtype=np.int64)}          # odd ids: default rows
    g = torch.Generator().manual_seed(7)
    dense = {1: torch.randn(V, 4, generator=g)}
    batch = make_batch(12, keys, seed=8)
    got = {}
    for device_ids in (False, True):
        rep = ReplicatedTables({"small": tables[0]}, vocab)
        arch = SparseArch(plans)
        arch.use_replicated(rep)
        _, store, lookup = _lookup(plans, batch, dense, device_ids, arch=arch)
        pooled, _ = lookup.wait()
        pooled.square().sum().backward()
        assert len(lookup.push()) == 1                           # only big's group goes to the store
        got[device_ids] = pooled.detach(), rep.weight["small"].grad.clone(), store.pushed[1]
    assert torch.equal(got[True][0], got[False][0])
    assert torch.equal(got[True][1], got[False][1])
    host = dict(zip(got[False][2][0].tolist(), got[False][2][1]))
    dev = dict(zip(got[True][2][0].tolist(), got[True][2][1]))
    assert host.keys() == dev.keys() and all(torch.equal(host[i], dev[i]) for i in host)


@pytest.fixture(scope="module")
def data_dir(tiny_dataset) -> Path:
    return tiny_dataset(rows=20 * 64, files=1, seed=3, row_group_rows=300)


def test_training_with_ids_on_the_device_ends_where_the_host_dedup_ends(tmp_path: Path, data_dir: Path,
                                                                         monkeypatch) -> None:
    """A sync run of the tiny job (2 shards, multi-hot features, dense + tables trained) with the
    trainer's sparse arch set to device_ids on the CPU: the same losses and the same rows and
    optimizer state on the shards as the host dedup's run."""
    from recsys.training import trainer as trainer_mod
    results = {}
    step = trainer_mod.Trainer.train_step
    for device_ids in (False, True):
        built, losses = trainer_mod.build_job_model, []

        def build(cfg, _built=built, _on=device_ids):
            sparse, model = _built(cfg)
            sparse.device_ids = _on
            return sparse, model

        def train_step(self, *args, _losses=losses, **kwargs):
            _losses.append(step(self, *args, **kwargs))
            return _losses[-1]
        monkeypatch.setattr(trainer_mod, "build_job_model", build)
        monkeypatch.setattr(trainer_mod.Trainer, "train_step", train_step)
        cfg = job(tmp_path / f"run-{device_ids}", data_dir, "train.max_steps=12", "ps.mode='sync'")
        trainer, store = train(cfg)
        assert trainer.sparse.device_ids is device_ids and len(losses) == 12
        results[device_ids] = trainer, store, losses
        monkeypatch.undo()
    (t_host, s_host, l_host), (t_dev, s_dev, l_dev) = results[False], results[True]
    assert l_dev == pytest.approx(l_host, rel=1e-6, abs=1e-7)
    for (name, p), q in zip(t_host.model.state_dict().items(), t_dev.model.state_dict().values()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    assert_same_rows(s_host, s_dev)


@pytest.mark.parametrize("device_ids", [False, True])
def test_a_pull_ahead_lookup_reads_the_replicated_table_as_the_optimizer_left_it(device_ids: bool) -> None:
    """A lookup issued before step t's optimizer update (async pull-ahead) pools the replicated table's
    weight after that update, whether or not some of its ids miss the vocabulary (the default rows
    are joined to the weight when the step reads them, not when the lookup is issued)."""
    from recsys.models.replicated import ReplicatedTables
    tables = (TableConfig(name="small", dim=4, placement="replicated"),)
    plans = plan_tables(("a",), tables, {"a": "small"}, {}, {"small": "sum"})
    rep = ReplicatedTables({"small": tables[0]}, {"small": np.arange(0, V, 2, dtype=np.int64)})
    arch = SparseArch(plans)
    arch.use_replicated(rep)
    arch.device_ids = device_ids
    for ids in ([0, 2, 4, 6], [0, 2, 3, 5]):                  # all in the vocabulary; two misses
        batch = Batch(torch.zeros(4, 1), KeyedJagged(("a",), torch.tensor(ids), torch.ones(4, dtype=torch.int32)),
                      torch.zeros(4), None)
        lookup = arch.lookup(batch, CountingStore({}))
        with torch.no_grad():
            rep.weight["small"].add_(1.0)                      # the previous step's optimizer update
        pooled, _ = lookup.wait()
        want = rep.rows("small", torch.tensor(ids))[0][rep.rows("small", torch.tensor(ids))[1]]
        assert torch.equal(pooled[:, 0], want.detach()), ids


def test_the_replicated_tables_searched_at_once_give_what_one_search_a_table_gives() -> None:
    from recsys.models.replicated import ReplicatedTables
    configs = {n: TableConfig(name=n, dim=4, placement="replicated", unadmitted=u, seed=s)
               for n, u, s in (("a", "zeros", 1), ("b", "init", 2), ("c", "init", 3), ("d", "init", 4))}
    vocab = {"a": np.arange(0, 40, 2), "b": np.arange(10), "c": np.array([], dtype=np.int64), "d": np.arange(5)}
    rep = ReplicatedTables(configs, vocab)
    items = [("a", torch.tensor([0, 2, 4, 2])), ("b", torch.tensor([3, 11, 11, 12, 0])),     # all hit; misses
             ("c", torch.tensor([7, 7])), ("d", torch.zeros(0, dtype=torch.int64))]            # empty vocab; no ids
    many = rep.rows_parts_many(items)
    for (name, ids), (weight, extra, pos) in zip(items, many):
        one = rep.rows_parts(name, ids)
        assert weight is rep.weight[name] and torch.equal(pos, one[2])
        assert (extra is None) == (one[1] is None) and (extra is None or torch.equal(extra, one[1]))
        rows, idx = rep.rows(name, ids)
        full = weight if extra is None else torch.cat([weight, extra])
        assert torch.equal(full[pos], rows[idx])
    assert many[0][1] is None and many[1][1].shape == (2, 4) and many[2][1].shape == (1, 4) and many[3][1] is None
