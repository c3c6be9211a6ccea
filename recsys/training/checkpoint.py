"""Job checkpoints: one consistent cut of the PS shards, the dense model and every rank's data position.

Layout (`run_dir/checkpoints/step-0000000100/`)::

    manifest.json          step, shard and trainer counts, mode, and size + sha256 of every file below
    config.toml            the resolved job config
    model/dense.pt         dense state_dict (what `recsys eval` / `recsys export` read)
    model/ps/shard{i}/     each shard's own save (its manifest.json has its files' checksums)
    trainer/state.pt       dense (+ replicated tables') optimizer, LR schedule, step, torch RNG, validation record
    trainer/loaders.json   every rank's data reader position (ParquetLoader.state_dict)

The cut (`Checkpointer.save` at step t, called by every rank between steps): docs/operations.md
"Consistency"; in sync mode step t waits for all trainers' barrier(t), which rank 0 sends only after
the shards answered.

With `train.checkpoint_background` (docs/operations.md "Pause") a thread of rank 0 waits for the
shards' writes, writes the manifest and renames the temporary directory into place: a `step-*`
directory is complete. On a URI run directory (docs/storage.md "Checkpoints") rank 0 stages its files
in the local scratch directory (`recsys.rundir.local_run_dir`), uploads them, then the manifest.
"""

from __future__ import annotations

import errno
import hashlib
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
from embedding_ps.shard.snapshot import LAYOUT_FIELDS, saved_file_checksums, saved_files
from embedding_ps.store import EmbeddingStore
from recsys import storage
from recsys.config import ConfigError, JobConfig, load_config, to_toml
from recsys.dist import all_gather_parts, barrier, collective_device
from recsys.manifest import check_files, file_entry
from recsys.manifest import read_manifest as _read_manifest
from recsys.manifest import write_manifest as write_files_manifest
from recsys.models.replicated import (REPLICATED_FILE, ReplicatedTables, TableOptimizer, load_bytes,
                                      save_bytes)
from recsys.rundir import local_run_dir, run_path

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
    replicated: ReplicatedTables | None = None              # tables trained on the trainers (model/replicated.pt)
    table_optimizer: TableOptimizer | None = None           # their optimizers (trainer/state.pt)


def checkpoint_path(run_dir: str | Path, step: int) -> Path | str:
    """RUN_DIR/checkpoints/step-N: a Path, or a URI string when the run directory is one."""
    return run_path(run_dir, "checkpoints", f"{PREFIX}{step:010d}")


def list_checkpoints(run_dir: str | Path) -> list[Path] | list[str]:
    """Complete checkpoint directories (renamed into place; on a URI: with their manifest), oldest first."""
    root = run_path(run_dir, "checkpoints")
    names = [n for n in storage.list_dir(root) if n.startswith(PREFIX)]
    if storage.is_uri(root):
        return [run_path(root, n) for n in names if storage.is_file(run_path(root, n, "manifest.json"))]
    return [root / n for n in names if (root / n).is_dir()]


# ---------------------------------------------------------------------------------------------
# manifest


def write_manifest(root: Path, info: dict[str, Any]) -> dict[str, Any]:
    """manifest.json of checkpoint directory `root`: `info` plus size and sha256 of every file (the
    shards' files with the checksums they computed while writing: hashing them again would re-read every row)."""
    known = {f"model/ps/{rel}": entry for rel, entry in saved_file_checksums(root / "model" / "ps").items()}
    return write_files_manifest(root, {"format": FORMAT, "version": VERSION, **info}, known)


def publish_checkpoint(local: Path, root: str, info: dict[str, Any]) -> dict[str, Any]:
    """Upload rank 0's staged files under `local` to URI `root`, whose model/ps the shards already
    wrote, then its manifest.json (last: the checkpoint is complete from then on)."""
    # the shards' files, as their manifests list them
    files = {f"model/ps/{rel}": entry
             for rel, entry in saved_files(str(run_path(root, "model", "ps")), int(info["num_shards"])).items()}
    for path in sorted(local.rglob("*")):
        if path.is_file():
            rel = path.relative_to(local).as_posix()
            files[rel] = file_entry(path)
            storage.write_bytes(run_path(root, rel), path.read_bytes())
    manifest = {"format": FORMAT, "version": VERSION, **info, "files": dict(sorted(files.items()))}
    storage.write_text(run_path(root, "manifest.json"), json.dumps(manifest, indent=1))
    return manifest


def read_manifest(root: Path | str) -> dict[str, Any]:
    return _read_manifest(root, CorruptCheckpointError, kind="a complete checkpoint", format=FORMAT,
                          version=("version", VERSION))


