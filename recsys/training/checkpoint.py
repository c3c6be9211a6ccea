"""Job checkpoints: one consistent cut of the PS shards, the dense model and every rank's data position.

Layout (`run_dir/checkpoints/step-0000000100/`)::

    manifest.json          step, shard and trainer counts, mode, and size + sha256 of every file below
    config.toml            the resolved job config
    model/dense.pt         dense state_dict (what `recsys eval` / `recsys export` read)
    model/ps/shard{i}/     each shard's own save (its manifest.json has its files' checksums)
    trainer/state.pt       dense optimizer, LR schedule, step, torch RNG
    trainer/loaders.json   every rank's data reader position (ParquetLoader.state_dict)

The cut (`Checkpointer.save` at step t, called by every rank between steps):
- sync mode: rank 0 asks the shards to save "at step t"; a shard defers the request until every
  step < t is applied, and step t's pushes are held back until all trainers' barrier(t), which
  rank 0 sends only after the shards answered. So the cut is exactly the step boundary.
- async mode: every rank waits for its pushes to be acknowledged, all ranks meet at a barrier,
  the shards snapshot, and the ranks meet again before any new push: the cut holds every push of
  steps < t and none of step t. Each shard's rows are as the PS applied them, so a resumed async run
  continues from that state; it does not replay the same staleness pattern (no async run does).

With `train.checkpoint_background` the shards take a copy-on-write snapshot (the only pause; extra
memory within `ps.checkpoint_extra_memory`, `embedding_ps.cow`) and write it while training goes
on. Half-way between two checkpoints rank 0 still sends `prepare_save`, which the shards now answer
without doing anything (nothing to prepare); a thread of rank 0 waits for the writes, writes the manifest and
renames the temporary directory into place, so a directory named `step-*` is always complete.
`resolve_resume` verifies checksums and, for `latest`, falls back to the newest good checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from data.loader import ParquetLoader
from embedding_ps.snapshot import saved_file_checksums
from embedding_ps.store import EmbeddingStore
from recsys.config import JobConfig, to_toml
from recsys.manifest import check_files, file_entry, write_json_atomic
from recsys.manifest import read_manifest as _read_manifest

logger = logging.getLogger(__name__)

FORMAT = "recsys-checkpoint"
VERSION = 1
PREFIX = "step-"
SAVE_TIMEOUT_S = 3600.0


class CorruptCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or altered; the message names the file."""


@dataclass(frozen=True, slots=True)
class TrainParts:
    """What a checkpoint saves of one rank's trainer, besides the step and the data position."""

    model: nn.Module                                        # the dense model (not the DDP wrapper)
    optimizer: torch.optim.Optimizer                        # the dense optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    store: EmbeddingStore                                   # the shards save their own rows


