"""Replicated tables (recsys.models.replicated): vocabulary, lookup, optimizers, placement decisions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from data.config import DataConfig
from data.hashing import hash_strings
from data.vocab import distinct_ids
from embedding_ps.wire.config import TableConfig
from embedding_ps.init import init_rows
from recsys.config import ConfigError, load_config
from recsys.models.replicated import (ReplicatedTables, TableOptimizer, resolve_placement,
                                      table_bytes)
from recsys.models.sparse_arch import SparseArch, plan_tables

ROOT = Path(__file__).resolve().parents[4]


def test_distinct_ids_reads_ints_lists_strings_and_skips_nulls(tmp_path: Path) -> None:
    a = pa.table({"u": pa.array([5, 3, None, 5], pa.int64()),
                  "m": pa.array([[1, 2], None, [2, 9], []], pa.list_(pa.int64())),
                  "s": pa.array(["x", "y", "x", None]), "label": pa.array([0, 1, 0, 1], pa.float32())})
    pq.write_table(a, tmp_path / "a.parquet", row_group_size=2)
    b = a.replace_schema_metadata(None).slice(0, 1)
    b = b.set_column(0, "u", pa.array([-7], pa.int64()))
    pq.write_table(b, tmp_path / "b.parquet")
    cfg = DataConfig(sparse_columns=("u", "m", "s"))
    got = distinct_ids(cfg, [str(tmp_path)], ["u", "m", "s"])
    assert got["u"].tolist() == [-7, 3, 5]
    assert got["m"].tolist() == [1, 2, 9]
    assert got["s"].tolist() == sorted(hash_strings(pa.array(["x", "y"])).tolist())


def _tables(opt: str = "adam", **kw) -> tuple[dict[str, TableConfig], dict[str, np.ndarray]]:
    tc = TableConfig(name="t", dim=4, optimizer=opt, lr=0.1, placement="replicated", seed=3, **kw)
    return {"t": tc}, {"t": np.array([-5, 2, 10, 40], np.int64)}


def test_rows_maps_ids_to_their_rows_and_unknown_ids_to_the_default_row() -> None:
    configs, vocab = _tables()
    rt = ReplicatedTables(configs, vocab)
    ids = torch.tensor([10, -5, 10, 7, 40, 7, 99])
    rows, idx = rt.rows("t", ids)
    # the vocabulary's rows start at the PS's init rows; unknown ids 7 and 99 follow, once each
    torch.testing.assert_close(rt.weight["t"].detach(), init_rows(torch.tensor([-5, 2, 10, 40]), 4, 3, "uniform", 0.01))
    assert idx.tolist() == [2, 0, 2, 4, 3, 4, 5]
    assert rows.shape == (6, 4)
    torch.testing.assert_close(rows[4:], init_rows(torch.tensor([7, 99]), 4, 3, "uniform", 0.01))
    # all known: the parameter itself (no copy), and gradients reach it
    rows, idx = rt.rows("t", torch.tensor([2, 40]))
    assert rows is rt.weight["t"]
    configs["t"] = dataclasses.replace(configs["t"], unadmitted="zeros")
    rows, _ = ReplicatedTables(configs, vocab).rows("t", torch.tensor([1234]))
    assert rows[-1].abs().sum() == 0


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_table_optimizer_equals_torch_on_an_embedding(opt: str, mode: str) -> None:
    """Every row moves every step (decay and moments included), as torch's optimizers move an nn.Embedding."""
    configs, vocab = _tables(opt, weight_decay=0.05, weight_decay_mode=mode)
    tc = configs["t"]
    rt = ReplicatedTables(configs, vocab)
    ref = nn.Embedding(4, 4)
    with torch.no_grad():
        ref.weight.copy_(rt.weight["t"])
    wd = tc.weight_decay if mode == "l2" else 0.0
    kinds = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=wd),
             "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, eps=tc.eps, weight_decay=wd),
             "adam": lambda p: torch.optim.Adam(p, lr=0.1, eps=tc.eps, weight_decay=wd)}
    ropt = kinds[opt]([ref.weight])
    topt = TableOptimizer(rt)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        ids = torch.tensor([10, 10, 2]) if step % 2 else torch.tensor([-5])     # row 40 never touched
        target = torch.randn(ids.numel(), 4, generator=g)
        rows, idx = rt.rows("t", ids)
        ((rows[idx] - target) ** 2).sum().backward()
        topt.step()
        topt.zero_grad()
        ((ref(torch.searchsorted(torch.tensor([-5, 2, 10, 40]), ids)) - target) ** 2).sum().backward()
        if mode == "decoupled":
            with torch.no_grad():
                ref.weight.mul_(1 - 0.1 * 0.05)
        ropt.step()
        ropt.zero_grad()
    torch.testing.assert_close(rt.weight["t"].detach(), ref.weight.detach(), atol=1e-6, rtol=0)
    # the untouched row decayed (and, with Adam, kept moving on its moments... here it never had any)
    if opt == "sgd":
        assert not torch.equal(rt.weight["t"][3], init_rows(torch.tensor([40]), 4, 3, "uniform", 0.01)[0])


