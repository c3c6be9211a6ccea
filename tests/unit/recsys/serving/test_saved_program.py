"""`train.save_program`: the trainer saves the served dense program with its model (recsys daily sets it),
and an export copies it instead of tracing again, only while it was traced from that model's dense.pt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from recsys.serving import Predictor, dense_export
from recsys.serving.export import export_model
from recsys.serving.source import resolve_source


def test_an_export_copies_the_saved_program_and_traces_again_for_a_changed_model(
        tmp_path: Path, export_data: Path, tiny_config, train_run, monkeypatch) -> None:
    cfg = tiny_config(export_data, tmp_path / "run", save_program=True)
    run = train_run(tmp_path, cfg, steps=(20,))[-1]
    model = run / "model"
    assert (model / "dense.pt2").is_file() and (model / dense_export.PROGRAM_OF).is_file()
    traced: list[Path] = []
    real = dense_export.export_dense
    monkeypatch.setattr(dense_export, "export_dense", lambda c, state, out: traced.append(state) or real(c, state, out))

    copied = export_model(resolve_source(run=run), tmp_path / "copied")
    assert traced == []
    assert (tmp_path / "copied" / "dense.pt2").read_bytes() == (model / "dense.pt2").read_bytes()
    assert not (tmp_path / "copied" / dense_export.PROGRAM_OF).exists()       # the export's files are unchanged

    (model / dense_export.PROGRAM_OF).unlink()                                    # no record: traced anew
    fresh = export_model(resolve_source(run=run), tmp_path / "traced")
    assert len(traced) == 1 and copied["dense"] == fresh["dense"]
    rows = pq.read_table(export_data / "part-00001.parquet").slice(0, 500)
    np.testing.assert_array_equal(Predictor(tmp_path / "copied").predict(rows),
                                  Predictor(tmp_path / "traced").predict(rows))

    # the model saved again (a later save of the directory without the setting): the old program is stale
    dense_export.save_program(cfg, model)
    state = torch.load(model / "dense.pt", weights_only=True)
    torch.save({k: v + 0.5 if v.is_floating_point() else v for k, v in state.items()}, model / "dense.pt")
    export_model(resolve_source(run=run), tmp_path / "changed")
    assert len(traced) == 3                                     # save_program's own trace, then the export's
    assert not np.array_equal(Predictor(tmp_path / "changed").predict(rows), Predictor(tmp_path / "traced").predict(rows))
