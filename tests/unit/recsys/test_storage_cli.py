"""`recsys eval / predict / export / reshard` on a run, checkpoint and outputs given as URIs (file://,
the same staging code as s3://): the results equal those of the same commands on plain paths."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from embedding_ps.local import LocalStore
from recsys import cli, storage
from recsys.config import load_config, to_toml
from recsys.rundir import run_path
from recsys.training.checkpoint import list_checkpoints, verify_checkpoint
from recsys.training.trainer import Trainer
from recsys.training.worker import save_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def run(tiny_dataset, tmp_path_factory) -> tuple[str, Path, Path]:
    """(run URI, its plain path, data dir): 8 steps, a checkpoint at 8, model/, config, metrics.json."""
    data = tiny_dataset(rows=4000, files=2, seed=5)
    plain = tmp_path_factory.mktemp("uri-run") / "run"
    uri = f"file://{plain}"
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", "data.eval_paths=[]", "ps.num_shards=2",
        f"train.run_dir='{uri}'", f"train.scratch_dir='{plain.parent / 'scratch'}'", "train.max_steps=8",
        "train.checkpoint_every=8", "train.num_threads=1"])
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    trainer.train()
    trainer.close()
    save_model(trainer, store, run_path(uri, "model"))
    storage.write_text(run_path(uri, "config.toml"), to_toml(cfg))
    storage.write_text(run_path(uri, "metrics.json"), json.dumps({"steps": trainer.step}))
    return uri, plain, data


def test_eval_and_predict_on_a_uri_run(run, tmp_path: Path) -> None:
    uri, plain, data = run
    test = f"{data}/part-00001.parquet"
    assert cli.main(["eval", "--run", uri, "--data", f"file://{test}"]) == 0
    assert cli.main(["eval", "--run", str(plain), "--data", test, "--out", str(tmp_path / "m.json")]) == 0
    got = json.loads((plain / "eval_metrics.json").read_text())          # the default: beside the run
    assert got == json.loads((tmp_path / "m.json").read_text()) and 0.0 < got["auc"] < 1.0
    assert cli.main(["predict", "--run", uri, "--data", test, "--out", f"file://{tmp_path}/p.parquet"]) == 0
    assert cli.main(["predict", "--run", str(plain), "--data", test, "--out", str(tmp_path / "q.parquet")]) == 0
    assert pq.read_table(tmp_path / "p.parquet").equals(pq.read_table(tmp_path / "q.parquet"))


def test_export_and_reshard_to_uris(run, tmp_path: Path) -> None:
    uri, plain, _ = run
    assert cli.main(["export", "--run", uri, "--out", f"file://{tmp_path}/exp"]) == 0
    assert cli.main(["export", "--run", str(plain), "--out", str(tmp_path / "exp2")]) == 0
    a = json.loads((tmp_path / "exp" / "manifest.json").read_text())
    b = json.loads((tmp_path / "exp2" / "manifest.json").read_text())
    assert {k: v["sha256"] for k, v in a["files"].items() if k.startswith("tables/")} == \
        {k: v["sha256"] for k, v in b["files"].items() if k.startswith("tables/")} and a["rows"] == b["rows"] and sum(a["rows"].values()) > 0
    assert a["origin"].endswith(uri) and a["origin"].split(" ", 1)[0] == b["origin"].split(" ", 1)[0]
    ckpt = list_checkpoints(uri)[-1]
    assert cli.main(["reshard", ckpt, "--shards", "3", "--out", f"file://{tmp_path}/r3"]) == 0
    assert verify_checkpoint(tmp_path / "r3")["num_shards"] == 3
    assert cli.main(["reshard", ckpt, "--shards", "3", "--out", f"file://{tmp_path}/r3"]) == 2   # exists: refused
