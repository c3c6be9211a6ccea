"""Checkpoints through real processes: exact resume, elastic trainer counts, kill -9 recovery.

Every job here is a `recsys train` with PS shard processes and trainers under torch elastic, on
127.0.0.1, in sync mode (deterministic, so a resumed run must end where an uninterrupted one ends).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys.config import load_config
from recsys.training.checkpoint import list_checkpoints
from recsys.training.launch import launch_train

from .conftest import alive, assert_same_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
B = 64
ROWS = 48 * B                 # 2 trainers: 24 steps per epoch each; 1 trainer: 48
TIMEOUT = 300


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dataset) -> Path:
    """part-*.parquet (the shared train set) and eval/ (another seed), as links to the session's datasets."""
    out = tmp_path_factory.mktemp("recovery-data")
    train = tiny_dataset(rows=ROWS, files=3, seed=11, row_group_rows=400)
    for part in sorted(train.glob("part-*.parquet")):
        (out / part.name).symlink_to(part)
    (out / "eval").symlink_to(tiny_dataset(rows=4000, files=1, seed=12), target_is_directory=True)
    return out


def overrides(run: Path, data: Path, *extra: str) -> list[str]:
    return [f"data.train_paths=['{data}/part-*.parquet']", f"data.eval_paths=['{data}/eval']",
            f"data.batch_size={B}", "data.shuffle_buffer_rows=256", "ps.num_shards=2", "ps.mode='sync'",
            f"train.run_dir='{run}'", "train.log_every=4", "train.num_threads=1", "train.checkpoint_every=8",
            *extra]


def run_job(run: Path, data: Path, *extra: str, resume: str | None = None) -> dict:
    return launch_train(load_config(ROOT / "configs" / "tiny.toml", overrides(run, data, *extra)), resume=resume)