def test_rowwise_adagrad_by_hand() -> None:
    configs, vocab = _tables("rowwise_adagrad", eps=0.0, initial_accumulator=1.0)
    rt = ReplicatedTables(configs, vocab)
    w0 = rt.weight["t"].detach().clone()
    grad = torch.zeros(4, 4)
    grad[1] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rt.weight["t"].grad = grad.clone()
    TableOptimizer(rt).step()
    h = 1.0 + (1 + 4 + 9 + 16) / 4                       # 8.5
    expect = w0.clone()
    expect[1] -= 0.1 * grad[1] / h ** 0.5
    torch.testing.assert_close(rt.weight["t"].detach(), expect)


def test_state_round_trip_and_checks() -> None:
    configs, vocab = _tables()
    rt = ReplicatedTables(configs, vocab)
    with torch.no_grad():
        rt.weight["t"].add_(1.0)
    state = rt.state()
    other = build_replicated_from(configs, state)
    torch.testing.assert_close(other.weight["t"].detach(), rt.weight["t"].detach())
    assert other.keys["t"].tolist() == [-5, 2, 10, 40]
    bad = dict(state)
    bad["t.weight"] = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="replicated table 't'.*dim 4"):
        rt.load_state(bad, where="ckpt")
    with pytest.raises(ValueError, match="not saved there"):
        rt.load_state({}, where="ckpt")


def build_replicated_from(configs, state):
    rt = ReplicatedTables(configs, {n: np.zeros(0, np.int64) for n in configs})
    rt.load_state(state)
    return rt


def _onehot_job(tmp_path: Path, tiny_dataset, *overrides: str):
    data = tiny_dataset(rows=2000, files=1, seed=3)
    return load_config(ROOT / "configs" / "tiny.toml", [f"data.train_paths=['{data}']", "data.eval_paths=[]",
                                                         f"train.run_dir='{tmp_path / 'run'}'", *overrides])


def _placed(cfg, **placement):
    tables = tuple(dataclasses.replace(t, placement=placement.get(t.name, t.placement)) for t in cfg.ps.tables)
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))


