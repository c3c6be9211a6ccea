"""Warm start (`recsys train --init-from`, #27 item 1): a new run on new data starts from another run's
rows (with optimizer state), dense weights and optimizer state; the step counter continues; tables
added since start empty; a changed table is refused; the lineage lets the new run's deltas apply to
the old run's export.

In-process parts (ShardState / Trainer) check exact values; one CLI job (1 shard + 1 trainer
processes on 127.0.0.1) checks the launcher's plumbing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data.vocab import distinct_ids
from embedding_ps.local import LocalStore
from recsys import cli
from recsys.config import load_config, to_toml
from recsys.serving.predictor import Predictor
from recsys.training.checkpoint import list_checkpoints
from recsys.training.warm_start import resolve_init
from recsys.training.reshard import init_shard
from recsys.training.trainer import Trainer
from recsys.training.worker import saved_replicated

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _cfg(run: Path, train: Path, *extra: str):
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{train}']", "data.eval_paths=[]", "data.batch_size=64", f"train.run_dir='{run}'",
        "train.checkpoint_every=4", "ps.num_shards=2", *extra])
    tables = tuple(dataclasses.replace(t, placement="replicated", optimizer="adam", lr=0.01) if t.name == "C1"
                   else t for t in cfg.ps.tables)
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, tiny_dataset):
    """Run A: 8 steps on part-00000 (in process), checkpoints at 4 and 8."""
    data = tiny_dataset(rows=3000, files=2, seed=23)
    run = tmp_path_factory.mktemp("warm") / "a"
    cfg = _cfg(run, data / "part-00000.parquet", "train.max_steps=8")
    torch.manual_seed(0)
    trainer = Trainer(cfg, LocalStore.create(cfg.ps))
    trainer.train()
    trainer.close()
    (run / "config.toml").write_text(to_toml(cfg))
    return data, run, trainer, list_checkpoints(run)[-1]


def test_shards_take_the_source_rows_by_table_name(source, tmp_path: Path) -> None:
    """Any shard count; a table added since starts empty; a replicated table is not put on the shards."""
    data, _, trainer, ckpt = source
    cfg = _cfg(tmp_path / "b", data / "part-00001.parquet", "ps.num_shards=3")
    new = dataclasses.replace(cfg.ps.tables[1], name="NEW")
    ps = dataclasses.replace(cfg.ps, tables=(*cfg.ps.tables, new))
    states = [init_shard(ps, i, ckpt / "model" / "ps") for i in range(3)]
    store = LocalStore(ps, states)
    trained = distinct_ids(cfg.data, [str(data / "part-00000.parquet")], cfg.data.sparse_columns)
    fresh = LocalStore.create(ps)
    for t, table in enumerate(cfg.ps.tables):
        if table.placement == "replicated":
            continue
        ids = torch.from_numpy(trained[table.name])
        torch.testing.assert_close(store.pull(t, ids), trainer.store.pull(t, ids), atol=0, rtol=0)
        assert not torch.equal(store.pull(t, ids), fresh.pull(t, ids)), table.name      # they trained
    # the new table has no row yet: its pulls are the init rows, as in a fresh run
    ids = torch.from_numpy(trained["C2"])
    torch.testing.assert_close(store.pull(len(cfg.ps.tables), ids), fresh.pull(len(cfg.ps.tables), ids))


def test_a_trainer_warm_started_holds_the_source_model(source, tmp_path: Path) -> None:
    data, _, trainer, ckpt = source
    cfg = _cfg(tmp_path / "b", data / "part-00001.parquet", "train.max_steps=4")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(ckpt), init_step=8))
    init = resolve_init(ckpt)
    assert init.step == 8 and init.checkpoint
    store = LocalStore(cfg.ps, [init_shard(cfg.ps, i, ckpt / "model" / "ps") for i in range(cfg.ps.num_shards)])
    warm = Trainer(cfg, store, replicated_state=saved_replicated(init.model_dir), warm=True)
    warm.warm_start(init)
    assert warm.step == 8
    for k, v in trainer.model.state_dict().items():
        torch.testing.assert_close(warm.model.state_dict()[k], v, atol=0, rtol=0, msg=k)
    # the dense optimizer's moments came along
    a = trainer.optimizer.state_dict()["state"]
    b = warm.optimizer.state_dict()["state"]
    torch.testing.assert_close(b[0]["exp_avg"], a[0]["exp_avg"])
    # C1 (replicated): the vocabulary is the union of both days' ids, A's rows and Adam state at their ids
    old_keys, new_keys = trainer.replicated.keys["C1"], warm.replicated.keys["C1"]
    assert set(old_keys.tolist()) <= set(new_keys.tolist())
    pos = torch.searchsorted(new_keys, old_keys)
    torch.testing.assert_close(warm.replicated.weight["C1"][pos], trainer.replicated.weight["C1"])
    got = warm.table_optimizer.optimizers["C1"].state_dict()["state"][0]["exp_avg"]
    want = trainer.table_optimizer.optimizers["C1"].state_dict()["state"][0]["exp_avg"]
    torch.testing.assert_close(got[pos], want)
    warm.train()                                       # 4 more steps: the counter continues
    assert warm.step == 12
    warm.close()


def test_cli_warm_start_then_a_delta_of_the_new_run_applies_to_the_old_export(source, tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    data, run_a, _, ckpt = source
    (run_a / "metrics.json").write_text(json.dumps({"steps": 8.0}))
    argv = ["train", "--config", str(ROOT / "configs" / "tiny.toml"),
            "--set", f"data.train_paths=['{data}/part-00001.parquet']", "--set", "data.eval_paths=[]",
            "--set", "data.batch_size=64", "--set", "train.max_steps=6", "--set", "train.checkpoint_every=4",
            "--set", f"train.run_dir='{tmp_path / 'b'}'", "--set", "ps.num_shards=2",
            "--set", "ps.tables=[{name='C1', dim=8, lr=0.01, optimizer='adam', placement='replicated'}, "
                     "{name='C2', dim=8, lr=0.05}, {name='C3', dim=8, lr=0.05}, {name='C4', dim=8, lr=0.05}, "
                     "{name='M1', dim=8, lr=0.05}]"]
    assert cli.main([*argv, "--init-from", str(ckpt)]) == 0
    b = tmp_path / "b"
    metrics = json.loads((b / "metrics.json").read_text())
    assert metrics["steps"] == 14                       # 8 of A + 6 of this run
    text = (b / "config.toml").read_text()
    a_id = json.loads((ckpt / "manifest.json").read_text()).get("run_id") or ""
    assert "init_step = 8" in text
    assert load_config(b / "config.toml").data.id_types == dict.fromkeys(["C1", "C2", "C3", "C4", "M1"], "integer")
    # A's export (step 8) + B's delta since 8 = B's full export, served alike
    assert cli.main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "base")]) == 0
    assert cli.main(["export", "--run", str(b), "--out", str(tmp_path / "delta"), "--since", "8"]) == 0
    assert cli.main(["export", "--run", str(b), "--out", str(tmp_path / "full")]) == 0
    assert cli.main(["export-apply", str(tmp_path / "base"), str(tmp_path / "delta"),
                     "--out", str(tmp_path / "applied")]) == 0
    table = pq.read_table(data / "part-00001.parquet")
    full = Predictor(tmp_path / "full").predict(table)
    np.testing.assert_array_equal(Predictor(tmp_path / "applied").predict(table), full)
    np.testing.assert_array_equal(Predictor(tmp_path / "base", deltas=[tmp_path / "delta"]).predict(table), full)
    if a_id:
        assert a_id in text
    # resumed later, the run keeps its warm-start step: max_steps = 8 now ends at 8 + 8
    longer = [a.replace("train.max_steps=6", "train.max_steps=8") for a in argv]
    assert cli.main([*longer, "--resume", "latest"]) == 0
    assert json.loads((b / "metrics.json").read_text())["steps"] == 16
    # a changed table: one error line naming it, nothing written
    capsys.readouterr()
    bad = [a.replace("{name='C2', dim=8, lr=0.05}", "{name='C2', dim=8, lr=0.05, optimizer='sgd'}")
           if a.startswith("ps.tables") else a for a in argv]
    bad = [a.replace(str(tmp_path / "b"), str(tmp_path / "c")) for a in bad]
    assert cli.main([*bad, "--init-from", str(ckpt)]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "ps.tables[C2].optimizer" in err[0] and "init_from" in err[0], err
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())    # (preflight's write check)
    # the next day's C2 ids as strings: "7" is not the id 7 the source trained; refused before any process
    day = table.set_column(table.schema.get_field_index("C2"), "C2", table.column("C2").cast("string"))
    pq.write_table(day, tmp_path / "strings.parquet")
    strings = [a.replace(f"{data}/part-00001.parquet", str(tmp_path / "strings.parquet")) for a in argv]
    assert cli.main([*[a.replace(str(tmp_path / "b"), str(tmp_path / "d")) for a in strings],
                     "--init-from", str(ckpt)]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "strings.parquet" in err[0] and "column 'C2': string ids" in err[0], err
    assert "data.id_types says integer" in err[0]


def test_warm_start_from_an_fp32_export(source, tmp_path: Path) -> None:
    """Rows and dense weights come from an fp32 export (no optimizer state); a quantized one is refused."""
    from recsys.config import ConfigError
    from recsys.serving.export import export_model
    from recsys.serving.source import resolve_source
    from recsys.training.warm_start import source_replicated

    data, _, trainer, ckpt = source
    export_model(resolve_source(checkpoint=ckpt), tmp_path / "exp")
    init = resolve_init(tmp_path / "exp")
    assert init.export and init.step == 8
    cfg = _cfg(tmp_path / "b", data / "part-00001.parquet", "ps.num_shards=3", "train.max_steps=2", "train.init_step=8")
    store = LocalStore(cfg.ps, [init_shard(cfg.ps, i, tmp_path / "exp") for i in range(3)])
    trained = distinct_ids(cfg.data, [str(data / "part-00000.parquet")], cfg.data.sparse_columns)
    for t, table in enumerate(cfg.ps.tables):
        if table.placement != "replicated":
            ids = torch.from_numpy(trained[table.name])
            torch.testing.assert_close(store.pull(t, ids), trainer.store.pull(t, ids), atol=0, rtol=0)
    warm = Trainer(cfg, store, replicated_state=source_replicated(init), warm=True)
    warm.warm_start(init)
    for k, v in trainer.model.state_dict().items():
        torch.testing.assert_close(warm.model.state_dict()[k], v, atol=0, rtol=0, msg=k)
    pos = torch.searchsorted(warm.replicated.keys["C1"], trainer.replicated.keys["C1"])
    torch.testing.assert_close(warm.replicated.weight["C1"][pos], trainer.replicated.weight["C1"])
    warm.train()
    assert warm.step == 10
    warm.close()
    export_model(resolve_source(checkpoint=ckpt), tmp_path / "q", precision="int8")
    with pytest.raises(ConfigError, match="int8 full export; a warm start needs a full fp32 export"):
        resolve_init(tmp_path / "q")
