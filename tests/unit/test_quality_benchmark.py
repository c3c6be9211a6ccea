"""benchmarks/quality.py's plumbing: its configs load, the reference trains, the report's key paths and medians.

The comparison itself trains for minutes (run by hand, see the script's docstring); this checks that every
run it would start is a valid config and that the numbers it prints are put together right.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from data.onehot import ONEHOT_FIELDS, generate_onehot
from recsys.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def q():
    spec = importlib.util.spec_from_file_location("bench_quality", BENCH / "quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(**kw) -> argparse.Namespace:
    base = dict(l2=1e-4, global_wd=None, max_epochs=3, presets=["onehot"], models=["lr", "fm", "deepfm"],
                variants=["auto", "ps_global", "ps"])
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("model", ["lr", "fm", "deepfm"])
@pytest.mark.parametrize("variant", ["auto", "ps_global", "ps"])
def test_every_run_is_a_valid_config(q, model: str, variant: str, tmp_path: Path) -> None:
    cfg = load_config(q.BASE, q.overrides("onehot", model, variant, tmp_path, tmp_path / "run", 1, _args()))
    assert cfg.data.sparse_columns == ONEHOT_FIELDS and len(cfg.ps.tables) == 20      # + the linear tables
    assert cfg.model.arch == ("wide_deep" if model == "lr" else "deepfm")
    assert cfg.model.top_mlp == ((64, 32) if model == "deepfm" else ())
    want = {"auto": ("auto", "l2"), "ps_global": ("ps", "global"), "ps": ("ps", "l2")}[variant]
    assert {(t.placement, t.weight_decay_mode) for t in cfg.ps.tables} == {want}
    assert {t.weight_decay for t in cfg.ps.tables} == {2e-4}
    assert cfg.train.validate_every == "epoch" and cfg.train.keep_best and cfg.data.test_paths


def test_reference_trains_and_scores_the_test_file(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(BENCH))
    from quality_reference import RefConfig, train_reference

    generate_onehot(out_dir=str(tmp_path), seed=0, split=(1500, 300, 600))
    paths = [[str(tmp_path / f"part-0000{i}.parquet")] for i in range(3)]
    for arch in ("lr", "fm", "deepfm"):
        r = train_reference(RefConfig(arch=arch, max_epochs=1, dim=4, hidden=(8,)), ONEHOT_FIELDS, *paths)
        assert 0 < r["auc"] < 1 and r["epochs"] == 1 and 0 < r["logloss"] < 1   # scored, not learned yet


def test_summary_takes_medians_and_keeps_the_key_paths(q) -> None:
    def run(auc: float, ref: float) -> dict:
        one = {"auc": auc, "ref_auc": ref, "ratio_auc_vs_reference": auc / ref}
        model = {"ref_auc": ref, "auto": one, "ps_global": one, "ps": {"error": "boom"}}
        return {"onehot": {"oracle_auc": 0.95, "rows": [1, 2, 3], "lr": model, "fm": model, "deepfm": model}}

    out = q.summarize([run(0.90, 0.95), run(0.80, 0.80), run(0.93, 0.94)], _args())
    d = out["onehot"]["deepfm"]
    assert d["auto"]["auc"] == 0.90 and d["ref_auc"] == 0.94
    assert d["ps_global"]["ratio_auc_vs_reference"] == pytest.approx(0.93 / 0.94)     # median of the ratios
    assert d["ps"]["auc"] is None and d["ps"]["errors"] == ["boom"] * 3
    assert "wide_deep" in out["onehot"]["lr"]["arch"]