def verify_checkpoint(root: str | Path, checksums: bool = True) -> dict[str, Any]:
    """Check every file of checkpoint `root` against its manifest; returns the manifest.

    Raises CorruptCheckpointError naming the first missing, truncated or altered file. On a URI, or without
    `checksums`, only presence and sizes are checked here (sha256: when read, by the shards, `read_checked`).
    """
    manifest = read_manifest(root)
    if not storage.is_uri(root):
        check_files(Path(root), manifest["files"], CorruptCheckpointError, verify=checksums)
        return manifest
    stored = storage.list_files(root)
    for rel, want in manifest["files"].items():
        if rel not in stored:
            raise CorruptCheckpointError(f"{run_path(root, rel)}: missing (listed in its manifest.json)")
        if stored[rel] != want["size"]:
            raise CorruptCheckpointError(f"{run_path(root, rel)}: {stored[rel]} bytes, the manifest says "
                                         f"{want['size']} (truncated or changed)")
    return manifest


def resolve_resume(run_dir: str | Path, resume: str) -> Path | str | None:
    """The checkpoint to resume from: `latest` (newest that verifies, None if the run has none) or a path.

    A corrupt checkpoint is skipped for `latest` with a warning naming the bad file; an explicit
    path must verify.
    """
    if resume != "latest":
        path = resume if storage.is_uri(resume) else Path(resume)
        try:
            verify_checkpoint(path)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"--resume {resume}: {e} (resume from another checkpoint, e.g. "
                                         f"--resume latest)") from None
        return path
    failed = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CorruptCheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", storage.basename(path), e)
            failed.append(f"{storage.basename(path)}: {e}")
    if failed:      # starting from step 0 would overwrite them and the model: the user decides
        raise CorruptCheckpointError(
            f"--resume latest: none of the {len(failed)} checkpoints of {run_path(run_dir, 'checkpoints')} verifies "
            f"({'; '.join(failed)}); resume from a given one with --resume PATH, or start a new run_dir")
    return None


def prune(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and the unfinished saves of steps before
    the newest (a killed attempt's `.tmp-step-*`; on a URI, `step-*` without a manifest)."""
    done = list_checkpoints(run_dir)
    root = run_path(run_dir, "checkpoints")
    newest = storage.basename(done[-1]) if done else ""
    kept = {storage.basename(path) for path in done[-keep:]}
    for name in storage.list_dir(root):
        step_name = name.removeprefix(".tmp-")
        if step_name.startswith(PREFIX) and step_name < newest and name not in kept:
            storage.delete_tree(run_path(root, name))
            if name == step_name:
                logger.info("removed old checkpoint %s", name)


# ---------------------------------------------------------------------------------------------
# saving (every rank calls Checkpointer.save at the same step)


def write_model_state(model_dir: str | Path, model: torch.nn.Module, replicated: ReplicatedTables | None) -> None:
    """A model directory's (a path or URI) dense.pt and, with replicated tables, their file; each written
    atomically. The shards write their own part (model/ps)."""
    storage.write_bytes(run_path(model_dir, "dense.pt"), save_bytes(model.state_dict()))
    if replicated is not None:
        storage.write_bytes(run_path(model_dir, REPLICATED_FILE), save_bytes(replicated.state()))


def gather_json(obj: Any, world_size: int) -> list[Any]:
    """`obj` of every rank, in rank order, sent as UTF-8 bytes over the process group (no pickle)."""
    if world_size == 1 or not dist.is_initialized():
        return [obj]
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    return [json.loads(bytes(part.numpy())) for part in all_gather_parts(data)]


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a file size limit, a read-only or unwritable
    run directory): nothing of it is kept, and the message says what to change."""


_WRITE_HINTS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.EFBIG: "a file size limit (ulimit -f) was hit", errno.EROFS: "the file system is read-only",
                errno.EACCES: "permission denied", errno.EPERM: "permission denied"}


def write_failure(path: str, e: BaseException) -> str:
    """One line for a failed write under `path`: what happened (a full disk, a size limit, read-only,
    permissions) and what to change; the exception's own text when it is none of those."""
    cause = e
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in _WRITE_HINTS):
        cause = cause.__cause__ or cause.__context__
    text = str(e) if cause is None else _WRITE_HINTS[cause.errno]
    if cause is None and "file write failed" in text:       # torch.save's own words for a write error
        text = "a write failed (a full disk or a file size limit?)"
    return (f"checkpoint {path}: cannot write it: {text} (free space, lower train.keep_checkpoints, or set "
            f"train.run_dir to a writable place with room); nothing of it was kept")


