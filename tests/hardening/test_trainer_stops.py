"""In one process (Trainer + LocalStore): a stop request ends training after the current step with a
checkpoint that resumes exactly; a non-finite loss stops training naming the step, file and rows,
before any gradient of that batch reaches the shards."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embedding_ps.local import LocalStore
from recsys.config import JobConfig, load_config
from recsys.training import stopping
from recsys.training.checkpoint import list_checkpoints
from recsys.training.trainer import NonFiniteLossError, Trainer

ROOT = Path(__file__).resolve().parents[2]
B = 64


@pytest.fixture(scope="module")
def data_dir(tiny_dataset) -> Path:
    return tiny_dataset(rows=30 * B, files=2, seed=7, row_group_rows=300)


@pytest.fixture(autouse=True)
def no_stop_request():
    stopping.reset()
    yield
    stopping.reset()


def job(run: Path, data: Path, *extra: str) -> JobConfig:
    return load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", f"data.batch_size={B}",
        "data.shuffle_buffer_rows=256", "ps.num_shards=2", "train.num_threads=1", "train.log_every=1",
        f"train.run_dir='{run}'", "train.max_steps=24", *extra])


class StopAt:
    """A metric sink that asks for a stop when step `step` is logged (as a signal handler would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def log(self, metrics, step: int) -> None:
        if step == self.step:
            stopping.request()

    def close(self) -> None:
        pass


def test_stop_request_checkpoints_the_current_step_and_resumes_exactly(tmp_path: Path, data_dir: Path) -> None:
    full = Trainer(job(tmp_path / "full", data_dir), full_store := LocalStore.create(job(tmp_path, data_dir).ps))
    full.train()
    assert not full.stopped and full.step == 24

    cfg = job(tmp_path / "run", data_dir)          # checkpoints off: the stop writes one anyway
    assert not (cfg.train.checkpoint_every or cfg.train.checkpoint_every_s)
    store = LocalStore.create(cfg.ps)
    stopped = Trainer(cfg, store, metric_logger=StopAt(9))
    stopped.train()
    assert stopped.stopped and stopped.step == 9       # the step that was running finished, no more
    assert [p.name for p in list_checkpoints(cfg.train.run_dir)] == ["step-0000000009"]

    stopping.reset()
    ckpt = list_checkpoints(cfg.train.run_dir)[-1]
    resumed = Trainer(cfg, LocalStore.from_dir(cfg.ps, ckpt / "model" / "ps"))
    resumed.restore(str(ckpt))
    resumed.train()
    assert resumed.step == 24 and not resumed.stopped
    for name, value in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, atol=1e-6, rtol=0, msg=name)
    ids = torch.arange(0, 2000)
    for t in range(len(cfg.ps.tables)):
        torch.testing.assert_close(resumed.store.pull(t, ids), full_store.pull(t, ids), atol=1e-6, rtol=0)


SECOND_SIGNAL = """
import os, signal, sys, time
from recsys.training import stopping
stopping.install(signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.1)
assert stopping.requested()
os.kill(os.getpid(), signal.SIGTERM)      # the same request delivered twice (terminal + torchrun's agent)
time.sleep(stopping.DUPLICATE_WINDOW_S + 0.1)
print("alive after the first", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("alive after the second", flush=True)
"""


def test_first_signal_asks_second_stops_at_once() -> None:
    r = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, r.stderr[-2000:]        # killed by the second signal itself
    assert r.stdout.splitlines() == ["alive after the first"]


def test_non_finite_loss_names_step_file_and_rows_and_pushes_nothing(tmp_path: Path, data_dir: Path) -> None:
    cfg = job(tmp_path / "run", data_dir, "train.dense_lr=1e30")      # diverges at once
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    pushed: list[int] = []
    real_push = store.push_many_async

    def counting_push(*args, **kwargs):
        pushed.append(trainer.step + 1)
        return real_push(*args, **kwargs)

    store.push_many_async = counting_push
    with pytest.raises(NonFiniteLossError) as err:
        trainer.train()
    msg = str(err.value)
    m = re.match(r"step (\d+): the training loss is (nan|inf|-inf) on the batch of (.+?) rows (\d+)\.\.(\d+)", msg)
    assert m, msg
    step = int(m.group(1))
    assert m.group(3).startswith(str(data_dir)) and m.group(3).endswith(".parquet")
    assert step == trainer.step + 1                  # the failing step did not count
    assert step not in pushed and set(pushed) == set(range(1, step))   # its row gradients never left
    assert "\n" not in msg and "train.dense_lr" in msg