@dataclass(frozen=True, slots=True)
class Restored:
    """What `restore_trainer` read: the step to continue from and the checkpoint's manifest."""

    step: int
    manifest: dict[str, Any]
    validation: dict[str, Any]                              # recsys.training.validation state ({} if none)


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{PREFIX}{step:010d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories (renamed into place), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


# ---------------------------------------------------------------------------------------------
# manifest


def _known_checksums(root: Path) -> dict[str, dict[str, Any]]:
    """Checksums the shards already computed while writing (their manifest.json `files`), by path
    relative to `root`; hashing them again would re-read every row."""
    return {f"model/ps/{rel}": entry for rel, entry in saved_file_checksums(root / "model" / "ps").items()}


def write_manifest(root: Path, info: dict[str, Any]) -> dict[str, Any]:
    """manifest.json of checkpoint directory `root`: `info` plus size and sha256 of every file."""
    known = _known_checksums(root)
    files = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or (path.parent == root and path.name.startswith("manifest.json")):
            continue
        rel = str(path.relative_to(root))
        size = path.stat().st_size
        entry = known.get(rel)
        files[rel] = entry if entry is not None and entry["size"] == size else file_entry(path)
    manifest = {"format": FORMAT, "version": VERSION, **info, "files": files}
    write_json_atomic(root / "manifest.json", manifest)
    return manifest


def read_manifest(root: Path) -> dict[str, Any]:
    return _read_manifest(root, CorruptCheckpointError, kind="a complete checkpoint", format=FORMAT,
                          version=("version", VERSION))


def verify_checkpoint(root: str | Path) -> dict[str, Any]:
    """Check every file of checkpoint `root` against its manifest; returns the manifest.

    Raises CorruptCheckpointError naming the first missing, truncated or altered file.
    """
    root = Path(root)
    manifest = read_manifest(root)
    check_files(root, manifest["files"], CorruptCheckpointError)
    return manifest


def resolve_resume(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint to resume from: `latest` (newest that verifies, None if the run has none) or a path.

    A corrupt checkpoint is skipped for `latest` with a warning naming the bad file; an explicit
    path must verify.
    """
    if resume != "latest":
        path = Path(resume)
        verify_checkpoint(path)
        return path
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
        except CorruptCheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", path.name, e)
            continue
        return path
    return None


def prune(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and temporary leftovers of older saves."""
    done = list_checkpoints(run_dir)
    for path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed old checkpoint %s", path.name)
    if done:     # a killed attempt's unfinished saves of steps before the newest complete one
        for tmp in checkpoints_dir(run_dir).glob(f".tmp-{PREFIX}*"):
            if tmp.name[len(".tmp-"):] < done[-1].name:
                shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# saving (every rank calls Checkpointer.save at the same step)


def gather_json(obj: Any, world_size: int) -> list[Any]:
    """`obj` of every rank, in rank order, sent as UTF-8 bytes over the process group (no pickle)."""
    data = json.dumps(obj).encode()
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, size)
    n = int(max(s.item() for s in sizes))
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(n, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[: int(s.item())].tolist())) for b, s in zip(bufs, sizes)]


