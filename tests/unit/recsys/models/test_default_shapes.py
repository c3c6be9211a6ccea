"""Tower shapes left out of the config: every CTR arch builds and runs at any table dim.

`model.bottom_mlp` not given is derived from the tables' dim (`default_bottom_mlp`); a config that
gives it builds the model it always built.
"""

from __future__ import annotations

import pytest
import torch

from recsys.config import ConfigError, ModelConfig, load_config
from recsys.config_model import default_bottom_mlp
from recsys.models import build_model

B, DN, F = 4, 13, 5


@pytest.mark.parametrize("arch", ["dlrm", "dcn", "deepfm", "wide_deep"])
@pytest.mark.parametrize("dim", [8, 16, 32])
@pytest.mark.parametrize("num_dense", [DN, 0])
def test_every_arch_builds_at_any_dim_without_shapes(arch: str, dim: int, num_dense: int) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch=arch), num_dense=num_dense, num_sparse=F, embedding_dim=dim)
    pooled = torch.randn(B, F, dim, requires_grad=True)                      # [B, F, D]
    linear = torch.randn(B, F) if model.needs_linear_terms else None        # [B, F]
    logits = model(torch.randn(B, num_dense), pooled, linear)
    assert logits.shape == (B,) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert pooled.grad.abs().sum() > 0


@pytest.mark.parametrize("dim", [8, 16, 32])
def test_a_job_config_without_bottom_mlp_loads_at_any_dim(dim: int) -> None:
    cfg = load_config(None, ["data.dense_columns=['I1', 'I2']", "data.sparse_columns=['C1', 'C2']",
                             f"ps.table_defaults.dim={dim}"])
    assert cfg.model.arch == "dlrm" and cfg.model.bottom_mlp == ()
    model = build_model(cfg.model, num_dense=2, num_sparse=2, embedding_dim=dim)
    assert model.dense_arch.mlp.out_features == dim
    assert model(torch.randn(B, 2), torch.randn(B, 2, dim)).shape == (B,)


def test_derived_bottom_mlp() -> None:
    assert default_bottom_mlp(16) == (64, 16)          # the old default, at the old default dim
    assert default_bottom_mlp(8) == (64, 8) and default_bottom_mlp(64) == (128, 64)


def test_given_shapes_build_the_same_model_as_before() -> None:
    """At D = 16, leaving bottom_mlp out builds the model the old default [64, 16] built (same init)."""
    states = []
    for cfg in (ModelConfig(arch="dlrm"), ModelConfig(arch="dlrm", bottom_mlp=(64, 16))):
        torch.manual_seed(3)
        states.append(build_model(cfg, num_dense=DN, num_sparse=F, embedding_dim=16).state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_given_bottom_mlp_must_still_end_in_the_dim() -> None:
    with pytest.raises(ConfigError, match=r"model\.bottom_mlp must end in the tables' dim 8 for dlrm, got \[64, 16\]"):
        load_config(None, ["data.dense_columns=['I1']", "data.sparse_columns=['C1']", "ps.table_defaults.dim=8",
                           "model.bottom_mlp=[64, 16]"])
    with pytest.raises(ValueError, match=r"model\.bottom_mlp must end in the embedding dim 8"):
        build_model(ModelConfig(arch="dlrm", bottom_mlp=(64, 16)), num_dense=DN, num_sparse=F, embedding_dim=8)
