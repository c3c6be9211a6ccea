"""Checks a job can run before any process starts (`recsys train`, `eval`, `predict`, `export`; README,
"Commands"): from Parquet footers only (`data.parquet.scan_files`), never rows, so a config or schema
problem is one `error:` line (`PreflightError`, a `ConfigError`) in about a second."""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from pathlib import Path

from data.parquet import DataError, check_example_weights, resolve_paths, scan_files, scoring_config, with_id_types
from recsys import storage
from recsys.config import ConfigError, JobConfig

MIN_FREE_BYTES = 64 << 20
"""The run directory's filesystem needs at least this much free space for logs and a first checkpoint."""


class PreflightError(ConfigError):
    """A job that cannot run: the message names the file or config key, what is wrong and the fix."""


def preflight_train(cfg: JobConfig, resume: str | None = None) -> None:
    """Everything `recsys train` can know before it starts a process; PreflightError on the first problem."""
    check_tables(cfg)
    check_cluster(cfg)
    if resume is not None and resume != "latest":
        check_checkpoint(resume, "--resume", checksums=False)
    if cfg.train.init_from:       # the new data's ids keep the types the source was trained on (data.id_types)
        from recsys.training.warm_start import resolve_init

        known = resolve_init(cfg.train.init_from, verify=False).config.data.id_types
        cfg = dataclasses.replace(cfg, data=with_id_types(cfg.data, known, read_footer=False))
    if not cfg.data.train_paths:
        raise PreflightError("data.train_paths: empty (list the training Parquet files, directories or globs)")
    for key in ("train_paths", "eval_paths", "test_paths"):
        if paths := getattr(cfg.data, key):
            preflight_data(cfg, paths, f"data.{key}", scoring=key != "train_paths")
    if storage.is_uri(cfg.train.run_dir):
        check_remote_run_dir(cfg.train.run_dir)
    else:
        check_run_dir(Path(cfg.train.run_dir))


RAY_PIN = "2.60.0"
"""The Ray release of the `[ray]` extra (pyproject.toml)."""


def check_cluster(cfg: JobConfig) -> None:
    """cluster.engine = "ray": Ray is installed (found without importing it), at the pinned release."""
    if cfg.cluster.engine != "ray":
        return
    import importlib.metadata
    import importlib.util

    install = f"pip install -e '.[ray]' (ray[default,train]=={RAY_PIN})"
    if importlib.util.find_spec("ray") is None:         # (a submodule's spec would import ray)
        raise PreflightError(f"cluster.engine = 'ray': Ray is not installed (install it with: {install}, or set "
                             f"cluster.engine = 'local')")
    version = importlib.metadata.version("ray")
    if version != RAY_PIN:
        raise PreflightError(f"cluster.engine = 'ray': ray {version} is installed, this project is tested with "
                             f"{RAY_PIN} (install it with: {install})")


def check_tables(cfg: JobConfig) -> None:
    """Every sparse feature reads a table that exists, and every table is read by some feature."""
    from recsys.table_plans import table_plans

    try:
        plans, _ = table_plans(cfg)
    except ValueError as e:
        raise PreflightError(f"ps.tables / model.feature_tables: {e} (add the table, or map the feature "
                             f"to one with model.feature_tables)") from None
    used = {p.name for p in plans}
    for table in cfg.ps.tables:
        if table.name not in used:
            raise PreflightError(f"ps.tables[{table.name}]: no feature of data.sparse_columns reads it (remove it, "
                                 f"or map a feature to it with model.feature_tables / linear_feature_tables)")


def preflight_data(cfg: JobConfig, paths: tuple[str, ...] | list[str], key: str, scoring: bool = True) -> None:
    """The files of `paths` exist and their footers have the configured columns with usable types.
    `scoring` (eval, test, predict data): data.example_weight_column may be absent from every file
    (unweighted metrics); training data must have it (a number per row)."""
    try:
        files = resolve_paths(tuple(paths))
        data_cfg = scoring_config(cfg.data, files) if scoring else cfg.data
        scan_files(data_cfg, files)
        if data_cfg.example_weight_column and data_cfg.on_bad_rows == "error":   # "skip": the reader drops them
            check_example_weights(data_cfg.example_weight_column, files)
    except DataError as e:
        raise PreflightError(f"{e} (fix the data, or {key} / the data.*_columns settings)") from None
    except (FileNotFoundError, ValueError) as e:
        raise PreflightError(f"{key}: {e} (check the paths)") from None


def check_checkpoint(path: str, key: str, checksums: bool = True) -> None:
    """An explicit checkpoint directory exists and every file matches its manifest (sizes, and sha256
    with `checksums`; `--resume` leaves those to the launcher's `checkpoint.resolve_resume`, before
    any process starts or anything is written: hashing the checkpoint here too read it twice)."""
    from recsys.training.checkpoint import CorruptCheckpointError, verify_checkpoint

    if not storage.is_uri(path) and not Path(path).is_dir():
        raise PreflightError(f"{key} {path}: no such checkpoint directory (give run_dir/checkpoints/step-N, "
                             f"or --resume latest)")
    try:
        verify_checkpoint(path, checksums)
    except CorruptCheckpointError as e:
        raise PreflightError(f"{key} {path}: {e} (resume from another checkpoint, e.g. --resume latest)") from None
    except OSError as e:                       # a URI: storage.StorageError / FileNotFoundError name it
        raise PreflightError(f"{key}: {e}") from None


def preflight_export(source_dir: Path, is_checkpoint: bool, out: Path) -> None:
    """`recsys export`, before any table is read: a checkpoint source verifies against its manifest,
    and `out` is new, empty or an older export (never another directory) in a writable place."""
    if is_checkpoint:
        check_checkpoint(str(source_dir), "--checkpoint")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "manifest.json").exists())):
        raise PreflightError(f"--out {out}: exists and is not an export; refusing to replace it "
                             f"(choose a new directory)")
    parent = next((p for p in out.parents if p.exists()), out.parent)      # the nearest that exists
    if not os.access(parent, os.W_OK):
        raise PreflightError(f"--out {out}: {parent} is not writable (choose a writable directory)")


def check_remote_run_dir(run_dir: str) -> None:
    """A URI run directory can be written (a probe object is written and deleted)."""
    probe = storage.join(run_dir, f".preflight-{uuid.uuid4().hex}")
    try:
        storage.write_bytes(probe, b"x")
        storage.delete_tree(probe)
    except OSError as e:
        raise PreflightError(f"train.run_dir = {run_dir!r}: not writable: {e} (check the bucket, credentials "
                             f"and endpoint; docs/storage.md)") from None


def check_run_dir(run_dir: Path) -> None:
    """The run directory can be created and written, and its filesystem has room."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".preflight-{uuid.uuid4().hex}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise PreflightError(f"train.run_dir = {str(run_dir)!r}: not writable ({e.strerror or e}) "
                             f"(choose a writable directory)") from None
    free = shutil.disk_usage(run_dir).free
    if free < MIN_FREE_BYTES:
        raise PreflightError(f"train.run_dir = {str(run_dir)!r}: only {free >> 20} MiB free on its filesystem "
                             f"(free space, or choose another train.run_dir)")


__all__ = ["PreflightError", "preflight_train", "check_cluster", "preflight_data", "check_tables", "check_checkpoint",
           "check_run_dir", "check_remote_run_dir", "preflight_export"]
