"""DDP broadcasts module buffers before every forward only for models whose buffers are state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from recsys.config import load_config
from recsys.models import build_job_model
from recsys.training.dense import has_state_buffers

ROOT = Path(__file__).resolve().parents[4]


@pytest.mark.parametrize("name, state", [("tiny", False), ("quickstart", False), ("din", False),
                                         ("dcn", False), ("deepfm", True), ("wide_deep", False),
                                         ("two_tower", True)])
def test_which_shipped_models_have_state_buffers(name: str, state: bool) -> None:
    """DLRM's triu indices and DIN's kept features are derived from the config (non-persistent, equal
    on every rank): no broadcast. two_tower's frequency counts and batch norm's running statistics
    (configs/deepfm.toml sets model.norm = "batch") are state: broadcast, as by default."""
    _, model = build_job_model(load_config(ROOT / "configs" / f"{name}.toml", []))
    assert has_state_buffers(model) is state
    if not state:
        persistent = model.state_dict().keys()
        assert all(n not in persistent for n, _ in model.named_buffers())


def test_a_persistent_buffer_counts_and_a_constant_one_does_not() -> None:
    m = nn.Linear(2, 2)
    assert not has_state_buffers(m)
    m.register_buffer("idx", torch.arange(3), persistent=False)
    assert not has_state_buffers(m)
    m.register_buffer("running", torch.zeros(2))
    assert has_state_buffers(m)
    assert has_state_buffers(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
