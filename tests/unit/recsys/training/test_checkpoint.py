"""Checkpoints in one process (Trainer + in-process shards): exact resume, corruption, re-sharding."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from embedding_ps.local import LocalStore
from embedding_ps.wire.sharding import shard_of
from recsys.config import JobConfig, load_config
from recsys.training.checkpoint import (CorruptCheckpointError, list_checkpoints, resolve_resume,
                                        verify_checkpoint)
from recsys.training.reshard import reshard_checkpoint
from recsys.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[4]
B = 64


@pytest.fixture(scope="module")
def data_dir(tiny_dataset) -> Path:
    out = tiny_dataset(rows=40 * B, files=2, seed=7, row_group_rows=300)
    return out


def job(run: Path, data: Path, *extra: str) -> JobConfig:
    return load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", f"data.batch_size={B}",
        "data.shuffle_buffer_rows=256", "ps.num_shards=2", "train.num_threads=1", "train.log_every=4",
        f"train.run_dir='{run}'", "train.checkpoint_every=6", *extra,
    ])


def train(cfg: JobConfig, resume: Path | None = None, store: LocalStore | None = None) -> tuple[Trainer, LocalStore]:
    if store is None:
        store = LocalStore.create(cfg.ps) if resume is None else LocalStore.from_dir(cfg.ps, resume / "model" / "ps")
    trainer = Trainer(cfg, store)
    if resume is not None:
        trainer.restore(str(resume))
    trainer.train()
    trainer.close()
    return trainer, store


def rows_by_id(store: LocalStore) -> dict[int, dict[str, dict[int, torch.Tensor]]]:
    """{table: {"rows" / optimizer state / counters: {id: value}}} over every shard."""
    out: dict = {}
    for t in range(len(store.config.tables)):
        merged: dict[str, dict[int, torch.Tensor]] = {}
        for state in store.states:
            keys, rows, extra = state.dump_table(t)
            for name, values in {"rows": rows, **extra}.items():
                merged.setdefault(name, {}).update(zip(keys.tolist(), values))
        out[t] = merged
    return out


def assert_same_rows(a: LocalStore, b: LocalStore, atol: float = 1e-6) -> None:
    ra, rb = rows_by_id(a), rows_by_id(b)
    for t in ra:
        assert ra[t].keys() == rb[t].keys()
        for name in ra[t]:
            assert ra[t][name].keys() == rb[t][name].keys(), (t, name)
            ka = sorted(ra[t][name])
            va = torch.stack([torch.as_tensor(ra[t][name][k]).double() for k in ka])
            vb = torch.stack([torch.as_tensor(rb[t][name][k]).double() for k in ka])
            torch.testing.assert_close(va, vb, atol=atol, rtol=0, msg=f"table {t} {name}")


def test_resume_equals_uninterrupted(tmp_path: Path, data_dir: Path) -> None:
    full, full_store = train(job(tmp_path / "full", data_dir, "train.max_steps=30"))
    part_cfg = job(tmp_path / "part", data_dir, "train.max_steps=12")
    train(part_cfg)
    ckpts = list_checkpoints(part_cfg.train.run_dir)
    assert [p.name for p in ckpts][-1] == "step-0000000012"
    rest_cfg = job(tmp_path / "part", data_dir, "train.max_steps=30")
    resumed, resumed_store = train(rest_cfg, resume=ckpts[-1])
    assert resumed.step == full.step == 30
    for (name, p), q in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    for sa, sb in zip(full.optimizer.state_dict()["state"].values(), resumed.optimizer.state_dict()["state"].values()):
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], atol=1e-6, rtol=0)
    assert_same_rows(full_store, resumed_store)


def test_checkpoint_contents_and_keep_last(tmp_path: Path, data_dir: Path) -> None:
    cfg = job(tmp_path / "run", data_dir, "train.max_steps=25", "train.keep_checkpoints=2")
    stale = Path(cfg.train.run_dir) / "checkpoints" / ".tmp-step-0000000003"    # a killed attempt's
    (stale / "model").mkdir(parents=True)
    train(cfg)
    names = [p.name for p in list_checkpoints(cfg.train.run_dir)]
    assert names == ["step-0000000024", "step-0000000025"]          # every 6 steps + the end; keep 2
    root = list_checkpoints(cfg.train.run_dir)[-1]
    manifest = verify_checkpoint(root)
    assert manifest["step"] == 25 and manifest["num_shards"] == 2 and manifest["num_trainers"] == 1
    for rel in ("config.toml", "model/dense.pt", "trainer/state.pt", "trainer/loaders.json",
                "model/ps/shard0/manifest.json", "model/ps/shard1/manifest.json"):
        assert rel in manifest["files"], rel
    assert all(len(e["sha256"]) == 64 for e in manifest["files"].values())
    loaders = json.loads((root / "trainer" / "loaders.json").read_text())
    assert len(loaders) == 1 and loaders[0]["batches"] == 25
    assert not list(Path(cfg.train.run_dir, "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corruption_detected_and_latest_falls_back(tmp_path: Path, data_dir: Path, damage: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    cfg = job(tmp_path / "run", data_dir, "train.max_steps=12")
    train(cfg)
    older, newest = list_checkpoints(cfg.train.run_dir)[-2:]
    victim = newest / "model" / "ps" / "shard1" / "table0" / "weights.npy"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-10]))
    else:
        victim.unlink()
    with pytest.raises(CorruptCheckpointError, match=str(victim)):
        verify_checkpoint(newest)
    with pytest.raises(CorruptCheckpointError, match="weights.npy"):
        resolve_resume(cfg.train.run_dir, str(newest))       # an explicit path must be good
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(cfg.train.run_dir, "latest") == older
    assert "weights.npy" in caplog.text and newest.name in caplog.text


def test_manifest_missing_is_named(tmp_path: Path, data_dir: Path) -> None:
    cfg = job(tmp_path / "run", data_dir, "train.max_steps=6")
    train(cfg)
    root = list_checkpoints(cfg.train.run_dir)[-1]
    (root / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="manifest.json: missing"):
        verify_checkpoint(root)
    # no good checkpoint left: an error listing them, not a silent start from step 0 over them (#27)
    with pytest.raises(CorruptCheckpointError, match=f"none of the 1 checkpoints.*{root.name}: .*manifest.json: missing"):
        resolve_resume(cfg.train.run_dir, "latest")


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 5)])
def test_offline_reshard_moves_every_row_and_slot(tmp_path: Path, data_dir: Path, old: int, new: int) -> None:
    cfg = job(tmp_path / "run", data_dir, "train.max_steps=10", f"ps.num_shards={old}",
              "train.checkpoint_every=10")
    tables = tuple(dataclasses.replace(t, optimizer=opt) for t, opt in
                   zip(cfg.ps.tables, ["rowwise_adagrad", "adam", "adagrad", "ftrl", "sgd"]))
    cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))
    _, store = train(cfg)
    src = list_checkpoints(cfg.train.run_dir)[-1]
    out = reshard_checkpoint(src, new, tmp_path / "resharded")
    manifest = verify_checkpoint(out)
    assert manifest["num_shards"] == new and manifest["step"] == 10
    moved_cfg = load_config(out / "config.toml")
    assert moved_cfg.ps.num_shards == new
    moved = LocalStore.from_dir(moved_cfg.ps, out / "model" / "ps")
    assert sum(s.stats()["rows"] for s in moved.states) == sum(s.stats()["rows"] for s in store.states)
    assert_same_rows(store, moved, atol=0)
    for i, state in enumerate(moved.states):                # every row on the shard its id hashes to
        for t in range(len(tables)):
            keys = state.dump_table(t)[0]
            assert keys.numel() and bool((shard_of(keys, new) == i).all())


def test_resume_into_more_shards_equals_uninterrupted(tmp_path: Path, data_dir: Path) -> None:
    full, full_store = train(job(tmp_path / "full", data_dir, "train.max_steps=18"))
    part = job(tmp_path / "part", data_dir, "train.max_steps=6")
    train(part)
    ckpt = list_checkpoints(part.train.run_dir)[-1]
    rest = job(tmp_path / "part", data_dir, "train.max_steps=18", "ps.num_shards=3")
    from recsys.training.reshard import restore_shard

    store = LocalStore(rest.ps, [restore_shard(rest.ps, i, ckpt / "model" / "ps") for i in range(3)])
    resumed, store = train(rest, resume=ckpt, store=store)
    assert_same_rows(full_store, store, atol=1e-6)
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def test_resumed_metrics_drop_the_dead_attempts_later_lines(tmp_path: Path) -> None:
    from recsys.training.worker import trim_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss/train": 0.5}) + "\n" for s in (4, 8, 12, 16)]
    path.write_text("".join(lines) + '{"step": 20, "loss/tr')        # the kill cut the last line short
    trim_metrics(path, 8)
    assert path.read_text() == "".join(lines[:2])
    trim_metrics(tmp_path / "none.jsonl", 8)                          # no file yet: nothing to do


def test_a_full_disk_is_one_line_and_leaves_no_temporary_directory(tmp_path: Path, data_dir: Path,
                                                                   monkeypatch) -> None:
    """#28 item 4: a full disk (or ulimit -f) while writing a checkpoint was a cryptic torch error and
    left a .tmp-step-* directory: now one line saying what happened and what to change, nothing kept."""
    import errno

    from recsys.training import checkpoint as ck

    real = ck.torch.save

    def full(obj, path, *a, **k):
        if str(path).endswith("state.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed") from OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path, *a, **k)

    monkeypatch.setattr(ck.torch, "save", full)
    cfg = job(tmp_path / "run", data_dir, "train.max_steps=6")
    with pytest.raises(ck.CheckpointWriteError, match=r"checkpoint .*step-0000000006: cannot write it: the disk is "
                                                      r"full \(free space, lower train.keep_checkpoints"):
        train(cfg)
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    assert "a file size limit" in ck.write_failure("x", OSError(errno.EFBIG, "File too large"))
