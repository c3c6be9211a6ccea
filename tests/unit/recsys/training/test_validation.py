"""Validation passes, early stopping and the best model's record (recsys.training.validation)."""

from __future__ import annotations

import math

import pytest

from recsys.config import ConfigError, load_config
from recsys.training.validation import Validation


def make(**train) -> Validation:
    sets = ["data.eval_paths=['x.parquet']"] + [f"train.{k}={v!r}" if isinstance(v, str) else f"train.{k}={v}"
                                                  for k, v in train.items()]
    return Validation(load_config(None, [s.replace("True", "true").replace("False", "false") for s in sets]))


def test_due_by_steps_and_by_epoch() -> None:
    v = make(validate_every=5)
    assert [s for s in range(1, 16) if v.due(s, end_of_epoch=False)] == [5, 10, 15]
    e = make(validate_every="epoch")
    assert not e.due(7, end_of_epoch=False) and e.due(8, end_of_epoch=True)
    assert not make().due(5, end_of_epoch=True)                    # validate_every = 0: no passes


@pytest.mark.parametrize("metric,values,best_index", [
    ("logloss", [0.5, 0.4, 0.45, 0.41, 0.42], 1),
    ("auc", [0.6, 0.7, 0.69, 0.71, 0.65, 0.7], 3),
])
def test_best_and_early_stop(metric: str, values: list[float], best_index: int) -> None:
    v = make(validate_every="epoch", early_stop_metric=metric, early_stop_patience=2)
    stopped_at = None
    for i, x in enumerate(values):
        improved = v.record({metric: x, "logloss" if metric == "auc" else "auc": 0.0}, step=10 * (i + 1))
        assert improved == (x == (min if metric == "logloss" else max)(values[: i + 1]))
        if v.should_stop and stopped_at is None:
            stopped_at = i
    assert v.state.best_step == 10 * (best_index + 1) and v.state.best_value == values[best_index]
    assert stopped_at == best_index + 2                              # two passes without a new best


def test_state_survives_a_restart() -> None:
    v = make(validate_every=5, early_stop_patience=3)
    for x in (0.5, 0.4, 0.45):
        v.record({"logloss": x}, step=1)
    w = make(validate_every=5, early_stop_patience=3)
    w.load_state_dict(v.state_dict())
    assert w.state == v.state and w.state.passes_since_best == 1
    w.record({"logloss": 0.46}, step=2)
    w.record({"logloss": 0.47}, step=3)
    assert w.should_stop
    assert math.isnan(make().state.best_value)


@pytest.mark.parametrize("sets,message", [
    (["train.validate_every=5"], "train.validate_every needs validation data"),
    (["data.eval_paths=['x']", "train.validate_every=-1"], "train.validate_every must be >= 0"),
    (["data.eval_paths=['x']", "train.early_stop_patience=2"], "train.early_stop_patience needs validation"),
    (["data.eval_paths=['x']", "train.validate_every='week'"], "train.validate_every must be"),
])
def test_bad_validation_settings_are_named(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, sets)
