"""Embedding export for serving: per table, ids sorted with their rows, as safetensors and Parquet.

    recsys export --run RUN_DIR --out DIR [--precision fp32|fp16|int8|int4] [--since STEP] [--index exact|ann]

An export directory::

    manifest.json                 what is here (below) + sha256 and size of every other file
    config.toml                   the run's resolved job config
    dense.pt2                     the dense model, a torch.export program (see dense_export.py)
    tables/NAME.safetensors       "ids" int64 [R] (sorted) [, "tombstones" int64 [E]], "weight" [R, W]
    tables/NAME.parquet           id int64, vector fixed_size_list<...>[W'] [, scale float32, bias float32]
    tables/NAME.tombstones.parquet   (delta exports) id int64: ids to delete

"weight" is the matrix of quantize.py for the precision (its layouts there). The Parquet file splits
quantized rows into `vector` (the codes: fixed_size_list<uint8>, int4 packed two per byte, low nibble
first), `scale` and `bias`; for fp32/fp16 `vector` is fixed_size_list<float>/<halffloat>[D]. What the
rows, ids, defaults, deltas and the write into a temporary directory mean to a user: docs/serving.md,
"Export for serving" (calibration: docs/models.md, "Example weights and negative downsampling"); the
delta's rows and tombstones: source.py. Live shards writing their own part is not supported: the
export reads saved shards.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import safetensors
import safetensors.numpy

from recsys.config import JobConfig, to_toml
from recsys.serving.dense_export import dense_program
from recsys.serving.retrieval import export_retrieval
from recsys.serving.quantize import PRECISIONS, QUANTIZED, quantize, split_fused
from recsys.serving.source import SavedShards, Source
from recsys.calibration import manifest_section
from recsys.manifest import check_files, write_manifest
from recsys.manifest import read_manifest as _read_manifest
from recsys.serving.errors import ExportError
from recsys.models import build_sparse_arch

logger = logging.getLogger(__name__)

FORMAT = "recsys-export"
FORMAT_VERSION = 1
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_ROW_GROUP = 1 << 16
INDEXES = ("exact", "ann")          # --index: how Predictor.topk searches a two_tower export's items


# ---------------------------------------------------------------------------------------------
# one table's files


def write_tensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """A safetensors file (the `safetensors` package) of `tensors` with string `metadata`, fsynced.
    The metadata goes in as one key, "recsys" (its JSON, keys sorted): the package writes a header's
    metadata keys in a random order, so several keys would make the same table's file differ from
    run to run (exports are compared by sha256). `read_tensors` unpacks it."""
    packed = {"recsys": json.dumps(metadata, sort_keys=True, separators=(",", ":"))}
    safetensors.numpy.save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path), packed)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def read_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """({name: array}, metadata) of a safetensors file. The arrays are read-only views of the file,
    memory-mapped (`safe_open(framework="pt")` maps it; nothing is read before it is touched).
    A missing, truncated or corrupt file raises ExportError naming it."""
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name).numpy() for name in f.keys()}
            metadata = f.metadata() or {}
        if set(metadata) == {"recsys"}:          # written by write_tensors (files before #31: the keys themselves)
            metadata = json.loads(metadata["recsys"])
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise ExportError(f"{path}: not a readable safetensors file, corrupt or truncated ({e})") from None
    for a in tensors.values():
        a.flags.writeable = False
    return tensors, metadata


def write_table(root: Path, name: str, ids: np.ndarray, matrix: np.ndarray, precision: str, dim: int,
                tombstones: np.ndarray | None = None) -> dict[str, str]:
    """Write one table's safetensors + Parquet files under `root`; returns their relative paths."""
    if not _SAFE_NAME.match(name) or name.startswith("."):
        raise ExportError(f"table {name!r}: name is not usable as a file name (letters, digits, _ . - only)")
    files = {"safetensors": f"tables/{name}.safetensors", "parquet": f"tables/{name}.parquet"}
    tensors = {"ids": ids.astype(np.int64, copy=False), "weight": matrix}
    if tombstones is not None:
        tensors["tombstones"] = tombstones.astype(np.int64, copy=False)
    write_tensors(root / files["safetensors"], tensors, {"table": name, "precision": precision, "dim": str(dim)})
    codes, scale_bias = matrix, {}
    if precision in QUANTIZED:
        codes, scale, bias = split_fused(matrix, precision)
        scale_bias = {"scale": pa.array(scale), "bias": pa.array(bias)}
    vector = pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(codes).reshape(-1)), codes.shape[1])
    cols = {"id": pa.array(ids, pa.int64()), "vector": vector, **scale_bias}
    meta = {"recsys.table": name, "recsys.precision": precision, "recsys.dim": str(dim)}
    pq.write_table(pa.table(cols).replace_schema_metadata(meta), root / files["parquet"],
                   row_group_size=_ROW_GROUP, compression="zstd")
    if tombstones is not None:
        files["tombstones_parquet"] = f"tables/{name}.tombstones.parquet"
        pq.write_table(pa.table({"id": pa.array(tombstones, pa.int64())}), root / files["tombstones_parquet"],
                       compression="zstd")
    return files


