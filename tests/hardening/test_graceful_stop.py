"""Signals and trainer errors through real processes (`recsys train`: PS shards + torch elastic trainers).

- SIGTERM during training, during a background checkpoint write and during the trainers' restore:
  each run exits 0 with a checkpoint and a line saying how to resume, leaves no process behind, and
  `--resume latest` then ends with the same weights (<= 1e-6) as an uninterrupted run (sync mode,
  2 trainers x 2 shards: the stop is a consistent cut at a step every rank agreed on).
- A bad label at row 500 (only the rows show it) and a non-finite loss stop the job with the
  trainer's one line last (file, column, row / step, batch rows), exit 2, the traceback only in the
  trainer's log, and no process left.
- A standalone `recsys ps` exits 0 on SIGTERM and on SIGINT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embedding_ps.wire.config import PSConfig, TableConfig
from recsys.config import load_config
from recsys.training.checkpoint import list_checkpoints
from recsys.training.launch import launch_train

from ..integration.conftest import alive, assert_same_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
B = 64
ROWS = 48 * B                  # 2 trainers: 24 steps per epoch each
STEPS = 40
TIMEOUT = 240


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dataset) -> Path:
    out = tmp_path_factory.mktemp("stop-data")
    for part in sorted(tiny_dataset(rows=ROWS, files=3, seed=11, row_group_rows=400).glob("part-*.parquet")):
        (out / part.name).symlink_to(part)
    return out


def overrides(run: Path, data: Path, *extra: str) -> list[str]:
    return [f"data.train_paths=['{data}/part-*.parquet']", "data.eval_paths=[]", f"data.batch_size={B}",
            "data.shuffle_buffer_rows=256", "ps.num_shards=2", "ps.mode='sync'", "train.num_trainers=2",
            f"train.run_dir='{run}'", "train.log_every=2", "train.num_threads=1", "train.checkpoint_every=8",
            "train.epochs=2", f"train.max_steps={STEPS}", *extra]


def start_cli(run: Path, data: Path, *extra: str, resume: bool = False, group: bool = False) -> subprocess.Popen:
    argv = [sys.executable, "-m", "recsys.cli", "train", "--config", str(ROOT / "configs" / "tiny.toml")]
    for o in overrides(run, data, *extra):
        argv += ["--set", o]
    if resume:
        argv += ["--resume", "latest"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=group)      # group: the launcher leads a group, as a shell's job


def wait_for(cond, proc: subprocess.Popen, what: str, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"job exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def logged_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(x).get("step", 0) for x in path.read_text().splitlines() if x.endswith("}")]
    return max(steps, default=0)


def assert_no_process_left(run: Path) -> None:
    """Every shard, trainer and launcher of the run is gone (within 10 s of the launcher's exit)."""
    procs = json.loads((run / "processes.json").read_text())
    procs += [json.loads(f.read_text()) for f in (run / "pids").glob("trainer-*.json")]
    deadline = time.monotonic() + 10
    while any(alive(p["pid"]) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in procs if alive(p["pid"])], "processes of the run still alive"


def stop_gracefully(proc: subprocess.Popen, run: Path, stop: Callable[[], None] | None = None) -> dict:
    """SIGTERM the launcher (or call `stop`); it must exit 0 with the resume line last, leaving a
    checkpoint and no process (killed here whatever happens)."""
    try:
        if stop is None:
            proc.send_signal(signal.SIGTERM)
        else:
            stop()
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "stopped at step" in last and "--resume latest" in last, last
    assert_no_process_left(run)
    info = json.loads((run / "stopped.json").read_text()) if (run / "stopped.json").exists() else {}
    return info


def resume_to_the_end(run: Path, data: Path) -> None:
    metrics = launch_train(load_config(ROOT / "configs" / "tiny.toml", overrides(run, data)), resume="latest")
    assert metrics["steps"] == STEPS


@pytest.fixture(scope="module")
def uninterrupted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("full") / "run"
    launch_train(load_config(ROOT / "configs" / "tiny.toml", overrides(run, data_dir)))
    return run


def test_sigterm_in_training_then_in_restore_resumes_exactly(tmp_path: Path, data_dir: Path, uninterrupted: Path) -> None:
    run = tmp_path / "run"
    proc = start_cli(run, data_dir)
    wait_for(lambda: logged_step(run) >= 10, proc, "step 10")
    first = stop_gracefully(proc, run)
    assert 10 <= first["step"] < STEPS
    assert list_checkpoints(run)[-1].name == f"step-{first['step']:010d}"

    proc = start_cli(run, data_dir, resume=True)                               # SIGTERM while the trainers restore
    (run / "pids" / "trainer-1.json").unlink(missing_ok=True)
    wait_for(lambda: (run / "pids" / "trainer-1.json").exists(), proc, "the trainers", poll_s=0.005)
    second = stop_gracefully(proc, run)
    assert first["step"] <= second["step"] <= first["step"] + 2

    resume_to_the_end(run, data_dir)
    assert_same_model(uninterrupted, run)


def test_ctrl_c_to_the_terminals_group_reaches_the_launcher_alone(tmp_path: Path, data_dir: Path) -> None:
    # a terminal's Ctrl-C signals its whole foreground group: trainers and shards are not in it (the
    # zygote that forks them runs in a session of its own), so only the launcher hears it and stops
    # the job gracefully (a checkpoint, exit 0)
    run = tmp_path / "run"
    proc = start_cli(run, data_dir, group=True)

    def ctrl_c() -> None:
        wait_for(lambda: logged_step(run) >= 4 and len(list((run / "pids").glob("trainer-*.json"))) == 2, proc,
                 "step 4")
        children = [json.loads(f.read_text())["pid"] for f in (run / "pids").glob("trainer-*.json")]
        children += [p["pid"] for p in json.loads((run / "processes.json").read_text()) if p["pid"] != proc.pid]
        assert children and all(os.getpgid(pid) != proc.pid for pid in children)
        os.killpg(proc.pid, signal.SIGINT)

    stop_gracefully(proc, run, ctrl_c)


def test_sigterm_during_a_background_save_resumes_exactly(tmp_path: Path, data_dir: Path, uninterrupted: Path) -> None:
    run = tmp_path / "run"
    proc = start_cli(run, data_dir, "train.checkpoint_every=4")
    tmp_dirs = lambda: list((run / "checkpoints").glob(".tmp-step-*")) if (run / "checkpoints").exists() else []
    wait_for(lambda: bool(tmp_dirs()) and logged_step(run) >= 8, proc, "a background save", poll_s=0.002)
    info = stop_gracefully(proc, run)
    assert info["step"] < STEPS
    assert not tmp_dirs()                            # the write in flight was finished (renamed), none left half
    resume_to_the_end(run, data_dir)
    assert_same_model(uninterrupted, run)


def bad_label_data(data_dir: Path, out: Path) -> Path:
    """The job's data with a label of 3 at row 500 of the first file (only the rows show it)."""
    table = pq.read_table(sorted(data_dir.glob("part-*.parquet"))[0])
    labels = table.column("label").to_numpy().copy()
    labels[500] = 3.0
    out.mkdir()
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels)),
                   out / "part-00000.parquet")
    for part in sorted(data_dir.glob("part-*.parquet"))[1:]:
        (out / part.name).symlink_to(part.resolve())
    return out


