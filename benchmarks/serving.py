"""Serving throughput of `recsys.serving.Predictor` over an export, per precision and batch size.

    python benchmarks/serving.py [--json] [--rows N] [--extra-rows N] [--threads T]

Builds a criteo-like model in-process (configs/quickstart.toml: DLRM, 26 one-id + 2 multi-hot
features, D = 16): trains it for a few steps on `--rows` synthetic rows, adds `--extra-rows` rows
to table C1 (so one table is large: lookups search 1M+ sorted ids), saves it as a run and exports
it in fp32, fp16, int8 and int4. Then, per precision, times (median over repeats, after warm-up):

- lookups/s: `Predictor.lookup("C1", ids)` of B ids from the eval data (unknown ids get defaults)
- predictions/s: `Predictor.predict(batch)` of a decoded Batch of B rows (pooling + dense program)
- predictions/s from a pyarrow Table of 4096 rows (decoding included)

at B = 1, 64, 4096, with `--threads` torch threads (default 1).

Measured (2-core shared VM, 1 thread, C1 1.0M rows, 28 tables): lookups/s 70-120k at B=1, 0.5-0.66M
at B=64, 5.5-6.5M at B=4096; predictions/s ~320-450 at B=1, ~11-12k at B=64, 107-129k at B=4096
(fp32/fp16 ~128k, int8/int4 ~108k; from a pyarrow Table incl. decoding 94-122k). Batch 1 is per-call
overhead: ~28 tables x ~50-80 us of Python/numpy per table plus ~0.35 ms for the exported program.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.decode import decode_table  # noqa: E402
from data.synthetic import generate  # noqa: E402
from recsys.config import load_config, to_toml  # noqa: E402
from recsys.serving import Predictor  # noqa: E402
from recsys.serving.export import export_model  # noqa: E402
from recsys.serving.source import resolve_source  # noqa: E402
from embedding_ps.local import LocalStore  # noqa: E402
from recsys.training.trainer import Trainer  # noqa: E402
from recsys.training.worker import save_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 64, 4096)
PRECISIONS = ("fp32", "fp16", "int8", "int4")


def make_run(tmp: Path, rows: int, extra_rows: int, steps: int) -> tuple[Path, Path]:
    data = tmp / "data"
    generate(preset="criteo-like", rows=rows, num_files=2, out_dir=str(data), seed=0)
    cfg = load_config(ROOT / "configs" / "quickstart.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"train.run_dir='{tmp / 'run'}'", f"train.max_steps={steps}", "ps.mode='sync'"])
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    trainer.train()
    trainer.close()
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(1, 2**62, size=extra_rows, dtype=np.int64))
    store.push(0, ids, torch.zeros(extra_rows, cfg.ps.tables[0].dim))      # admits them: a large C1
    run = tmp / "run"
    save_model(trainer, store, run / "model")
    (run / "config.toml").write_text(to_toml(cfg))
    (run / "metrics.json").write_text(json.dumps({"steps": trainer.step}))
    return run, data / "part-00001.parquet"


def timed(fn, work: int, min_s: float = 0.3, reps: int = 5) -> float:
    """Median units of `work` per second over `reps` timings of at least `min_s` each."""
    fn()
    rates = []
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        rates.append(n * work / dt)
    return statistics.median(rates)


def bench_precision(export: Path, table, batch_of: dict, ids: np.ndarray) -> dict:
    t0 = time.perf_counter()
    p = Predictor(export)
    out = {"open_s": round(time.perf_counter() - t0, 3)}
    for B in BATCHES:
        chunk = torch.from_numpy(ids[:B])
        out[f"lookups_per_s_b{B}"] = round(timed(lambda: p.lookup("C1", chunk), B))
        out[f"predictions_per_s_b{B}"] = round(timed(lambda: p.predict(batch_of[B]), B))
    t = table.slice(0, 4096)
    out["predictions_per_s_arrow_b4096"] = round(timed(lambda: p.predict(t), 4096))
    return out


def run(rows: int, extra_rows: int, steps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        t0 = time.perf_counter()
        run_dir, eval_file = make_run(Path(tmp), rows, extra_rows, steps)
        build_s = time.perf_counter() - t0
        source = resolve_source(run=run_dir)
        sizes, export_s = {}, {}
        for prec in PRECISIONS:
            t0 = time.perf_counter()
            m = export_model(source, Path(tmp) / prec, prec)
            export_s[prec] = round(time.perf_counter() - t0, 2)
            sizes[prec] = round(sum(f["size"] for k, f in m["files"].items() if k.endswith(".safetensors")) / 2**20, 1)
        table = pq.read_table(eval_file)
        cfg = dataclasses.replace(source.config.data, shuffle=False)
        batch_of = {B: decode_table(cfg, table.slice(0, B)) for B in BATCHES}
        ids = table.column("C1").to_numpy(zero_copy_only=False).astype(np.int64)
        res = {prec: bench_precision(Path(tmp) / prec, table, batch_of, ids) for prec in PRECISIONS}
    return {"rows_C1": m["rows"]["C1"], "rows_total": sum(m["rows"].values()), "build_s": round(build_s, 1),
            "export_s": export_s, "safetensors_mb": sizes, "threads": threads, "cpus": os.cpu_count(),
            "results": res}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--rows", type=int, default=40_000, help="synthetic rows (half train, half eval)")
    p.add_argument("--extra-rows", type=int, default=1_000_000, help="rows added to table C1")
    p.add_argument("--steps", type=int, default=15, help="training steps (batch 1024)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    r = run(a.rows, a.extra_rows, a.steps, a.threads)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"criteo-like DLRM export: C1 {r['rows_C1']:,} rows, {r['rows_total']:,} rows in all; "
          f"{r['threads']} torch thread(s), {r['cpus']} cpus")
    print(f"{'':6s} {'MB':>6s} {'export s':>8s} " + " ".join(f"{'lookup/s b' + str(b):>14s}" for b in BATCHES)
          + " " + " ".join(f"{'pred/s b' + str(b):>12s}" for b in BATCHES) + f" {'arrow b4096':>12s}")
    for prec, x in r["results"].items():
        print(f"{prec:6s} {r['safetensors_mb'][prec]:6.1f} {r['export_s'][prec]:8.2f} "
              + " ".join(f"{x[f'lookups_per_s_b{b}']:14,d}" for b in BATCHES) + " "
              + " ".join(f"{x[f'predictions_per_s_b{b}']:12,d}" for b in BATCHES)
              + f" {x['predictions_per_s_arrow_b4096']:12,d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