class Checkpointer:
    """Saves checkpoints of a training job every `train.checkpoint_every` steps and/or seconds.

    Every rank calls `due(step)` and `save(parts, step, position)` between steps; rank 0 writes.
    """

    def __init__(self, cfg: JobConfig, *, rank: int, world_size: int) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.local_dir = local_run_dir(cfg.train.run_dir, cfg.train.scratch_dir)   # staging for a URI run_dir
        self.enabled = cfg.train.checkpoint_every > 0 or cfg.train.checkpoint_every_s > 0
        self._last_time = time.monotonic()
        self._finisher: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pauses: list[float] = []          # seconds training stood still per checkpoint (rank 0)
        self.last_step = -1

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
                flag = torch.tensor([int(late)], dtype=torch.int64, device=collective_device())
                dist.broadcast(flag, src=0)         # on the backend's device (NCCL: the GPU)
                late = bool(flag.item())
            return late
        return False

    def save(self, parts: TrainParts, step: int, loader_state: dict[str, Any], *,
             validation: dict[str, Any], target: Path | str | None = None) -> None:
        """A checkpoint of a trainer's `parts` (and its store's rows) after `step` steps; collective.

        `loader_state`: this rank's data position after the last trained batch (in async mode the
        loader has already handed out the next one). `validation`: the early-stopping record.
        `target`: write there (replacing what is there, e.g. run_dir/best) instead of
        run_dir/checkpoints/step-N; such a save does not count as the periodic checkpoint.
        """
        t0 = time.perf_counter()
        self.join()                       # rank 0: one checkpoint in flight at a time
        loader_states = gather_json(loader_state, self.world_size)
        barrier()                         # async: every rank's pushes acknowledged before the snapshot
        if self.rank == 0:
            root = checkpoint_path(self.cfg.train.run_dir, step) if target is None else target
            remote = storage.is_uri(root)
            if remote:         # written in place, complete once its manifest is (docs/storage.md, "Checkpoints")
                tmp = self.local_dir / "staging" / storage.basename(root)
                storage.delete_tree(root)
            else:
                tmp = root.with_name(f".tmp-{root.name}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                (tmp / "trainer").mkdir(parents=True)
                (tmp / "model").mkdir()
                (tmp / "config.toml").write_text(to_toml(self.cfg))
                (tmp / "trainer" / "loaders.json").write_text(json.dumps(loader_states, indent=1))
                write_model_state(tmp / "model", parts.model, parts.replicated)
                state = {"step": step, "optimizer": parts.optimizer.state_dict(),
                         "scheduler": parts.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                         "validation": dict(validation)}
                if parts.table_optimizer is not None:
                    state["table_optimizer"] = parts.table_optimizer.state_dict()
                torch.save(state, tmp / "trainer" / "state.pt")
            except (OSError, RuntimeError) as e:     # torch.save wraps the OSError of a full disk in a RuntimeError
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointWriteError(write_failure(str(root), e)) from e
            ps_dir = run_path(root, "model", "ps") if remote else str((tmp / "model" / "ps").resolve())
            parts.store.save(ps_dir, step=step, background=self.cfg.train.checkpoint_background)
            info = {"step": step, "num_shards": self.cfg.ps.num_shards, "num_trainers": self.world_size,
                    "mode": self.cfg.ps.mode, "time": time.time(), "run_id": self.cfg.train.run_id}
            self._finisher = threading.Thread(target=self._finish, name="checkpoint-finish", daemon=True,
                                              args=(parts.store, ps_dir, tmp, root, info, target is None))
            self._finisher.start()
        barrier()                         # no rank pushes step t before the shards snapshot
        if target is not None:
            return
        self._last_time = time.monotonic()
        self.last_step = step
        if self.rank == 0:
            pause = time.perf_counter() - t0
            self.pauses.append(pause)
            logger.info("checkpoint at step %d: training paused %.3f s (%s write)", step, pause,
                        "background" if self.cfg.train.checkpoint_background else "blocking")

    def _finish(self, store: EmbeddingStore, ps_dir: str, tmp: Path, root: Path | str, info: dict,
                periodic: bool) -> None:
        try:
            t0 = time.perf_counter()
            if self.cfg.train.checkpoint_background:
                store.wait_saved(ps_dir, timeout_s=SAVE_TIMEOUT_S)
            if storage.is_uri(root):
                publish_checkpoint(tmp, str(root), info)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                write_manifest(tmp, info)
                if root.exists():
                    shutil.rmtree(root)
                os.replace(tmp, root)
            if periodic:
                prune(self.cfg.train.run_dir, self.cfg.train.keep_checkpoints)
            logger.info("checkpoint %s complete (%.2f s after the pause)", root, time.perf_counter() - t0)
        except BaseException as e:     # raised in the training thread at the next save or join
            logger.error("checkpoint %s failed: %s", storage.basename(root), e)
            shutil.rmtree(tmp, ignore_errors=True)
            self._error = e

    def join(self) -> None:
        """Wait for the checkpoint being finished (rank 0); raise its error if it failed."""
        if self._finisher is not None:
            self._finisher.join(timeout=SAVE_TIMEOUT_S)
            self._finisher = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"a background checkpoint failed: {err}") from err


