"""`recsys eval --export` / `recsys predict --export` (#28 item 5): the serving model, from a directory
or a URI, scores Parquet data; an fp32 export's metrics are the run's own."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys import cli
from recsys.serving.export import export_model
from recsys.serving.predictor import Predictor
from recsys.serving.source import resolve_source
from recsys.training.evaluate import evaluate_run


@pytest.fixture(scope="module")
def exported(tmp_path_factory, export_data, tiny_config, train_run) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("offline")
    cfg = tiny_config(export_data, root / "run")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, on_bad_rows="skip"))
    (run,) = train_run(root, cfg, steps=(30,))
    export_model(resolve_source(run=run), root / "export")
    return run, root / "export"


def test_eval_of_an_export_is_the_runs_eval(exported, export_data: Path, tmp_path: Path, capsys) -> None:
    run, export = exported
    data = [str(export_data / "part-00001.parquet")]
    want = evaluate_run(run, data, out=str(tmp_path / "run.json"), last=True)
    assert cli.main(["eval", "--export", str(export), "--data", data[0], "--out", str(tmp_path / "m.json")]) == 0
    got = json.loads((tmp_path / "m.json").read_text())
    assert json.loads(capsys.readouterr().out) == got
    assert got["eval_examples"] == want["eval_examples"] > 0
    for key in ("auc", "logloss", "calibration"):
        assert abs(got[key] - want[key]) <= 1e-5, (key, got[key], want[key])


def test_predict_of_an_export_writes_the_predictors_scores(exported, export_data: Path, tmp_path: Path) -> None:
    _, export = exported
    data = export_data / "part-00001.parquet"
    out = tmp_path / "scores.parquet"
    assert cli.main(["predict", "--export", str(export), "--data", str(data), "--out", str(out)]) == 0
    scores = pq.read_table(out).column("score").to_numpy()
    np.testing.assert_allclose(scores, Predictor(export).predict(pq.read_table(data)), rtol=0, atol=1e-6)


def test_predict_keeps_the_columns_asked_for_run_and_export_alike(exported, export_data: Path, tmp_path: Path,
                                                                   capsys) -> None:
    """`--keep` writes data columns beside each score (a row key to join on: they came only from
    data.passthrough_columns), in row order, from a run as from its export; a column the data lacks
    is one error naming it and the file, before any scoring."""
    run, export = exported
    data = export_data / "part-00001.parquet"
    want = pq.read_table(data)
    for src, out in (("--export", tmp_path / "e.parquet"), ("--run", tmp_path / "r.parquet")):
        argv = ["predict", src, str(export if src == "--export" else run), "--data", str(data), "--out", str(out),
                "--keep", "C1", "C2"] + (["--last"] if src == "--run" else [])
        assert cli.main(argv) == 0
        got = pq.read_table(out)
        assert {"score", "C1", "C2"} <= set(got.column_names) and got.num_rows == want.num_rows
        for c in ("C1", "C2"):
            assert got.column(c).to_pylist() == want.column(c).to_pylist(), c
    e, r = pq.read_table(tmp_path / "e.parquet"), pq.read_table(tmp_path / "r.parquet")
    np.testing.assert_allclose(e.column("score").to_numpy(), r.column("score").to_numpy(), rtol=0, atol=1e-5)
    capsys.readouterr()
    assert cli.main(["predict", "--export", str(export), "--data", str(data), "--out", str(tmp_path / "x.parquet"),
                     "--keep", "user_key"]) == 2
    assert "--keep user_key: not a column of" in capsys.readouterr().err
    assert not (tmp_path / "x.parquet").exists()


def test_kept_integer_columns_with_nulls_stay_integers(exported, export_data: Path, tmp_path: Path) -> None:
    """A row key with nulls came back as float64 with NaN (numpy's view of a nullable integer column): an
    id past 2**53 lost its low digits, and nothing joined back. Run and export alike, uint64 too."""
    import pyarrow as pa
    run, export = exported
    table = pq.read_table(export_data / "part-00001.parquet").slice(0, 500)
    n = table.num_rows
    key = pa.array([None if i % 7 == 0 else (1 << 60) + i for i in range(n)], pa.int64())
    big = pa.array([None if i % 5 == 0 else (1 << 64) - 1 - i for i in range(n)], pa.uint64())
    flag = pa.array([None if i % 3 == 0 else bool(i % 2) for i in range(n)], pa.bool_())
    data = tmp_path / "keys.parquet"
    pq.write_table(table.append_column("key", key).append_column("big", big).append_column("flag", flag), data)
    for src, out in (("--export", tmp_path / "e.parquet"), ("--run", tmp_path / "r.parquet")):
        argv = ["predict", src, str(export if src == "--export" else run), "--data", str(data), "--out", str(out),
                "--keep", "key", "big", "flag"] + (["--last"] if src == "--run" else [])
        assert cli.main(argv) == 0
        got = pq.read_table(out)
        assert got.schema.field("key").type == pa.int64() and got.column("key").to_pylist() == key.to_pylist()
        assert got.schema.field("big").type == pa.uint64() and got.column("big").to_pylist() == big.to_pylist()
        assert got.schema.field("flag").type == pa.bool_() and got.column("flag").to_pylist() == flag.to_pylist()


def test_run_and_export_are_one_or_the_other(exported, export_data: Path, capsys) -> None:
    run, export = exported
    with pytest.raises(SystemExit):
        cli.main(["eval", "--run", str(run), "--export", str(export), "--data", str(export_data)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_predict_of_a_table_scores_every_row_or_names_the_bad_one(exported, export_data: Path) -> None:
    """`Predictor.predict(table)` never drops a row (data.on_bad_rows = "skip" is for training files): a
    bad value is a DataError naming its column, so scores and rows stay aligned."""
    import pyarrow as pa

    from data.parquet import DataError

    _, export = exported
    p = Predictor(export)
    assert p.config.data.on_bad_rows == "skip"                          # the training data's setting
    table = pq.read_table(export_data / "part-00001.parquet").slice(0, 50)
    assert p.predict(table).shape == (50,)
    np.testing.assert_array_equal(p.predict(table.to_pylist()), p.predict(table))      # rows as dicts (serve's)
    col = p.config.data.sparse_columns[0]
    ids = table[col].to_numpy(zero_copy_only=False).astype(np.int64)
    ids[7] = -5
    bad = table.set_column(table.schema.get_field_index(col), col, pa.array(ids))
    with pytest.raises(DataError, match=f"column '{col}': negative id at row 7"):
        p.predict(bad)
    with pytest.raises(DataError, match=f"column '{col}': negative id at row 7"):
        p.predict(bad.to_pylist())
