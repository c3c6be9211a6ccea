"""Negative downsampling and example weights outside the trainer: score calibration, weighted metrics, config."""

import math

import numpy as np
import pytest
import torch

from recsys.calibration import calibrate, data_score_rate, manifest_score_rate, probabilities
from recsys.config import ConfigError, load_config
from recsys.metrics import CTRMetrics, StreamingAUC, auc, eval_metrics
from data.config import DataConfig


# -- calibration -------------------------------------------------------------------------------

@pytest.mark.parametrize("r", [1.0, 0.5, 0.1, 0.01])
def test_calibration_undoes_negative_downsampling(r):
    p = torch.linspace(0.001, 0.999, 999, dtype=torch.float64)          # true click probabilities
    p_sampled = p / (p + (1 - p) * r)                                  # what a model of the kept rows learns
    torch.testing.assert_close(calibrate(p_sampled, r), p, rtol=1e-12, atol=0)
    logits = torch.logit(p_sampled)
    torch.testing.assert_close(probabilities(logits, r), p, rtol=1e-12, atol=1e-15)


def test_rate_one_is_the_plain_sigmoid_bit_for_bit():
    x = torch.randn(1000)
    assert torch.equal(probabilities(x, 1.0), torch.sigmoid(x))
    assert torch.equal(calibrate(torch.sigmoid(x), 1.0), torch.sigmoid(x))


def test_which_rate_the_scores_are_corrected_by():
    assert data_score_rate(DataConfig()) == 1.0
    assert data_score_rate(DataConfig(negative_sampling_rate=0.2)) == 0.2
    assert data_score_rate(DataConfig(negative_sampling_rate=0.2, negative_sampling_correction="weight")) == 1.0
    assert manifest_score_rate({}) == 1.0                                 # exports made before the section
    assert manifest_score_rate({"calibration": {"negative_sampling_rate": 0.2, "correction": "calibrate"}}) == 0.2
    assert manifest_score_rate({"calibration": {"negative_sampling_rate": 0.2, "correction": "weight"}}) == 1.0


# -- weighted metrics ----------------------------------------------------------------------------

def _data(n=400, seed=0):
    g = np.random.default_rng(seed)
    y = (g.random(n) < 0.3).astype(np.float64)
    s = np.clip(0.3 + 0.3 * (y - 0.3) + 0.2 * g.standard_normal(n), 0.001, 0.999)
    s[::7] = s[0]                                                        # some ties
    k = g.integers(0, 4, n)                                              # integer weights, some 0
    return torch.from_numpy(y), torch.from_numpy(s), torch.from_numpy(k.astype(np.float64))


@pytest.mark.parametrize("exact", [True, False])
def test_integer_weights_equal_repeated_rows(exact):
    y, s, k = _data()
    rep = torch.from_numpy(np.repeat(np.arange(len(y)), k.numpy().astype(np.int64)))
    weighted = eval_metrics(y, s, s, exact_auc=exact, weights=k)
    repeated = eval_metrics(y[rep], s[rep], s[rep], exact_auc=exact)
    assert weighted.pop("eval_examples") == len(y)                       # a row count, not the weight
    repeated.pop("eval_examples")
    assert weighted == pytest.approx(repeated, rel=1e-12)


def test_ones_weights_equal_no_weights_exactly():
    y, s, _ = _data()
    for exact in (True, False):
        assert eval_metrics(y, s, None, exact_auc=exact, weights=torch.ones(len(y))) == \
            eval_metrics(y, s, None, exact_auc=exact)


def test_weighted_auc_by_hand():
    # pairs (pos, neg): (0.9, 0.2) won w 2*1, (0.9, 0.95) lost 2*3, (0.4, 0.2) won 1*1, (0.4, 0.95) lost 1*3
    y, s, w = torch.tensor([1., 1., 0., 0.]), torch.tensor([0.9, 0.4, 0.2, 0.95]), torch.tensor([2., 1., 1., 3.])
    assert auc(y, s, w) == pytest.approx((2 + 1) / (3 * 4))
    m = StreamingAUC(100)
    m.update(y, s, w)
    assert m.compute() == pytest.approx(3 / 12)


def test_bad_weights_raise():
    y, s, _ = _data(10)
    with pytest.raises(ValueError, match="weights must be finite and >= 0"):
        eval_metrics(y, s, None, weights=torch.tensor([-1.0] + [1.0] * 9))
    with pytest.raises(ValueError, match="weights and labels differ in length"):
        eval_metrics(y, s, None, weights=torch.ones(3))
    with pytest.raises(ValueError, match="needs weights"):
        CTRMetrics(weighted=True).update(y, s)


def test_all_zero_weights_give_nan_not_an_error():
    y, s, _ = _data(10)
    out = eval_metrics(y, s, None, weights=torch.zeros(10))
    assert math.isnan(out["logloss"]) and math.isnan(out["auc"]) and out["eval_examples"] == 10


# -- config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0.0", "-0.5", "1.01", "2"])
def test_rate_outside_0_1_is_a_config_error_naming_the_key(repo_root, value):
    with pytest.raises(ConfigError, match=r"data\.negative_sampling_rate must be in \(0, 1\]"):
        load_config(repo_root / "configs" / "tiny.toml", [f"data.negative_sampling_rate={value}"])


def test_correction_is_a_literal(repo_root):
    with pytest.raises(ConfigError, match="data.negative_sampling_correction must be one of"):
        load_config(repo_root / "configs" / "tiny.toml", ["data.negative_sampling_correction='both'"])


def test_two_tower_takes_neither(repo_root):
    for sets in (["data.negative_sampling_rate=0.5"], ["data.example_weight_column='w'"]):
        with pytest.raises(ConfigError, match="model.arch = 'two_tower' trains an in-batch softmax"):
            load_config(repo_root / "configs" / "two_tower.toml", sets)
