"""Pieces of a shard's and a trainer's per-step work, C against the numpy / torch code it replaced.

    python benchmarks/shard_ops.py [--json] [--rows 14000] [--dim 64] [--calls 50] [--tables 26] [--batch 4096]

- row init: `embedding_ps.native.init_bits` (one C pass, `ps_init_bits`) against
  `reference.init_bits` (~15 numpy passes) for --rows new ids: what a shard computes for every id it
  has not seen, on the pull and again when it admits the id on the push.
- duplicate merge: `native.merge_rows` against `reference.merge_rows` (np.unique + zeros +
  index_add_) for two trainers' pushes of --rows / 2 rows each sharing 40% of their slots: what a
  sync-mode shard does when it applies a step.
- trainer dedup: `embedding_ps.native.unique` (one hash pass) against `torch.unique(...,
  return_inverse=True)` (a sort) for --tables tables of --batch Zipf(1.05) ids over 200k each (the
  train benchmarks' shape): what the sparse arch does per table per step (`embedding_ps.native.unique`).
- trainer bags example-major: `embedding_ps.native.to_example_major` (one C pass) against the torch
  ops of `embedding_ps.reference.to_example_major` for --tables features x --batch bags of 0-2
  ids each (the same values): what the sparse arch does once a step before pooling into [B, F, D].
One thread; medians of --calls calls (ms) and the ratios, measured in the same run. Both sides give
the same bits (tests/unit/embedding_ps/test_native.py; the dedup: the same ids, in another order).
Exits 2 when the C library cannot load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding_ps import native, reference  # noqa: E402


def median_ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def zipf_ids(n: int, vocab: int, rng: np.random.Generator) -> torch.Tensor:
    """int64 [n] Zipf(1.05) draws over ranks 1..vocab (inverse CDF), ranks mapped to scattered ids."""
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.05)
    ranks = np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(n)), vocab - 1)
    return torch.from_numpy(ranks.astype(np.int64) * 7919 + 13)


def run(rows: int, dim: int, calls: int, tables: int = 26, batch: int = 4096) -> dict:
    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, rows, dtype=np.int64)
    out = {"rows": rows, "dim": dim, "calls": calls}
    out["init_c_ms"] = median_ms(lambda: native.init_bits(keys, dim, reference.seed_mix(7)), calls)
    out["init_numpy_ms"] = median_ms(lambda: reference.init_bits(keys, dim, reference.seed_mix(7)), calls)
    half = rows // 2
    a = rng.choice(10 * rows, half, replace=False).astype(np.int32)
    shared = int(0.4 * half)
    fresh = rng.choice(10 * rows, half - shared, replace=False).astype(np.int32)
    b = np.concatenate([a[:shared], fresh])
    slots, grads = np.concatenate([a, b]), torch.randn(2 * half, dim)
    out["merge_c_ms"] = median_ms(lambda: native.merge_rows(slots, grads), calls)
    out["merge_numpy_torch_ms"] = median_ms(lambda: reference.merge_rows(slots, grads), calls)
    out["ratio_init"] = out["init_numpy_ms"] / out["init_c_ms"]
    out["ratio_merge"] = out["merge_numpy_torch_ms"] / out["merge_c_ms"]
    ids = [zipf_ids(batch, 200_000, rng) for _ in range(tables)]
    out["dedup_tables"], out["dedup_batch"] = tables, batch
    out["dedup_c_ms"] = median_ms(lambda: [native.unique(x) for x in ids], calls)
    out["dedup_torch_ms"] = median_ms(lambda: [torch.unique(x, return_inverse=True) for x in ids], calls)
    out["ratio_dedup"] = out["dedup_torch_ms"] / out["dedup_c_ms"]
    lengths = torch.from_numpy(rng.integers(0, 3, tables * batch)).to(torch.int64)
    indices = torch.from_numpy(rng.integers(0, 200_000, int(lengths.sum()))).to(torch.int64)
    out["example_major_c_ms"] = median_ms(lambda: native.to_example_major(indices, lengths, batch), calls)
    native.set_enabled(False)
    try:
        out["example_major_torch_ms"] = median_ms(lambda: reference.to_example_major(indices, lengths, batch), calls)
    finally:
        native.set_enabled(True)
    out["ratio_example_major"] = out["example_major_torch_ms"] / out["example_major_c_ms"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--rows", type=int, default=14_000, help="new ids to init; rows of the two pushes together")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--tables", type=int, default=26, help="trainer dedup: tables a step")
    p.add_argument("--batch", type=int, default=4096, help="trainer dedup: ids a table a step")
    a = p.parse_args()
    if not native.available():
        print("error: the native C library does not load (no C compiler?): nothing to compare", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    r = run(a.rows, a.dim, a.calls, a.tables, a.batch)
    if a.json:
        print(json.dumps(r))
    else:
        for k, v in r.items():
            print(f"  {k:22s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
