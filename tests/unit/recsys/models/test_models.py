"""The CTR architectures: shapes, training signal, seeded init, and the interaction ops against loops."""

import itertools

import pytest
import torch
from torch import nn

from recsys.config import ModelConfig
from recsys.models import (
    ARCHS,
    DCN,
    CrossNet,
    FactorizationMachine,
    FieldWeightedFM,
    InteractionArch,
    build_model,
)

B, DN, F, D = 8, 5, 4, 6
ARCH_NAMES = sorted(a for a in ARCHS if not getattr(ARCHS[a], "needs_sequences", False))   # din: test_din.py


def config(arch: str, **kw) -> ModelConfig:
    kw.setdefault("bottom_mlp", (16, D))
    kw.setdefault("top_mlp", (16, 8))
    return ModelConfig(arch=arch, **kw)


def make(arch: str, seed: int = 0, num_dense: int = DN, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(config(arch, **kw), num_dense=num_dense, num_sparse=F, embedding_dim=D)


def inputs(seed: int = 1, batch: int = B, num_dense: int = DN) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, num_dense, generator=g)           # [B, Dn]
    pooled = torch.randn(batch, F, D, generator=g)               # [B, F, D]
    linear = torch.randn(batch, F, generator=g)                  # [B, F]
    return dense, pooled, linear


def linear_arg(model: nn.Module, linear: torch.Tensor) -> torch.Tensor | None:
    return linear if model.needs_linear_terms else None


# -- shapes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCH_NAMES)
@pytest.mark.parametrize("sizes", [dict(top_mlp=(16, 8)), dict(top_mlp=(4,), bottom_mlp=(D,)), dict(top_mlp=())])
def test_output_shape(arch, sizes):
    model = make(arch, **sizes)
    dense, pooled, linear = inputs()
    out = model(dense, pooled, linear_arg(model, linear))
    assert out.shape == (B,)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("arch", ["deepfm", "wide_deep"])
def test_linear_models_accept_no_linear_terms_and_no_dense(arch):
    model = make(arch, num_dense=0)
    dense, pooled, _ = inputs(num_dense=0)
    assert model(dense, pooled, None).shape == (B,)


@pytest.mark.parametrize("arch", ["deepfm", "wide_deep"])
def test_first_order_terms_add_their_sum_to_the_logit(arch):
    # The dim-1 PS rows enter only through the wide / first-order sum, so they shift the logit
    # by exactly their row sum.
    model = make(arch).eval()
    dense, pooled, linear = inputs()
    with torch.no_grad():
        delta = model(dense, pooled, linear) - model(dense, pooled, None)
    torch.testing.assert_close(delta, linear.sum(dim=1))


def test_needs_linear_terms():
    assert {name: cls.needs_linear_terms for name, cls in ARCHS.items()} == {
        "dlrm": False, "dcn": False, "deepfm": True, "wide_deep": True, "din": False}


def test_dlrm_works_under_cpu_bf16_autocast():
    model = make("dlrm")
    dense, pooled, _ = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(dense, pooled)
    assert out.shape == (B,)


# -- training signal and determinism ----------------------------------------------------------------


