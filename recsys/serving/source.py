"""What an export reads: a finished run or a checkpoint, and its saved PS shards, one table at a time.

    source = resolve_source(run="runs/tiny")           # or checkpoint="runs/tiny/ckpt/step-500"
    shards = SavedShards(source)                       # every shard's manifest, checked once
    part = shards.read_table(t, since=None)            # TableRows: ids sorted, rows float32, tombstones

Both inputs hold `config.toml`, `model/dense.pt` and `model/ps/shard{i}/` (one saved `ShardState`
per shard: manifest.json + table{t}/*.npy); a run's step is `metrics.json["steps"]`, a
checkpoint's `manifest.json["step"]`. Both count completed training steps.

Every saved file is read through `embedding_ps.shard.snapshot.SavedShard`, so its size and SHA-256 are
checked against the shard's manifest before use. A table is read shard by shard: `weights` and
`meta` memory-mapped (hashed once through the mapping: one sequential read of each file; only the
live rows `weights[map_slots]` are then copied), so one process never holds more than one table's rows.

Steps of rows and evictions: a push in training step t (0-based) stamps its rows with
`last_seen = t`; a model saved after S completed steps holds pushes of steps 0..S-1, and TTL
sweeps log their evictions with the completed-step count. `since=S` therefore keeps rows with
`last_seen >= S` and evictions logged at steps >= S: everything that can differ from a model
saved at step S (a superset when S falls mid-way, never less). A table with global weight decay
(`embedding_ps.shard.decay`) changes every row every step: a delta holds all its rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embedding_ps.wire.config import TableConfig
from embedding_ps.shard.decay import is_global
from embedding_ps.shard.snapshot import SavedShard, shard_dir, unpack_meta
from recsys.config import ConfigError, JobConfig, load_config
from recsys.models.replicated import REPLICATED_FILE, read_replicated
from recsys.rundir import model_root
from recsys.serving.errors import ExportError

LAYOUT = ("name", "dim", "kind", "num_embeddings")
"""The table fields an export needs to match: between the saved shards and the config, a delta and its base."""


def _guard(read: Callable) -> Callable:
    """`read`, with a damaged or mismatched saved shard (ValueError, incl. CorruptShardError) or a
    missing file reported as ExportError."""
    def guarded(*args):
        try:
            return read(*args)
        except ExportError:
            raise
        except (ValueError, OSError) as e:
            raise ExportError(str(e)) from e
    return guarded


@dataclass(frozen=True)
class Source:
    """A trained model on disk."""

    config: JobConfig
    model_dir: Path
    """holds dense.pt and ps/shard{i}/"""
    step: int
    """completed training steps"""
    origin: str
    """'run DIR' or 'checkpoint DIR' (for messages and the manifest)"""


def resolve_source(run: str | Path | None = None, checkpoint: str | Path | None = None,
                   last: bool = False) -> Source:
    """(run dir | checkpoint dir) -> Source. Raises ConfigError naming what is missing.

    A run that kept a best model (`RUN_DIR/best`, train.validate_every with train.keep_best) gives
    that checkpoint, unless `last` asks for the run's last model (`RUN_DIR/model`)."""
    if (run is None) == (checkpoint is None):
        raise ConfigError("give exactly one of a run directory or a checkpoint")
    if run is not None and (root := model_root(run, last)) != Path(run):   # its best model: a checkpoint
        run, checkpoint = None, root
    root = Path(run if run is not None else checkpoint)
    kind = "run" if run is not None else "checkpoint"
    model_dir = root / "model"
    step_file = root / ("metrics.json" if kind == "run" else "manifest.json")
    for needed in (root / "config.toml", model_dir / "dense.pt", model_dir / "ps", step_file):
        if not needed.exists():
            raise ConfigError(f"{root}: not a finished {kind}, {needed} is missing")
    try:
        info = json.loads(step_file.read_text())
        step = int(info["steps"] if kind == "run" else info["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{step_file}: no readable step count ({type(e).__name__}: {e})") from None
    return Source(load_config(root / "config.toml"), model_dir, step, f"{kind} {root}")


@dataclass
class TableRows:
    """One table's live rows (or, with `since`, the changed ones) across all shards."""

    ids: np.ndarray
    """int64 [R] sorted, distinct: raw ids (`dynamic`) or hashed row indices (`hashed`)"""
    rows: torch.Tensor
    """float32 [R, D]"""
    tombstones: np.ndarray
    """int64 [E] sorted, distinct: evicted at steps >= since and not live now (empty without since)"""


class SavedShards:
    """The saved shards of a source; checks their manifests against the config once.

    Raises ExportError (with the cause's message) for a missing, damaged or mismatched shard."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._replicated_state: dict | None = None
        self.shards = [self._open(i) for i in range(source.config.ps.num_shards)]

    @_guard
    def _open(self, index: int) -> SavedShard:
        ps = self.source.config.ps
        directory = shard_dir(self.source.model_dir / "ps", index)
        try:
            saved = SavedShard(directory)
        except FileNotFoundError:
            raise ExportError(f"{directory}: missing (ps.num_shards = {ps.num_shards})") from None
        saved.check(ps.tables, shard_index=index, num_shards=ps.num_shards, fields=LAYOUT)
        return saved

    def read_table(self, t: int, since: int | None = None) -> TableRows:
        """Table `t` of every shard, concatenated and sorted by id (see the module docstring for `since`).

        A replicated table (trained on the trainers, `recsys.models.replicated`) comes from the model's
        replicated.pt instead: all its rows, also for a delta (they change every step)."""
        cfg = self.source.config.ps.tables[t]
        if cfg.placement == "replicated":
            return self._replicated(cfg)
        parts = [self._read_shard(s, t, cfg, since) for s in self.shards]
        ids, rows, tomb = (np.concatenate(column) for column in zip(*parts))
        del parts
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[order]
        if ids.size > 1 and (ids[1:] == ids[:-1]).any():
            dup = ids[1:][ids[1:] == ids[:-1]][0]
            raise ExportError(f"table {cfg.name!r}: id {dup} is saved by two shards")
        return TableRows(ids, torch.from_numpy(rows), np.unique(tomb))

    def _replicated(self, cfg: TableConfig) -> TableRows:
        path = self.source.model_dir / REPLICATED_FILE
        if self._replicated_state is None:
            try:
                self._replicated_state = read_replicated(self.source.model_dir)
            except Exception as e:                      # a damaged torch file
                raise ExportError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
            if self._replicated_state is None:
                raise ExportError(f"{path}: missing: table {cfg.name!r} trained replicated on the trainers")
        state = self._replicated_state
        if f"{cfg.name}.ids" not in state or f"{cfg.name}.weight" not in state:
            raise ExportError(f"{path}: has no table {cfg.name!r}")
        ids = state[f"{cfg.name}.ids"].numpy().astype(np.int64)
        rows = state[f"{cfg.name}.weight"].float()
        if rows.dim() != 2 or rows.shape != (ids.size, cfg.dim):
            raise ExportError(f"{path}: table {cfg.name!r} is {tuple(rows.shape)} with {ids.size} ids; dim {cfg.dim}")
        return TableRows(ids, rows.contiguous(), np.zeros(0, np.int64))

    @_guard
    def _read_shard(self, saved: SavedShard, t: int, cfg: TableConfig, since: int | None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys int64 [R_i], rows float32 [R_i, D], tombstones int64 [E_i]) of one shard's table."""
        keys, slots = saved.live_slots(t)
        tomb = np.zeros(0, np.int64) if since is None else self._evictions(saved, t, since, cfg, keys)
        if since is not None and not is_global(cfg):    # global weight decay: every row changes every step
            if "meta" not in saved.array_names(t):
                raise ExportError(f"{saved.directory}/table{t}: table {cfg.name!r} was saved without row counters "
                                  f"(ps.tables[{cfg.name}].row_counters = false): a delta since {since} cannot tell "
                                  f"which rows changed: make a full export")
            _, last_seen = unpack_meta(saved.array(t, "meta", mmap=True)[slots])   # [R_i] int64
            changed = last_seen >= since
            keys, slots = keys[changed], slots[changed]
        weights = saved.array(t, "weights", mmap=True)
        if weights.ndim != 2 or weights.shape[1] != cfg.dim:
            raise ExportError(f"{saved.directory}/table{t}/weights.npy: shape {weights.shape}, "
                              f"table {cfg.name!r} has dim {cfg.dim}")
        rows = np.asarray(weights[slots], dtype=np.float32)                  # [R_i, D], fp16 tables widen
        return np.array(keys, dtype=np.int64), rows, tomb

    def _evictions(self, saved: SavedShard, t: int, since: int, cfg: TableConfig, live: np.ndarray) -> np.ndarray:
        lost = int(saved.meta(t).get("evlog_lost_through", -1))
        if lost >= since:
            raise ExportError(
                f"{saved.directory}/table{t}: table {cfg.name!r}: the eviction log no longer covers step {since} "
                f"(records through step {lost} were dropped past eviction_log_max = {cfg.eviction_log_max}); "
                f"a delta since {since} cannot name every evicted id: make a full export")
        keys, steps = saved.array(t, "evlog_keys"), saved.array(t, "evlog_steps")
        tomb = np.unique(keys[steps >= since].astype(np.int64))
        return tomb[~np.isin(tomb, live)]                                    # evicted, then admitted again

