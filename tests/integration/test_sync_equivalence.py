"""Sync mode is exact: W trainers + S shards end where one plain-PyTorch process ends.

The job runs for real (`recsys train` path: PS shard processes, trainers under
torch.distributed.elastic, gloo DDP). The reference is one process with nn.EmbeddingBag tables,
the same dense model and optimizer, and the PS optimizer's own per-row math
(`tests/optim_reference.reference_update`), trained on the concatenation of the ranks' batches.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from data.loader import ParquetLoader
from embedding_ps.init import init_rows
from embedding_ps.local import LocalStore
from embedding_ps.shard.optim import fill_value, state_specs
from tests.optim_reference import reference_update
from recsys.config import JobConfig, load_config
from recsys.models import build_model
from recsys.training.launch import launch_train

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
BATCH = 32


@pytest.fixture(scope="module")
def tiny_data(tiny_dataset) -> Path:
    out = tiny_dataset(rows=4 * STEPS * BATCH, files=3, seed=5, row_group_rows=500)
    return out


def job(tmp_path: Path, data: Path, trainers: int, shards: int, optimizer: str) -> JobConfig:
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", f"data.batch_size={BATCH}",
        "data.shuffle_buffer_rows=64", "data.drop_last=true",
        f"ps.num_shards={shards}", "ps.mode='sync'", f"train.num_trainers={trainers}",
        f"train.max_steps={STEPS}", f"train.run_dir='{tmp_path / 'run'}'", "train.log_every=5",
        "train.num_threads=1",
    ])
    return _with_optimizer(cfg, optimizer)


def _with_optimizer(cfg: JobConfig, optimizer: str) -> JobConfig:
    import dataclasses

    tables = tuple(dataclasses.replace(t, optimizer=optimizer, lr=0.05 if optimizer != "adam" else 0.01)
                   for t in cfg.ps.tables)
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))


def global_batches(cfg: JobConfig, world: int, steps: int = STEPS):
    """Per step, every rank's batch (rank order), read exactly as the trainers read them."""
    loaders = [ParquetLoader(cfg.data, cfg.data.train_paths, rank=r, world_size=world) for r in range(world)]
    try:
        for loader in loaders:
            loader.set_epoch(0)
        its = [iter(loader) for loader in loaders]
        for _ in range(steps):
            yield [next(it) for it in its]
    finally:
        for loader in loaders:
            loader.close()


class Reference:
    """One process: nn.EmbeddingBag per table over the ids of the data, the same dense model."""

    def __init__(self, cfg: JobConfig, vocab: dict[str, torch.Tensor]) -> None:
        """Tables with placement = "replicated" train like a plain PyTorch model's: their whole weight
        by torch.optim.Adam (weight decay on every row, every step); the others as the PS does."""
        self.cfg = cfg
        self.tables = {t.name: t for t in cfg.ps.tables}
        self.vocab = vocab                                  # table -> sorted ids [V]
        self.bags = {}
        self.state = {}
        for name, ids in vocab.items():
            t = self.tables[name]
            bag = nn.EmbeddingBag(ids.numel(), t.dim, mode=cfg.model.table_pooling.get(name, "sum"))
            with torch.no_grad():
                bag.weight.copy_(init_rows(ids, t.dim, t.seed, t.init, t.init_scale))
            self.bags[name] = bag
            self.state[name] = [
                {s.name: torch.full((t.dim,) if s.per_coordinate else (), fill_value(t, s), dtype=s.dtype)
                 for s in state_specs(t)} for _ in range(ids.numel())
            ]
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, num_dense=len(cfg.data.dense_columns),
                                 num_sparse=len(cfg.data.sparse_columns), embedding_dim=cfg.ps.tables[0].dim)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=cfg.train.dense_lr)
        self.replicated = {name: torch.optim.Adam([self.bags[name].weight], lr=t.lr, betas=(t.beta1, t.beta2),
                                                  eps=t.eps, weight_decay=t.weight_decay)
                           for name, t in self.tables.items() if t.placement == "replicated"}
        assert all(self.tables[n].optimizer == "adam" for n in self.replicated)

    def step(self, batches) -> None:
        dense = torch.cat([b.dense for b in batches])
        labels = torch.cat([b.labels for b in batches])
        pooled = []
        for feature in self.cfg.data.sparse_columns:
            values, lengths = [], []
            for b in batches:
                j = b.sparse[feature]
                values.append(j.values)
                lengths.append(j.lengths.long())
            values, lengths = torch.cat(values), torch.cat(lengths)
            local = torch.searchsorted(self.vocab[feature], values)
            pooled.append(self.bags[feature](local, torch.cumsum(lengths, 0) - lengths))
        logits = self.model(dense, torch.stack(pooled, dim=1), None)
        weight = None                     # data.example_weight_column, times 1 / r on negatives ("weight")
        if batches[0].example_weights is not None:
            weight = torch.cat([b.example_weights for b in batches])
        d = self.cfg.data
        if d.negative_sampling_correction == "weight" and d.negative_sampling_rate < 1:
            neg = torch.where(labels == 0, 1.0 / d.negative_sampling_rate, 1.0)
            weight = neg if weight is None else weight * neg
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels, weight=weight)   # sum(w l) / B
        for bag in self.bags.values():
            bag.zero_grad()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        for opt in self.replicated.values():
            opt.step()
        for feature in self.cfg.data.sparse_columns:            # the PS's sparse update, row by row
            if feature in self.replicated:
                continue
            touched = torch.unique(torch.cat([torch.searchsorted(self.vocab[feature], b.sparse[feature].values)
                                              for b in batches]))
            w, g = self.bags[feature].weight, self.bags[feature].weight.grad
            with torch.no_grad():
                for r in touched.tolist():
                    reference_update(self.tables[feature], w[r], self.state[feature][r], g[r].clone())


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.parametrize("trainers, shards", [(1, 1), (2, 2)])
def test_sync_training_equals_one_process_reference(tmp_path: Path, tiny_data: Path, trainers: int,
                                                    shards: int, optimizer: str) -> None:
    cfg = job(tmp_path, tiny_data, trainers, shards, optimizer)
    launch_train(cfg)
    check_equals_reference(cfg, tmp_path / "run", trainers, STEPS)


