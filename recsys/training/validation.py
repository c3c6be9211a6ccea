"""Periodic validation, early stopping and the best model's bookkeeping (the settings,
`train.validate_every`, `early_stop_metric`, `early_stop_patience` and `keep_best`: docs/config.md).
The trainer runs the passes and saves `RUN_DIR/best/` (`Trainer._validate`); the record (best value and
step, passes without improvement) is in every checkpoint, so a resumed run keeps its best-so-far and patience.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from recsys.config import JobConfig


@dataclass
class ValidationState:
    """The early-stopping record (JSON-able numbers; saved in checkpoints)."""

    best_value: float = math.nan     # nan: no pass yet
    best_step: int = -1
    passes: int = 0
    passes_since_best: int = 0


class Validation:
    """When to validate, and what a pass's metrics mean for the best model and early stopping."""

    def __init__(self, cfg: JobConfig) -> None:
        t = cfg.train
        self.every = t.validate_every
        self.metric = t.early_stop_metric
        self.patience = t.early_stop_patience
        self.keep_best = t.keep_best
        self.state = ValidationState()

    def due(self, step: int, end_of_epoch: bool) -> bool:
        """Whether a pass runs after `step` steps (`end_of_epoch`: the step ended an epoch)."""
        return end_of_epoch if self.every == "epoch" else self.every != 0 and step % self.every == 0

    def record(self, metrics: dict[str, float], step: int) -> bool:
        """Note a pass's metrics; True if it is the best so far (lower logloss / higher auc)."""
        value = float(metrics[self.metric])
        s = self.state
        s.passes += 1
        better = math.isnan(s.best_value) or (value < s.best_value if self.metric == "logloss"
                                              else value > s.best_value)
        if better and not math.isnan(value):
            s.best_value, s.best_step, s.passes_since_best = value, step, 0
            return True
        s.passes_since_best += 1
        return False

    @property
    def should_stop(self) -> bool:
        """Early stopping: `patience` passes in a row without a new best."""
        return self.patience > 0 and self.state.passes_since_best >= self.patience

    def state_dict(self) -> dict[str, float | int]:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        """A saved record; a key it lacks keeps its default (each value is cast to its default's type)."""
        self.state = ValidationState(**{k: type(v)(state.get(k, v)) for k, v in asdict(ValidationState()).items()})


__all__ = ["Validation", "ValidationState"]
