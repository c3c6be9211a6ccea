"""Serving: export for serving (export.py, delta.py, dense_export.py), the `Predictor` over an
export (predictor.py) and its rows as a read-only RowSource (export_store.py). Imports
the models package, never the training one (offline evaluation of a run lives there, in evaluate.py)."""

from __future__ import annotations

from typing import Any

__all__ = ["Predictor"]


def __getattr__(name: str) -> Any:
    # lazy: `recsys eval` imports this package without needing the predictor's imports
    if name == "Predictor":
        from recsys.serving.predictor import Predictor

        return Predictor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
