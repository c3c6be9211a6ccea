"""Bad input, one table: config, data, command-line arguments, checkpoints, exports.

Every case runs the real CLI entry (`recsys.cli.main`) in this process: each of these problems is
found before any process starts (preflight, argument parsing, manifests), so no case spawns one.
Each asserts
- the exit code (2: a problem of the input),
- exactly one line on stderr, `error: ...`, naming the file / key / column / argument,
- that nothing already written changed: the hash of every file of the world (data, run directory,
  checkpoints, export) is the same before and after, and no file appeared or vanished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from embedding_ps.local import LocalStore
from recsys import cli
from recsys.config import load_config, to_toml
from recsys.training.checkpoint import list_checkpoints
from recsys.training.trainer import Trainer
from recsys.training.worker import save_model

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class World:
    """Everything a case may point at; written once, hashed around every case."""

    root: Path

    def __truediv__(self, name: str) -> Path:
        return self.root / name

    @property
    def ckpt(self) -> Path:
        return list_checkpoints(self.root / "run")[-1]


def _train_run(world: Path) -> None:
    """An in-process 8-step run in world/run (checkpoints at 4 and 8, the final model, metrics)."""
    run = world / "run"
    cfg = load_config(world / "job.toml", ["train.max_steps=8", "train.checkpoint_every=4"])
    torch.manual_seed(0)
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    try:
        trainer.train()
    finally:
        trainer.close()
    save_model(trainer, store, run / "model")
    (run / "config.toml").write_text(to_toml(cfg))
    (run / "metrics.json").write_text(json.dumps({"steps": float(trainer.step)}))


def _bad_data(world: Path, good: Path) -> None:
    bad = world / "bad"
    bad.mkdir()
    table = pq.read_table(good)
    pq.write_table(table.drop_columns(["I2"]), bad / "no_I2.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label",
                                    pa.array([str(x) for x in table.column("label").to_pylist()])),
                   bad / "label_as_text.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("C1"), "C1",
                                    table.column("C1").cast(pa.float64(), safe=False)), bad / "C1_as_float.parquet")
    pq.write_table(table.append_column("row_weight", pa.array(["1.0"] * table.num_rows)),
                   bad / "weight_as_text.parquet")
    pq.write_table(table.append_column("row_weight", pa.array([1.0] * table.num_rows)), bad / "weighted.parquet")
    for name, value in (("negative", -0.5), ("nan", float("nan")), ("inf", float("inf"))):
        w = [1.0] * table.num_rows
        w[table.num_rows - 7] = value
        pq.write_table(table.append_column("row_weight", pa.array(w)), bad / f"weight_{name}.parquet")
    (bad / "not_parquet.parquet").write_text("label,I1\n1,2\n")
    raw = good.read_bytes()
    (bad / "truncated.parquet").write_bytes(raw[: len(raw) // 2])
    (bad / "empty_dir").mkdir()
    (bad / "a_file").write_text("not a directory")


def _corrupt_checkpoints(world: Path, ckpt: Path) -> None:
    out = world / "corrupt"
    out.mkdir()
    flipped = out / "flipped"
    shutil.copytree(ckpt, flipped)
    data = bytearray((flipped / "model" / "dense.pt").read_bytes())
    data[len(data) // 2] ^= 0x40
    (flipped / "model" / "dense.pt").write_bytes(bytes(data))
    truncated = out / "truncated"
    shutil.copytree(ckpt, truncated)
    path = truncated / "trainer" / "state.pt"
    path.write_bytes(path.read_bytes()[:-10])
    no_manifest = out / "no_manifest"
    shutil.copytree(ckpt, no_manifest)
    (no_manifest / "manifest.json").unlink()
    missing = out / "missing_file"
    shutil.copytree(ckpt, missing)
    (missing / "trainer" / "loaders.json").unlink()
    shard = out / "bad_shard"
    shutil.copytree(ckpt, shard)
    npy = shard / "model" / "ps" / "shard0" / "table0" / "weights.npy"
    npy.write_bytes(npy.read_bytes()[:-8])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_dataset) -> World:
    from recsys.serving.export import export_model
    from recsys.serving.source import resolve_source

    root = tmp_path_factory.mktemp("world")
    data = root / "data"
    data.mkdir()
    for part in sorted(tiny_dataset(rows=3000, files=2, seed=21).glob("*.parquet")):
        shutil.copy(part, data / part.name)
    (root / "job.toml").write_text((ROOT / "configs" / "tiny.toml").read_text()
                                   .replace('"runs/tiny-data/part-00000.parquet"', f'"{data}/part-00000.parquet"')
                                   .replace('"runs/tiny-data/part-00001.parquet"', f'"{data}/part-00001.parquet"')
                                   .replace('"runs/tiny"', f'"{root}/run"'))
    _train_run(root)
    _bad_data(root, data / "part-00000.parquet")
    _corrupt_checkpoints(root, list_checkpoints(root / "run")[-1])
    export_model(resolve_source(run=root / "run"), root / "export")
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("not an export")
    (root / "broken.toml").write_text("[data\ntrain_paths = 3\n")
    (root / "unknown_section.toml").write_text((root / "job.toml").read_text() + "\n[trainer]\nx = 1\n")
    return World(root)


def tree_hash(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


W = World  # the cases below get the world and return argv

Case = tuple[str, Callable[[World], list[str]], str]


def train(*sets: str, config: str = "job.toml") -> Callable[[World], list[str]]:
    def argv(w: World) -> list[str]:
        out = ["train", "--config", str(w / config)]
        for s in sets:
            out += ["--set", s.format(w=w.root)]
        return out
    return argv


def args(*argv: str) -> Callable[[World], list[str]]:
    return lambda w: [a.format(w=w.root, ckpt=w.ckpt) for a in argv]


CASES: list[Case] = [
    # -- config ------------------------------------------------------------------------------
    ("unknown key", train("ps.num_shard=2"), "num_shard"),
    ("wrong type", train("data.batch_size='big'"), "data.batch_size"),
    ("value outside a Literal", train("ps.mode='fast'"), "ps.mode"),
    ("nan float", train("train.dense_lr=nan"), "train.dense_lr"),
    ("inf float", train("train.dense_lr=inf"), "train.dense_lr"),
    ("negative lr", train("train.dense_lr=-1.0"), "train.dense_lr"),
    ("too many shards", train("ps.num_shards=10000"), "ps.num_shards"),
    ("too many trainers", train("train.num_trainers=5000"), "train.num_trainers"),
    ("zero batch", train("data.batch_size=0"), "data.batch_size"),
    ("negative epochs", train("train.epochs=-1"), "train.epochs"),
    ("unknown optimizer", train("train.dense_optimizer='lbfgs'"), "train.dense_optimizer"),
    ("override without =", train("train.epochs"), "train.epochs"),
    ("override not TOML", train("train.epochs=[1,"), "train.epochs"),
    ("missing config file", train(config="nope.toml"), "nope.toml"),
    ("broken TOML", train(config="broken.toml"), "broken.toml"),
    ("unknown section", train(config="unknown_section.toml"), "trainer"),
    # -- data ---------------------------------------------------------------------------------
    ("missing dense column", train("data.dense_columns=['I1', 'nope']"), "nope"),
    ("missing train path", train("data.train_paths=['{w}/no/such/dir']"), "no/such/dir"),
    ("feature without table", train("data.sparse_columns=['C1', 'C2', 'C3', 'C4', 'M1', 'C9']"), "C9"),
    ("table nobody reads", train("data.sparse_columns=['C1', 'C2', 'C3', 'C4']"), "M1"),
    ("empty train dir", train("data.train_paths=['{w}/bad/empty_dir']"), "empty_dir"),
    ("not a parquet file", train("data.train_paths=['{w}/bad/not_parquet.parquet']"), "not_parquet.parquet"),
    ("truncated parquet file", train("data.train_paths=['{w}/bad/truncated.parquet']"), "truncated.parquet"),
    ("label of a wrong type", train("data.train_paths=['{w}/bad/label_as_text.parquet']"), "label"),
    ("sparse column of a wrong type", train("data.train_paths=['{w}/bad/C1_as_float.parquet']"), "C1"),
    ("eval file without a column", train("data.eval_paths=['{w}/bad/no_I2.parquet']"), "I2"),
    ("test file missing", train("data.test_paths=['{w}/no_test.parquet']"), "no_test.parquet"),
    ("run dir is a file", train("train.run_dir='{w}/bad/a_file'"), "train.run_dir"),
    ("negative sampling rate 0", train("data.negative_sampling_rate=0.0"), "data.negative_sampling_rate"),
    ("negative sampling rate above 1", train("data.negative_sampling_rate=1.5"), "data.negative_sampling_rate"),
    ("example weight column missing", train("data.example_weight_column='row_weight'"), "'row_weight': missing"),
    ("example weight column of a wrong type", train("data.train_paths=['{w}/bad/weight_as_text.parquet']",
                                                    "data.example_weight_column='row_weight'"), "'row_weight'"),
    ("negative example weight", train("data.train_paths=['{w}/bad/weight_negative.parquet']",
                                      "data.example_weight_column='row_weight'"), "weight_negative.parquet"),
    ("NaN example weight", train("data.train_paths=['{w}/bad/weight_nan.parquet']",
                                 "data.example_weight_column='row_weight'"), "'row_weight'"),
    ("infinite example weight", train("data.train_paths=['{w}/bad/weight_inf.parquet']",
                                      "data.example_weight_column='row_weight'"), "weight_inf.parquet"),
    ("eval files with and without the example weight column",
     train("data.train_paths=['{w}/bad/weighted.parquet']", "data.example_weight_column='row_weight'",
           "data.eval_paths=['{w}/bad/weighted.parquet', '{w}/data/part-00001.parquet']"), "'row_weight': missing"),
    ("replicated table over the byte budget",
     train("ps.table_defaults.placement='replicated'", "ps.replicate_max_bytes=1000"), "ps.replicate_max_bytes"),
    # -- command-line arguments -----------------------------------------------------------------
    ("no command", args(), "command"),
    ("unknown command", args("fly"), "fly"),
    ("train without --config", args("train"), "--config"),
    ("--shards not a number", args("reshard", "{ckpt}", "--shards", "three", "--out", "{w}/new"), "--shards"),
    ("unknown precision", args("export", "--run", "{w}/run", "--out", "{w}/new", "--precision", "fp8"), "--precision"),
    ("--run and --checkpoint", args("export", "--run", "{w}/run", "--checkpoint", "{ckpt}", "--out", "{w}/new"),
     "--checkpoint"),
    ("shard index out of range", args("ps", "--config", "{w}/job.toml", "--shard", "7"), "--shard 7"),
    ("port outside 0..65535", args("ps", "--config", "{w}/job.toml", "--shard", "0", "--port", "70000"),
     "--port: 70000 is outside 0..65535"),
    ("gen-data without --rows", args("gen-data", "--out", "{w}/new"), "--rows"),
    # -- checkpoints --------------------------------------------------------------------------
    ("resume from a missing path", train("train.max_steps=12") , None),   # placeholder, replaced below
    ("resume: a flipped byte", None, "dense.pt"),
    ("resume: a truncated file", None, "state.pt"),
    ("resume: no manifest", None, "manifest.json"),
    ("resume: a file missing", None, "loaders.json"),
    ("reshard a corrupt checkpoint", args("reshard", "{w}/corrupt/bad_shard", "--shards", "3", "--out", "{w}/new"),
     "shard0"),
    ("reshard onto an existing dir", args("reshard", "{ckpt}", "--shards", "3", "--out", "{w}/other"), "other"),
    ("export a corrupt checkpoint", args("export", "--checkpoint", "{w}/corrupt/flipped", "--out", "{w}/new"),
     "dense.pt"),
    # -- exports, eval, predict ---------------------------------------------------------------
    ("export: not a run", args("export", "--run", "{w}/data", "--out", "{w}/new"), "config.toml"),
    ("export over another directory", args("export", "--run", "{w}/run", "--out", "{w}/other"), "other"),
    ("export --since past the run", args("export", "--run", "{w}/run", "--since", "999", "--out", "{w}/new"),
     "--since 999"),
    ("export-apply of a full export as delta", args("export-apply", "{w}/export", "{w}/export", "--out", "{w}/new"),
     "delta"),
    ("export-apply of a missing base", args("export-apply", "{w}/nope", "{w}/export", "--out", "{w}/new"), "nope"),
    ("eval: not a run", args("eval", "--run", "{w}/data", "--data", "{w}/data/part-00001.parquet"), "config.toml"),
    ("eval: data without a column", args("eval", "--run", "{w}/run", "--data", "{w}/bad/no_I2.parquet"), "I2"),
    ("predict: missing data", args("predict", "--run", "{w}/run", "--data", "{w}/nope.parquet", "--out",
                                   "{w}/new.parquet"), "nope.parquet"),
    ("predict: --out into a missing directory", args("predict", "--run", "{w}/run", "--data",
                                                      "{w}/data/part-00001.parquet", "--out", "{w}/no_dir/p.parquet"),
     "no_dir/p.parquet: the directory"),
    ("eval: an empty directory", args("eval", "--run", "{w}/run", "--data", "{w}/bad/empty_dir"), "empty_dir"),
]
RESUME = {
    "resume from a missing path": ("{w}/no_ckpt", "no_ckpt"),
    "resume: a flipped byte": ("{w}/corrupt/flipped", "dense.pt"),
    "resume: a truncated file": ("{w}/corrupt/truncated", "state.pt"),
    "resume: no manifest": ("{w}/corrupt/no_manifest", "manifest.json"),
    "resume: a file missing": ("{w}/corrupt/missing_file", "loaders.json"),
}
CASES = [(name, args("train", "--config", "{w}/job.toml", "--resume", RESUME[name][0]), RESUME[name][1])
         if name in RESUME else (name, make, names) for name, make, names in CASES]


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,make,names", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_and_changes_nothing(world: World, capsys: pytest.CaptureFixture,
                                                        name: str, make: Callable[[World], list[str]],
                                                        names: str) -> None:
    before = tree_hash(world.root)
    capsys.readouterr()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()                     # main() configures logging on this test's stderr
    try:
        code = cli.main(make(world))
    except SystemExit as e:                   # argparse exits (our parser: one line, code 2)
        code = e.code
    finally:
        root.handlers[:], root.level = saved  # not left writing to this test's (closed) stderr
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, f"{name}: exit {code}\n{err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}:\n{err[-2000:]}"
    assert names in lines[0], f"{name}: {names!r} not in {lines[0]!r}"
    assert "Traceback" not in err
    assert tree_hash(world.root) == before, f"{name} changed files of the world"


def test_a_port_in_use_is_one_line_naming_it(world: World, capsys: pytest.CaptureFixture) -> None:
    """#28: `recsys ps --port P` with P taken was a raw ZMQError traceback."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers.clear()
    try:
        capsys.readouterr()
        code = cli.main(["ps", "--config", str(world / "job.toml"), "--shard", "0", "--port", str(port),
                         "--set", "ps.auth='none'"])
    finally:
        root.handlers[:], root.level = saved
        taken.close()
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and x.startswith("error: ")]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and f"cannot bind tcp://127.0.0.1:{port}" in lines[0], err[-2000:]
    assert "Traceback" not in err

