"""Sparse weight decay on the shard (`weight_decay`, `weight_decay_mode`) against plain PyTorch.

The reference is torch.optim itself, with one `nn.Parameter` per row: a step sets `.grad` of the
rows it touches (the summed gradient of duplicate ids) and None elsewhere, so `optimizer.step()`
updates, decays and counts only the touched rows, as the shard does (lazy Adam included):

    sgd / adagrad / adam, "l2"      torch.optim.SGD / Adagrad / Adam(weight_decay=wd)
    adam, "decoupled"               torch.optim.AdamW(weight_decay=wd)
    sgd / adagrad, "decoupled"      p.mul_(1 - lr * wd), then SGD / Adagrad without decay
    rowwise_adagrad                 no torch optimizer: written out below (fbgemm TBE's math)

Every case runs on each update path the shard has: torch (vectorized), the native C path (where
the library loads) and fbgemm's fused CPU op (sgd, adagrad, rowwise_adagrad).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embedding_ps import native
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import ShardState

LR, WD, D, STEPS = 0.05, 0.3, 8, 6
IDS = list(range(100, 140))


def _paths(optimizer: str) -> list[str]:
    paths = ["torch"]
    if optimizer != "adam":
        paths.append("native")
        paths.append("fbgemm")
    return paths


CASES = [(opt, mode, path) for opt in ("sgd", "adagrad", "rowwise_adagrad", "adam")
         for mode in ("l2", "decoupled") for path in _paths(opt)]


class _Native:
    """native.set_enabled(on) for the block, restored after."""

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.prev = native.set_enabled(self.on)

    def __exit__(self, *exc: object) -> None:
        native.set_enabled(self.prev)


def _pushes(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS pushes: each a random subset of IDS with some ids twice (duplicates are summed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        pick = torch.tensor(IDS)[torch.randperm(len(IDS), generator=g)[:25]]
        ids = torch.cat([pick, pick[:5]])                              # 5 duplicates
        out.append((ids, torch.randn(ids.numel(), D, generator=g)))
    return out


def _summed(ids: torch.Tensor, grads: torch.Tensor) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for i, gr in zip(ids.tolist(), grads):
        out[i] = out[i] + gr if i in out else gr.clone()
    return out


def _reference(optimizer: str, mode: str, init: torch.Tensor,
               pushes: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    params = [nn.Parameter(row.clone()) for row in init]          # one Parameter per row of IDS
    index = {k: i for i, k in enumerate(IDS)}
    decay_in_opt = WD if mode == "l2" else 0.0
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=LR, weight_decay=decay_in_opt)
    elif optimizer == "adagrad":
        opt = torch.optim.Adagrad(params, lr=LR, eps=1e-8, weight_decay=decay_in_opt)
    elif optimizer == "adam":
        opt = (torch.optim.Adam(params, lr=LR, eps=1e-8, weight_decay=WD) if mode == "l2"
               else torch.optim.AdamW(params, lr=LR, eps=1e-8, weight_decay=WD))
    else:
        opt = None
    sum_sq = torch.zeros(len(IDS))                                    # rowwise_adagrad's state
    for ids, grads in pushes:
        summed = _summed(ids, grads)
        for p in params:
            p.grad = None
        for k, gr in summed.items():
            params[index[k]].grad = gr.clone()
        with torch.no_grad():
            if optimizer == "rowwise_adagrad":
                for k, gr in summed.items():
                    i, w = index[k], params[index[k]]
                    if mode == "l2":
                        gr = gr + WD * w
                    else:
                        w.mul_(1.0 - LR * WD)
                    sum_sq[i] += (gr * gr).mean()
                    w.sub_(LR * gr / (sum_sq[i].sqrt() + 1e-8))
                continue
            if mode == "decoupled" and optimizer in ("sgd", "adagrad"):
                for k in summed:
                    params[index[k]].mul_(1.0 - LR * WD)
        opt.step()
    return torch.stack([p.detach() for p in params])


@pytest.mark.parametrize("optimizer,mode,path", CASES)
def test_weight_decay_matches_plain_pytorch(optimizer: str, mode: str, path: str) -> None:
    if path == "native" and not native.available():
        pytest.skip("native library unavailable (no C compiler?)")
    cfg = TableConfig(name="t", dim=D, optimizer=optimizer, lr=LR, weight_decay=WD, weight_decay_mode=mode,
                      init="normal", init_scale=0.5, kernel="fbgemm" if path == "fbgemm" else "torch")
    state = ShardState(PSConfig(tables=(cfg,)), 0)
    keys = torch.tensor(IDS)
    pushes = _pushes(seed=len(optimizer) * 7 + len(mode))
    with _Native(path == "native"):
        init = state.pull(0, keys).clone()
        for step, (ids, grads) in enumerate(pushes):
            state.push(0, ids, grads, step)
        got = state.pull(0, keys)
    want = _reference(optimizer, mode, init, pushes)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    # the decay did something: without it the rows differ clearly
    plain = ShardState(PSConfig(tables=(TableConfig(name="t", dim=D, optimizer=optimizer, lr=LR, init="normal",
                                                    init_scale=0.5),)), 0)
    for step, (ids, grads) in enumerate(pushes):
        plain.push(0, ids, grads, step)
    assert (plain.pull(0, keys) - got).abs().max() > 1e-3


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_native_and_torch_paths_agree_on_fp16_rows(optimizer: str, mode: str) -> None:
    if not native.available():
        pytest.skip("native library unavailable (no C compiler?)")
    cfg = TableConfig(name="t", dim=D, dtype="fp16", optimizer=optimizer, lr=LR, weight_decay=WD,
                      weight_decay_mode=mode, init="normal", init_scale=0.5)
    keys = torch.tensor(IDS)
    pushes = _pushes(seed=3)
    rows = []
    for on in (True, False):
        state = ShardState(PSConfig(tables=(cfg,)), 0)
        with _Native(on):
            for step, (ids, grads) in enumerate(pushes):
                state.push(0, ids, grads, step)
            rows.append(state.pull(0, keys))
    torch.testing.assert_close(rows[0], rows[1], rtol=0, atol=0)   # both round each update once


def test_untouched_rows_are_not_decayed() -> None:
    cfg = TableConfig(name="t", dim=4, optimizer="sgd", lr=0.1, weight_decay=0.5, weight_decay_mode="decoupled",
                      init="normal", init_scale=1.0)
    state = ShardState(PSConfig(tables=(cfg,)), 0)
    state.push(0, torch.tensor([1, 2]), torch.zeros(2, 4), 0)   # rows 1 and 2 exist now
    before = state.pull(0, torch.tensor([1, 2]))
    state.push(0, torch.tensor([1]), torch.zeros(1, 4), 1)      # only row 1 is touched
    after = state.pull(0, torch.tensor([1, 2]))
    torch.testing.assert_close(after[0], before[0] * (1 - 0.1 * 0.5))   # zero gradient: the shrink alone
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)


@pytest.mark.parametrize("bad,message", [
    (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0"),
    (dict(weight_decay=float("nan")), "weight_decay must be a finite number >= 0"),
    (dict(weight_decay=float("inf")), "weight_decay must be a finite number >= 0"),
    (dict(weight_decay=0.1, optimizer="ftrl"), "use ftrl_l2"),
    (dict(weight_decay=50.0, lr=0.1, weight_decay_mode="decoupled"), "lr \\* weight_decay < 1"),
])
def test_bad_weight_decay_is_named(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        TableConfig(name="emb", dim=4, **bad)
    assert "ps.tables[emb]" in str(e.value)
