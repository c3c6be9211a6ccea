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
