"""#17's DIN target, for real (`recsys train`'s launcher: a shard process and a trainer process): on the
`sequence` preset, DIN (configs/din.toml as it is, on 100k training rows) reaches an eval AUC of at
least 0.98x the planted oracle's, and beats DeepFM without the behavior list by at least 0.10 AUC.

Measured while writing this (same data, seed 0; eval oracle AUC 0.8275): DIN 0.8182 (0.989x oracle,
3 epochs; train.seed 1: 0.982x; data seed 1: 0.989x); DeepFM on (ctx, item, I1) 0.6196: DIN ahead
by 0.20. For scale: DeepFM with `hist` as a plain pooled multi-hot feature (item table) 0.789;
DIN without the cut to the last 20 behaviors (max_seq_len 40) 0.795 (at dense_lr 0.003).
(Export and Predictor of DIN: tests/unit/recsys/serving/test_export_din.py.)
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from data.batch import Batch, KeyedJagged
from data.loader import ParquetLoader
from data.sequence import generate_sequence
from embedding_ps.local import LocalStore
from recsys.config import JobConfig, load_config
from recsys.training.launch import launch_train
from recsys.training.trainer import StepTimes, Trainer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)

ORACLE_RATIO = 0.98
MARGIN = 0.10          # measured 0.19


def job(run: Path, data: Path, *extra: str) -> JobConfig:
    return load_config(ROOT / "configs" / "din.toml", [
        f"data.train_paths=['{data}/part-00000.parquet', '{data}/part-00001.parquet']",
        f"data.eval_paths=['{data}/part-00002.parquet']", f"train.run_dir='{run}'", "train.num_threads=1",
        "train.log_every=100", *extra])


def test_din_reaches_the_oracle_and_beats_deepfm_without_the_sequence(tmp_path: Path) -> None:
    data = tmp_path / "data"
    summary = generate_sequence(rows=150000, num_files=3, out_dir=str(data), seed=0)   # the config's header command
    din = launch_train(job(tmp_path / "din", data))
    deepfm = launch_train(job(tmp_path / "deepfm", data, "model.arch=deepfm", "model.sequence_features={}",
                              "data.sparse_columns=['ctx', 'item']"))
    logger.info("oracle %.4f (all rows %.4f), DIN %.4f, DeepFM without hist %.4f", din["oracle_auc"],
                summary["oracle_auc"], din["auc"], deepfm["auc"])
    assert din["oracle_auc"] == pytest.approx(deepfm["oracle_auc"])          # the same eval rows
    assert din["auc"] >= ORACLE_RATIO * din["oracle_auc"], (din, deepfm)
    assert din["auc"] >= deepfm["auc"] + MARGIN, (din, deepfm)


STEPS, BATCH = 12, 32


def concat(batches: list[Batch]) -> Batch:
    """One Batch of the ranks' batches, example after example (feature-major ids, as the loader makes them)."""
    keys = batches[0].sparse.keys
    values, lengths = [], []
    for k in keys:
        values += [b.sparse[k].values for b in batches]
        lengths += [b.sparse[k].lengths for b in batches]
    return Batch(dense=torch.cat([b.dense for b in batches]), labels=torch.cat([b.labels for b in batches]),
                 sparse=KeyedJagged(keys, torch.cat(values), torch.cat(lengths)))


def test_din_two_trainers_two_shards_sync_equal_one_process(tmp_path: Path) -> None:
    """The behavior rows' gradients (gathered per position from the candidate's leaf) go through DDP
    and the sync PS exactly: 2 trainers x 2 shards end where one process on the concatenated
    batches ends (dense weights and every row, 1e-5)."""
    data = tmp_path / "data"
    generate_sequence(rows=2 * STEPS * BATCH + 100, num_files=1, out_dir=str(data), seed=3, row_group_rows=200)
    cfg = job(tmp_path / "run", data, f"data.train_paths=['{data}']", "data.eval_paths=[]",
              f"data.batch_size={BATCH}", "data.drop_last=true", "data.shuffle_buffer_rows=64",
              "ps.num_shards=2", "train.num_trainers=2", f"train.max_steps={STEPS}", "model.max_seq_len=8")
    launch_train(cfg)
    # one process: the same model built the same way, on each step's two batches concatenated
    one = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, num_shards=1))
    store = LocalStore.create(one.ps)
    trainer = Trainer(one, store)
    loaders = [ParquetLoader(cfg.data, cfg.data.train_paths, rank=r, world_size=2) for r in range(2)]
    ids: list[torch.Tensor] = []
    try:
        for loader in loaders:
            loader.set_epoch(0)
        its = [iter(loader) for loader in loaders]
        for step in range(STEPS):
            batch = concat([next(it) for it in its])
            ids.append(batch.sparse.values)
            trainer.train_step(batch, trainer.sparse.lookup(batch, store, step), StepTimes())
            trainer.step += 1
    finally:
        for loader in loaders:
            loader.close()
        trainer.close()
    dense = torch.load(tmp_path / "run" / "model" / "dense.pt", weights_only=True)
    for name, p in trainer.model.state_dict().items():
        torch.testing.assert_close(dense[name], p, atol=1e-5, rtol=0, msg=f"dense {name}")
    run_store = LocalStore.from_dir(cfg.ps, tmp_path / "run" / "model" / "ps")
    every = torch.unique(torch.cat(ids))
    for t, table in enumerate(cfg.ps.tables):
        torch.testing.assert_close(run_store.pull(t, every), store.pull(t, every), atol=1e-5, rtol=0,
                                   msg=f"table {table.name}")
    assert (store.pull(1, every) - LocalStore.create(one.ps).pull(1, every)).abs().max() > 1e-3   # rows moved
