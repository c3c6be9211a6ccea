"""The CLI end to end on tiny data: gen-data -> train -> eval -> predict; no process of a run survives it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from .conftest import alive

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240


def recsys(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    return subprocess.run([sys.executable, "-m", "recsys.cli", *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)


def assert_all_dead(run: Path) -> list[dict]:
    procs = json.loads((run / "processes.json").read_text())
    deadline = time.monotonic() + 15
    while any(alive(p["pid"]) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in procs if alive(p["pid"])]
    for p in left:
        os.kill(p["pid"], signal.SIGKILL)
    assert not left, f"processes of the run still alive: {left}"
    return procs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli-data")
    r = recsys("gen-data", "--preset", "tiny", "--rows", "12000", "--files", "2", "--out", str(out), "--seed", "3")
    assert r.returncode == 0, r.stderr
    return out


def train_args(run: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "--config", "configs/tiny.toml",
            "--set", f"data.train_paths=['{data}/part-00000.parquet']",
            "--set", f"data.eval_paths=['{data}/part-00001.parquet']",
            "--set", f"train.run_dir='{run}'", "--set", "ps.num_shards=2", *extra]


def test_train_eval_predict(tmp_path: Path, data_dir: Path) -> None:
    run = tmp_path / "run"
    r = recsys(*train_args(run, data_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    for key in ("auc", "logloss", "ne", "calibration", "samples_per_s", "steps", "oracle_auc"):
        assert key in metrics, key
    assert metrics["steps"] > 0 and 0.5 < metrics["auc"] <= 1.0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("loss/train" in x for x in lines)
    procs = assert_all_dead(run)
    assert [p["role"] for p in procs].count("ps") == 2 and [p["role"] for p in procs].count("trainer") == 1

    r = recsys("eval", "--run", str(run), "--data", f"{data_dir}/part-00001.parquet")
    assert r.returncode == 0, r.stderr[-3000:]
    evaluated = json.loads(r.stdout)
    assert evaluated["auc"] == pytest.approx(metrics["auc"], abs=1e-9)   # the same model, the same data
    assert evaluated["oracle_auc"] == pytest.approx(metrics["oracle_auc"], abs=1e-9)

    preds = tmp_path / "preds.parquet"
    r = recsys("predict", "--run", str(run), "--data", f"{data_dir}/part-00001.parquet", "--out", str(preds))
    assert r.returncode == 0, r.stderr[-3000:]
    table = pq.read_table(preds)
    source = pq.read_table(data_dir / "part-00001.parquet", columns=["row_id", "p_true"])
    assert table.column_names == ["score", "row_id", "p_true"]
    assert table.column("row_id").to_pylist() == source.column("row_id").to_pylist()
    scores = table.column("score").to_numpy()
    assert ((scores > 0) & (scores < 1)).all()


def test_failing_trainer_tears_down_shards(tmp_path: Path, data_dir: Path) -> None:
    """A problem only the rows show (a label of 3 at row 5000) stops the trainers; the shards go too."""
    import pyarrow as pa

    table = pq.read_table(data_dir / "part-00000.parquet")
    labels = table.column("label").to_numpy().copy()
    labels[5000] = 3.0
    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels)),
                   bad / "part-00000.parquet")
    run = tmp_path / "run"
    r = recsys("train", "--config", "configs/tiny.toml", "--set", f"data.train_paths=['{bad}/part-00000.parquet']",
               "--set", f"data.eval_paths=['{data_dir}/part-00001.parquet']", "--set", f"train.run_dir='{run}'",
               "--set", "ps.num_shards=2")
    assert r.returncode != 0
    assert "label" in r.stderr and "part-00000.parquet" in r.stderr      # the error names file and column
    assert_all_dead(run)


@pytest.mark.parametrize("override,names", [
    ("data.dense_columns=['I1', 'nope']", "nope"),                  # a missing column
    ("data.train_paths=['/no/such/dir']", "/no/such/dir"),           # a missing path
    ("data.sparse_columns=['C1', 'C2', 'C3', 'C4', 'M1', 'C9']", "C9"),  # a feature without a table
    ("data.sparse_columns=['C1', 'C2', 'C3', 'C4']", "M1"),          # a table no feature reads
])
def test_config_and_schema_problems_fail_before_any_process_starts(tmp_path: Path, data_dir: Path, override: str,
                                                                   names: str) -> None:
    run = tmp_path / "run"
    r = recsys(*train_args(run, data_dir, "--set", override))
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (run / "processes.json").exists()    # nothing started


@contextlib.contextmanager
def running_job(run: Path, data: Path, *extra: str):
    """A long `recsys train` in the background, yielded once its trainer runs; afterwards every
    process of the run (the trainer included, even if processes.json missed it) must be gone."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-m", "recsys.cli",
                             *train_args(run, data, "--set", "train.epochs=1000", *extra)],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (run / "pids" / "trainer-0.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "job did not start"
            time.sleep(0.2)
        time.sleep(1.0)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    procs = json.loads((run / "processes.json").read_text())
    trainer = json.loads((run / "pids" / "trainer-0.json").read_text())
    if trainer not in procs:
        procs.append(trainer)
        (run / "processes.json").write_text(json.dumps(procs))
    assert_all_dead(run)


def test_ctrl_c_tears_everything_down(tmp_path: Path, data_dir: Path) -> None:
    """Ctrl-C is a graceful stop (tests/hardening has the resume): a checkpoint, exit 0, no process left."""
    with running_job(tmp_path / "run", data_dir) as proc:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert "--resume latest" in err.strip().splitlines()[-1]
    assert (tmp_path / "run" / "stopped.json").exists()


def test_killed_shard_stops_the_job_naming_it(tmp_path: Path, data_dir: Path) -> None:
    """Without restarts left, a killed shard ends the job at once (test_recovery: with restarts)."""
    run = tmp_path / "run"
    with running_job(run, data_dir, "--set", "train.max_restarts=0") as proc:
        shard1 = next(p for p in json.loads((run / "processes.json").read_text()) if p["role"] == "ps" and p["rank"] == 1)
        os.kill(shard1["pid"], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)      # well before the client's own 180 s timeout
        assert proc.returncode != 0
        assert "ps shard 1 exited with code -9 during training" in err