def test_auto_replicates_small_tables_and_keeps_big_ones_on_the_ps(tmp_path: Path, tiny_dataset) -> None:
    cfg = _onehot_job(tmp_path, tiny_dataset)
    cfg = _placed(cfg, **{t.name: "auto" for t in cfg.ps.tables})
    counts = {n: v.size for n, v in resolve_placement(cfg).vocab.items()}
    assert set(counts) == {t.name for t in cfg.ps.tables}              # all small: all replicated
    limit = sorted(counts.values())[2]                                  # the 3 smallest fit
    cfg2 = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, replicate_max_rows=limit))
    placed = resolve_placement(cfg2)
    rep = {t.name for t in placed.config.ps.tables if t.placement == "replicated"}
    assert rep == {n for n, c in counts.items() if c <= limit}
    assert all(t.placement in ("ps", "replicated") for t in placed.config.ps.tables)
    big = max(counts, key=counts.get)
    assert placed.report[big]["placement"] == "ps" and "replicate_max_rows" in placed.report[big]["why"]
    # a byte budget that holds only the smallest table
    smallest = min(counts, key=counts.get)
    tc = next(t for t in cfg.ps.tables if t.name == smallest)
    cfg3 = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, replicate_max_bytes=table_bytes(tc, counts[smallest])))
    assert {t.name for t in resolve_placement(cfg3).config.ps.tables if t.placement == "replicated"} == {smallest}


def test_a_replicated_table_over_the_byte_budget_is_a_config_error(tmp_path: Path, tiny_dataset) -> None:
    cfg = _placed(_onehot_job(tmp_path, tiny_dataset, "ps.replicate_max_bytes=100"), C3="replicated")
    with pytest.raises(ConfigError, match=r"ps.tables\[C3\].placement = 'replicated'.*ps.replicate_max_bytes = 100"):
        resolve_placement(cfg)


def test_placement_config_checks() -> None:
    with pytest.raises(ValueError, match="ftrl"):
        TableConfig(name="a", dim=4, optimizer="ftrl", placement="replicated")
    with pytest.raises(ValueError, match="dynamic"):
        TableConfig(name="a", dim=4, kind="hashed", num_embeddings=10, placement="replicated")
    with pytest.raises(ConfigError, match="placement"):
        load_config(ROOT / "configs" / "tiny.toml", ["ps.table_defaults.placement='everywhere'"])


def test_sparse_arch_pools_replicated_tables_from_their_parameter() -> None:
    """A job mixing PS and replicated tables pools each feature from the right rows; gradients of the
    replicated rows land on the parameter, only the PS group is pushed."""
    from embedding_ps.wire.config import PSConfig
    from embedding_ps.local import LocalStore
    from data.batch import Batch, KeyedJagged

    tables = (TableConfig(name="a", dim=2, placement="replicated", init="normal", init_scale=1.0),
              TableConfig(name="b", dim=2, init="normal", init_scale=1.0))
    plans = plan_tables(("a", "b"), tables, {}, {}, {"a": "mean"})
    arch = SparseArch(plans)
    rt = ReplicatedTables({"a": tables[0]}, {"a": np.array([1, 2, 3], np.int64)})
    arch.use_replicated(rt)
    store = LocalStore.create(PSConfig(tables=tables))
    kj = KeyedJagged(keys=("a", "b"), values=torch.tensor([1, 3, 2, 9, 7, 8, 6]),
                     lengths=torch.tensor([2, 1, 1, 1, 1, 1], dtype=torch.int32))   # a: [1, 3], [2], [9]; b: 7, 8, 6
    batch = Batch(dense=torch.zeros(3, 0), sparse=kj, labels=torch.zeros(3))
    look = arch.lookup(batch, store)
    pooled, _ = look.wait()                                                  # [3, 2, 2]
    w = rt.weight["a"]
    torch.testing.assert_close(pooled[0, 0], (w[0] + w[2]).detach() / 2)
    torch.testing.assert_close(pooled[1, 0], w[1].detach())
    torch.testing.assert_close(pooled[2, 0], init_rows(torch.tensor([9]), 2, 0, "normal", 1.0)[0])   # unknown id
    torch.testing.assert_close(pooled[:, 1], store.pull(1, torch.tensor([7, 8, 6])))
    pooled.sum().backward()
    torch.testing.assert_close(w.grad, torch.tensor([[0.5, 0.5], [1.0, 1.0], [0.5, 0.5]]))
    assert len(look.push()) == 1                                             # only b's group goes to the PS
