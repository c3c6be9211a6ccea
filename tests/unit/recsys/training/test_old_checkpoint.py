"""A checkpoint written before issue #11 (tests/fixtures/ckpt_format2, see its README) still restores,
exports and re-shards, with the values that were written; export checks the shards' checksums."""

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from embedding_ps.local import LocalStore
from embedding_ps.shard.state import ShardState
from embedding_ps.shard.snapshot import saved_shard_dirs, shard_dir
from recsys.config import JobConfig, load_config
from recsys.serving import Predictor
from recsys.serving.export import export_model
from recsys.serving.source import resolve_source
from recsys.serving.errors import ExportError
from recsys.training.checkpoint import verify_checkpoint
from recsys.training.reshard import reshard_checkpoint, restore_shard
from recsys.training.trainer import Trainer

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "ckpt_format2"
STEPS = 4


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """A copy of the fixture's checkpoint (tests must not write into the fixture)."""
    return Path(shutil.copytree(FIXTURE / "checkpoint", tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "expected.npz") as f:
        return dict(f)


def config(ckpt: Path, tmp_path: Path) -> JobConfig:
    data = FIXTURE / "data" / "part-00000.parquet"
    return load_config(ckpt / "config.toml", [f"data.train_paths=['{data}']", f"data.eval_paths=['{data}']",
                                              f"train.run_dir='{tmp_path / 'run'}'"])


def assert_store_holds(store: LocalStore, expected: dict[str, np.ndarray]) -> None:
    probe = torch.from_numpy(expected["probe_ids"])
    for t in range(len(store.config.tables)):
        torch.testing.assert_close(store.pull(t, probe), torch.from_numpy(expected[f"t{t}_probe_rows"]),
                                   atol=0, rtol=0, msg=f"table {t}")
        parts = [s.dump_table(t) for s in store.states]
        keys = torch.cat([p[0] for p in parts])
        order = torch.argsort(keys)
        np.testing.assert_array_equal(keys[order].numpy(), expected[f"t{t}_ids"])
        np.testing.assert_array_equal(torch.cat([p[1] for p in parts])[order].numpy(), expected[f"t{t}_rows"])
        for name in parts[0][2]:
            np.testing.assert_array_equal(torch.cat([p[2][name] for p in parts])[order].numpy(),
                                          expected[f"t{t}_state.{name}"], err_msg=f"table {t} {name}")


def test_restores(ckpt: Path, tmp_path: Path, expected: dict[str, np.ndarray]) -> None:
    verify_checkpoint(ckpt)
    cfg = config(ckpt, tmp_path)
    assert [Path(d).name for d in saved_shard_dirs(ckpt / "model" / "ps")] == ["shard0", "shard1"]
    store = LocalStore.from_dir(cfg.ps, ckpt / "model" / "ps")
    assert_store_holds(store, expected)
    state = ShardState(cfg.ps, 1)
    state.load(shard_dir(ckpt / "model" / "ps", 1))
    assert state.stats()["rows"] == store.states[1].stats()["rows"]
    trainer = Trainer(cfg, store)
    try:
        trainer.restore(str(ckpt))
        assert trainer.step == store.step == STEPS
        dense = torch.load(ckpt / "model" / "dense.pt", weights_only=True)
        for name, value in trainer.model.state_dict().items():
            torch.testing.assert_close(value, dense[name], atol=0, rtol=0, msg=name)
    finally:
        trainer.close()


def test_exports(ckpt: Path, tmp_path: Path, expected: dict[str, np.ndarray]) -> None:
    source = resolve_source(checkpoint=ckpt)
    assert source.step == STEPS
    export_model(source, tmp_path / "export", "fp32")
    predictor = Predictor(tmp_path / "export")
    probe = torch.from_numpy(expected["probe_ids"])
    for t, table in enumerate(source.config.ps.tables):
        np.testing.assert_array_equal(np.asarray(predictor.tables[t].ids), expected[f"t{t}_ids"])
        torch.testing.assert_close(predictor.lookup(table.name, probe), torch.from_numpy(expected[f"t{t}_probe_rows"]),
                                   atol=0, rtol=0, msg=table.name)


def test_export_checks_the_shards_checksums(ckpt: Path, tmp_path: Path) -> None:
    victim = ckpt / "model" / "ps" / "shard1" / "table2" / "weights.npy"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF                       # same size, one row changed
    victim.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="shard1/table2/weights.npy: sha256 mismatch"):
        export_model(resolve_source(checkpoint=ckpt), tmp_path / "export", "fp32")


def test_reshards(ckpt: Path, tmp_path: Path, expected: dict[str, np.ndarray]) -> None:
    out = reshard_checkpoint(ckpt, 3, tmp_path / "three")
    cfg3 = load_config(out / "config.toml")
    assert cfg3.ps.num_shards == 3
    assert_store_holds(LocalStore.from_dir(cfg3.ps, out / "model" / "ps"), expected)
    # and straight from the 2 old shards into 3 new ones, as a restarted shard process does
    cfg = config(ckpt, tmp_path)
    ps3 = dataclasses.replace(cfg.ps, num_shards=3)
    assert_store_holds(LocalStore(ps3, [restore_shard(ps3, i, ckpt / "model" / "ps") for i in range(3)]), expected)
