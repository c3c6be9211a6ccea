"""Applying a delta export to a base export (`recsys export-apply BASE DELTA --out DIR`).

Per table: drop the base rows whose ids are tombstoned or replaced, add the delta's rows, sort by
id. The rows of both are already in the export's precision (row-wise quantization is a function
of the row), so the result is the full export of the delta's step, table file for table file.

A delta made `--since S` at step T applies to a base of any step B with S <= B <= T (it then
holds every change after B), of the same precision and the same tables.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np

from recsys.config import load_config
from recsys.serving.errors import ExportError
from recsys.serving.export_store import find_sorted
from recsys.serving.export import new_manifest, read_manifest, read_tensors, staged, write_table
from recsys.serving.source import LAYOUT

logger = logging.getLogger(__name__)


def check_applicable(base: dict, delta: dict, base_where: str, delta_where: str) -> None:
    """Raise ExportError unless the delta `delta` applies to the base `base` (manifests)."""
    if delta.get("kind") != "delta":
        raise ExportError(f"{delta_where}: a {delta.get('kind')!r} export, not a delta (made with --since)")
    if base.get("kind") != "full":
        raise ExportError(f"{base_where}: a {base.get('kind')!r} export; apply deltas to a full export")
    if not delta["since"] <= base["step"] <= delta["step"]:
        raise ExportError(f"{delta_where}: a delta since step {delta['since']} to step {delta['step']} does not "
                          f"apply to {base_where} at step {base['step']} (needs since <= base step <= delta step)")
    b_run, d_run = base.get("run_id") or "", delta.get("run_id") or ""
    if b_run and d_run and b_run != d_run and b_run not in delta.get("lineage", []):
        raise ExportError(f"{delta_where}: a delta of run {d_run}, but {base_where} is an export of run {b_run} "
                          f"(neither that run nor one it was warm-started from): apply deltas of the base's own run")
    if base["precision"] != delta["precision"]:
        raise ExportError(f"{delta_where}: precision {delta['precision']}, {base_where} has {base['precision']}")
    b_tables, d_tables = ([tuple(t[k] for k in LAYOUT) for t in m["tables"]] for m in (base, delta))
    if b_tables != d_tables:
        raise ExportError(f"{delta_where}: tables {d_tables} differ from {base_where}'s {b_tables}")


def merge_table(base_ids: np.ndarray, base_rows: np.ndarray, delta_ids: np.ndarray, delta_rows: np.ndarray,
                tombstones: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids [R], rows [R, W]) of the base with tombstoned ids dropped and the delta's rows put in.

    All id arrays sorted and distinct; the result is sorted. Memory: one table.
    """
    drop = np.union1d(delta_ids, tombstones)                                 # sorted, distinct
    keep = ~find_sorted(drop, base_ids)[1]                                    # [R_base]
    ids = np.concatenate([base_ids[keep], delta_ids])
    rows = np.concatenate([base_rows[keep], delta_rows])
    order = np.argsort(ids, kind="stable")
    return ids[order], rows[order]


def read_table(root: Path, entry: dict) -> dict[str, np.ndarray]:
    """{"ids", "weight"[, "tombstones"]} of one table of an export, memory-mapped."""
    return read_tensors(root / entry["files"]["safetensors"])[0]


def apply_delta(base_dir: str | Path, delta_dir: str | Path, out: str | Path) -> dict:
    """Write the full export `out` = base + delta; returns its manifest."""
    base_dir, delta_dir, out = Path(base_dir), Path(delta_dir), Path(out)
    t0 = time.perf_counter()
    base, delta = read_manifest(base_dir), read_manifest(delta_dir)
    check_applicable(base, delta, str(base_dir), str(delta_dir))
    precision = delta["precision"]
    with staged(out) as tmp:
        entries = []
        for b_entry, d_entry in zip(base["tables"], delta["tables"]):
            b, d = read_table(base_dir, b_entry), read_table(delta_dir, d_entry)
            ids, rows = merge_table(b["ids"], b["weight"], d["ids"], d["weight"], d["tombstones"])
            del b, d
            files = write_table(tmp, d_entry["name"], ids, rows, precision, d_entry["dim"])
            entries.append(dict({k: v for k, v in d_entry.items() if k != "tombstones"}, rows=int(ids.shape[0]),
                                files=files))
            del ids, rows
        shutil.copyfile(delta_dir / "dense.pt2", tmp / "dense.pt2")
        retrieval = delta.get("retrieval")         # two_tower: the delta holds every item vector and the user tower
        if retrieval is not None:
            for name in (retrieval["items_file"], retrieval["user_tower_file"], retrieval.get("index", {}).get("file")):
                if name:
                    shutil.copyfile(delta_dir / name, tmp / name)
        origin = f"{base.get('origin')} + delta {delta_dir} ({delta.get('origin')})"
        manifest = new_manifest(load_config(delta_dir / "config.toml"), tmp, "full", delta["step"], None, precision,
                                entries, delta["dense"], origin, retrieval)
    logger.info("applied %s (steps %d..%d) to %s (step %d) -> %s in %.1f s", delta_dir, delta["since"],
                delta["step"], base_dir, base["step"], out, time.perf_counter() - t0)
    return manifest
