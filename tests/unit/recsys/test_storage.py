"""recsys.storage (and the URI seams of data/ and embedding_ps/) on file:// URIs and plain paths.

Every operation must behave the same on a plain path and on the file:// URI of the same place; the
S3 behaviour (a real object store through moto) is in tests/integration/test_remote_storage.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data import remote as data_remote
from data.parquet import DataError, resolve_paths
from embedding_ps import remote
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import ShardState
from embedding_ps.shard.snapshot import SavedShard, shard_dir
from recsys import storage
from recsys.rundir import local_run_dir, run_path
from recsys.training.checkpoint import checkpoint_path, list_checkpoints, prune


@pytest.fixture(params=["path", "uri"])
def where(request, tmp_path: Path):
    """(root as the test uses it, the same place as a plain path)."""
    root = tmp_path / "store"
    root.mkdir()
    return (str(root) if request.param == "path" else f"file://{root}"), root


def test_join_keeps_the_query_last() -> None:
    assert storage.join("s3://b/run?endpoint_override=h:1&scheme=http", "checkpoints", "step-1") == \
        "s3://b/run/checkpoints/step-1?endpoint_override=h:1&scheme=http"
    assert storage.join("s3://b/run/", "/x/") == "s3://b/run/x"
    assert storage.join("/tmp/run", "a", "b") == "/tmp/run/a/b"
    assert shard_dir("gs://b/ps?x=1", 3) == "gs://b/ps/shard3?x=1"          # the shard names it the same way
    assert run_path("s3://b/r?q=1", "model", "ps") == "s3://b/r/model/ps?q=1"
    assert run_path("runs/x", "model") == Path("runs/x/model")


def test_is_uri_agrees_between_packages() -> None:
    for p in ("s3://b/k", "file:///tmp/x", "hdfs://nn:8020/x", "gs://b", "/tmp/x", "runs/x", "C:/x", "s3:/b"):
        assert storage.is_uri(p) == data_remote.is_uri(p) == remote.is_uri(p), p
    assert storage.is_uri("s3://b/k") and not storage.is_uri("/tmp/x") and not storage.is_uri("C:/x")


def test_within_refuses_other_buckets_queries_and_dotdot() -> None:
    root = "s3://b/run?endpoint_override=h:1"
    assert remote.within(root, "s3://b/run/checkpoints/step-1/model/ps?endpoint_override=h:1")
    assert not remote.within(root, "s3://b/runx/ps?endpoint_override=h:1")
    assert not remote.within(root, "s3://c/run/ps?endpoint_override=h:1")
    assert not remote.within(root, "s3://b/run/ps?endpoint_override=evil:1")
    assert not remote.within(root, "s3://b/run/../other?endpoint_override=h:1")
    assert not remote.within(root, "/tmp/run/ps")


def test_file_operations_same_on_path_and_uri(where) -> None:
    root, plain = where
    storage.write_text(storage.join(root, "a", "b.txt"), "hello")
    storage.write_bytes(storage.join(root, "c.bin"), b"\x00\x01")
    assert (plain / "a" / "b.txt").read_text() == "hello"                 # the same file either way
    assert storage.read_text(storage.join(root, "a", "b.txt")) == "hello"
    assert storage.read_bytes(storage.join(root, "c.bin")) == b"\x00\x01"
    assert storage.exists(storage.join(root, "a")) and not storage.is_file(storage.join(root, "a"))
    assert storage.is_file(storage.join(root, "c.bin")) and not storage.exists(storage.join(root, "nope"))
    assert storage.list_dir(root) == ["a", "c.bin"]
    assert storage.list_dir(storage.join(root, "nope")) == []
    assert storage.list_files(root) == {"a/b.txt": 5, "c.bin": 2}
    assert not list(plain.glob(".*"))                                      # no temporary file left behind
    storage.delete_tree(storage.join(root, "a"))
    storage.delete_tree(storage.join(root, "a"))                           # missing: nothing to do
    assert storage.list_files(root) == {"c.bin": 2}


def test_upload_download_and_local_copies(where, tmp_path: Path) -> None:
    root, plain = where
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "manifest.json").write_text("{}")
    (src / "sub" / "x.npy").write_bytes(b"123")
    (plain / "d" / "old").mkdir(parents=True)
    (plain / "d" / "old" / "stale").write_text("gone after the upload")
    storage.upload_dir(src, storage.join(root, "d"))
    assert storage.list_files(storage.join(root, "d")) == {"manifest.json": 2, "sub/x.npy": 3}
    with storage.local_copy(storage.join(root, "d")) as copy:
        assert (copy / "sub" / "x.npy").read_bytes() == b"123"
    with storage.local_output(storage.join(root, "out.txt"), directory=False) as out:
        Path(out).write_text("scores")
    assert (plain / "out.txt").read_text() == "scores"
    with storage.local_output(storage.join(root, "exp")) as out:
        Path(out).mkdir()
        (Path(out) / "manifest.json").write_text("{}")
    assert storage.list_files(storage.join(root, "exp")) == {"manifest.json": 2}


def test_errors_name_the_uri(tmp_path: Path) -> None:
    missing = f"file://{tmp_path}/nope.txt"
    with pytest.raises(FileNotFoundError, match=f"file://{tmp_path}/nope.txt: not found"):
        storage.read_bytes(missing)
    with pytest.raises(storage.StorageError, match="nosuchscheme://x/y: resolving the filesystem failed"):
        storage.read_bytes("nosuchscheme://x/y")
    (tmp_path / "file").write_text("x")
    with pytest.raises(storage.StorageError, match=f"file://{tmp_path}/file/a.txt: write failed"):
        storage.write_text(f"file://{tmp_path}/file/a.txt", "under a file")
    assert "bucket does not exist" in storage._explain("AWS Error NO_SUCH_BUCKET during PutObject")
    assert "permission denied" in storage._explain("AWS Error ACCESS_DENIED during PutObject")


def test_scratch_dir_for_uri_run_dirs(tmp_path: Path) -> None:
    a = local_run_dir("s3://b/runs/exp1?endpoint_override=h:1")
    assert a.name.startswith("exp1-") and a.parent.name == "recsys-scratch"
    assert a != local_run_dir("s3://b/runs/exp1?endpoint_override=h:2")   # another store: another dir
    assert local_run_dir("s3://b/runs/exp1", str(tmp_path)) == tmp_path
    assert local_run_dir("runs/x", str(tmp_path)) == Path("runs/x")        # a local run_dir is its own


def test_checkpoint_listing_and_prune_on_a_uri(tmp_path: Path) -> None:
    """A URI run directory: only checkpoints with a manifest count; prune keeps the newest and drops
    unfinished older ones."""
    run = f"file://{tmp_path}/run"
    for step in (2, 4, 6, 8):
        storage.write_text(storage.join(checkpoint_path(run, step), "model", "dense.pt"), "x")
        if step != 6:
            storage.write_text(storage.join(checkpoint_path(run, step), "manifest.json"), "{}")
    assert checkpoint_path(run, 4) == f"file://{tmp_path}/run/checkpoints/step-0000000004"
    assert list_checkpoints(run) == [checkpoint_path(run, s) for s in (2, 4, 8)]
    prune(run, keep=2)
    assert storage.list_dir(storage.join(run, "checkpoints")) == ["step-0000000004", "step-0000000008"]


def _state() -> ShardState:
    cfg = PSConfig(num_shards=2, tables=(TableConfig(name="t", dim=4),))
    state = ShardState(cfg, 1)
    ids = torch.arange(40, dtype=torch.int64)
    state.push(0, ids, torch.randn(40, 4, generator=torch.Generator().manual_seed(0)), 0)   # rows exist now
    return state


def test_shard_save_and_load_through_a_uri(tmp_path: Path) -> None:
    state = _state()
    uri = shard_dir(f"file://{tmp_path}/ps", 1)
    info = state.save(uri)
    assert info["directory"] == uri and (tmp_path / "ps" / "shard1" / "manifest.json").is_file()
    assert not list(tmp_path.glob("ps/*.tmp-*"))
    back = ShardState(state.config, 1)
    back.load(uri)
    k0, r0, _ = state.dump_table(0)
    k1, r1, _ = back.dump_table(0)
    assert len(k0) > 0 and torch.equal(k0, k1) and torch.equal(r0, r1)
    assert SavedShard(uri).num_shards == 2
    with pytest.raises(FileNotFoundError, match=f"file://{tmp_path}/ps/shard0"):
        SavedShard(shard_dir(f"file://{tmp_path}/ps", 0))


def test_data_paths_on_uris(tmp_path: Path) -> None:
    for name in ("part-0.parquet", "part-1.parquet", "_SUCCESS", "sub/part-2.parquet", ".hidden/x.parquet"):
        (tmp_path / "d" / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"x": np.arange(3)}), tmp_path / "d" / name)
    base = f"file://{tmp_path}/d"
    assert resolve_paths([base]) == [f"{base}/part-0.parquet", f"{base}/part-1.parquet", f"{base}/sub/part-2.parquet"]
    assert resolve_paths([f"{base}/part-*.parquet"]) == [f"{base}/part-0.parquet", f"{base}/part-1.parquet"]
    assert resolve_paths([f"{base}/part-1.parquet"]) == [f"{base}/part-1.parquet"]
    local = resolve_paths([str(tmp_path / "d")])
    assert [Path(p).name for p in local] == [p.rsplit("/", 1)[-1] for p in resolve_paths([base])]
    with data_remote.parquet_file(f"{base}/part-1.parquet") as pf:
        assert pf.metadata.num_rows == 3
    with pytest.raises(DataError, match=f"data path '{base}/nope' does not exist"):
        resolve_paths([f"{base}/nope"])
    with pytest.raises(DataError, match="matched no files"):
        resolve_paths([f"{base}/zzz-*.parquet"])


def test_run_files_json_roundtrip(where) -> None:
    root, _ = where
    storage.write_text(storage.join(root, "metrics.json"), json.dumps({"steps": 3}))
    assert json.loads(storage.read_text(storage.join(root, "metrics.json"))) == {"steps": 3}