def train_losses(run: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss/train"] for x in lines if "loss/train" in x}


@pytest.fixture(scope="module")
def uninterrupted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 trainers x 2 shards, 40 steps, no interruption."""
    run = tmp_path_factory.mktemp("full") / "run"
    run_job(run, data_dir, "train.num_trainers=2", "train.max_steps=40", "train.epochs=2")
    return run


def test_resume_equals_uninterrupted_run(tmp_path: Path, data_dir: Path, uninterrupted: Path) -> None:
    run = tmp_path / "run"
    run_job(run, data_dir, "train.num_trainers=2", "train.max_steps=20", "train.epochs=2")
    assert [p.name for p in list_checkpoints(run)][-1] == "step-0000000020"
    metrics = run_job(run, data_dir, "train.num_trainers=2", "train.max_steps=40", "train.epochs=2",
                      resume="latest")
    assert metrics["steps"] == 40
    assert_same_model(uninterrupted, run)
    full, resumed = train_losses(uninterrupted), train_losses(run)     # the same batches, step for step
    assert [s for s in resumed if s > 20] == [s for s in full if s > 20]
    np.testing.assert_allclose([resumed[s] for s in full if s > 20], [full[s] for s in full if s > 20], atol=1e-6)
    full_metrics = json.loads((uninterrupted / "metrics.json").read_text())
    assert metrics["auc"] == pytest.approx(full_metrics["auc"], abs=1e-6)


def test_resume_into_three_shards_equals_uninterrupted_run(tmp_path: Path, data_dir: Path, uninterrupted: Path) -> None:
    run = tmp_path / "run"
    run_job(run, data_dir, "train.num_trainers=2", "train.max_steps=16", "train.epochs=2")
    run_job(run, data_dir, "train.num_trainers=2", "train.max_steps=40", "train.epochs=2", "ps.num_shards=3",
            resume="latest")
    assert_same_model(uninterrupted, run, atol=1e-5)


def test_elastic_2_1_2_trainers_see_every_example_once(tmp_path: Path, data_dir: Path) -> None:
    run = tmp_path / "run"
    common = ("train.epochs=1", "train.trace_column='row_id'", "data.eval_paths=[]")
    run_job(run, data_dir, "train.num_trainers=2", "train.max_steps=10", *common)          # 2 x 10 batches
    run_job(run, data_dir, "train.num_trainers=1", "train.max_steps=17", *common, resume="latest")  # 7 more
    m = run_job(run, data_dir, "train.num_trainers=2", *common, resume="latest")            # to the epoch's end
    assert m["steps"] == 17 + -(-(ROWS - 27 * B) // (2 * B))     # the remainder split in two, last batch partial
    traces = sorted((run / "trace").glob("*.npy"))
    assert len(traces) == 2 + 1 + 2
    seen = np.concatenate([np.load(p) for p in traces])
    expected = np.sort(pq.read_table(sorted(data_dir.glob("part-*.parquet")), columns=["row_id"])
                       .column("row_id").to_numpy())
    assert len(seen) == ROWS
    np.testing.assert_array_equal(np.sort(seen), expected)         # every example once: no loss, no repeat


# -- kill -9 -------------------------------------------------------------------------------------


def start_cli(run: Path, data: Path, *extra: str) -> subprocess.Popen:
    args = []
    for o in overrides(run, data, *extra):
        args += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    return subprocess.Popen([sys.executable, "-m", "recsys.cli", "train", "--config", "configs/tiny.toml", *args],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


KILL_JOB = ("train.num_trainers=2", "train.max_steps=40", "train.epochs=2", "train.max_restarts=2")


@pytest.mark.parametrize("victim", ["ps", "trainer"])
def test_kill_9_recovers_from_checkpoint(tmp_path: Path, data_dir: Path, uninterrupted: Path, victim: str) -> None:
    run = tmp_path / "run"
    proc = start_cli(run, data_dir, *KILL_JOB)
    try:
        wait_for(lambda: bool(list_checkpoints(run)), proc, "the first checkpoint")
        procs = json.loads((run / "processes.json").read_text())
        if victim == "trainer":
            wait_for(lambda: (run / "pids" / "trainer-1.json").exists(), proc, "trainer 1")
            target = json.loads((run / "pids" / "trainer-1.json").read_text())["pid"]
        else:
            target = next(p["pid"] for p in procs if p["role"] == "ps" and p["rank"] == 1)
        os.kill(target, signal.SIGKILL)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    restarts = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1
    assert ("ps shard 1" if victim == "ps" else "trainer rank 1") in restarts[0]["reason"]
    assert restarts[0]["checkpoint"] is not None
    metrics = json.loads((run / "metrics.json").read_text())
    full = json.loads((uninterrupted / "metrics.json").read_text())
    assert metrics["steps"] == 40
    logged = [x["step"] for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss/train" in x]
    assert logged == list(train_losses(uninterrupted))   # each step once: the dead attempt's later lines are gone
    assert abs(metrics["auc"] - full["auc"]) <= 0.002
    left = [p for p in json.loads((run / "processes.json").read_text()) if alive(p["pid"])]
    assert not left, f"processes still alive: {left}"


def test_async_resume_keeps_the_staleness_bound(tmp_path: Path, data_dir: Path) -> None:
    """Async mode: the cut waits for every rank's pushes; after a resume at step 12 the shards know the
    trainers' progress again (else every pull would wait on a worker 'at step -1')."""
    run = tmp_path / "run"
    job = ("train.num_trainers=2", "ps.mode='async'", "ps.max_staleness=2", "train.epochs=2")
    run_job(run, data_dir, *job, "train.max_steps=12")
    m = run_job(run, data_dir, *job, "train.max_steps=30", resume="latest")
    assert m["steps"] == 30 and m["auc"] > 0.6
    stats = json.loads((run / "ps_stats.json").read_text())
    assert all(s["max_pull_lead"] <= 2 for s in stats)
    resumed = train_losses(run)
    assert max(resumed) == 28 and min(resumed) == 4           # one metrics.jsonl across both runs
