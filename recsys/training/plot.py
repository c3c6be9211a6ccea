"""`recsys plot RUN_DIR`: PNG curves of a run's metrics.jsonl (loss, AUC, samples/s); training and
validation (`val/*`, train.validate_every) curves share a plot, one line each, and the loss and AUC
plots mark the best validation pass (metrics.json's `best_step`: the model `best/` keeps)."""

from __future__ import annotations

import json
from pathlib import Path

CURVES = {
    "loss": ("loss/train", "val/logloss"),
    "auc": ("auc/train", "val/auc", "final/auc", "auc"),
    "samples_per_s": ("perf/samples_per_s",),
}


def read_metrics(path: Path, partial: bool = False) -> list[dict]:
    """The lines of a metrics.jsonl; ValueError naming a line that is not JSON, or with `partial` (a
    file still being written) the lines before it."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if partial:
                    break
                raise ValueError(f"{path}:{n}: not a JSON line: {e}") from None
    return rows


def pyplot(who: str):
    """matplotlib.pyplot on the Agg backend; ImportError saying that `who` needs it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(f"{who} needs matplotlib: pip install matplotlib") from None
    return plt


def save_plot(fig, ax, path: Path, ylabel: str, title: str) -> Path:
    """A plot of values per step labelled, written to `path` (PNG, 100 dpi) and closed."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write one PNG per curve that has data into RUN_DIR/plots; return their paths."""
    plt = pyplot("recsys plot")
    run = Path(run_dir)
    rows = read_metrics(run / "metrics.jsonl")
    try:                                    # the step of the best validation pass (metrics.json), or None
        best = json.loads((run / "metrics.json").read_text()).get("best_step")
    except (OSError, ValueError):
        best = None
    best = int(best) if isinstance(best, (int, float)) and best >= 0 else None
    out_dir = run / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, keys in CURVES.items():
        series = {k: [(r["step"], r[k]) for r in rows if k in r] for k in keys}
        series = {k: pts for k, pts in series.items() if pts}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            ax.plot(*zip(*points), label=key, marker="." if len(points) < 50 else None)
        if best is not None and name in ("loss", "auc"):
            ax.axvline(best, color="grey", linestyle="--", linewidth=1, label=f"best (step {best})")
        if len(series) > 1 or best is not None:
            ax.legend()
        written.append(save_plot(fig, ax, out_dir / f"{name}.png", name, f"{run.name}: {name}"))
    return written
