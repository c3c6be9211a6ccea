"""Tiny trained runs for the export tests, made in-process (LocalStore + Trainer, no processes).

`export_data`: the `tiny` synthetic preset, part-00000 (train) and part-00001 (eval), 15000 rows each.
`tiny_config(data, run_dir, tables={...}, **train)`: configs/tiny.toml on that data, 2 PS shards.
`train_run(root, cfg, steps, checkpoints)`: trains and saves after each of `steps`: the last save
is a run directory as `recsys train` writes it (config.toml, model/dense.pt, model/ps/shard{i}/,
metrics.json), the earlier ones checkpoints (`run_dir/checkpoints/step-*`, written by the trainer's
Checkpointer).
`two_tower_trainer(tmp, rows)`: a two-tower job on the `retrieval` preset, its live store and trainer,
a `train(steps)` and a `save(root)` (a run directory, as above), for tests that need the live model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from data.loader import ParquetLoader
from data.synthetic import generate
from embedding_ps.local import LocalStore
from recsys.config import JobConfig, load_config, to_toml
from recsys.training.checkpoint import checkpoint_path
from recsys.training.trainer import StepTimes, Trainer
from recsys.training.worker import save_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def export_data(tiny_dataset) -> Path:
    return tiny_dataset(rows=30000, files=2, seed=5)


def _tiny_config(data: Path, run_dir: Path, tables: dict[str, dict] | None = None, **train: object) -> JobConfig:
    """configs/tiny.toml on `data`, 2 shards; `tables` updates fields of named tables."""
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"train.run_dir='{run_dir}'", "ps.num_shards=2"])
    new = tuple(dataclasses.replace(t, **(tables or {}).get(t.name, {})) for t in cfg.ps.tables)
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=new),
                               train=dataclasses.replace(cfg.train, **train))


def _save(root: Path, cfg: JobConfig, trainer: Trainer, store: LocalStore, checkpoint: bool) -> Path:
    if checkpoint:               # a real checkpoint of the job (recsys.training.checkpoint)
        trainer.checkpoint(trainer.loader.state_dict())
        trainer.checkpointer.join()
        return checkpoint_path(cfg.train.run_dir, trainer.step)
    root.mkdir(parents=True, exist_ok=True)
    save_model(trainer, store, root / "model")
    (root / "config.toml").write_text(to_toml(dataclasses.replace(cfg, data=trainer.cfg.data)))   # as the launcher's
    (root / "metrics.json").write_text(json.dumps({"steps": float(trainer.step)}))
    return root


@pytest.fixture(scope="session")
def train_run() -> Callable[..., list[Path]]:
    def make(root: Path, cfg: JobConfig, steps: tuple[int, ...] = (0,), checkpoints: bool = False) -> list[Path]:
        """Train `cfg` and save after each of `steps` (0: the whole epoch); the last save is a run dir.

        Steps after the first go on with the data from where the last part stopped."""
        torch.manual_seed(0)
        store = LocalStore.create(cfg.ps)
        trainer = Trainer(cfg, store)
        out = []
        try:
            for i, n in enumerate(steps):
                trainer.cfg = dataclasses.replace(trainer.cfg, train=dataclasses.replace(cfg.train, max_steps=n))
                if i:     # go on with the data where the last part stopped, as a resumed run would
                    trainer.loader.load_state_dict(trainer.loader.state_dict())
                trainer.train()
                last = i == len(steps) - 1
                out.append(_save(root / ("run" if last else f"ckpt-{trainer.step}"), cfg, trainer, store,
                                 checkpoint=checkpoints and not last))
        finally:
            trainer.close()
        return out

    return make



def _train_steps(cfg: JobConfig, trainer: Trainer, store: LocalStore, steps: range) -> None:
    """The training batches of `steps` (step numbers), the data read from its start."""
    with ParquetLoader(cfg.data, cfg.data.train_paths) as loader:
        for step, batch in zip(steps, loader):
            trainer.train_step(batch, trainer.sparse.lookup(batch, store, step), StepTimes())
            trainer.step += 1


@pytest.fixture(scope="session")
def two_tower_trainer() -> Callable[..., tuple]:
    def make(tmp: Path, rows: int) -> tuple[JobConfig, LocalStore, Trainer, Callable, Callable]:
        """configs/two_tower.toml on `rows` rows of the `retrieval` preset (tmp/data, 2 files; run dir
        tmp/run, batch 128) in this process: (cfg, store, trainer, train(steps), save(root))."""
        generate(preset="retrieval", rows=rows, num_files=2, out_dir=str(tmp / "data"), seed=1)
        cfg = load_config(ROOT / "configs" / "two_tower.toml", [
            f"data.train_paths=['{tmp}/data/part-00000.parquet']", "data.eval_paths=[]",
            f"data.item_paths=['{tmp}/data/items']", f"train.run_dir='{tmp / 'run'}'", "data.batch_size=128"])
        store = LocalStore.create(cfg.ps)
        trainer = Trainer(cfg, store)
        return (cfg, store, trainer, functools.partial(_train_steps, cfg, trainer, store),
                lambda root: _save(root, cfg, trainer, store, checkpoint=False))

    return make


@pytest.fixture(scope="session")
def tiny_config() -> Callable[..., JobConfig]:
    """`tiny_config(data, run_dir, tables={"C4": {"max_rows": 300}}, log_every=5)` -> JobConfig."""
    return _tiny_config