# ---------------------------------------------------------------------------------------------
# trainer state


def read_checked(root: Path | str, rel: str, manifest: dict[str, Any]) -> bytes:
    """File `rel` of checkpoint `root` (a path or a URI), checked against its manifest entry (if any)."""
    path = run_path(root, *rel.split("/"))
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing (listed in its manifest.json)") from None
    want = manifest.get("files", {}).get(rel)
    if want is not None and (len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]):
        raise CorruptCheckpointError(f"{path}: {len(data)} bytes, sha256 differs from the manifest's (altered)")
    return data


def restore_trainer(parts: TrainParts, loader: ParquetLoader, root: str | Path, *,
                    world_size: int) -> tuple[int, dict[str, Any]]:
    """Put checkpoint `root`'s dense model, optimizer, schedule and RNG into `parts` and every rank's
    data position into `loader` (any trainer count, `world_size` now: the data remainder is
    re-partitioned); returns the step to continue from and the early-stopping record
    (recsys.training.validation's state, {} if none)."""
    manifest = read_manifest(root)
    parts.model.load_state_dict(load_bytes(read_checked(root, "model/dense.pt", manifest)))
    if parts.replicated is not None:
        rel = f"model/{REPLICATED_FILE}"
        if rel not in manifest["files"]:
            raise CorruptCheckpointError(f"{run_path(root, rel)}: missing: the checkpoint has no replicated tables "
                                         f"(a table's placement cannot change on resume)")
        parts.replicated.load_state(load_bytes(read_checked(root, rel, manifest)), where=str(run_path(root, rel)))
    state = load_bytes(read_checked(root, "trainer/state.pt", manifest))
    parts.optimizer.load_state_dict(state["optimizer"])
    if parts.table_optimizer is not None:
        parts.table_optimizer.load_state_dict(state.get("table_optimizer", {}))
    parts.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    step = int(state["step"])
    loader.resume_from(json.loads(read_checked(root, "trainer/loaders.json", manifest)))
    logger.info("resumed from %s at step %d (%d trainers then, %d now)", root, step,
                manifest["num_trainers"], world_size)
    return step, dict(state.get("validation", {}))


# ---------------------------------------------------------------------------------------------
# a saved run's config and table layout (resume here; warm start: recsys/training/warm_start.py)


def load_saved_config(root: Path | str) -> JobConfig:
    """The resolved config.toml a run, checkpoint or export directory holds (local or a URI)."""
    return load_config(run_path(root, "config.toml"))


def check_layout(tables, saved_tables, keys: tuple[str, ...], saved_as: str, advice: str) -> None:
    """ConfigError naming the first table among `tables` whose `key` differs from the table of the same
    name in `saved_tables` (tables not saved are skipped): "ps.tables[T].KEY = new, but `saved_as` KEY =
    old: `advice`" (`advice` may name {key})."""
    saved = {t.name: t for t in saved_tables}
    for t in tables:
        old = saved.get(t.name)
        for key in keys if old is not None else ():
            if getattr(old, key) != getattr(t, key):
                raise ConfigError(f"ps.tables[{t.name}].{key} = {getattr(t, key)!r}, but {saved_as} {key} = "
                                  f"{getattr(old, key)!r}: {advice.format(key=key)}")


def check_resume_tables(cfg: JobConfig, checkpoint: Path | str) -> None:
    """Before any process starts: ConfigError naming a table whose saved layout (the fields a shard
    checks when it loads, `snapshot.LAYOUT_FIELDS`) differs in `cfg` from the checkpoint's config,
    e.g. a changed dim (a shard would refuse to load it, after the job had started)."""
    check_layout(cfg.ps.tables, load_saved_config(checkpoint).ps.tables, LAYOUT_FIELDS,
                 f"the checkpoint {checkpoint} saved it with", "--resume continues the same tables (set {key} back, "
                 "or start a new run from it with --init-from and a renamed table)")
