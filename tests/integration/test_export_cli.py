"""`recsys export` and `recsys export-apply` end to end on a tiny run (trained in-process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from embedding_ps.local import LocalStore
from recsys.config import load_config, to_toml
from recsys.serving import Predictor
from recsys.training.checkpoint import list_checkpoints
from recsys.training.trainer import Trainer
from recsys.training.worker import save_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def recsys(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run([sys.executable, "-m", "recsys.cli", *args], cwd=ROOT, env=env, timeout=240,
                          capture_output=True, text=True)


def save(root: Path, cfg, trainer: Trainer, store: LocalStore) -> Path:
    """A finished run's model/, config.toml and metrics.json, as `recsys train` leaves them."""
    save_model(trainer, store, root / "model")
    (root / "config.toml").write_text(to_toml(cfg))
    (root / "metrics.json").write_text(json.dumps({"steps": trainer.step}))
    return root


def test_export_delta_apply_cli(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=8000, files=2, seed=11)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"train.run_dir='{tmp_path / 'run'}'", "ps.num_shards=2", "train.max_steps=8", "train.checkpoint_every=8"])
    torch.manual_seed(0)
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    trainer.train()
    ckpt = list_checkpoints(cfg.train.run_dir)[-1]        # the real checkpoint of step 8 (manifest verified)
    trainer.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=15))
    trainer.loader.load_state_dict(trainer.loader.state_dict())
    trainer.train()
    trainer.close()
    run = save(tmp_path / "run", cfg, trainer, store)

    r = recsys("export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "base"), "--precision", "int8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["step"] == 8
    r = recsys("export", "--run", str(run), "--out", str(tmp_path / "delta"), "--precision", "int8", "--since", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["kind"] == "delta"
    r = recsys("export-apply", str(tmp_path / "base"), str(tmp_path / "delta"), "--out", str(tmp_path / "applied"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["step"] == 15

    table = pq.read_table(data / "part-00001.parquet")
    got = Predictor(tmp_path / "applied").predict(table)
    assert got.shape == (table.num_rows,) and np.isfinite(got).all()

    # errors are one line naming the problem, exit code 2 (bad input, #13)
    r = recsys("export-apply", str(tmp_path / "delta"), str(tmp_path / "base"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "not a delta" in r.stderr
    r = recsys("export", "--run", str(tmp_path / "nope"), "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "not a finished run" in r.stderr
