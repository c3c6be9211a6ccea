"""Negative downsampling through the CLI: train -> metrics.json -> predict -> export -> Predictor.

The `tiny` preset's training file, every positive kept and each negative with probability 0.5; the
eval file as generated (the true ctr). With data.negative_sampling_rate = 0.5 the calibration in
metrics.json is close to 1, without it the model predicts ~1.6x too many clicks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.synthetic import generate
from recsys.serving import Predictor

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
R = 0.5


def recsys(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run([sys.executable, "-m", "recsys.cli", *args], cwd=ROOT, env=env, timeout=300,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ns-data")
    generate(preset="tiny", rows=30000, num_files=2, out_dir=str(out), seed=5)
    t = pq.read_table(out / "part-00000.parquet")
    keep = (t.column("label").to_numpy() == 1) | (np.random.default_rng(0).random(t.num_rows) < R)
    pq.write_table(t.filter(pa.array(keep)), out / "sampled.parquet")
    return out


def train(run: Path, data: Path, *sets: str) -> dict:
    args = ["train", "--config", "configs/tiny.toml", "--set", f"data.train_paths=['{data}/sampled.parquet']",
            "--set", f"data.eval_paths=['{data}/part-00001.parquet']", "--set", f"train.run_dir='{run}'",
            "--set", "train.epochs=2"]
    for s in sets:
        args += ["--set", s]
    r = recsys(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((run / "metrics.json").read_text())


def test_calibration_in_metrics_json_and_served_scores(tmp_path: Path, data: Path) -> None:
    plain = train(tmp_path / "plain", data)
    run = tmp_path / "run"
    metrics = train(run, data, f"data.negative_sampling_rate={R}")
    assert plain["calibration"] > 1.4, plain
    assert abs(metrics["calibration"] - 1) < 0.1, metrics
    assert metrics["auc"] == pytest.approx(plain["auc"], abs=1e-12)    # the same model, scores shifted

    preds = tmp_path / "preds.parquet"
    r = recsys("predict", "--run", str(run), "--data", f"{data}/part-00001.parquet", "--out", str(preds))
    assert r.returncode == 0, r.stderr[-3000:]
    scores = pq.read_table(preds).column("score").to_numpy()
    labels = pq.read_table(data / "part-00001.parquet", columns=["label"]).column("label").to_numpy()
    assert scores.astype(np.float64).sum() / labels.sum() == pytest.approx(metrics["calibration"], rel=1e-6)

    r = recsys("export", "--run", str(run), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((tmp_path / "export" / "manifest.json").read_text())
    assert manifest["calibration"] == {"negative_sampling_rate": R, "correction": "calibrate"}
    served = Predictor(tmp_path / "export").predict(pq.read_table(data / "part-00001.parquet"))
    np.testing.assert_allclose(served, scores, atol=1e-5, rtol=0)
