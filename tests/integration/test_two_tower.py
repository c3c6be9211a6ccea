"""Two-tower retrieval (#17), run as `recsys train` runs it (a shard process, trainer processes):

- the target: on the `retrieval` preset, configs/two_tower.toml reaches recall@50 >= 2x the
  most-popular baseline (metrics.json), and `recsys eval` of the run gives the same numbers;
- sync mode, 2 trainers with all-gathered negatives, equals one process on the global batch (the
  concatenation of the ranks' batches) with the same code (1e-5: dense weights, frequency counts,
  rows); async mode with 2 trainers trains and evaluates.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from data.batch import Batch, KeyedJagged
from data.loader import ParquetLoader
from data.synthetic import generate
from embedding_ps.local import LocalStore
from recsys.config import JobConfig, load_config
from recsys.training.evaluate import evaluate_run
from recsys.training.launch import launch_train
from recsys.training.trainer import StepTimes, Trainer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def retrieval_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("retrieval-data")
    generate(preset="retrieval", rows=60000, num_files=3, out_dir=str(out), seed=0)
    return out


def job(run: Path, data: Path, *extra: str) -> JobConfig:
    return load_config(ROOT / "configs" / "two_tower.toml", [
        f"data.train_paths=['{data}/part-00000.parquet', '{data}/part-00001.parquet']",
        f"data.eval_paths=['{data}/part-00002.parquet']", f"data.item_paths=['{data}/items']",
        f"train.run_dir='{run}'", "train.num_threads=1", *extra])


def test_recall_at_50_beats_twice_the_most_popular_baseline(tmp_path: Path, retrieval_data: Path) -> None:
    cfg = job(tmp_path / "run", retrieval_data, f"data.test_paths=['{retrieval_data}/part-00002.parquet']")
    launch_train(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    logger.info("two-tower recall@50 %.4f, most popular %.4f", metrics["recall@50"], metrics["popular_recall@50"])
    assert metrics["eval_users"] > 1000 and metrics["items"] == 4000
    assert metrics["recall@50"] >= 2.0 * metrics["popular_recall@50"], metrics
    assert metrics["ndcg@50"] > metrics["popular_ndcg@50"]
    assert metrics["test"]["recall@50"] == pytest.approx(metrics["recall@50"], abs=1e-9)   # test scoring
    assert metrics["test"]["examples"] == 20000
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/train" in x for x in lines) and not any("auc/train" in x for x in lines)   # no nan train AUC
    again = evaluate_run(tmp_path / "run", [f"{retrieval_data}/part-00002.parquet"])
    for k in ("recall@10", "recall@50", "recall@100", "ndcg@50", "popular_recall@50"):
        assert again[k] == pytest.approx(metrics[k], abs=1e-6), k


def cat_batches(batches: list[Batch]) -> Batch:
    """The global batch: the ranks' batches one after the other (rank order)."""
    keys = batches[0].sparse.keys
    values = [b.sparse[k].values for k in keys for b in batches]
    lengths = [b.sparse[k].lengths for k in keys for b in batches]
    return Batch(dense=torch.cat([b.dense for b in batches]),
                 sparse=KeyedJagged(keys, torch.cat(values), torch.cat(lengths)),
                 labels=torch.cat([b.labels for b in batches]))


STEPS, BATCH = 12, 32


