"""recsys.training.job.run_attempts: restarts after a kill, and the shared-memory sweeps around them
(#28 item 3: a killed process's /dev/shm segments do not outlive the job)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from recsys.config import load_config
from recsys.training import job


class _Stops:
    def __init__(self) -> None:
        self.requested = threading.Event()


def test_sweeps_before_the_job_before_each_restart_and_at_exit(tmp_path: Path, monkeypatch, caplog) -> None:
    cfg = load_config(None, [f"train.run_dir='{tmp_path}'", "train.max_restarts=1"])
    calls: list[str] = []
    monkeypatch.setattr(job, "sweep_dead", lambda: (calls.append("sweep"), (2, 3 << 20))[1])
    monkeypatch.setattr(job, "write_run_dir", lambda cfg, run_dir: None)
    attempts = []

    def attempt(*args, **kwargs):
        attempts.append(len(calls))
        if len(attempts) == 1:
            raise job.JobFailure("trainer rank 1 died (SIGKILL)", killed=True)
        return {"auc": 0.5}

    with caplog.at_level("INFO", logger="recsys.training.job"):
        out = job.run_attempts(cfg, tmp_path / "config.toml", tmp_path, None, _Stops(), False, attempt)
    assert out == {"auc": 0.5}
    assert attempts == [1, 2] and len(calls) == 3             # before attempt 1, before the restart, at exit
    assert "removed 2 shared-memory segments (3.0 MiB) of the failed attempt" in caplog.text
    assert json.loads((tmp_path / "restarts.jsonl").read_text())["restart"] == 1

    calls.clear()
    with pytest.raises(RuntimeError, match="after 0 restarts"):     # no restart left: still swept at exit
        job.run_attempts(load_config(None, [f"train.run_dir='{tmp_path}'", "train.max_restarts=0"]),
                         tmp_path / "config.toml", tmp_path, None, _Stops(), False,
                         lambda *a, **k: (_ for _ in ()).throw(job.JobFailure("shard 0 died", killed=True)))
    assert len(calls) == 2


def test_the_closing_summary_names_the_run_the_best_pass_the_test_metrics_and_what_next(tmp_path: Path) -> None:
    """#30 item 4: the last lines of `recsys train` (the `done:` line showed the last model's AUC
    while `test` used the best, and named neither the run nor the next commands)."""
    cfg = load_config(None, [f"train.run_dir='{tmp_path}'", "train.run_id='abc123'"])
    metrics = {"run_id": "abc123", "steps": 120, "samples_per_s": 41234.5, "best_step": 80, "best_val_logloss": 0.4512,
               "auc": 0.7801, "logloss": 0.4601, "test": {"auc": 0.7905, "logloss": 0.4499, "step": 80.0, "model": "best", "examples": 9}}
    text = job.closing_summary(cfg, metrics)
    lines = text.splitlines()
    assert lines[0] == f"done: run {tmp_path} (abc123): 120 steps, 41,234 samples/s"
    assert f"best pass: step 80, val/logloss 0.4512, kept in {tmp_path}/best" in text
    assert "test (best model, step 80): auc 0.7905 logloss 0.4499" in text
    assert "eval (last model, data.eval_paths): auc 0.7801 logloss 0.4601" in text
    assert f"recsys plot {tmp_path}" in text and "TensorBoard: " in text
    assert lines[-1] == f"  next: recsys eval --run {tmp_path} --data FILES | recsys export --run {tmp_path} --out DIR"
    plain = job.closing_summary(cfg, {"steps": 10})                  # no validation, no test, no eval data
    assert "best pass" not in plain and "test (" not in plain and "eval (" not in plain


def test_the_ray_driver_prints_rank_0_s_step_lines(tmp_path: Path, caplog) -> None:
    """#30 item 4: the Ray engine printed no step lines (log_to_driver is off): the driver follows
    rank 0's log from where it ended and prints its step lines, whole lines only."""
    pytest.importorskip("ray")
    from recsys.training.ray_launch import StepLines

    log = tmp_path / "logs" / "trainer-0.log"
    log.parent.mkdir()
    log.write_text("2026-11-28 03:00:00,000 INFO trainer0: step 5/10 | loss/train=0.7\n")   # an earlier attempt's
    lines = StepLines(log, poll_s=0.01)
    with log.open("a") as f:
        f.write("2026-11-28 03:00:01,000 INFO trainer0: built dlrm\n"
                "2026-11-28 03:00:02,000 INFO trainer0: epoch 1/2 step 4/8 eta 0:00:03 | loss/train=0.6\n"
                "2026-11-28 03:00:03,000 INFO trainer0: step 8/8 | loss/tr")       # not whole yet
    with caplog.at_level("INFO", logger="recsys.training.ray_launch"):
        lines.forward()
        with log.open("a") as f:
            f.write("ain=0.5\n")
        lines.forward()
    got = [r.getMessage() for r in caplog.records]
    assert got == ["epoch 1/2 step 4/8 eta 0:00:03 | loss/train=0.6", "step 8/8 | loss/train=0.5"]
