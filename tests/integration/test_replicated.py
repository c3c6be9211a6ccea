"""Replicated tables through the rest of a run's life: resume, eval, export (full, delta, int8), serving.

In-process (LocalStore shards, one trainer): the tiny job with two tables (C1, and the multi-hot,
mean-pooled M1) replicated on the trainer, three on the PS. (Multi-process sync equality against a
plain-PyTorch reference: tests/integration/test_sync_equivalence.py.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from embedding_ps.local import LocalStore
from recsys.config import load_config, to_toml
from recsys.serving.export import export_model
from recsys.serving.predictor import Predictor
from recsys.serving.source import resolve_source
from recsys.training.checkpoint import list_checkpoints
from recsys.training.evaluate import open_run
from recsys.training.trainer import Trainer
from recsys.training.worker import save_model, saved_replicated

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _job(run: Path, data: Path, steps: int):
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", "data.eval_paths=[]", "data.batch_size=64",
        f"train.run_dir='{run}'", f"train.max_steps={steps}", "train.checkpoint_every=4", "ps.mode='sync'"])
    tables = tuple(dataclasses.replace(t, placement="replicated", optimizer="adam", lr=0.01, weight_decay=0.01)
                   if t.name in ("C1", "M1") else t for t in cfg.ps.tables)
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))


def _train(cfg, resume: Path | None = None) -> Trainer:
    torch.manual_seed(0)
    store = LocalStore.from_dir(cfg.ps, resume / "model" / "ps") if resume else LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store, replicated_state=saved_replicated(resume / "model") if resume else None)
    if resume is not None:
        trainer.restore(str(resume))
    try:
        trainer.train()
    finally:
        trainer.close()
    run = Path(cfg.train.run_dir)
    save_model(trainer, store, run / "model")
    (run / "config.toml").write_text(to_toml(cfg))
    (run / "metrics.json").write_text(json.dumps({"steps": float(trainer.step)}))
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_dataset):
    root = tmp_path_factory.mktemp("replicated")
    data = tiny_dataset(rows=3000, files=2, seed=4)
    full = _train(_job(root / "full", data, 8))
    ckpt = list_checkpoints(root / "full")[0]                  # step 4
    assert ckpt.name.endswith("4")
    shutil.copytree(ckpt, root / "ckpt4")
    resumed = _train(_job(root / "resumed", data, 8), resume=root / "ckpt4")
    return root, data, full, resumed


def test_a_resumed_run_equals_the_uninterrupted_one(runs) -> None:
    _, _, full, resumed = runs
    assert resumed.step == full.step == 8
    for name in ("C1", "M1"):
        assert torch.equal(resumed.replicated.keys[name], full.replicated.keys[name])
        torch.testing.assert_close(resumed.replicated.weight[name], full.replicated.weight[name], atol=1e-6, rtol=0)
        # Adam's moments came back from the checkpoint too (else the step-5 update differs)
        opt_r = resumed.table_optimizer.optimizers[name].state_dict()["state"][0]["exp_avg"]
        opt_f = full.table_optimizer.optimizers[name].state_dict()["state"][0]["exp_avg"]
        torch.testing.assert_close(opt_r, opt_f, atol=1e-6, rtol=0)
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=k)


def test_eval_export_and_serving_score_alike(runs) -> None:
    """`recsys eval` (open_run), a full fp32 export served by Predictor, and the trained weights agree;
    an export holds the replicated tables like any other (ids sorted, the trained rows)."""
    root, data, full, _ = runs
    run = root / "full"
    cfg, trainer = open_run(run, last=True)
    try:
        _, scores, _ = trainer.predict((str(data / "part-00001.parquet"),))
    finally:
        trainer.close()
    export_model(resolve_source(run=run, last=True), root / "export")
    manifest = json.loads((root / "export" / "manifest.json").read_text())
    assert manifest["rows"]["C1"] == full.replicated.keys["C1"].numel()
    served = Predictor(root / "export").predict(pq.read_table(data / "part-00001.parquet"))
    np.testing.assert_allclose(served, scores.numpy(), atol=1e-5)
    # a delta since a later step still carries every replicated row (they move every step)
    export_model(resolve_source(run=run, last=True), root / "delta", since=7)
    delta = json.loads((root / "delta" / "manifest.json").read_text())
    assert delta["rows"]["C1"] == manifest["rows"]["C1"] and delta["rows"]["M1"] == manifest["rows"]["M1"]
    served_d = Predictor(root / "export", deltas=[root / "delta"]).predict(pq.read_table(data / "part-00001.parquet"))
    np.testing.assert_allclose(served_d, served, atol=1e-6)
    export_model(resolve_source(run=run, last=True), root / "int8", precision="int8")
    q = Predictor(root / "int8").predict(pq.read_table(data / "part-00001.parquet"))
    assert np.abs(q - served).max() < 0.02
