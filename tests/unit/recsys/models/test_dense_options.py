"""Dense options (#17 item 5): `model.norm` in every MLP, `train.dense_weight_decay` against hand values
and torch.optim, the "step" LR schedule, and their config errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recsys import eager_optim
from recsys.config import ConfigError, ModelConfig, TrainConfig, load_config
from recsys.models import ARCHS, MLP, build_model
from recsys.training.dense import build_optimizer, build_scheduler, lr_factor, param_groups

B, DN, F, D = 16, 5, 4, 6
ARCH_NAMES = sorted(a for a in ARCHS if not getattr(ARCHS[a], "needs_sequences", False))   # din: test_din.py
NORM_TYPES = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}


def make(arch: str, norm: str, seed: int = 0, num_dense: int = DN) -> nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(arch=arch, bottom_mlp=(16, D), top_mlp=(16, 8), norm=norm)
    return build_model(cfg, num_dense=num_dense, num_sparse=F, embedding_dim=D)


def inputs(seed: int = 1, batch: int = B, num_dense: int = DN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, num_dense, generator=g), torch.randn(batch, F, D, generator=g),   # [B, Dn], [B, F, D]
            torch.randn(batch, F, generator=g))                                                 # [B, F]


def call(model: nn.Module, dense, pooled, linear) -> torch.Tensor:
    return model(dense, pooled, linear if model.needs_linear_terms else None)


# -- model.norm -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("norm", ["batch", "layer"])
def test_norm_shapes_and_one_norm_per_hidden_layer(arch: str, norm: str) -> None:
    model = make(arch, norm)
    out = call(model, *inputs())
    assert out.shape == (B,) and torch.isfinite(out).all()
    norms = [m for m in model.modules() if isinstance(m, NORM_TYPES[norm])]
    hidden = [m for mlp in model.modules() if isinstance(mlp, MLP) for m in mlp.layers if isinstance(m, nn.Linear)]
    assert len(norms) == len(hidden) > 0                      # DLRM: bottom 2 + top 2; others: top 2
    assert [n.normalized_shape[0] if norm == "layer" else n.num_features for n in norms] == \
        [h.out_features for h in hidden]
    if arch == "dlrm":
        assert len(norms) == 4
    # zero dense columns still work (DLRM then has no bottom MLP)
    assert call(make(arch, norm, num_dense=0), *inputs(num_dense=0)).shape == (B,)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_norm_none_is_the_plain_mlp(arch: str) -> None:
    # the state dict (keys, shapes and init values) and the function of norm = "none" are those of
    # an MLP built layer by layer as before the option existed: old checkpoints load, numbers unchanged
    model = make(arch, "none")
    for mlp in (m for m in model.modules() if isinstance(m, MLP)):
        assert all(isinstance(m, (nn.Linear, nn.ReLU)) for m in mlp.layers)
    torch.manual_seed(0)
    ref = MLP(7, (5, 3))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3), nn.ReLU())
    assert ref.layers.state_dict().keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(ref.layers.state_dict()[k], v), k
    x = torch.randn(4, 7)
    assert torch.equal(ref(x), plain(x))


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("norm", ["batch", "layer"])
def test_eval_mode_is_deterministic_and_per_row(arch: str, norm: str) -> None:
    model = make(arch, norm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for seed in range(3):                                    # move weights and running statistics
        loss = call(model, *inputs(seed=10 + seed)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dense, pooled, linear = inputs()
    model.eval()
    with torch.no_grad():
        full = call(model, dense, pooled, linear)                       # [B]
        again = call(model, dense, pooled, linear)
        halves = torch.cat([call(model, dense[:5], pooled[:5], linear[:5]),
                            call(model, dense[5:], pooled[5:], linear[5:])])
        one = call(model, dense[3:4], pooled[3:4], linear[3:4])         # a batch of one row
    assert torch.equal(full, again)
    torch.testing.assert_close(halves, full, rtol=0, atol=1e-6)          # a row's score ignores its batch
    torch.testing.assert_close(one, full[3:4], rtol=0, atol=1e-6)
    if norm == "batch":
        # training mode normalizes by the batch: the same rows score differently in other company
        model.train()
        with torch.no_grad():
            part = call(model, dense[:5], pooled[:5], linear[:5])
            whole = call(model, dense, pooled, linear)[:5]
        assert not torch.allclose(part, whole, atol=1e-4)


def test_batch_norm_running_statistics_move_in_training_only() -> None:
    model = make("deepfm", "batch")
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
    before = bn.running_mean.clone()
    call(model, *inputs())
    assert not torch.equal(bn.running_mean, before)
    after_train = bn.running_mean.clone()
    model.eval()
    call(model, *inputs(seed=2))
    assert torch.equal(bn.running_mean, after_train)


# -- train.dense_weight_decay -------------------------------------------------------------------------


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.ReLU(), nn.Linear(4, 1))


def one_step(opt_name: str, wd: float, lr: float = 0.1) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor], torch.optim.Optimizer]:
    """(model after one step, params before, grads, optimizer) of a fixed batch."""
    model = tiny_model()
    with torch.no_grad():            # non-trivial norm gains and shifts, so their exemption shows
        model[1].weight.add_(0.5)
        model[1].bias.add_(0.3)
    opt = build_optimizer(model, TrainConfig(dense_optimizer=opt_name, dense_lr=lr, dense_weight_decay=wd))
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    model(x).square().mean().backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    opt.step()
    return model, before, grads, opt


@pytest.mark.parametrize("opt_name", ["adam", "sgd", "adagrad"])
def test_weight_decay_one_step_against_hand_values(opt_name: str) -> None:
    lr, wd = 0.1, 0.3
    model, p0, g, _ = one_step(opt_name, wd, lr)
    for name, p in model.named_parameters():
        decayed = p.dim() >= 2                          # the weight matrices; biases and norm params are exempt
        w, grad = p0[name], g[name]
        if opt_name == "adam":      # AdamW's first step: shrink, then lr * m_hat / (sqrt(v_hat) + eps) = lr * g / (|g| + eps)
            want = w * (1 - lr * wd if decayed else 1.0) - lr * grad / (grad.abs() + 1e-8)
        elif opt_name == "sgd":     # L2 in the gradient: w - lr (g + wd w)
            want = w - lr * (grad + (wd * w if decayed else 0.0))
        else:                       # adagrad, L2 in the gradient, then scaled by its own first square
            gg = grad + (wd * w if decayed else 0.0)
            want = w - lr * gg / (gg.abs() + 1e-10)
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6, msg=f"{opt_name} {name}")


@pytest.mark.parametrize("opt_name, ref", [("adam", torch.optim.AdamW), ("sgd", torch.optim.SGD),
                                           ("adagrad", torch.optim.Adagrad)])
def test_weight_decay_equals_torch_optim_with_decay_on_the_weight_matrices(opt_name: str, ref) -> None:
    lr, wd = 0.05, 0.2
    model, opt = tiny_model(), None
    ours = build_optimizer(model, TrainConfig(dense_optimizer=opt_name, dense_lr=lr, dense_weight_decay=wd))
    assert type(ours) is getattr(eager_optim, ref.__name__) and isinstance(ours, ref)     # torch's, without dynamo
    other = tiny_model()
    mats = [p for p in other.parameters() if p.dim() >= 2]
    rest = [p for p in other.parameters() if p.dim() < 2]
    opt = ref([{"params": mats, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], lr=lr)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
    for m, o in ((model, ours), (other, opt)):
        for _ in range(4):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_no_weight_decay_keeps_one_group_and_plain_adam() -> None:
    model = tiny_model()
    opt = build_optimizer(model, TrainConfig())
    assert type(opt) is eager_optim.Adam and len(opt.param_groups) == 1
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))
    groups = param_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [2, 4]          # 2 weight matrices; 2 biases + LN gain/shift
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_decay_shrinks_weights_without_gradient() -> None:
    # with a zero gradient AdamW leaves exactly the decoupled shrink: w (1 - lr wd) per step
    model = tiny_model()
    opt = build_optimizer(model, TrainConfig(dense_lr=0.1, dense_weight_decay=0.5))
    w0, b0 = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(3):
        opt.step()
    torch.testing.assert_close(model[0].weight.detach(), w0 * 0.95 ** 3, rtol=0, atol=1e-7)
    assert torch.equal(model[0].bias.detach(), b0)


# -- the step LR schedule -----------------------------------------------------------------------------


def test_step_schedule_values() -> None:
    cfg = TrainConfig(lr_decay="step", lr_step_size=3, lr_gamma=0.5)
    assert [lr_factor(s, cfg, 0) for s in range(8)] == [1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25]
    warm = TrainConfig(lr_decay="step", lr_step_size=2, lr_gamma=0.1, warmup_steps=2)
    got = [lr_factor(s, warm, 0) for s in range(7)]
    assert got[:2] == [0.5, 1.0] and got[2:4] == [1.0, 1.0]
    assert got[4:6] == pytest.approx([0.1, 0.1], abs=1e-15) and got[6] == pytest.approx(0.01, abs=1e-15)


def test_step_schedule_drives_the_optimizer_lr() -> None:
    model = tiny_model()
    cfg = TrainConfig(dense_optimizer="sgd", dense_lr=0.2, lr_decay="step", lr_step_size=2, lr_gamma=0.5)
    opt = build_optimizer(model, cfg)
    sched = build_scheduler(opt, cfg, cfg.max_steps)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.2, 0.2, 0.1, 0.1, 0.05, 0.05], abs=1e-15)
    # torch's own StepLR agrees
    ref_opt = torch.optim.SGD(tiny_model().parameters(), lr=0.2)
    ref = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    ref_lrs = []
    for _ in range(6):
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref.step()
    assert lrs == pytest.approx(ref_lrs, abs=1e-15)


# -- config errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, pattern", [
    (["model.norm='group'"], r"model\.norm must be one of 'none', 'batch', 'layer', got 'group'"),
    (["train.dense_weight_decay=-0.1"], r"train\.dense_weight_decay must be >= 0, got -0\.1"),
    (["train.lr_decay='step'"], r"train\.lr_decay = 'step' needs train\.lr_step_size >= 1"),
    (["train.lr_step_size=-2"], r"train\.lr_step_size must be >= 0, got -2"),
    (["train.lr_gamma=0.0"], r"train\.lr_gamma must be in \(0, 1\], got 0\.0"),
    (["train.lr_gamma=1.5"], r"train\.lr_gamma must be in \(0, 1\], got 1\.5"),
    (["model.norm='batch'"], r"model\.norm = 'batch' needs data\.drop_last = true"),
])
def test_config_errors_name_the_key(overrides: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, overrides)


def test_config_accepts_the_options() -> None:
    cfg = load_config(None, ["model.norm='batch'", "data.drop_last=true", "train.dense_weight_decay=0.01",
                             "train.lr_decay='step'", "train.lr_step_size=100", "train.lr_gamma=0.5"])
    assert (cfg.model.norm, cfg.train.dense_weight_decay, cfg.train.lr_step_size, cfg.train.lr_gamma) == \
        ("batch", 0.01, 100, 0.5)
    assert load_config(None, ["model.norm='layer'"]).model.norm == "layer"      # layer norm: any batch split
