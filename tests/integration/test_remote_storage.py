"""Data, run directory, checkpoints and exports on a local S3 server (moto, 127.0.0.1, a free port).

The job reads its Parquet files from s3://, writes its checkpoints there (each shard uploads its own
part), stops, resumes from the newest good checkpoint on s3:// and must end with the weights of an
uninterrupted local sync run (<= 1e-6). The model is then exported to s3:// and read back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from moto.server import ThreadedMotoServer

from recsys import cli, storage
from recsys.config import load_config
from recsys.serving.export import read_manifest as read_export_manifest
from recsys.training.checkpoint import CorruptCheckpointError, list_checkpoints, resolve_resume
from recsys.training.launch import launch_train

from .conftest import assert_same_model, final_model

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
B = 64
BUCKET = "recsys-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def environment(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def s3(tiny_dataset):
    """`s3(key)` -> the URI of `key` in a fresh bucket on a moto server; the tiny data is under data/."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)      # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    with environment(CREDENTIALS):
        server.start()
        try:
            host, port = server.get_host_and_port()
            query = f"endpoint_override={host}:{port}&scheme=http"
            fs = pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", access_key="testing",
                                   secret_key="testing", region="us-east-1", allow_bucket_creation=True)
            fs.create_dir(BUCKET)
            local = tiny_dataset(rows=24 * B, files=3, seed=11, row_group_rows=200)
            for part in sorted(local.glob("part-*.parquet")):
                pafs.copy_files(str(part), f"{BUCKET}/data/{part.name}", destination_filesystem=fs)
            yield lambda key: f"s3://{BUCKET}/{key}?{query}", local
        finally:
            server.stop()


def job(run: str | Path, data: str, scratch: Path, *extra: str) -> list[str]:
    return [f"data.train_paths=['{data}']", "data.eval_paths=[]", f"data.batch_size={B}",
            "data.shuffle_buffer_rows=256", "ps.num_shards=2", "ps.mode='sync'", f"train.run_dir='{run}'",
            f"train.scratch_dir='{scratch}'", "train.log_every=4", "train.num_threads=1",
            "train.checkpoint_every=6", "train.keep_checkpoints=2", "train.epochs=2", *extra]


def train(run: str | Path, data: str, scratch: Path, *extra: str, resume: str | None = None) -> dict:
    return launch_train(load_config(ROOT / "configs" / "tiny.toml", job(run, data, scratch, *extra)), resume=resume)


def test_train_resume_export_on_s3(s3, tmp_path: Path) -> None:
    uri, local_data = s3
    run = uri("runs/a")
    full = tmp_path / "full"
    train(full, f"{local_data}/part-*.parquet", tmp_path / "s0", "train.max_steps=24")   # uninterrupted, local

    scratch = tmp_path / "scratch"
    train(run, uri("data"), scratch, "train.max_steps=12")                    # stops at step 12 ...
    done = list_checkpoints(run)
    assert [storage.join(uri("runs/a/checkpoints"), f"step-{s:010d}") for s in (6, 12)] == done
    metrics = train(run, uri("data"), scratch, "train.max_steps=24", resume="latest")   # ... resumed from s3
    assert metrics["steps"] == 24
    assert json.loads(storage.read_text(storage.join(run, "metrics.json")))["steps"] == 24

    with storage.local_copy(run) as copy:                                     # the run, as stored on s3
        assert_same_model(full, copy)
        assert {p.name for p in (copy / "checkpoints").iterdir()} == {"step-0000000018", "step-0000000024"}
        steps = [json.loads(x)["step"] for x in (copy / "metrics.jsonl").read_text().splitlines()]
        assert steps == sorted(steps) and steps[-1] == 24                     # one log across both attempts
        _, rows = final_model(copy)

    out = uri("exports/a")
    assert cli.main(["export", "--run", run, "--out", out, "--precision", "fp32"]) == 0
    with storage.local_copy(out) as export:
        manifest = read_export_manifest(export)                              # every file's sha256 checked
        assert manifest["step"] == 24
        cfg = load_config(export / "config.toml")
        for t, table in enumerate(cfg.ps.tables):
            got = pq.read_table(export / "tables" / f"{table.name}.parquet")
            ids = got.column("id").to_numpy()
            vectors = np.stack(got.column("vector").to_numpy(zero_copy_only=False))
            want = {k: v for (tt, k), v in rows.items() if tt == t}
            assert sorted(ids.tolist()) == sorted(want) and len(ids) > 0
            np.testing.assert_array_equal(vectors, np.stack([want[k].numpy() for k in ids.tolist()]))

    from recsys.serving import Predictor                                # a Predictor opens the export on s3
    from recsys.serving.errors import ExportError
    rows_in = pq.read_table(sorted(Path(local_data).glob("part-*.parquet"))[0]).slice(0, 200)
    with storage.local_copy(out) as export:
        want = Predictor(export).predict(rows_in)
    np.testing.assert_array_equal(Predictor(out).predict(rows_in), want)
    with pytest.raises(ExportError, match=r"exports/none\?.*: no manifest.json"):
        Predictor(uri("exports/none"))


