"""Checkpoints on a URI run directory (file://, the same code path as s3://), in one process:
written in place with the manifest last, resumed exactly, the best model kept on the URI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from embedding_ps.local import LocalStore
from recsys import storage
from recsys.rundir import best_dir, has_best, run_path
from recsys.training.checkpoint import list_checkpoints, read_manifest, resolve_resume, verify_checkpoint

from .test_checkpoint import assert_same_rows, job, train

B = 64


@pytest.fixture(scope="module")
def data_dir(tiny_dataset) -> Path:
    return tiny_dataset(rows=40 * B, files=2, seed=7, row_group_rows=300)


def test_uri_run_dir_resume_equals_uninterrupted(tmp_path: Path, data_dir: Path) -> None:
    full, full_store = train(job(tmp_path / "full", data_dir, "train.max_steps=18"))
    run = f"file://{tmp_path}/remote/run"
    extra = (f"train.scratch_dir='{tmp_path}/scratch'", "train.keep_checkpoints=2")
    train(job(run, data_dir, "train.max_steps=12", *extra))
    ckpts = list_checkpoints(run)
    assert ckpts == [run_path(run, "checkpoints", f"step-{s:010d}") for s in (6, 12)]
    newest = resolve_resume(run, "latest")
    assert newest == ckpts[-1] and verify_checkpoint(newest)["step"] == 12
    assert not (tmp_path / "scratch" / "staging" / "step-0000000012").exists()     # staging removed
    with storage.local_copy(run_path(newest, "model", "ps")) as ps:
        store = LocalStore.from_dir(job(run, data_dir).ps, ps)
    resumed, resumed_store = _resume(job(run, data_dir, "train.max_steps=18", *extra), newest, store)
    assert resumed.step == full.step == 18
    for (name, p), q in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    assert_same_rows(full_store, resumed_store)
    assert [_step(c) for c in list_checkpoints(run)] == [12, 18]                 # pruned on the URI


def _resume(cfg, checkpoint: str, store: LocalStore):
    from recsys.training.trainer import Trainer

    trainer = Trainer(cfg, store)
    trainer.restore(checkpoint)
    trainer.train()
    trainer.close()
    return trainer, store


def _step(uri: str) -> int:
    return int(uri.partition("?")[0].rsplit("step-", 1)[1])


def test_best_model_kept_on_the_uri(tmp_path: Path, data_dir: Path) -> None:
    run = f"file://{tmp_path}/remote/run"
    cfg = job(run, data_dir, "train.max_steps=12", f"data.eval_paths=['{data_dir}/part-00001.parquet']",
              "train.validate_every=6", "train.checkpoint_every=0", f"train.scratch_dir='{tmp_path}/scratch'")
    train(cfg)
    assert has_best(run)
    best = best_dir(run)
    manifest = read_manifest(best)
    assert manifest["step"] in (6, 12) and "model/ps/shard1/manifest.json" in manifest["files"]
    verify_checkpoint(best)
    assert not storage.list_dir(run_path(run, "checkpoints"))
