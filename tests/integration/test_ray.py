"""The Ray engine on a real 2-node Ray cluster on 127.0.0.1 (`ray.cluster_utils.Cluster`).

The head node offers the custom resource `ps`, the second node `trainer`; the job asks for them in
cluster.ps_resources / cluster.trainer_resources, so 2 shards land on the head and 2 trainers on the
other node (checked by node id). Every actor and trainer reserves an explicit fraction of a CPU.
One cluster serves every test of the module; the data is test_recovery's (48 batches of 64 rows).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

# Ray resolves 127.0.0.1 to the machine's interface address unless told it runs without a cluster
# network: every node, worker and driver of this module then stays on loopback (read at import).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from recsys.config import load_config  # noqa: E402
from recsys.training.checkpoint import list_checkpoints  # noqa: E402
from recsys.training.launch import launch_train  # noqa: E402

from .conftest import assert_same_model  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
B = 64
ROWS = 48 * B
TIMEOUT = 240
JOB = ("train.num_trainers=2", "train.max_steps=40", "train.epochs=2", "train.max_restarts=2")


@pytest.fixture(scope="module")
def cluster():
    """Head: 1 CPU + `ps` = 2; second node: 1 CPU + `trainer` = 2; the test process is the driver."""
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"ps": 2}, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        trainer_node = c.add_node(num_cpus=1, resources={"trainer": 2}, node_ip_address="127.0.0.1")
        c.wait_for_nodes(timeout=60)
        ray.init(address=c.address, log_to_driver=False)
        c.trainer_node = trainer_node        # the last test removes it
        yield c, c.head_node.node_id, trainer_node.node_id
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dataset) -> Path:
    out = tmp_path_factory.mktemp("ray-data")
    for part in sorted(tiny_dataset(rows=ROWS, files=3, seed=11, row_group_rows=400).glob("part-*.parquet")):
        (out / part.name).symlink_to(part)
    return out


def config(run: Path, data: Path, *extra: str, engine: str = "ray", address: str = ""):
    return load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-*.parquet']", "data.eval_paths=[]", f"data.batch_size={B}",
        "data.shuffle_buffer_rows=256", "ps.num_shards=2", "ps.mode='sync'", f"train.run_dir='{run}'",
        "train.log_every=4", "train.num_threads=1", "train.checkpoint_every=8", *JOB,
        f"cluster.engine='{engine}'", f"cluster.address='{address}'",
        "cluster.ps_resources={CPU=0.25, ps=1}", "cluster.trainer_resources={CPU=0.25, trainer=1}",
        "cluster.start_timeout_s=20", *extra])


@pytest.fixture(scope="module")
def local_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same job through the local launcher: the reference weights."""
    run = tmp_path_factory.mktemp("local") / "run"
    launch_train(config(run, data_dir, engine="local"))
    return run


def start_job(cfg) -> tuple[threading.Thread, dict]:
    """launch_train in a thread (the test kills processes meanwhile); out["metrics"] or out["error"]."""
    out: dict = {}

    def run() -> None:
        try:
            out["metrics"] = launch_train(cfg)
        except BaseException as e:     # reaches the test's thread through `out`
            out["error"] = e

    t = threading.Thread(target=run, name="ray-job", daemon=True)
    t.start()
    return t, out


def finish(t: threading.Thread, out: dict) -> dict:
    t.join(timeout=TIMEOUT)
    assert not t.is_alive(), "the Ray job did not finish in time"
    if "error" in out:
        raise out["error"]
    return out["metrics"]


def test_ray_job_places_roles_on_their_nodes_and_equals_the_local_launcher(
        cluster, data_dir: Path, local_run: Path, tmp_path: Path) -> None:
    c, head, trainer_node = cluster
    run = tmp_path / "run"
    metrics = launch_train(config(run, data_dir, address=c.address))
    assert metrics["steps"] == 40
    assert_same_model(local_run, run, atol=1e-6)        # dense and every embedding row
    procs = json.loads((run / "processes.json").read_text())
    ps = [p for p in procs if p["role"] == "ps"]
    trainers = [p for p in procs if p["role"] == "trainer"]
    assert sorted(p["rank"] for p in ps) == [0, 1] and sorted(p["rank"] for p in trainers) == [0, 1]
    assert {p["node_id"] for p in ps} == {head}
    assert {p["node_id"] for p in trainers} == {trainer_node}
    same = {"config.toml", "processes.json", "metrics.jsonl", "metrics.json", "ps_stats.json", "checkpoints", "model"}
    assert same <= {x.name for x in local_run.iterdir()} and same <= {x.name for x in run.iterdir()}
    assert [p.name for p in list_checkpoints(run)] == [p.name for p in list_checkpoints(local_run)]
    token_files = [p for p in run.rglob("*") if p.is_file() and "token" in p.name]
    assert not token_files
    for shard in (0, 1):          # each shard served on its node's address with the job's token
        assert "serving at tcp://127.0.0.1:" in (run / f"ps-{shard}.log").read_text()
        assert "auth token" in (run / f"ps-{shard}.log").read_text()