def test_incomplete_checkpoint_on_s3_is_skipped(s3, tmp_path: Path) -> None:
    """A checkpoint whose manifest never arrived is not `latest`; a damaged one is skipped with a warning."""
    uri, _ = s3
    run = uri("runs/b")
    ckpts = storage.join(run, "checkpoints")
    storage.write_text(storage.join(ckpts, "step-0000000009", "model", "dense.pt"), "half")
    assert resolve_resume(run, "latest") is None
    storage.write_text(storage.join(ckpts, "step-0000000003", "manifest.json"),
                       json.dumps({"format": "recsys-checkpoint", "version": 1, "step": 3,
                                   "files": {"model/dense.pt": {"size": 4, "sha256": "0"}}}))
    assert list_checkpoints(run) == [storage.join(ckpts, "step-0000000003")]
    with pytest.raises(CorruptCheckpointError, match="none of the 1 checkpoints.*dense.pt.*missing"):
        resolve_resume(run, "latest")                                  # model/dense.pt is missing
    with pytest.raises(CorruptCheckpointError, match="step-0000000003/model/dense.pt.*missing"):
        resolve_resume(run, storage.join(ckpts, "step-0000000003"))


def test_missing_bucket_is_named(s3) -> None:
    uri, _ = s3
    bad = uri("x").replace(BUCKET, "no-such-bucket")
    with pytest.raises(storage.StorageError, match="no-such-bucket.*bucket does not exist"):
        storage.write_text(storage.join(bad, "f.txt"), "x")
    from recsys.preflight import PreflightError, check_remote_run_dir

    with pytest.raises(PreflightError, match="train.run_dir = 's3://no-such-bucket/.*bucket does not exist"):
        check_remote_run_dir(bad)


def test_dated_hive_partitions_on_s3(s3) -> None:
    """`{date-1}`, a hive partition directory and a glob over partitions, on s3:// as on local paths:
    date order, `*` inside one name, Spark's `_SUCCESS` / `_temporary/` skipped."""
    from data.parquet import resolve_paths
    from data.remote import parquet_file

    uri, local_data = s3
    fs, root = pafs.FileSystem.from_uri(uri("hive"))
    part = sorted(local_data.glob("part-*.parquet"))[0]
    for day in ("2026-11-20", "2026-11-25", "2026-11-26", "2026-12-01"):
        for name in ("part-0.parquet", "part-1.parquet", "_SUCCESS"):
            pafs.copy_files(str(part), f"{root}/day={day}/{name}", destination_filesystem=fs)
    pafs.copy_files(str(part), f"{root}/day=2026-11-26/_temporary/0/part-9.parquet", destination_filesystem=fs)
    pafs.copy_files(str(part), f"{root}/day=2026-11-26/sub/part-2.parquet", destination_filesystem=fs)

    def keys(got: list[str]) -> list[str]:
        return [g.split("/hive/", 1)[1].split("?", 1)[0] for g in got]

    job = ["data.train_paths=['" + uri("hive/day={date-1}/") + "']", "data.eval_paths=[]", "data.date='2026-11-27'"]
    cfg = load_config(ROOT / "configs" / "tiny.toml", job)
    assert keys(resolve_paths(cfg.data.train_paths)) == [
        "day=2026-11-26/part-0.parquet", "day=2026-11-26/part-1.parquet", "day=2026-11-26/sub/part-2.parquet"]
    assert keys(resolve_paths([uri("hive/day=2026-11-2*/part-*.parquet")])) == [
        f"day={d}/part-{k}.parquet" for d in ("2026-11-20", "2026-11-25", "2026-11-26") for k in (0, 1)]
    assert keys(resolve_paths([uri("hive/day=2026-1[12]-*")]))[-3:] == [
        "day=2026-11-26/sub/part-2.parquet", "day=2026-12-01/part-0.parquet", "day=2026-12-01/part-1.parquet"]
    with parquet_file(resolve_paths([uri("hive/day=2026-12-01/")])[0]) as pf:     # a listed URI opens on its own
        assert pf.metadata.num_rows == pq.ParquetFile(part).metadata.num_rows


def test_a_uri_run_dir_is_locked_and_a_run_on_s3_warm_starts_another(s3, tmp_path: Path) -> None:
    """#27: a launcher of an s3 run directory holds a lock object there (another one is refused, naming
    the holder; one left by a dead launcher of this host is taken over), and a run on s3 is a warm
    start's source."""
    import os
    import socket

    from recsys.rundir import URI_LOCK, RunDirError

    uri, _ = s3
    run = uri("runs/lock")
    train(run, uri("data"), tmp_path / "s1", "train.max_steps=6")
    assert not storage.exists(storage.join(run, URI_LOCK))              # released at the end
    lock = storage.join(run, URI_LOCK)
    storage.write_text(lock, json.dumps({"run_id": "abc", "pid": 4242, "host": "elsewhere", "since": "t"}))
    with pytest.raises(RunDirError, match=r"held by run abc \(pid 4242 on host elsewhere"):
        train(run, uri("data"), tmp_path / "s2", "train.max_steps=12", resume="latest")
    assert json.loads(storage.read_text(lock))["host"] == "elsewhere"   # untouched
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    storage.write_text(lock, json.dumps({"run_id": "abc", "pid": dead.pid, "host": socket.gethostname()}))
    assert train(run, uri("data"), tmp_path / "s3", "train.max_steps=12", resume="latest")["steps"] == 12
    # warm start from the run on s3 into a local run
    warm = launch_train(load_config(ROOT / "configs" / "tiny.toml", job(
        tmp_path / "warm", uri("data"), tmp_path / "s4", "train.max_steps=4", f"train.init_from='{run}'")))
    assert warm["steps"] == 16 and os.path.exists(tmp_path / "warm" / "model" / "dense.pt")
