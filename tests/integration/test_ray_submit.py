"""`recsys ray-submit` against a real Ray head with its dashboard on 127.0.0.1 (started here).

One head node (`ray.cluster_utils.Cluster`, 1 CPU, every port from bind(0), its own temp dir) serves
the three submissions: `--check` (the cluster reads the shipped config), a train whose data is missing
on the cluster (the job fails with the entrypoint's exit code 2, which ray-submit returns), and a
real tiny training job (the run directory gets its final metrics). `recsys` runs here as a
process, as a user runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
SUBMIT_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dashboard() -> Iterator[str]:
    """The address `http://127.0.0.1:PORT` of a fresh one-node Ray cluster's dashboard."""
    from ray.cluster_utils import Cluster

    saved = dict(os.environ)
    # Ray resolves 127.0.0.1 to the host's outward address unless told this is a single-host setup; the
    # dashboard agent then cannot reach the loopback-bound GCS. The job's driver inherits PATH: `recsys`.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    temp_dir = tempfile.mkdtemp(prefix="rs", dir="/tmp")     # short: Ray's socket paths must stay < 108 chars
    port = free_port()
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=True, dashboard_host="127.0.0.1",
            dashboard_port=port, dashboard_agent_listen_port=free_port(), metrics_export_port=free_port(),
            runtime_env_agent_port=free_port(), temp_dir=temp_dir))
        yield f"http://127.0.0.1:{port}"
    finally:
        if cluster is not None:
            cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(temp_dir, ignore_errors=True)


def submit(address: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).parent / "recsys"), "ray-submit", "--config", str(TINY), "--address", address,
           *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S, cwd=ROOT)


def paths(data: Path, run: Path) -> list[str]:
    return ["--set", f"data.train_paths=['{data}/part-00000.parquet']",
            "--set", f"data.eval_paths=['{data}/part-00001.parquet']", "--set", f"train.run_dir='{run}'"]


def test_check_job_reads_the_shipped_config(dashboard: str, tmp_path: Path) -> None:
    r = submit(dashboard, "--check", *paths(tmp_path / "data", tmp_path / "run"), "--set", "train.max_steps=13")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = r.stdout.split("submitted job ", 1)[1].split()[0]
    assert f"ray job logs -f {job_id} --address {dashboard}" in r.stdout
    # `recsys print-config` ran on the cluster and printed the shipped config, overrides included
    assert f'run_dir = "{tmp_path}/run"' in r.stdout and "max_steps = 13" in r.stdout
    from ray.job_submission import JobSubmissionClient

    info = JobSubmissionClient(dashboard).get_job_info(job_id)
    assert str(info.status.value) == "SUCCEEDED" and info.metadata["recsys_command"] == "print-config"


def test_failed_job_returns_its_exit_code(dashboard: str, tmp_path: Path) -> None:
    r = submit(dashboard, *paths(tmp_path / "missing", tmp_path / "run"), "--submission-id", "recsys-missing-data")
    assert r.returncode == 2, r.stdout + r.stderr        # preflight on the cluster: a data file is missing
    assert "error:" in r.stdout and "missing" in r.stdout
    assert "job recsys-missing-data failed (exit code 2)" in r.stderr
    again = submit(dashboard, *paths(tmp_path / "missing", tmp_path / "run"), "--submission-id", "recsys-missing-data")
    assert again.returncode == 1 and "recsys-missing-data" in again.stderr     # an id is used once


def test_tiny_job_trains_on_the_cluster(dashboard: str, tiny_dataset: Callable[..., Path], tmp_path: Path) -> None:
    data, run = tiny_dataset(rows=4000, files=2), tmp_path / "run"
    start = time.monotonic()
    r = submit(dashboard, *paths(data, run), "--set", "train.max_steps=5")
    assert r.returncode == 0, r.stdout + r.stderr
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps"] == 5 and 0.0 < metrics["auc"] <= 1.0
    assert time.monotonic() - start < SUBMIT_TIMEOUT_S