UNEVEN_ROWS = 645          # 2 ranks: 322 and 323 rows = 10 batches of 32, then 2 and 3 rows


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_sync_is_exact_when_ranks_batches_differ_in_size(tmp_path: Path, tiny_dataset, optimizer: str) -> None:
    """data.drop_last = false: the epoch's last step has a 2-row and a 3-row batch. Each rank weights
    its loss and row gradients by its share of the global batch, so the job still equals one
    process on the concatenation (the loss a mean over all 5 rows)."""
    data = tiny_dataset(rows=UNEVEN_ROWS, files=1, seed=9, row_group_rows=100)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", f"data.batch_size={BATCH}",
        "data.shuffle_buffer_rows=64", "data.drop_last=false", "ps.num_shards=2", "ps.mode='sync'",
        "train.num_trainers=2", "train.epochs=1", f"train.run_dir='{tmp_path / 'run'}'", "train.log_every=5",
        "train.num_threads=1"])
    cfg = _with_optimizer(cfg, optimizer)
    steps = list(global_batches(cfg, 2, steps=11))
    assert sorted(b.batch_size for b in steps[-1]) == [2, 3] and all(b.batch_size == BATCH for bs in steps[:-1] for b in bs)
    launch_train(cfg)
    check_equals_reference(cfg, tmp_path / "run", 2, 11)


