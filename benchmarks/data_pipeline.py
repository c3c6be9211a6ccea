"""Parquet -> Batch throughput of `data.loader.ParquetLoader` against plain pyarrow, same files, same run.

    python benchmarks/data_pipeline.py [--json] [--rows N] [--reps R]

Writes a criteo-like dataset (13 dense with nulls, 26 int64 ids, 2 list<int64> columns, zstd) to a
temporary directory with `data.synthetic.generate`, then times, interleaved, R repetitions of:

- loader, shuffle on (the default window of 65536 rows), prefetch thread on (the training setting)
- loader, shuffle on, decoding inline (prefetch_batches = 0)
- loader, shuffle off, prefetch on
- baseline: `ParquetFile.iter_batches(4096)` + `to_numpy()` of every column (list columns: the
  flattened values), nothing else

and reports medians. `rows_per_s` is the training setting; `ratio` = rows_per_s / pyarrow_rows_per_s.
Rows per CPU-second are printed too: on a shared machine they are steadier than wall-clock rates.

The pyarrow pass is the baseline: when it fails (its warm-up pass raises, or reads a wrong row
count) the script exits 1, unless --allow-missing-baseline (then `pyarrow_rows_per_s`, `ratio` and
`cpu_ratio` are null and `notes` says why). --json prints one line with every figure and ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.config import DataConfig  # noqa: E402
from data.loader import ParquetLoader  # noqa: E402

DENSE = tuple(f"I{i}" for i in range(1, 14))
SPARSE = tuple(f"C{i}" for i in range(1, 27)) + ("M1", "M2")


def make_data(out: str, rows: int, files: int, row_group_rows: int) -> None:
    from data.synthetic import generate
    generate(preset="criteo-like", rows=rows, num_files=files, out_dir=out, seed=0,
             row_group_rows=row_group_rows, compression="zstd")


def loader_pass(files: list[str], batch_size: int, shuffle: bool, prefetch: int) -> tuple[int, float, float]:
    cfg = DataConfig(batch_size=batch_size, dense_columns=DENSE, dense_log1p=True, sparse_columns=SPARSE,
                     shuffle=shuffle, prefetch_batches=prefetch)
    with ParquetLoader(cfg, files) as loader:
        t0, c0 = time.perf_counter(), time.process_time()
        n = 0
        for batch in loader:
            n += batch.batch_size
        return n, time.perf_counter() - t0, time.process_time() - c0


def pyarrow_pass(files: list[str], batch_size: int) -> tuple[int, float, float]:
    columns = ["label", *DENSE, *SPARSE]
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for f in files:
        for rb in pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=columns):
            for col in rb.columns:
                if pa.types.is_list(col.type):
                    col.flatten().to_numpy()
                else:
                    col.to_numpy(zero_copy_only=False)
            n += rb.num_rows
    return n, time.perf_counter() - t0, time.process_time() - c0


def run(rows: int, reps: int, files: int, batch_size: int, row_group_rows: int) -> dict:
    variants = {
        "loader": lambda fs: loader_pass(fs, batch_size, True, 2),
        "loader_inline": lambda fs: loader_pass(fs, batch_size, True, 0),
        "loader_no_shuffle": lambda fs: loader_pass(fs, batch_size, False, 2),
        "pyarrow": lambda fs: pyarrow_pass(fs, batch_size),
    }
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        t0 = time.perf_counter()
        make_data(tmp, rows, files, row_group_rows)
        gen_s = time.perf_counter() - t0
        paths = sorted(str(p) for p in Path(tmp).glob("*.parquet"))
        size_mb = sum(os.path.getsize(p) for p in paths) / 2 ** 20
        notes = []
        for name, fn in list(variants.items()):          # warm-up: page cache, imports, allocator
            try:
                n = fn(paths)[0]
                if n != rows:
                    raise RuntimeError(f"read {n} rows, expected {rows}")
            except Exception as e:
                if name != "pyarrow":
                    raise
                notes.append(f"baseline pyarrow failed ({type(e).__name__}: {e}); reported as null")
                del variants[name]
        wall: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(reps):
            for name, fn in variants.items():
                n, w, c = fn(paths)
                if n != rows:
                    raise RuntimeError(f"{name} read {n} rows, expected {rows}")
                wall[name].append(rows / w)
                cpu[name].append(rows / max(c, 1e-9))
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    base, base_cpu = med.get("pyarrow"), med_cpu.get("pyarrow")
    return {
        "rows": rows, "files": files, "row_group_rows": row_group_rows, "batch_size": batch_size, "reps": reps,
        "dataset_mb": round(size_mb, 1), "gen_s": round(gen_s, 2),
        "rows_per_s": round(med["loader"]), "pyarrow_rows_per_s": None if base is None else round(base),
        "ratio": None if base is None else round(med["loader"] / base, 3),
        "rows_per_s_inline": round(med["loader_inline"]), "rows_per_s_no_shuffle": round(med["loader_no_shuffle"]),
        "rows_per_cpu_s": {k: round(v) for k, v in med_cpu.items()},
        "cpu_ratio": None if base_cpu is None else round(med_cpu["loader"] / base_cpu, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cpus": os.cpu_count(), "notes": notes,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--row-group-rows", type=int, default=65536)
    p.add_argument("--allow-missing-baseline", action="store_true",
                   help="report null for the pyarrow baseline (and exit 0) when it cannot run")
    a = p.parse_args()
    r = run(a.rows, a.reps, a.files, a.batch_size, a.row_group_rows)
    missing = r["ratio"] is None
    if missing and not a.allow_missing_baseline:
        print(f"error: the pyarrow baseline did not run: {'; '.join(r['notes'])} "
              "(--allow-missing-baseline to report it as null)", file=sys.stderr)
    if a.json:
        print(json.dumps(r))
        return 1 if missing and not a.allow_missing_baseline else 0
    print(f"{r['rows']:,} criteo-like rows in {r['files']} files ({r['dataset_mb']} MB zstd, row groups of "
          f"{r['row_group_rows']}), batch {r['batch_size']}, median of {r['reps']}:")
    rows = [("loader (shuffle, prefetch)", "loader", r["rows_per_s"]),
            ("loader (shuffle, inline)", "loader_inline", r["rows_per_s_inline"]),
            ("loader (no shuffle, prefetch)", "loader_no_shuffle", r["rows_per_s_no_shuffle"]),
            ("pyarrow iter_batches + to_numpy", "pyarrow", r["pyarrow_rows_per_s"])]
    for label, key, v in rows:
        if v is None:
            print(f"  {label:34s}   null")
            continue
        print(f"  {label:34s} {v / 1e6:6.2f} M rows/s   {r['rows_per_cpu_s'][key] / 1e6:6.2f} M rows/cpu-s")
    if missing:
        print(f"  ratio loader / pyarrow: null; peak RSS {r['peak_rss_mb']:.0f} MB")
        return 0 if a.allow_missing_baseline else 1
    print(f"  ratio loader / pyarrow: {r['ratio']:.2f} (per cpu-s {r['cpu_ratio']:.2f}); "
          f"peak RSS {r['peak_rss_mb']:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
