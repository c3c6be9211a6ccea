"""Serving: offline eval/predict of a run (offline.py), export for serving (export.py, delta.py,
dense_export.py) and the `Predictor` over an export (predictor.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["Predictor"]


def __getattr__(name: str) -> Any:
    # lazy: `recsys eval` imports this package without needing the predictor's imports
    if name == "Predictor":
        from recsys.serving.predictor import Predictor

        return Predictor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