# ---------------------------------------------------------------------------------------------
# manifest


def features_section(cfg: JobConfig) -> dict:
    """Sparse features in the order the dense program takes them, with their tables and pooling."""
    arch, names = build_sparse_arch(cfg), cfg.data.sparse_columns
    by_feature = sorted(((f, p) for p in arch.plans for f in p.features), key=lambda x: x[0])    # stable: plan order
    section = {kind: [{"feature": names[f], "table": p.name, "pooling": p.pooling, "dim": p.dim,
                       "weight_column": cfg.data.weight_columns.get(names[f])}
                      for f, p in by_feature if p.linear == (kind == "linear")] for kind in ("pooled", "linear")}
    if cfg.model.sequence_features:      # din: these pooled features also come per position (dense "behaviors")
        section["sequences"] = [{"feature": s.name, "candidate": names[s.candidate], "max_len": cfg.model.max_seq_len}
                                for s in arch.sequences]
    return section


def read_manifest(root: str | Path, verify: bool = True) -> dict:
    """manifest.json of an export; with `verify`, every file's size and sha256 are checked.

    Raises ExportError naming the file that is missing, truncated, changed or unlisted.
    """
    root = Path(root)
    manifest = _read_manifest(root, ExportError, kind="an export", format=FORMAT,
                              version=("format_version", FORMAT_VERSION),
                              required=("kind", "step", "precision", "tables", "dense"))
    check_files(root, manifest["files"], ExportError, verify=verify)
    for entry in manifest["tables"]:
        read_tensors(root / entry["files"]["safetensors"])     # a broken file names itself (maps, reads nothing)
    return manifest


# ---------------------------------------------------------------------------------------------
# writing a whole export


