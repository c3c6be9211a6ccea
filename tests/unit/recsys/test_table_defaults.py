"""[ps.table_defaults], tables made for sparse columns, model.linear_tables, and models without dense columns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recsys.config import ConfigError, load_config, load_ps_config, to_toml
from recsys.models import build_model

ROOT = Path(__file__).resolve().parents[3]

BASE = """
[data]
sparse_columns = ["a", "b", "m"]
[ps]
tables = [{ name = "b", dim = 4, lr = 0.5 }]
[ps.table_defaults]
dim = 4
optimizer = "adam"
lr = 0.02
weight_decay = 0.01
[model]
arch = "deepfm"
linear_tables = true
table_pooling = { m = "mean" }
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_defaults_fill_tables_and_make_the_missing_ones(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE))
    tables = {t.name: t for t in cfg.ps.tables}
    assert list(tables) == ["b", "a", "m", "a_linear", "b_linear", "m_linear"]   # given, then by column
    assert tables["b"].lr == 0.5 and tables["b"].optimizer == "adam"             # its own value wins
    assert tables["a"].lr == 0.02 and tables["a"].weight_decay == 0.01 and tables["a"].dim == 4
    assert all(tables[f"{c}_linear"].dim == 1 and tables[f"{c}_linear"].optimizer == "adam" for c in "abm")
    assert cfg.model.linear_feature_tables == {"a": "a_linear", "b": "b_linear", "m": "m_linear"}
    assert cfg.model.table_pooling == {"m": "mean", "m_linear": "mean"}            # same pooling as its table


def test_expanded_config_round_trips_and_the_shard_sees_the_same_tables(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE))
    again = tmp_path / "resolved.toml"
    again.write_text(to_toml(cfg))                       # what print-config shows and the launcher writes
    assert load_config(again) == cfg
    assert load_ps_config(write(tmp_path, BASE)).tables == cfg.ps.tables   # `recsys ps` on the original file


def test_a_config_for_n_id_columns_needs_no_table_lines(tmp_path: Path) -> None:
    cols = [f"f{i}" for i in range(10)]
    cfg = load_config(write(tmp_path, f'[data]\nsparse_columns = {cols}\n[ps.table_defaults]\ndim = 16\n'
                                      '[model]\narch = "wide_deep"\nlinear_tables = true\n'))
    assert len(cfg.ps.tables) == 20 and {t.dim for t in cfg.ps.tables} == {1, 16}


@pytest.mark.parametrize("text,message", [
    ('[data]\nsparse_columns = ["a"]\n[ps.table_defaults]\nlr = 0.1\n',
     "column 'a' reads table 'a', which is not in ps.tables, and ps.table_defaults has no dim"),
    ('[ps.table_defaults]\ndim = 4\nlrr = 0.1\n', "unknown key 'ps.table_defaults.lrr'"),
    ('[data]\nsparse_columns = ["a"]\n[ps.table_defaults]\ndim = 4\nlr = -1.0\n', "ps.tables[a].lr must be > 0"),
    ('[data]\nsparse_columns = ["a"]\n[ps.table_defaults]\ndim = 4\n[model]\narch = "dcn"\nlinear_tables = true\n',
     "model.linear_tables is only used by deepfm and wide_deep"),
])
def test_bad_defaults_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_config(write(tmp_path, text))
    assert str(tmp_path / "job.toml") in str(e.value)


def test_the_real_data_example_config_loads() -> None:
    cfg = load_config(ROOT / "configs" / "deepfm_onehot.toml")
    assert len(cfg.ps.tables) == 20 and cfg.data.test_paths   # 10 columns, each with a linear table and cfg.train.validate_every == "epoch"
    assert not cfg.data.dense_columns


@pytest.mark.parametrize("arch", ["dlrm", "dcn", "deepfm", "wide_deep"])
@pytest.mark.parametrize("num_sparse", [1, 3])
def test_every_model_takes_zero_dense_columns(arch: str, num_sparse: int) -> None:
    cfg = load_config(None, [f"model.arch='{arch}'", "model.bottom_mlp=[8]", "model.top_mlp=[8]"]).model
    model = build_model(cfg, num_dense=0, num_sparse=num_sparse, embedding_dim=8)
    linear = torch.rand(5, num_sparse) if arch in ("deepfm", "wide_deep") else None
    pooled = torch.rand(5, num_sparse, 8, requires_grad=True)
    logits = model(torch.zeros(5, 0), pooled, linear)
    assert logits.shape == (5,) and torch.isfinite(logits).all()
    logits.sum().backward()
    assert pooled.grad is not None and pooled.grad.abs().sum() > 0     # the embeddings reach the logit


def test_a_default_no_table_takes_is_a_warning_naming_the_tables(caplog) -> None:
    """tiny.toml's tables set their own lr: `--set ps.table_defaults.lr=...` would change nothing."""
    with caplog.at_level("WARNING", logger="recsys.config"):
        cfg = load_config(ROOT / "configs" / "tiny.toml", ["ps.table_defaults.lr=0.5"])
    assert 0.5 not in {t.lr for t in cfg.ps.tables}
    assert "ps.table_defaults.lr = 0.5 applies to no table" in caplog.text
    assert "(C1, C2, C3, C4, M1)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="recsys.config"):
        load_config(ROOT / "configs" / "tiny.toml", ["ps.table_defaults.weight_decay=0.01"])   # no table sets it
        load_config(ROOT / "configs" / "tune_deepfm.toml", ["ps.table_defaults.lr=0.5"])      # tables made from it
    assert "applies to no table" not in caplog.text