@pytest.mark.parametrize("problem", ["bad label at row 500", "non-finite loss"])
def test_a_trainer_error_stops_the_job_with_one_line_and_exit_2(tmp_path: Path, data_dir: Path, problem: str) -> None:
    run = tmp_path / "run"
    if problem == "non-finite loss":
        proc, expect = start_cli(run, data_dir, "train.dense_lr=1e30"), ("the training loss is nan", "on the batch of",
                                                                         "part-0000", "rows ")
    else:
        proc, expect = start_cli(run, bad_label_data(data_dir, tmp_path / "bad")), ("part-00000.parquet", "'label'",
                                                                                   "row 500")
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(x in last for x in expect), last
    assert "Traceback" not in err
    rank = int(last.split("[trainer rank ")[1].split(";")[0])
    assert "Traceback" in (run / "logs" / f"trainer-{rank}.log").read_text()
    assert_no_process_left(run)


def test_standalone_shard_exits_0_on_sigterm_and_sigint(tmp_path: Path) -> None:
    from .conftest import Shard

    cfg = PSConfig(num_shards=1, tables=(TableConfig(name="t", dim=4),), storage_root=str(tmp_path))
    for sig in (signal.SIGTERM, signal.SIGINT):
        shard = Shard(cfg, tmp_path / sig.name, "--bind", "127.0.0.1")
        try:
            shard.proc.send_signal(sig)
            assert shard.proc.wait(timeout=30) == 0, shard.log()[-2000:]
            assert "stopping" in shard.log()
        finally:
            shard.close()
