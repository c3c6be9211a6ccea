"""What an export reads: a finished run or a checkpoint, and its saved PS shards, one table at a time.

    source = resolve_source(run="runs/tiny")           # or checkpoint="runs/tiny/ckpt/step-500"
    shards = SavedShards(source)                       # every shard's manifest, checked once
    part = shards.read_table(t, since=None)            # TableRows: ids sorted, rows float32, tombstones

Both inputs hold `config.toml`, `model/dense.pt` and `model/ps/shard{i}/` (one saved `ShardState`
per shard: manifest.json + table{t}/*.npy); a run's step is `metrics.json["steps"]`, a
checkpoint's `manifest.json["step"]`. Both count completed training steps.

A table is read shard by shard from the saved arrays (memory-mapped; only the live rows
`weights[map_slots]` are copied), so one process never holds more than one table's rows.

Steps of rows and evictions: a push in training step t (0-based) stamps its rows with
`last_seen = t`; a model saved after S completed steps holds pushes of steps 0..S-1, and TTL
sweeps log their evictions with the completed-step count. `since=S` therefore keeps rows with
`last_seen >= S` and evictions logged at steps >= S: everything that can differ from a model
saved at step S (a superset when S falls mid-way, never less).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embedding_ps.config import TableConfig
from recsys.config import ConfigError, JobConfig, load_config
from recsys.serving.tensorfile import ExportError

_LOW32 = 0xFFFFFFFF
_LAYOUT = ("name", "dim", "kind", "num_embeddings")


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


def resolve_source(run: str | Path | None = None, checkpoint: str | Path | None = None) -> Source:
    """(run dir | checkpoint dir) -> Source. Raises ConfigError naming what is missing."""
    if (run is None) == (checkpoint is None):
        raise ConfigError("give exactly one of a run directory or a checkpoint")
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
    """The saved shards of a source; checks their manifests against the config once."""

    def __init__(self, source: Source) -> None:
        self.source = source
        ps = source.config.ps
        self.dirs = [source.model_dir / "ps" / f"shard{i}" for i in range(ps.num_shards)]
        self.manifests = [self._manifest(d, i) for i, d in enumerate(self.dirs)]

    def _manifest(self, directory: Path, index: int) -> dict:
        path = directory / "manifest.json"
        try:
            m = json.loads(path.read_text())
        except FileNotFoundError:
            raise ExportError(f"{path}: missing (ps.num_shards = {self.source.config.ps.num_shards})") from None
        except json.JSONDecodeError as e:
            raise ExportError(f"{path}: not valid JSON ({e})") from None
        tables = self.source.config.ps.tables
        if m.get("num_shards") != len(self.dirs) or m.get("shard_index") != index:
            raise ExportError(f"{path}: shard {m.get('shard_index')} of {m.get('num_shards')}, "
                              f"expected shard {index} of {len(self.dirs)}")
        if len(m.get("tables", ())) != len(tables):
            raise ExportError(f"{path}: {len(m.get('tables', ()))} tables saved, config has {len(tables)}")
        for t, (cfg, entry) in enumerate(zip(tables, m["tables"])):
            for field in _LAYOUT:
                if entry["layout"].get(field) != getattr(cfg, field):
                    raise ExportError(f"{path}: table {t} saved with {field}={entry['layout'].get(field)!r}, "
                                      f"config has {field}={getattr(cfg, field)!r}")
        return m

    def read_table(self, t: int, since: int | None = None) -> TableRows:
        """Table `t` of every shard, concatenated and sorted by id (see the module docstring for `since`)."""
        cfg = self.source.config.ps.tables[t]
        parts = [self._read_shard(i, t, cfg, since) for i in range(len(self.dirs))]
        ids = np.concatenate([p[0] for p in parts])
        rows = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, cfg.dim), np.float32)
        tomb = np.unique(np.concatenate([p[2] for p in parts]))
        del parts
        order = np.argsort(ids, kind="stable")
        ids, rows = ids[order], rows[order]
        if ids.size > 1 and (ids[1:] == ids[:-1]).any():
            dup = ids[1:][ids[1:] == ids[:-1]][0]
            raise ExportError(f"table {cfg.name!r}: id {dup} is saved by two shards")
        return TableRows(ids, torch.from_numpy(rows), tomb)

    def _read_shard(self, i: int, t: int, cfg: TableConfig, since: int | None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys int64 [R_i], rows float32 [R_i, D], tombstones int64 [E_i]) of one shard's table."""
        sub = self.dirs[i] / f"table{t}"
        entry = self.manifests[i]["tables"][t]
        keys = _load(sub, "map_keys").astype(np.int64, copy=False)
        slots = _load(sub, "map_slots").astype(np.int64)
        tomb = np.zeros(0, np.int64)
        if since is not None:
            tomb = self._evictions(sub, entry, since, cfg)
            tomb = tomb[~np.isin(tomb, keys)]                                # evicted, then admitted again
            last_seen = _load(sub, "meta", mmap=True)[slots] & _LOW32        # [R_i] int64
            changed = last_seen >= since
            keys, slots = keys[changed], slots[changed]
        weights = _load(sub, "weights", mmap=True)
        if weights.ndim != 2 or weights.shape[1] != cfg.dim:
            raise ExportError(f"{sub}/weights.npy: shape {weights.shape}, table {cfg.name!r} has dim {cfg.dim}")
        rows = np.asarray(weights[slots], dtype=np.float32)                  # [R_i, D], fp16 tables widen
        return np.array(keys, dtype=np.int64), rows, tomb

    def _evictions(self, sub: Path, entry: dict, since: int, cfg: TableConfig) -> np.ndarray:
        lost = int(entry["meta"].get("evlog_lost_through", -1))
        if lost >= since:
            raise ExportError(
                f"{sub}: table {cfg.name!r}: the eviction log no longer covers step {since} (records through "
                f"step {lost} were dropped past eviction_log_max = {cfg.eviction_log_max}); a delta since "
                f"{since} cannot name every evicted id: make a full export")
        keys, steps = _load(sub, "evlog_keys"), _load(sub, "evlog_steps")
        return np.unique(keys[steps >= since].astype(np.int64))


def _load(sub: Path, name: str, mmap: bool = False) -> np.ndarray:
    path = sub / f"{name}.npy"
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise ExportError(f"{path}: missing from the saved shard") from None
    except (ValueError, OSError) as e:
        raise ExportError(f"{path}: unreadable ({e})") from None

