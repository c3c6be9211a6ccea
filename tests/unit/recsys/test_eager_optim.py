"""`recsys.eager_optim`: torch.optim's optimizers, the same numbers and state, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys import eager_optim

ROOT = Path(__file__).resolve().parents[3]

CASES = [
    (eager_optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (eager_optim.Adagrad, torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
    (eager_optim.Adam, torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99)}),
    (eager_optim.AdamW, torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]


def _train(opt_cls, kwargs: dict, steps: int, resume_at: int | None = None) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 1))
    opt = opt_cls(model.parameters(), **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    data = torch.randn(steps, 16, 6, generator=torch.Generator().manual_seed(1))
    for i in range(steps):
        if i == resume_at:                              # a checkpoint's round trip, into a new optimizer
            state = opt.state_dict()
            opt = opt_cls(model.parameters(), **kwargs)
            opt.load_state_dict(state)
            sched.optimizer = opt
        opt.zero_grad()
        model(data[i]).square().mean().backward()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


@pytest.mark.parametrize("ours, theirs, kwargs", CASES, ids=[c[1].__name__ for c in CASES])
def test_same_numbers_and_state_as_torch(ours, theirs, kwargs) -> None:
    assert issubclass(ours, theirs) and ours is not theirs
    want, want_state = _train(theirs, kwargs, steps=7)
    got, got_state = _train(ours, kwargs, steps=7, resume_at=4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got_state["param_groups"] == want_state["param_groups"]
    for k, v in want_state["state"].items():
        for name, t in v.items():
            assert torch.equal(got_state["state"][k][name], t), (k, name)


def test_a_trainers_optimizers_do_not_import_dynamo() -> None:
    """The dense optimizer and a replicated table's, built and stepped in a fresh interpreter."""
    code = """if True:
        import sys, torch
        from recsys.training.dense import build_optimizer, build_scheduler
        from recsys.config import TrainConfig
        from recsys.models.replicated import _RowwiseAdagrad
        m = torch.nn.Linear(3, 2)
        for name in ("adam", "adagrad", "sgd"):
            for wd in (0.0, 0.1):
                cfg = TrainConfig(dense_optimizer=name, dense_weight_decay=wd)
                opt = build_optimizer(m, cfg)
                sched = build_scheduler(opt, cfg, 10)
                m(torch.randn(4, 3)).sum().backward()
                opt.step(); sched.step(); opt.zero_grad()
                opt.load_state_dict(opt.state_dict())
        w = torch.nn.Parameter(torch.randn(5, 2))
        r = _RowwiseAdagrad([w], lr=0.1, eps=1e-8, initial_accumulator=0.0, weight_decay=0.0)
        w.sum().backward(); r.step()
        print("torch._dynamo" in sys.modules)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