@pytest.mark.parametrize("arch, structure", [(a, "stacked") for a in ARCH_NAMES] + [("dcn", "parallel")])
def test_loss_decreases_on_a_fixed_batch(arch, structure):
    model = make(arch, dcn_structure=structure, num_cross_layers=2)
    dense, pooled, linear = inputs(batch=32)
    linear = linear_arg(model, linear)
    labels = (dense[:, 0] + pooled[:, 0, 0] > 0).float()        # [B], learnable from the inputs
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = nn.BCEWithLogitsLoss()
    losses = []
    for _ in range(20):
        loss = loss_fn(model(dense, pooled, linear), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_init_is_deterministic_under_a_seed(arch):
    a, b, c = make(arch, seed=3), make(arch, seed=3), make(arch, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() and sa
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    dense, pooled, linear = inputs()
    torch.testing.assert_close(a(dense, pooled, linear_arg(a, linear)), b(dense, pooled, linear_arg(b, linear)),
                               rtol=0, atol=0)


def test_dropout_is_active_only_in_train_mode():
    model = make("dcn", dropout=0.5)
    dense, pooled, _ = inputs()
    torch.manual_seed(0)
    train_a, train_b = model(dense, pooled), model(dense, pooled)
    model.eval()
    assert not torch.equal(train_a, train_b)
    torch.testing.assert_close(model(dense, pooled), model(dense, pooled), rtol=0, atol=0)


# -- DCN ------------------------------------------------------------------------------------------


def test_dcn_stacked_and_parallel_differ_in_the_head():
    stacked, parallel = make("dcn", dcn_structure="stacked"), make("dcn", dcn_structure="parallel")
    assert isinstance(stacked, DCN) and isinstance(parallel, DCN)
    d = DN + F * D
    assert stacked.final.in_features == 8            # deep output only
    assert parallel.final.in_features == d + 8       # cross output beside the deep output


def test_dcn_with_no_cross_layers_is_just_the_deep_part():
    model = make("dcn", num_cross_layers=0)
    x = torch.randn(3, 7)
    torch.testing.assert_close(model.cross(x), x)
    dense, pooled, _ = inputs()
    assert model(dense, pooled).shape == (B,)


def test_cross_layers_match_the_formula():
    torch.manual_seed(0)
    net = CrossNet(in_features=5, num_layers=2)
    x0 = torch.randn(3, 5)
    x = x0
    for layer in net.layers:                         # x_{l+1} = x0 * (W x_l + b) + x_l, written out
        x = x0 * (x @ layer.weight.T + layer.bias) + x
    torch.testing.assert_close(net(x0), x)


# -- interaction ops against loops -------------------------------------------------------------------


def test_dlrm_interaction_matches_a_loop():
    torch.manual_seed(0)
    dense, pooled = torch.randn(3, D), torch.randn(3, F, D)
    out = InteractionArch(F)(dense, pooled)
    assert out.shape == (3, D + F * (F + 1) // 2)
    for b in range(3):
        vectors = [dense[b]] + [pooled[b, f] for f in range(F)]
        dots = [vectors[i] @ vectors[j] for i in range(F + 1) for j in range(i + 1, F + 1)]
        torch.testing.assert_close(out[b], torch.cat([dense[b], torch.stack(dots)]))


def test_dlrm_interaction_indices_stay_out_of_the_state_dict():
    model = make("dlrm")
    assert not any("triu" in k for k in model.state_dict())


def test_factorization_machine_matches_pairwise_dots():
    torch.manual_seed(0)
    pooled = torch.randn(3, F, D)
    expected = torch.stack([
        sum(pooled[b, i] @ pooled[b, j] for i, j in itertools.combinations(range(F), 2)) for b in range(3)
    ])
    torch.testing.assert_close(FactorizationMachine()(pooled), expected)


def test_field_weighted_fm_weights_each_pair():
    """FwFM: weights 1 give the FM; a pair's weight scales exactly that pair's dot product."""
    torch.manual_seed(0)
    pooled = torch.randn(3, F, D)
    fwfm = FieldWeightedFM(F)
    torch.testing.assert_close(fwfm(pooled), FactorizationMachine()(pooled))
    pairs = list(itertools.combinations(range(F), 2))
    weights = torch.randn(len(pairs))
    with torch.no_grad():
        fwfm.pair_weight.copy_(weights)
    expected = torch.stack([sum(w * (pooled[b, i] @ pooled[b, j]) for w, (i, j) in zip(weights, pairs))
                            for b in range(3)])
    torch.testing.assert_close(fwfm(pooled), expected)


def test_deepfm_fwfm_learns_pair_weights_and_keeps_them_in_the_state_dict():
    model = make("deepfm", fm_interaction="fwfm")
    assert model.state_dict()["fm.pair_weight"].shape == (F * (F - 1) // 2,)
    assert not any(k.startswith("fm.rows") or k.startswith("fm.cols") for k in model.state_dict())
    dense, pooled, pooled_linear = inputs()
    model(dense, pooled, pooled_linear).sum().backward()
    assert model.fm.pair_weight.grad is not None and model.fm.pair_weight.grad.abs().sum() > 0


def test_fm_interaction_is_refused_for_other_archs():
    with pytest.raises(ValueError, match="model.fm_interaction is only used by deepfm, not 'dcn'"):
        config("dcn", fm_interaction="fwfm")


# -- build_model errors ---------------------------------------------------------------------------


def test_dlrm_bottom_mlp_must_end_in_the_embedding_dim():
    with pytest.raises(ValueError, match=r"model.bottom_mlp must end in the embedding dim 6 .*got \[16, 8\]"):
        make("dlrm", bottom_mlp=(16, 8))


def test_dlrm_without_dense_features_interacts_the_embeddings_alone():
    """#12: zero dense columns: no bottom MLP (its sizes are then unused), F(F-1)/2 dot products."""
    model = make("dlrm", num_dense=0, bottom_mlp=(16, 8))
    assert model.dense_arch is None and model.inter_arch.out_features_extra == F * (F - 1) // 2


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_linear_tables_refused_for_archs_without_first_order_terms(arch):
    with pytest.raises(ValueError, match=f"model.arch = '{arch}' has no first-order terms"):
        make(arch, linear_feature_tables={"C1": "C1_lin"})


def test_needs_a_sparse_feature():
    with pytest.raises(ValueError, match="num_sparse=0"):
        build_model(config("deepfm"), num_dense=DN, num_sparse=0, embedding_dim=D)


def test_lr_schedule_warmup_and_decay() -> None:
    from recsys.config import TrainConfig
    from recsys.training.dense import lr_factor

    cfg = TrainConfig(warmup_steps=4, lr_decay="linear", max_steps=14)
    assert [lr_factor(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, cfg, 14) == 1.0 and lr_factor(9, cfg, 14) == 0.5 and lr_factor(14, cfg, 14) == 0.0
    cos = TrainConfig(lr_decay="cosine", max_steps=10)
    assert lr_factor(0, cos, 10) == 1.0 and abs(lr_factor(5, cos, 10) - 0.5) < 1e-12 and lr_factor(10, cos, 10) < 1e-12
    assert lr_factor(7, TrainConfig(), 0) == 1.0
