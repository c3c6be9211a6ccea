"""DIN through export and Predictor: the dense program takes the behavior rows and mask, and the served
scores equal the trained model's own eval scores (fp32); quantized exports of DIN are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data.sequence import generate_sequence
from recsys.config import load_config
from recsys.serving import Predictor
from recsys.serving.export import export_model
from recsys.serving.source import resolve_source
from recsys.serving.errors import ExportError
from recsys.training.evaluate import open_run

ROOT = Path(__file__).resolve().parents[4]


def test_din_export_scores_equal_the_trained_model(tmp_path: Path, train_run) -> None:
    data = tmp_path / "data"
    generate_sequence(rows=4000, num_files=2, out_dir=str(data), seed=2)
    cfg = load_config(ROOT / "configs" / "din.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"train.run_dir='{tmp_path / 'run'}'", "ps.num_shards=2", "model.max_seq_len=8", "train.max_steps=12"])
    run = train_run(tmp_path, cfg)[0]
    _, trainer = open_run(run)
    try:
        _, scores, _ = trainer.predict((str(data / "part-00001.parquet"),))
    finally:
        trainer.close()
    table = pq.read_table(data / "part-00001.parquet")
    assert max(len(h) for h in table.column("hist").to_pylist()) > 8          # the lists get cut
    for precision, tol in (("fp32", 1e-5), ("fp16", 2e-2)):
        m = export_model(resolve_source(run=run), tmp_path / precision, precision)
        assert [i["name"] for i in m["dense"]["inputs"]] == ["dense", "pooled", "behaviors", "mask"]
        assert m["dense"]["inputs"][2]["shape"] == ["B", 1, 8, 16]
        assert m["features"]["sequences"] == [{"feature": "hist", "candidate": "item", "max_len": 8}]
        p = Predictor(tmp_path / precision)
        got = p.predict(table)
        np.testing.assert_allclose(got, scores.numpy(), atol=tol, rtol=0)
        np.testing.assert_allclose(p.predict(table.slice(7, 1)), got[7:8], atol=1e-6, rtol=0)   # batch of one
    with pytest.raises(ExportError, match="din model exports as fp32 or fp16"):
        export_model(resolve_source(run=run), tmp_path / "int8", "int8")