def check_replaceable(out: Path, run_id: str, overwrite: bool) -> None:
    """Raise ExportError when `out` holds an export of another run than `run_id` (and not `overwrite`)."""
    path = out / "manifest.json"
    if overwrite or not path.is_file():
        return
    try:
        theirs = json.loads(path.read_text()).get("run_id") or ""
    except (ValueError, OSError, AttributeError):
        theirs = "?"
    if theirs != run_id:
        raise ExportError(f"{out}: holds an export of run {theirs or '(no run id)'}, this model is of run "
                          f"{run_id or '(no run id)'}: choose another --out, or pass --overwrite to replace it")


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh directory beside `out` (with tables/) to write an export into: renamed to `out` when the
    block ends, replacing an older export there (never another directory); removed when it raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "tables").mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            if not (out / "manifest.json").exists() and any(out.iterdir()):
                raise ExportError(f"{out}: exists and is not an export; refusing to replace it")
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_model(source: Source, out: str | Path, precision: str = "fp32", since: int | None = None,
                 overwrite: bool = False, index: str = "exact") -> dict:
    """Write a full export (or with `since`, a delta) of `source` to `out`; returns the manifest.

    An export already at `out` is replaced only when it is one of the same run, or with `overwrite`.
    `index` "ann" (two_tower runs): an ANN index over the item vectors too (retrieval.py, ann.py)."""
    if precision not in PRECISIONS:
        raise ExportError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if index not in INDEXES or (index == "ann" and source.config.model.arch != "two_tower"):
        raise ExportError(f"--index {index!r}: one of {', '.join(INDEXES)}; 'ann' for a two_tower model only "
                          f"(item vectors), this is {source.config.model.arch!r}")
    if since is not None and not 0 <= since <= source.step:
        raise ExportError(f"--since {since} must be in [0, {source.step}] "
                          f"(the {source.origin} is at step {source.step})")
    cfg, out = source.config, Path(out)
    check_replaceable(out, cfg.train.run_id, overwrite)
    if cfg.model.sequence_features and precision in QUANTIZED:
        raise ExportError(f"precision {precision!r}: a din model exports as fp32 or fp16 only (the quantized "
                          f"pooling kernel gives no per-position rows of the behavior lists)")
    t0 = time.perf_counter()
    with staged(out) as tmp:
        shards = SavedShards(source)
        entries = []
        for t, tc in enumerate(cfg.ps.tables):
            part = shards.read_table(t, since)
            tomb = part.tombstones if since is not None else None
            matrix = quantize(part.rows, precision)
            entry = {"name": tc.name, "index": t, "dim": tc.dim, "kind": tc.kind, "num_embeddings": tc.num_embeddings,
                     "pooling": cfg.model.table_pooling.get(tc.name, "sum"), "rows": int(matrix.shape[0]),
                     "weight": {"dtype": str(matrix.dtype), "width": int(matrix.shape[1])},
                     "default": {"unadmitted": tc.unadmitted, "init": tc.init, "init_scale": tc.init_scale,
                                 "seed": tc.seed},
                     "files": write_table(tmp, tc.name, part.ids, matrix, precision, tc.dim, tomb)}
            entries.append(entry if tomb is None else dict(entry, tombstones=int(tomb.shape[0])))
            logger.info("table %s: %d rows%s", tc.name, part.ids.shape[0],
                        "" if tomb is None else f", {tomb.shape[0]} tombstones")
            del part, tomb, matrix                   # one table in memory at a time
        dense = dense_program(cfg, source.model_dir, tmp / "dense.pt2")      # the trainer's, when it saved one
        # two_tower: item vectors (items.parquet) and the user tower (user_tower.pt2), see retrieval.py
        retrieval = export_retrieval(cfg, source.model_dir, tmp, index) if cfg.model.arch == "two_tower" else None
        manifest = new_manifest(cfg, tmp, "full" if since is None else "delta", source.step, since,
                                precision, entries, dense, source.origin, retrieval)
    logger.info("exported %s at step %d (%s%s) to %s in %.1f s", source.origin, source.step, precision,
                "" if since is None else f", delta since {since}", out, time.perf_counter() - t0)
    return manifest


def new_manifest(cfg: JobConfig, root: Path, kind: str, step: int, since: int | None, precision: str,
                 tables: list[dict], dense: dict, origin: str, retrieval: dict | None = None) -> dict:
    """Write config.toml and manifest.json into `root`."""
    (root / "config.toml").write_text(to_toml(cfg))
    data = cfg.data
    dense.update(columns=list(data.dense_columns), log1p=data.dense_log1p, fill=data.dense_fill)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, "step": step, "since": since,
        "precision": precision, "origin": origin, "created_unix": int(time.time()),
        "tables": tables, "features": features_section(cfg), "dense": dense,
        "rows": {e["name"]: e["rows"] for e in tables}, "run_id": cfg.train.run_id,
        "lineage": list(cfg.train.lineage),
        "calibration": manifest_section(data),      # the Predictor corrects scores by it (recsys.calibration)
    }
    if retrieval is not None:
        manifest["retrieval"] = retrieval
    return write_manifest(root, manifest)