class Checkpointer:
    """Saves checkpoints of a training job every `train.checkpoint_every` steps and/or seconds.

    Every rank calls `due(step)` and `save(parts, step, position)` between steps; rank 0 writes.
    """

    def __init__(self, cfg: JobConfig, *, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.run_dir = Path(cfg.train.run_dir)
        self.enabled = cfg.train.checkpoint_every > 0 or cfg.train.checkpoint_every_s > 0
        self._last_time = time.monotonic()
        self._finisher: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pauses: list[float] = []          # seconds training stood still per checkpoint (rank 0)
        self.last_step = -1
        self._prepared = False

    def maybe_prepare(self, step: int, store: EmbeddingStore) -> None:
        """Rank 0, half-way to the next checkpoint: the shards fault in the snapshot's memory now."""
        t = self.cfg.train
        if self.rank != 0 or not self.enabled or not t.checkpoint_background or self._prepared:
            return
        half_steps = t.checkpoint_every and step % t.checkpoint_every == t.checkpoint_every // 2
        half_time = t.checkpoint_every_s and time.monotonic() - self._last_time >= t.checkpoint_every_s / 2
        if half_steps or half_time:
            store.prepare_save()               # not waited for: the reply only says whether it started
            self._prepared = True

    def due(self, step: int) -> bool:
        """Whether to checkpoint after `step` steps (the same answer on every rank)."""
        t = self.cfg.train
        if not self.enabled or step == self.last_step:
            return False
        if t.checkpoint_every and step % t.checkpoint_every == 0:
            return True
        if t.checkpoint_every_s and step % t.log_every == 0:
            late = time.monotonic() - self._last_time >= t.checkpoint_every_s
            if self.world_size > 1 and dist.is_initialized():     # rank 0's clock decides for all
                flag = torch.tensor([int(late)], dtype=torch.int64)
                dist.broadcast(flag, src=0)
                late = bool(flag.item())
            return late
        return False

    def save(self, parts: TrainParts, step: int, loader_state: dict[str, Any], *,
             validation: dict[str, Any] | None = None, target: Path | None = None) -> None:
        """A checkpoint of a trainer's `parts` (and its store's rows) after `step` steps; collective.

        `loader_state`: this rank's data position after the last trained batch (in async mode the
        loader has already handed out the next one). `validation`: the early-stopping record.
        `target`: write there (replacing what is there, e.g. run_dir/best) instead of
        run_dir/checkpoints/step-N; such a save does not count as the periodic checkpoint.
        """
        t0 = time.perf_counter()
        self._raise_finisher_error()
        loader_states = gather_json(loader_state, self.world_size)
        self._barrier()                   # async: every rank's pushes acknowledged before the snapshot
        if self.rank == 0:
            self.join()                   # one checkpoint in flight at a time
            root = checkpoint_path(self.run_dir, step) if target is None else Path(target)
            tmp = root.with_name(f".tmp-{root.name}")
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "trainer").mkdir(parents=True)
            (tmp / "model").mkdir()
            (tmp / "config.toml").write_text(to_toml(self.cfg))
            (tmp / "trainer" / "loaders.json").write_text(json.dumps(loader_states, indent=1))
            torch.save(parts.model.state_dict(), tmp / "model" / "dense.pt")
            torch.save(trainer_state(parts, step, validation), tmp / "trainer" / "state.pt")
            background = self.cfg.train.checkpoint_background
            ps_dir = str((tmp / "model" / "ps").resolve())
            parts.store.save(ps_dir, step=step, background=background)
            info = {"step": step, "num_shards": self.cfg.ps.num_shards, "num_trainers": self.world_size,
                    "mode": self.cfg.ps.mode, "time": time.time()}
            self._finisher = threading.Thread(target=self._finish, name="checkpoint-finish", daemon=True,
                                              args=(parts.store, ps_dir, tmp, root, info, background,
                                                    target is None))
            self._finisher.start()
        self._barrier()                   # no rank pushes step t before the shards snapshot
        if target is not None:
            return
        self._last_time = time.monotonic()
        self.last_step = step
        self._prepared = False
        if self.rank == 0:
            pause = time.perf_counter() - t0
            self.pauses.append(pause)
            logger.info("checkpoint at step %d: training paused %.3f s (%s write)", step, pause,
                        "background" if self.cfg.train.checkpoint_background else "blocking")

    def _finish(self, store: EmbeddingStore, ps_dir: str, tmp: Path, root: Path, info: dict, background: bool,
                periodic: bool) -> None:
        try:
            t0 = time.perf_counter()
            if background:
                store.wait_saved(ps_dir, timeout_s=SAVE_TIMEOUT_S)
            write_manifest(tmp, info)
            if root.exists():
                shutil.rmtree(root)
            os.replace(tmp, root)
            if periodic:
                prune(self.run_dir, self.cfg.train.keep_checkpoints)
            logger.info("checkpoint %s complete (%.2f s after the pause)", root, time.perf_counter() - t0)
        except BaseException as e:     # raised in the training thread at the next save or join
            logger.error("checkpoint %s failed: %s", root.name, e)
            shutil.rmtree(tmp, ignore_errors=True)
            self._error = e

    def join(self) -> None:
        """Wait for the checkpoint being finished (rank 0); raise its error if it failed."""
        if self._finisher is not None:
            self._finisher.join(timeout=SAVE_TIMEOUT_S)
            self._finisher = None
        self._raise_finisher_error()

    def _raise_finisher_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"a background checkpoint failed: {err}") from err

    def _barrier(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()


# ---------------------------------------------------------------------------------------------
# trainer state


def trainer_state(parts: TrainParts, step: int, validation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The dense optimizer, LR schedule, step, RNG and early-stopping record of a trainer (tensors
    and numbers only)."""
    return {"step": step, "optimizer": parts.optimizer.state_dict(),
            "scheduler": parts.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
            "validation": dict(validation or {})}


def restore_trainer(parts: TrainParts, loader: ParquetLoader, root: str | Path, *, world_size: int) -> Restored:
    """Put checkpoint `root`'s dense model, optimizer, schedule and RNG into `parts` and every rank's
    data position into `loader` (any trainer count, `world_size` now: the data remainder is
    re-partitioned); returns the step to continue from and the manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    parts.model.load_state_dict(torch.load(root / "model" / "dense.pt", weights_only=True))
    state = torch.load(root / "trainer" / "state.pt", weights_only=True)
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    step = int(state["step"])
    loaders = json.loads((root / "trainer" / "loaders.json").read_text())
    loader.resume_from(loaders)
    logger.info("resumed from %s at step %d (%d trainers then, %d now)", root, step,
                manifest["num_trainers"], world_size)
    return Restored(step=step, manifest=manifest, validation=dict(state.get("validation", {})))