def test_sync_is_exact_with_example_weights_and_negative_weighting(tmp_path: Path, tiny_dataset) -> None:
    """Per-row loss weights (an example weight column, negatives times 1 / r) on the uneven last step:
    the loss is sum(w l) / B on every rank, so the shares still add up to one process's loss."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tiny_dataset(rows=UNEVEN_ROWS, files=1, seed=9, row_group_rows=100) / "part-00000.parquet"
    table = pq.read_table(src)
    weights = np.random.default_rng(0).random(table.num_rows).astype(np.float32) * 3
    data = tmp_path / "weighted.parquet"
    pq.write_table(table.append_column("ew", pa.array(weights)), data, row_group_size=100)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", f"data.batch_size={BATCH}",
        "data.shuffle_buffer_rows=64", "data.drop_last=false", "ps.num_shards=2", "ps.mode='sync'",
        "train.num_trainers=2", "train.epochs=1", f"train.run_dir='{tmp_path / 'run'}'", "train.log_every=5",
        "train.num_threads=1", "data.example_weight_column='ew'", "data.negative_sampling_rate=0.25",
        "data.negative_sampling_correction='weight'"])
    launch_train(cfg)
    check_equals_reference(cfg, tmp_path / "run", 2, 11)


def check_equals_reference(cfg: JobConfig, run: Path, trainers: int, num_steps: int) -> None:
    """The run's dense weights and table rows equal the one-process reference's (1e-5)."""
    assert json.loads((run / "metrics.json").read_text())["steps"] == num_steps
    steps = list(global_batches(cfg, trainers, num_steps))
    vocab = {f: torch.unique(torch.cat([b.sparse[f].values for bs in steps for b in bs]))
             for f in cfg.data.sparse_columns}
    replicated = {}
    if (run / "model" / "replicated.pt").exists():   # those tables hold every id of the training data
        replicated = torch.load(run / "model" / "replicated.pt", weights_only=True)
        vocab.update({t.name: replicated[f"{t.name}.ids"] for t in cfg.ps.tables if t.placement == "replicated"})
    ref = Reference(cfg, vocab)
    for batches in steps:
        ref.step(batches)

    dense = torch.load(run / "model" / "dense.pt", weights_only=True)
    for name, p in ref.model.state_dict().items():
        torch.testing.assert_close(dense[name], p, atol=1e-5, rtol=0, msg=f"dense {name}")
    store = LocalStore.from_dir(cfg.ps, run / "model" / "ps")
    for t, table in enumerate(cfg.ps.tables):
        got = replicated[f"{table.name}.weight"] if table.placement == "replicated" else store.pull(t, vocab[table.name])
        torch.testing.assert_close(got, ref.bags[table.name].weight.detach(), atol=1e-5, rtol=0,
                                   msg=f"table {table.name}")
    # the run really trained: the rows moved away from their init
    for t, table in enumerate(cfg.ps.tables):
        init = init_rows(vocab[table.name], table.dim, table.seed, table.init, table.init_scale)
        got = replicated[f"{table.name}.weight"] if table.placement == "replicated" else store.pull(t, vocab[table.name])
        assert (got - init).abs().max() > 1e-3, table.name
    processes = json.loads((run / "processes.json").read_text())
    assert sum(p["role"] == "trainer" for p in processes) == trainers
    for p in processes:
        if p["role"] != "launcher":
            with pytest.raises(ProcessLookupError):
                os.kill(p["pid"], 0)


def test_sync_with_layer_norm_equals_one_process_reference(tmp_path: Path, tiny_data: Path) -> None:
    """model.norm = "layer" normalizes each row by itself, so 2 trainers still equal one process on the
    concatenated batch (batch norm would not: each rank normalizes its own rows; README)."""
    import dataclasses

    cfg = job(tmp_path, tiny_data, 2, 2, "adam")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, norm="layer"))
    launch_train(cfg)
    dense = torch.load(tmp_path / "run" / "model" / "dense.pt", weights_only=True)
    assert any("layers.1.weight" in k for k in dense)       # the LayerNorm after the first Linear
    check_equals_reference(cfg, tmp_path / "run", 2, STEPS)


@pytest.mark.parametrize("trainers, shards", [(1, 1), (2, 2)])
def test_sync_with_replicated_tables_equals_one_process_reference(tmp_path: Path, tiny_data: Path, trainers: int,
                                                                   shards: int) -> None:
    """Two tables (one multi-hot, mean-pooled) replicated on the trainers with Adam and L2 weight decay,
    three on the PS: W trainers equal one process whose replicated tables are plain nn.EmbeddingBag
    weights trained by torch.optim.Adam (every row, every step; DDP all-reduces their gradients)."""
    import dataclasses

    cfg = job(tmp_path, tiny_data, trainers, shards, "adam")
    tables = tuple(dataclasses.replace(t, placement="replicated", weight_decay=0.01) if t.name in ("C1", "M1")
                   else t for t in cfg.ps.tables)
    cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))
    launch_train(cfg)
    run = tmp_path / "run"
    saved = torch.load(run / "model" / "replicated.pt", weights_only=True)
    assert sorted(k for k in saved) == ["C1.ids", "C1.weight", "M1.ids", "M1.weight"]
    assert json.loads((run / "placement.json").read_text())["C1"]["placement"] == "replicated"
    check_equals_reference(cfg, run, trainers, STEPS)
