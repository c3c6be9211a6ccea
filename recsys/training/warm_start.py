"""Warm start (`train.init_from`): a new run starts from a trained model: a checkpoint, a finished run's
model, or a full fp32 export.

    source = resolve_init(cfg.train.init_from)          # InitSource: what the path holds, its config and step
    check_init_tables(cfg, source)                      # ConfigError on a carried-over table's changed layout
    warm_start(parts, source)                           # dense weights (+ optimizer state from a checkpoint)

Shards load the source's rows themselves (`ps/shard{i}/`, or an export's table files; any shard
count); the replicated tables come in when the trainer builds them (`source_replicated`). The data
position, LR schedule and early-stopping record start new.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys import storage
from recsys.config import ConfigError, JobConfig
from recsys.models.replicated import load_bytes, read_replicated
from recsys.rundir import model_root, run_path
from recsys.training.checkpoint import (TrainParts, check_layout, load_saved_config, read_checked, read_manifest,
                                        verify_checkpoint)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InitSource:
    """A trained model a new run starts from (`resolve_init`)."""

    root: Path | str                  # the checkpoint directory, or the run's model directory's parent
    model_dir: Path | str             # holds dense.pt, ps/shard{i}/, replicated.pt
    step: int                         # completed training steps of the source
    config: JobConfig                 # the source run's resolved config
    checkpoint: bool                  # a checkpoint: trainer/state.pt (dense optimizer state) too
    manifest: dict[str, Any]          # the checkpoint's manifest ({} for a run's last model; an export's)
    export: bool = False              # an fp32 export: rows without optimizer state, dense weights from dense.pt2


def resolve_init(path: str | Path, verify: bool = True) -> InitSource:
    """`train.init_from` -> InitSource: a checkpoint directory (verified), a full fp32 export (local;
    quantized rows would not train on), or a run directory (its best model, RUN_DIR/best, when it kept
    one, else RUN_DIR/model with metrics.json's step count).

    Raises CorruptCheckpointError or ConfigError naming what is missing or damaged."""
    remote = storage.is_uri(path)
    root = path if remote else Path(path)
    if storage.exists(run_path(root, "manifest.json")) and storage.exists(run_path(root, "tables")):
        from recsys.serving.export import read_manifest as read_export

        if remote:
            raise ConfigError(f"train.init_from = {root}: an export as the source must be local (download it, or "
                              f"give the run or checkpoint it came from)")
        manifest = read_export(root, verify=verify)
        if manifest["kind"] != "full" or manifest["precision"] != "fp32":
            raise ConfigError(f"train.init_from = {root}: a {manifest['precision']} {manifest['kind']} export; a "
                              f"warm start needs a full fp32 export (or the run / checkpoint it came from)")
        return InitSource(root, root, int(manifest["step"]), load_saved_config(root), False, manifest, export=True)
    if storage.exists(run_path(root, "manifest.json")) and storage.exists(run_path(root, "trainer")):
        manifest = verify_checkpoint(root) if verify else read_manifest(root)
        return InitSource(root, run_path(root, "model"), int(manifest["step"]), load_saved_config(root), True, manifest)
    if not storage.exists(run_path(root, "config.toml")):
        raise ConfigError(f"train.init_from = {path}: neither a run directory nor a checkpoint (no config.toml)")
    best = model_root(root)
    if best != root:                                   # the run kept its best validation pass: a checkpoint
        return resolve_init(best, verify)
    for needed in ("metrics.json", "model/dense.pt"):
        if not storage.exists(run_path(root, *needed.split("/"))):
            raise ConfigError(f"train.init_from = {path}: not a finished run ({needed} is missing); give one of "
                              f"its checkpoints instead")
    try:
        step = int(json.loads(storage.read_text(run_path(root, "metrics.json")))["steps"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{run_path(root, 'metrics.json')}: no readable step count ({e})") from None
    return InitSource(root, run_path(root, "model"), step, load_saved_config(root), False, {})


def export_rows(root: Path | str, manifest: dict[str, Any], name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids int64 [R], rows float32 [R, D]) of table `name` of an fp32 export, or None when it has none."""
    from recsys.serving.delta import read_table

    entry = next((e for e in manifest["tables"] if e["name"] == name), None)
    if entry is None:
        return None
    t = read_table(Path(root), entry)
    return (torch.from_numpy(np.array(t["ids"], dtype=np.int64)),
            torch.from_numpy(np.array(t["weight"], dtype=np.float32)))


def source_replicated(source: InitSource) -> dict[str, torch.Tensor] | None:
    """The replicated tables' saved state of a warm start's source (an export: from its table files)."""
    if not source.export:
        return read_replicated(source.model_dir)
    out = {}
    for t in source.config.ps.tables:
        if t.placement == "replicated" and (got := export_rows(source.root, source.manifest, t.name)) is not None:
            out[f"{t.name}.ids"], out[f"{t.name}.weight"] = got
    return out


def check_init_tables(cfg: JobConfig, source: InitSource) -> None:
    """ConfigError naming a table of both `cfg` and the source (by name: the new run takes those) whose
    layout or optimizer changed. Tables only in `cfg` start empty."""
    check_layout(cfg.ps.tables, source.config.ps.tables,
                 ("dim", "kind", "num_embeddings", "optimizer", "placement", "weight_decay_mode"),
                 f"train.init_from = {source.root} trained it with", "its rows and optimizer state do not carry "
                 "over (keep {key}, rename the table to start it afresh, or drop init_from)")


def warm_start(parts: TrainParts, source: InitSource) -> None:
    """Put the source's dense weights, replicated tables and (from a checkpoint) dense and table
    optimizer state into `parts`; the data position, LR schedule and early-stopping record stay new."""
    root = source.root
    if source.export:          # the dense program's weights; rows came without optimizer state
        program = torch.export.load(str(Path(root) / "dense.pt2"))
        parts.model.load_state_dict({k.removeprefix("model."): v for k, v in program.state_dict.items()})
        logger.info("warm start from the export %s: rows and dense weights without optimizer state (the "
                    "optimizers start fresh)", root)
        return
    # (a run's last model has no manifest: nothing to check against)
    parts.model.load_state_dict(load_bytes(read_checked(root, "model/dense.pt", source.manifest)))
    # (the replicated tables came from the source when the trainer was built: `build_replicated(grow=)`)
    if not source.checkpoint:
        logger.info("warm start from %s: no dense optimizer state there (a run's last model); it starts fresh",
                    root)
        return
    state = load_bytes(read_checked(root, "trainer/state.pt", source.manifest))
    try:
        parts.optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        logger.warning("warm start from %s: the dense optimizer state does not fit (%s); it starts fresh", root, e)
    if parts.table_optimizer is not None:
        parts.table_optimizer.load_state_dict(state.get("table_optimizer", {}), remap=parts.replicated.grown)
