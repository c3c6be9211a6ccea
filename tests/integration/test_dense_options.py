"""Dense-side options under real DDP (2 trainers, gloo): comm hooks, accumulation, bf16 autocast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recsys.config import load_config
from recsys.training.launch import launch_train

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.fixture(scope="module")
def data(tiny_dataset) -> Path:
    out = tiny_dataset(rows=4000, files=2, seed=2, row_group_rows=500)
    return out


def run(tmp_path: Path, data: Path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", "data.batch_size=64", "data.drop_last=true",
        "ps.num_shards=1", "train.num_trainers=2", f"train.max_steps={STEPS}", "train.log_every=2",
        f"train.run_dir='{tmp_path / name}'", "train.num_threads=1", *overrides,
    ])
    launch_train(cfg)
    lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(x["loss/train"])) for x in lines if "loss/train" in x)
    return torch.load(tmp_path / name / "model" / "dense.pt", weights_only=True)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """L2 distance over all dense parameters (Adam turns tiny gradient noise into lr-sized steps on
    single coordinates, so a max-abs distance would mostly measure that)."""
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5)


def test_comm_hooks_accumulation_and_autocast(tmp_path: Path, data: Path) -> None:
    base = run(tmp_path, data, "none")
    init = run(tmp_path, data, "zero-lr", "train.dense_lr=1e-12")
    moved = max_diff(base, init)
    assert moved > 1e-3                       # training moved the dense weights
    # compressed allreduce: the same run up to the compression error (fp16 flushes the tiniest
    # gradients to zero and Adam turns that into visible steps; measured ~0.05x of `moved`)
    fp16 = max_diff(run(tmp_path, data, "fp16", "train.comm_hook='fp16'"), base)
    bf16 = max_diff(run(tmp_path, data, "bf16", "train.comm_hook='bf16'"), base)
    assert 0 < fp16 < 0.15 * moved and 0 < bf16 < 0.15 * moved   # > 0: the hook really ran
    # PowerSGD starts compressing at step 2 (rank-2 approximation): it still trains
    assert max_diff(run(tmp_path, data, "powersgd", "train.comm_hook='powersgd'"), init) > 1e-3
    # accumulation over 2 micro-batches: half the dense optimizer steps, so a different end point
    accum = run(tmp_path, data, "accum", "train.grad_accum_steps=2")
    assert max_diff(accum, init) > 1e-4 and max_diff(accum, base) > 1e-6
    # bf16 autocast: close to fp32
    assert max_diff(run(tmp_path, data, "autocast", "train.autocast=true"), base) < 0.5 * moved


def test_batch_norm_and_weight_decay_under_ddp(tmp_path: Path, data: Path) -> None:
    # plain BatchNorm1d per rank (SyncBatchNorm refuses CPU tensors); DDP broadcasts rank 0's running
    # statistics: the run trains, and the saved model carries trained statistics
    state = run(tmp_path, data, "bn", "model.norm='batch'", "train.dense_weight_decay=0.01",
                "train.lr_decay='step'", "train.lr_step_size=4")
    var = [v for k, v in state.items() if k.endswith("running_var")]
    assert len(var) == 4                                         # DLRM: 2 bottom + 2 top hidden layers
    assert all(torch.isfinite(v).all() and not torch.equal(v, torch.ones_like(v)) for v in var)
    assert all(int(v) == STEPS for k, v in state.items() if k.endswith("num_batches_tracked"))
