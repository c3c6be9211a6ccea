"""Exact top-K retrieval throughput: `recsys.serving.retrieval.ExactIndex` (what `Predictor.topk`
searches) over I items x d, B user queries per batch, against two baselines measured in the same run.

    python benchmarks/retrieval.py [--json] [--items 1000000] [--dim 64] [--batch 256] [--k 100]
                                   [--threads T] [--repeats R]

- exact_index: blocked matmul (65,536 items per block) + torch.topk per block + a topk over the
  candidates; never holds the full [B, I] score matrix (64 MB per block at B = 256)
- torch_full (baseline): one [B, I] score matrix (1 GB at B = 256, I = 1M) and torch.topk
- numpy_argpartition (baseline): numpy matmul, argpartition of k, argsort of the k

Random unit item vectors and queries (seed 0). All three must return the same ids (checked; the
run fails otherwise). Prints queries/s and ms per batch (median over --repeats after one warm-up)
and the ratio of each to exact_index ("speedup_of_exact_index": the method's ms / exact_index's ms).

Measured figures, and how often the methods' ids agree (near-ties round differently in the two
matmul shapes): BENCHMARKS.md, "benchmarks/retrieval.py". What exact_index buys is memory:
a 64 MB score block where the baselines hold the 1 GB [B, I] matrix.
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

from recsys.serving.retrieval import ExactIndex  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()                                          # warm-up (and the result)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    items = torch.nn.functional.normalize(torch.randn(args.items, args.dim, generator=g), dim=1)   # [I, d]
    queries = torch.nn.functional.normalize(torch.randn(args.batch, args.dim, generator=g), dim=1)  # [B, d]
    ids = np.arange(args.items, dtype=np.int64) * 7 + 3
    index = ExactIndex(ids, items)
    items_np, queries_np = items.numpy(), queries.numpy()

    def torch_full() -> np.ndarray:
        s = queries @ items.t()                                            # [B, I]
        return ids[torch.topk(s, args.k, dim=1).indices.numpy()]

    def numpy_argpartition() -> np.ndarray:
        s = queries_np @ items_np.T                                        # [B, I]
        part = np.argpartition(-s, args.k - 1, axis=1)[:, :args.k]         # [B, k] unordered
        order = np.argsort(-np.take_along_axis(s, part, axis=1), axis=1)
        return ids[np.take_along_axis(part, order, axis=1)]

    runs = {"exact_index": lambda: index.search(queries, args.k)[0], "torch_full": torch_full,
            "numpy_argpartition": numpy_argpartition}
    results, outs = {}, {}
    for name, fn in runs.items():
        sec, outs[name] = timed(fn, args.repeats)
        results[name] = {"ms_per_batch": 1e3 * sec, "queries_per_s": args.batch / sec}
    for name in ("torch_full", "numpy_argpartition"):
        same = float((outs[name] == outs["exact_index"]).mean())
        if same < 0.999:                                                   # ties aside, the same ids
            raise SystemExit(f"{name} disagrees with exact_index on {100 * (1 - same):.2f}% of the ids")
        results[name]["same_ids"] = same
    base = results["exact_index"]["ms_per_batch"]
    for name in results:
        results[name]["speedup_of_exact_index"] = results[name]["ms_per_batch"] / base
    report = {"items": args.items, "dim": args.dim, "batch": args.batch, "k": args.k,
              "threads": torch.get_num_threads(), "results": results}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{args.items} items x d{args.dim}, batch {args.batch} queries, top-{args.k}, "
              f"{torch.get_num_threads()} threads")
        for name, r in results.items():
            print(f"  {name:20s} {r['ms_per_batch']:9.1f} ms/batch {r['queries_per_s']:10.0f} queries/s "
                  f"(exact_index is {r['speedup_of_exact_index']:.2f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
