"""`recsys plot RUN_DIR` writes PNG curves from metrics.jsonl."""

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from recsys.cli import main  # noqa: E402


def test_plot_writes_pngs(tmp_path: Path) -> None:
    lines = [{"step": s, "time": s, "loss/train": 0.7 - 0.01 * s, "perf/samples_per_s": 1000.0 + s}
             for s in range(10, 110, 10)]
    lines.append({"step": 100, "time": 100, "final/auc": 0.8})
    lines += [{"step": s, "time": s, "val/logloss": 0.6, "val/auc": 0.7} for s in (50, 100)]   # validation passes
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["plot", str(tmp_path)]) == 0
    for name in ("loss", "auc", "samples_per_s"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_plot_marks_the_best_pass(tmp_path: Path, monkeypatch) -> None:
    """#30 item 5: the loss and AUC plots mark metrics.json's best_step (the model best/ keeps)."""
    import matplotlib.figure

    lines = [{"step": s, "time": s, "loss/train": 0.7 - 0.01 * s, "val/logloss": 0.6 + abs(s - 50) / 1000,
              "val/auc": 0.7} for s in range(10, 110, 10)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "metrics.json").write_text(json.dumps({"best_step": 50.0}))
    labels = {}
    real = matplotlib.figure.Figure.savefig

    def keep(fig, path, *a, **k):
        labels[Path(path).stem] = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
        return real(fig, path, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    assert main(["plot", str(tmp_path)]) == 0
    assert "best (step 50)" in labels["loss"] and "best (step 50)" in labels["auc"]


def test_plot_names_a_bad_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss/train": 0.5}\nnot json\n')
    from recsys.training.plot import plot_run

    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):
        plot_run(tmp_path)
