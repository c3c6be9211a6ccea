"""Dense options (`model.norm`, `train.dense_weight_decay`, the "step" LR schedule) through a real
run in one process (Trainer + in-process shards): exact resume from a checkpoint, and the export for
serving scoring what the trained model scores in eval mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from recsys import eager_optim
from recsys.serving import Predictor
from recsys.serving.export import export_model
from recsys.serving.source import resolve_source
from recsys.training.checkpoint import list_checkpoints
from recsys.training.evaluate import open_run
from tests.unit.recsys.training.test_checkpoint import assert_same_rows, job, train

OPTIONS = ("data.drop_last=true", "train.dense_weight_decay=0.05", "train.lr_decay='step'",
           "train.lr_step_size=5", "train.lr_gamma=0.5")


@pytest.fixture(scope="module")
def data_dir(tiny_dataset) -> Path:
    return tiny_dataset(rows=40 * 64, files=2, seed=7, row_group_rows=300)


@pytest.mark.parametrize("arch, norm", [("dlrm", "batch"), ("deepfm", "layer")])
def test_resume_equals_uninterrupted_with_dense_options(tmp_path: Path, data_dir: Path, arch: str, norm: str) -> None:
    extra = (*OPTIONS, f"model.norm='{norm}'", f"model.arch='{arch}'")
    if arch == "deepfm":
        extra += ("model.linear_tables=true", "ps.table_defaults.dim=8", "model.fm_interaction='fwfm'")
    full, full_store = train(job(tmp_path / "full", data_dir, "train.max_steps=12", *extra))
    part_cfg = job(tmp_path / "part", data_dir, "train.max_steps=6", *extra)
    train(part_cfg)
    resumed, resumed_store = train(job(tmp_path / "part", data_dir, "train.max_steps=12", *extra),
                                   resume=list_checkpoints(part_cfg.train.run_dir)[-1])
    assert resumed.step == full.step == 12
    # the state dict holds the norm's parameters and (batch norm) its running statistics
    kinds = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}
    assert any(isinstance(m, kinds[norm]) for m in full.model.modules())
    if norm == "batch":
        assert any(k.endswith("running_var") for k in full.model.state_dict())
    for (name, p), q in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    # AdamW with two groups (decayed weight matrices, exempt 1-D parameters); the schedule went on
    for opt in (full.optimizer, resumed.optimizer):
        assert type(opt) is eager_optim.AdamW
        assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.003 * 0.5 ** 2] * 2, rel=1e-12)  # 12 // 5 drops
    for sa, sb in zip(full.optimizer.state_dict()["state"].values(), resumed.optimizer.state_dict()["state"].values()):
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], atol=1e-6, rtol=0)
    assert_same_rows(full_store, resumed_store)


@pytest.mark.parametrize("arch", [(), ("model.arch='deepfm'", "model.linear_tables=true", "ps.table_defaults.dim=8",
                                     "model.fm_interaction='fwfm'")], ids=["dlrm", "deepfm_fwfm"])
def test_export_of_a_batch_norm_model_scores_like_the_trained_model(tmp_path: Path, data_dir: Path,
                                                                     train_run, arch) -> None:
    cfg = job(tmp_path / "run", data_dir, "train.max_steps=10", "model.norm='batch'", *OPTIONS, *arch)
    run = train_run(tmp_path, cfg)[0]
    _, trainer = open_run(run)
    try:
        # eval / predict build no optimizer (a torch optimizer's first use imports torch._dynamo, ~2 s)
        assert trainer.scoring_only and trainer.optimizer is None and trainer.scheduler is None
        with pytest.raises(RuntimeError, match="scoring_only"):
            trainer.train()
        eval_file = str(data_dir / "part-00001.parquet")
        _, offline, _ = trainer.predict((eval_file,))              # eval mode: running statistics
        bn = next(m for m in trainer.model.modules() if isinstance(m, nn.BatchNorm1d))
        assert not torch.equal(bn.running_var, torch.ones_like(bn.running_var))   # they were trained
    finally:
        trainer.close()
    export_model(resolve_source(run=run), tmp_path / "export", "fp32")
    got = Predictor(tmp_path / "export").predict(pq.read_table(eval_file))
    assert got.shape == offline.shape
    np.testing.assert_allclose(got, offline.numpy(), atol=1e-5, rtol=0)
    # a single row scores as it does in the full batch (eval-mode batch norm through torch.export)
    one = Predictor(tmp_path / "export").predict(pq.read_table(eval_file).slice(7, 1))
    np.testing.assert_allclose(one, offline.numpy()[7:8], atol=1e-5, rtol=0)


def test_scoring_keeps_the_short_last_batch_when_training_drops_it(tmp_path: Path, data_dir: Path) -> None:
    # norm = "batch" needs data.drop_last = true for training; validation, eval and test scoring still
    # score every row (1280 rows in the eval file, batches of 100: 12 full ones and one of 80)
    from embedding_ps.local import LocalStore
    from recsys.training.trainer import Trainer

    cfg = job(tmp_path / "run", data_dir, "train.max_steps=3", "model.norm='batch'", "data.batch_size=100", *OPTIONS)
    trainer = Trainer(cfg, LocalStore.create(cfg.ps))
    try:
        trainer.train()
        assert trainer.loader.num_batches == 2560 // 100          # training (both files): the short batch is dropped
        labels, scores, _ = trainer.predict((str(data_dir / "part-00001.parquet"),))
    finally:
        trainer.close()
    assert labels.shape == scores.shape == (pq.read_metadata(data_dir / "part-00001.parquet").num_rows,) == (1280,)


def test_linear_and_cosine_decay_span_the_epochs_without_max_steps(tmp_path: Path, data_dir: Path) -> None:
    """#30 item 6: lr_decay = "cosine" without train.max_steps decays over train.epochs x the data's
    batches (it was refused, asking for max_steps by hand): the LR ends at 0 on the last step."""
    from recsys.training.trainer import Trainer
    from embedding_ps.local import LocalStore
    from tests.unit.recsys.training.test_checkpoint import B

    cfg = job(tmp_path / "run", data_dir, "train.lr_decay='cosine'", "train.epochs=2", "train.max_steps=0",
              "data.drop_last=true", "train.checkpoint_every=0")
    trainer = Trainer(cfg, LocalStore.create(cfg.ps))
    per_epoch = trainer.loader.total_rows // B
    assert trainer._schedule_steps() == 2 * per_epoch
    lrs = []
    for _ in range(2 * per_epoch):
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.scheduler.step()
    assert lrs[0] == cfg.train.dense_lr and lrs == sorted(lrs, reverse=True) and lrs[-1] > 0
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)   # after the last step: 0
    accum = Trainer(job(tmp_path / "acc", data_dir, "train.lr_decay='linear'", "train.max_steps=12",
                        "train.grad_accum_steps=2"), LocalStore.create(cfg.ps))
    assert accum._schedule_steps() == 6                           # optimizer steps, not batches
    trainer.close()
    accum.close()
