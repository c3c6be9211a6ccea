"""Example weights and negative downsampling through the trainer, eval, export and the Predictor.

Data: the `tiny` synthetic preset (export_data: 15000 training rows, ctr ~0.14, and 15000 eval rows
with p_true). The training rows are downsampled here: every positive kept, each negative with
probability R. Runs are in-process (LocalStore + Trainer), 1 trainer, seconds each.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedding_ps.local import LocalStore
from recsys.calibration import calibrate
from recsys.config import JobConfig
from recsys.metrics import eval_metrics
from recsys.serving import Predictor
from recsys.serving.export import export_model
from recsys.serving.source import resolve_source
from recsys.training.evaluate import evaluate_run, open_run
from recsys.training.trainer import Trainer

R = 0.5


def downsample(src: Path, out: Path, rate: float, seed: int = 0) -> Path:
    t = pq.read_table(src)
    keep = (t.column("label").to_numpy() == 1) | (np.random.default_rng(seed).random(t.num_rows) < rate)
    pq.write_table(t.filter(pa.array(keep)), out)
    return out


def with_weights(src: Path, out: Path, weights: np.ndarray) -> Path:
    pq.write_table(pq.read_table(src).append_column("ew", pa.array(weights, pa.float32())), out)
    return out


def configure(cfg: JobConfig, train: Path, **data: object) -> JobConfig:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_paths=(str(train),), **data))


def fit(cfg: JobConfig, epochs: int = 1) -> Trainer:
    """A trained in-process Trainer (the caller closes it)."""
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, epochs=epochs))
    torch.manual_seed(0)
    trainer = Trainer(cfg, LocalStore.create(cfg.ps))
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def sampled(export_data, tmp_path_factory) -> Path:
    return downsample(export_data / "part-00000.parquet", tmp_path_factory.mktemp("sampled") / "train.parquet", R)


def test_calibration_is_close_to_1_with_the_rate_and_off_without(export_data, sampled, tiny_config, tmp_path):
    base = tiny_config(export_data, tmp_path / "run")
    eval_paths = (str(export_data / "part-00001.parquet"),)            # not downsampled: the true ctr
    got = {}
    for name, data in (("none", {}), ("calibrate", {"negative_sampling_rate": R}),
                       ("weight", {"negative_sampling_rate": R, "negative_sampling_correction": "weight"})):
        trainer = fit(configure(base, sampled, **data), epochs=2)
        try:
            got[name] = trainer.evaluate(eval_paths)                 # what metrics.json reports
        finally:
            trainer.close()
    assert got["none"]["calibration"] > 1.4, got                      # ~1 / (ctr + (1 - ctr) R) too high
    assert abs(got["calibrate"]["calibration"] - 1) < 0.1, got
    assert abs(got["weight"]["calibration"] - 1) < 0.1, got
    # "calibrate" trains exactly the model of "none" (the loss is the same) and only shifts its scores
    assert got["calibrate"]["auc"] == got["none"]["auc"]
    assert got["calibrate"]["logloss"] < got["none"]["logloss"]


def test_all_ones_example_weights_train_the_same_bits(export_data, tiny_config, tmp_path):
    data = with_weights(export_data / "part-00000.parquet", tmp_path / "ones.parquet", np.ones(15000))
    cfg = dataclasses.replace(tiny_config(export_data, tmp_path / "run"),
                              train=dataclasses.replace(tiny_config(export_data, tmp_path).train, max_steps=20))
    runs = []
    for column in ("", "ew"):
        trainer = fit(configure(cfg, data, example_weight_column=column))
        try:
            labels, scores, _ = trainer.predict((str(export_data / "part-00001.parquet"),))
            runs.append((trainer.model.state_dict(), scores))
        finally:
            trainer.close()
    (state_a, scores_a), (state_b, scores_b) = runs
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert torch.equal(scores_a, scores_b)


def test_rows_of_weight_0_do_not_train(export_data, tiny_config, tmp_path):
    data = with_weights(export_data / "part-00000.parquet", tmp_path / "zeros.parquet", np.zeros(15000))
    cfg = configure(tiny_config(export_data, tmp_path / "run"), data, example_weight_column="ew")
    torch.manual_seed(0)
    untrained = Trainer(cfg, LocalStore.create(cfg.ps))
    before = {k: v.clone() for k, v in untrained.model.state_dict().items()}
    untrained.close()
    trainer = fit(cfg)
    try:
        assert trainer.step > 10
        assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    finally:
        trainer.close()


def test_eval_metrics_are_weighted_by_the_column(export_data, sampled, tiny_config, tmp_path):
    w = np.random.default_rng(1).integers(0, 3, 15000).astype(np.float32)
    eval_file = with_weights(export_data / "part-00001.parquet", tmp_path / "eval.parquet", w)
    train = with_weights(sampled, tmp_path / "train.parquet", np.ones(pq.read_metadata(sampled).num_rows))
    cfg = configure(tiny_config(export_data, tmp_path / "run"), train, example_weight_column="ew")
    trainer = fit(cfg)
    try:
        got = trainer.evaluate((str(eval_file),))
        labels, scores, weights, extras = trainer.score((str(eval_file),))
    finally:
        trainer.close()
    np.testing.assert_array_equal(weights.numpy(), w)
    p_true = torch.from_numpy(extras["p_true"]).double()
    assert got == eval_metrics(labels, scores, p_true, weights=torch.from_numpy(w))
    assert got["logloss"] != eval_metrics(labels, scores, p_true)["logloss"]


def test_predict_export_and_predictor_report_calibrated_scores(export_data, sampled, tiny_config, train_run,
                                                               tmp_path):
    cfg = configure(tiny_config(export_data, tmp_path / "run"), sampled, negative_sampling_rate=R)
    run = train_run(tmp_path, cfg)[0]
    eval_file = export_data / "part-00001.parquet"
    _, trainer = open_run(run)
    try:
        labels, offline, _ = trainer.predict((str(eval_file),))     # `recsys predict` writes these
    finally:
        trainer.close()
    metrics = evaluate_run(run, [str(eval_file)], out=str(tmp_path / "eval.json"))
    assert abs(metrics["calibration"] - 1) < 0.15
    assert float(offline.double().sum() / labels.double().sum()) == pytest.approx(metrics["calibration"], rel=1e-9)

    export_model(resolve_source(run=run), tmp_path / "export")
    p = Predictor(tmp_path / "export")
    assert p.manifest["calibration"] == {"negative_sampling_rate": R, "correction": "calibrate"}
    table = pq.read_table(eval_file)
    served = p.predict(table)
    np.testing.assert_allclose(served, offline.numpy(), atol=1e-5, rtol=0)
    from data.decode import decode_table
    batch = decode_table(p.config.data, table.slice(0, 500))
    raw = torch.sigmoid(p.logits(batch))                            # the model's own, uncalibrated
    np.testing.assert_allclose(p.predict(batch), calibrate(raw.double(), R).numpy(), atol=1e-6, rtol=0)
    assert float(raw.mean()) > 1.3 * float(p.predict(batch).mean())