def pid_of(run: Path, role: str, rank: int) -> int | None:
    if role == "trainer":
        f = run / "pids" / f"trainer-{rank}.json"
        return json.loads(f.read_text())["pid"] if f.exists() else None
    f = run / "processes.json"
    if not f.exists():
        return None
    return next((p["pid"] for p in json.loads(f.read_text()) if p["role"] == role and p["rank"] == rank), None)


@pytest.mark.parametrize("victim", ["ps", "trainer"])
def test_kill_9_restarts_from_the_checkpoint_and_ends_where_an_uninterrupted_run_ends(
        cluster, data_dir: Path, local_run: Path, tmp_path: Path, victim: str) -> None:
    c, _, _ = cluster
    run = tmp_path / "run"
    t, out = start_job(config(run, data_dir, address=c.address))
    deadline = time.monotonic() + TIMEOUT
    while not (list_checkpoints(run) and pid_of(run, victim, 1)):
        assert t.is_alive() and time.monotonic() < deadline, f"no checkpoint before the job ended: {out}"
        time.sleep(0.02)
    os.kill(pid_of(run, victim, 1), signal.SIGKILL)
    metrics = finish(t, out)
    restarts = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert len(restarts) == 1, restarts
    assert ("ps shard 1" if victim == "ps" else "trainer rank 1") in restarts[0]["reason"]
    assert restarts[0]["checkpoint"] is not None
    assert metrics["steps"] == 40
    assert_same_model(local_run, run, atol=1e-6)


def test_resources_the_cluster_lacks_end_the_job_in_one_line(cluster, data_dir: Path, tmp_path: Path) -> None:
    c, _, _ = cluster
    cfg = config(tmp_path / "run", data_dir, "cluster.ps_resources={CPU=0.25, ps=3}", "cluster.start_timeout_s=2",
                 address=c.address)
    from recsys.training.ray_launch import ClusterResourceError

    with pytest.raises(ClusterResourceError) as e:
        launch_train(cfg)
    line = str(e.value)
    assert "\n" not in line
    assert "ps shard" in line and "cluster.ps_resources" in line and "ps 6 needed, 2 free of 2" in line


def test_tune_trials_run_as_jobs_on_the_ray_engine(cluster, data_dir: Path, tmp_path: Path) -> None:
    """`recsys tune` on a config with cluster.engine = "ray": Tune runs on its own local Ray instance and each
    trial's job on this cluster (the job's environment is the tune command's: Tune's worker variables,
    RAY_RAYLET_PID and RAY_JOB_ID of the other instance, made its shard actors never start)."""
    import csv
    import subprocess
    import sys

    c, _, _ = cluster
    sets = [f"data.train_paths=['{data_dir}/part-00000.parquet']", f"data.eval_paths=['{data_dir}/part-00001.parquet']",
            f"data.batch_size={B}", "ps.num_shards=1", "train.num_trainers=1", "train.epochs=1",
            "train.num_threads=1", "cluster.engine='ray'", f"cluster.address='{c.address}'",
            "cluster.ps_resources={CPU=0.25, ps=1}", "cluster.trainer_resources={CPU=0.25, trainer=1}",
            "cluster.start_timeout_s=60"]
    (tmp_path / "space.toml").write_text('"train.dense_lr" = { choice = [0.01] }\n')
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "tune", "--config", str(ROOT / "configs" / "tiny.toml"),
                          *(x for o in sets for x in ("--set", o)), "--space", "space.toml", "--trials", "1",
                          "--max-concurrent", "1", "--out", "tune"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=TIMEOUT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "tune" / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["status"] == "terminated" and row["error"] == "", row
    log = next((tmp_path / "tune" / "trials").glob("*.log")).read_text()
    assert "Connected to Ray cluster" in log and "recsys.training.ray_launch: ps shards ready" in log


def test_a_lost_node_without_spare_resources_ends_the_job_in_one_line(
        cluster, data_dir: Path, tmp_path: Path) -> None:
    """Runs last: the trainer node goes away mid-run; the restart finds no node offering `trainer`."""
    c, _, trainer_node = cluster
    run = tmp_path / "run"
    t, out = start_job(config(run, data_dir, "cluster.start_timeout_s=5", address=c.address))
    deadline = time.monotonic() + TIMEOUT
    while not list_checkpoints(run):
        assert t.is_alive() and time.monotonic() < deadline, f"no checkpoint before the job ended: {out}"
        time.sleep(0.02)
    c.remove_node(c.trainer_node, allow_graceful=False)
    t.join(timeout=TIMEOUT)
    assert not t.is_alive()
    from recsys.training.ray_launch import ClusterResourceError

    assert isinstance(out.get("error"), ClusterResourceError), out
    line = str(out["error"])
    assert "\n" not in line
    assert "trainer" in line and "cluster.trainer_resources" in line and "trainer 2 needed, 0 free of 0" in line
    assert f"lost nodes: {trainer_node[:12]} (127.0.0.1)" in line
