"""The documented multi-node path on one node: `recsys ps` shards + `torchrun -m recsys.train`."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recsys.training.launch import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180


@contextlib.contextmanager
def recsys_ps_shards(tmp_path: Path, common: list[str], env: dict[str, str]):
    """Two `recsys ps` shard processes of the job `common` (CLI args); yields their addresses."""
    shards = []
    try:
        ready = [tmp_path / f"ps{i}.ready" for i in range(2)]
        for i in range(2):
            shards.append(subprocess.Popen(
                [sys.executable, "-m", "recsys.cli", "ps", *common, "--shard", str(i), "--port", "0",
                 "--ready-file", str(ready[i])], cwd=ROOT, env=env, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while not all(r.exists() for r in ready):
            assert time.monotonic() < deadline, "shards not ready"
            assert all(p.poll() is None for p in shards), "a shard exited before it was ready"
            time.sleep(0.05)
        yield [r.read_text().strip() for r in ready]
    finally:
        for p in shards:
            p.terminate()
        for p in shards:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def test_ps_hosts_and_torchrun_trainers(tmp_path: Path, tiny_dataset) -> None:
    data = tiny_dataset(rows=6000, files=2, seed=4)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    token = tmp_path / "ps.token"                  # as docs/cluster.md: shards and trainers share a token file
    token.write_text(os.urandom(24).hex())
    token.chmod(0o600)
    common = ["--config", "configs/tiny.toml", "--set", "ps.num_shards=2", "--set", "ps.num_workers=2",
              "--set", "ps.auth=token", "--set", f"ps.token_file={token}",
              "--set", "data.batch_size=64", "--set", f"ps.storage_root='{tmp_path}'"]   # where the shards may write
    with recsys_ps_shards(tmp_path, common, env) as addresses:
        port = free_port()
        run = tmp_path / "run"
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
             "-m", "recsys.train", *common,
             "--set", f"ps.addresses={json.dumps(addresses)}",
             "--set", f"data.train_paths=['{data}/part-00000.parquet']",
             "--set", f"data.eval_paths=['{data}/part-00001.parquet']",
             "--set", f"train.run_dir='{run}'"],
            cwd=ROOT, env=env, timeout=TIMEOUT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["steps"] > 0 and metrics["eval_examples"] == 3000 and metrics["auc"] > 0.55
        stats = json.loads((run / "ps_stats.json").read_text())
        assert [s["shard"] for s in stats] == [0, 1]


def test_torchrun_restarts_killed_trainer_from_checkpoint(tmp_path: Path, tiny_dataset) -> None:
    """`torchrun --max-restarts 1`: a SIGKILLed trainer brings both workers back, they resume from the
    latest checkpoint (rank 0 makes the running shards load it) and end where an uninterrupted run of
    the same job ends."""
    from recsys.config import load_config
    from recsys.training.checkpoint import list_checkpoints
    from recsys.training.launch import launch_train

    data = tiny_dataset(rows=6000, files=2, seed=4)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    job = ["ps.num_shards=2", "ps.num_workers=2", "data.batch_size=64", "train.max_steps=40", "train.epochs=2",
           "train.checkpoint_every=8", "train.num_threads=1", f"data.train_paths=['{data}/part-00000.parquet']",
           f"data.eval_paths=['{data}/part-00001.parquet']", f"ps.storage_root='{tmp_path}'",
           "ps.auth='none'"]                    # said outright: shards started by hand need it
    common = ["--config", "configs/tiny.toml"] + [x for o in job for x in ("--set", o)]
    reference = launch_train(load_config(ROOT / "configs" / "tiny.toml",
                                         job + ["train.num_trainers=2", f"train.run_dir='{tmp_path / 'ref'}'"]))
    run = tmp_path / "run"
    with recsys_ps_shards(tmp_path, common, env) as addresses:
        trainers = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
             "--max-restarts", "1", "--monitor-interval", "0.2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1",
             "-m", "recsys.train", *common, "--set", f"ps.addresses={json.dumps(addresses)}",
             "--set", f"train.run_dir='{run}'"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + TIMEOUT
            while not list_checkpoints(run):
                assert time.monotonic() < deadline and trainers.poll() is None, "no checkpoint before the end"
                time.sleep(0.05)
            os.kill(json.loads((run / "pids" / "trainer-1.json").read_text())["pid"], 9)
            _, err = trainers.communicate(timeout=TIMEOUT)
            assert trainers.returncode == 0, err[-3000:]
            assert "resumed from" in err
        finally:
            if trainers.poll() is None:
                trainers.kill()
                trainers.wait(timeout=10)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == reference["steps"] == 40
    assert abs(metrics["auc"] - reference["auc"]) <= 0.002