def test_sync_two_trainers_equal_one_process_on_the_global_batch(tmp_path: Path, retrieval_data: Path) -> None:
    cfg = job(tmp_path / "run", retrieval_data, "data.eval_paths=[]", f"data.batch_size={BATCH}",
              "data.shuffle_buffer_rows=64", "train.num_trainers=2", "ps.num_shards=2", f"train.max_steps={STEPS}",
              "train.log_every=4")
    # rowwise adagrad: (per-coordinate) adagrad's first step of a row is about lr * sign(g), so a
    # coordinate whose gradient is ~0 turns rounding noise into an lr-sized difference (seen: 5e-4)
    cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tuple(
        dataclasses.replace(t, optimizer="rowwise_adagrad") for t in cfg.ps.tables)))
    launch_train(cfg)
    # the reference: the same Trainer code in one process, LocalStore, fed the concatenated batches
    one = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_trainers=1, run_dir=str(tmp_path / "ref")),
                              data=dataclasses.replace(cfg.data, batch_size=2 * BATCH))
    store = LocalStore.create(one.ps)
    ref = Trainer(one, store)
    loaders = [ParquetLoader(cfg.data, cfg.data.train_paths, rank=r, world_size=2) for r in range(2)]
    try:
        for loader in loaders:
            loader.set_epoch(0)
        its = [iter(loader) for loader in loaders]
        for step in range(STEPS):
            batch = cat_batches([next(it) for it in its])
            ref.train_step(batch, ref.sparse.lookup(batch, store, step), StepTimes())
            ref.step += 1
    finally:
        for loader in loaders:
            loader.close()
        ref.close()
    run = tmp_path / "run"
    assert json.loads((run / "metrics.json").read_text())["steps"] == STEPS
    dense = torch.load(run / "model" / "dense.pt", weights_only=True)
    for name, p in ref.model.state_dict().items():
        torch.testing.assert_close(dense[name], p, atol=1e-5, rtol=0, msg=f"dense {name}")
    assert float(dense["freq.total"]) == 2 * BATCH * STEPS           # every rank counted the global ids
    saved = LocalStore.from_dir(cfg.ps, run / "model" / "ps")
    moved = 0.0
    for t, table in enumerate(cfg.ps.tables):
        ids = _table_ids(cfg, table.name, STEPS)
        got, want = saved.pull(t, ids), store.pull(t, ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"table {table.name}: {m}")
        moved = max(moved, float((got - LocalStore.create(cfg.ps).pull(t, ids)).abs().max()))
    assert moved > 1e-3                                              # the rows trained


def _table_ids(cfg: JobConfig, feature: str, steps: int) -> torch.Tensor:
    """The ids of `feature` the 2 ranks read in `steps` steps."""
    out = []
    for r in range(2):
        with ParquetLoader(cfg.data, cfg.data.train_paths, rank=r, world_size=2) as loader:
            loader.set_epoch(0)
            for _, b in zip(range(steps), loader):
                out.append(b.sparse[feature].values)
    return torch.unique(torch.cat(out))


def test_async_two_trainers_train_and_evaluate(tmp_path: Path, retrieval_data: Path) -> None:
    cfg = job(tmp_path / "run", retrieval_data, "ps.mode='async'", "train.num_trainers=2", "train.epochs=1")
    launch_train(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["recall@50"] > 1.5 * metrics["popular_recall@50"], metrics


def test_replicated_tables_train_evaluate_and_export(tmp_path: Path, retrieval_data: Path) -> None:
    """item_id and item_cat replicated on the trainer (the item corpus is scored from the trainer's copy,
    and the export's item vectors from model/replicated.pt): recall as good as with every table on the PS."""
    tables = ("ps.tables=[{name='user_id', dim=16, optimizer='adagrad', lr=0.1}, "
              "{name='user_region', dim=16, optimizer='adagrad', lr=0.1}, "
              "{name='item_id', dim=16, optimizer='adagrad', lr=0.1, placement='replicated'}, "
              "{name='item_cat', dim=16, optimizer='adagrad', lr=0.1, placement='replicated'}]")
    cfg = job(tmp_path / "run", retrieval_data, tables)
    launch_train(cfg)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert json.loads((tmp_path / "run" / "placement.json").read_text())["item_id"]["placement"] == "replicated"
    assert metrics["items"] == 4000 and metrics["recall@50"] >= 2.0 * metrics["popular_recall@50"], metrics
    again = evaluate_run(tmp_path / "run", [f"{retrieval_data}/part-00002.parquet"])
    assert again["recall@50"] == pytest.approx(metrics["recall@50"], abs=1e-6)
    from recsys.serving.export import export_model
    from recsys.serving.predictor import Predictor
    from recsys.serving.source import resolve_source

    export_model(resolve_source(run=tmp_path / "run"), tmp_path / "export")
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["retrieval"]["num_items"] == 4000 and manifest["rows"]["item_id"] > 0
    assert Predictor(tmp_path / "export") is not None
