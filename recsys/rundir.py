"""The run directory's layout, one owner for both training (writes it) and serving (reads it).

    RUN_DIR/config.toml, metrics.json, metrics.jsonl     the resolved config and the metrics
    RUN_DIR/model/                                       the last model (dense.pt, ps/shardI/)
    RUN_DIR/best/                                        with validation: a checkpoint of the best pass
    RUN_DIR/checkpoints/step-N/                          periodic checkpoints (recsys.training.checkpoint)

`recsys eval`, `predict` and `export --run` use the best model when the run kept one, else the last
(`--last` asks for the last).
"""

from __future__ import annotations

from pathlib import Path

BEST_DIR = "best"


def best_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/best: the best validation pass's model, as a checkpoint (config.toml, model/, manifest.json)."""
    return Path(run_dir) / BEST_DIR


def has_best(run_dir: str | Path) -> bool:
    """Whether the run kept a complete best model (its manifest is written last)."""
    return (best_dir(run_dir) / "manifest.json").is_file()


def model_root(run_dir: str | Path, last: bool = False) -> Path:
    """The directory holding the model a command on the run uses: RUN_DIR/best when the run kept a
    best model and `last` is not asked for, else RUN_DIR (its last model in RUN_DIR/model)."""
    return best_dir(run_dir) if not last and has_best(run_dir) else Path(run_dir)


__all__ = ["BEST_DIR", "best_dir", "has_best", "model_root"]
