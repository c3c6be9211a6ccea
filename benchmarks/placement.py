"""Where a table should train: one table's step cost replicated on the trainer against on the PS, by rows.

    python benchmarks/placement.py [--json] [--batch 4096] [--dim 64] [--rows 1000,10000,30000,100000]

Per table size R and optimizer (row-wise Adagrad, Adam), one table of R rows, D = --dim, and a batch
of B = --batch one-id bags drawn uniformly over the R ids (the worst case for the PS: the most
distinct ids a batch can touch), timed on one thread, median of --steps after 3 warm-up steps:

- `replicated`: `recsys.models.replicated` as the trainer runs it: ids -> rows by binary search,
  sum pooling from the [R, D] parameter, backward (a dense [R, D] gradient), `TableOptimizer.step`
  (every row), zero_grad. DDP's all-reduce of the gradient (R x D x 4 bytes a step, ~1 GB/s on
  gloo here) is not included: it adds with more than one trainer.
- `ps`: the trainer's and the shard's work for the same batch: dedup (`native.unique`), pull of
  the distinct rows, pooling, backward, push (the shard's lazy update of the touched rows), on an
  in-process `LocalStore` (no transport: a launched shard adds the socket or shared-memory copy).

It prints `ratio_replicated_vs_ps` (step time replicated / ps) per R: below 1 the replicated table is
cheaper. `ps.replicate_max_rows`'s default (10,000) is the crossover measured here (BENCHMARKS.md,
"benchmarks/placement.py").
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

from embedding_ps import native  # noqa: E402
from embedding_ps.wire.config import PSConfig, TableConfig  # noqa: E402
from embedding_ps.local import LocalStore  # noqa: E402
from recsys.models.replicated import ReplicatedTables, TableOptimizer  # noqa: E402
from recsys.models.sparse_arch import _SumPool  # noqa: E402


def _pool(rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    B = idx.numel()
    return _SumPool.apply(rows, idx, torch.arange(B), torch.ones(B, dtype=torch.int64), None)


def time_replicated(R: int, opt: str, args: argparse.Namespace) -> float:
    tc = TableConfig(name="t", dim=args.dim, optimizer=opt, placement="replicated")
    tables = ReplicatedTables({"t": tc}, {"t": np.arange(R, dtype=np.int64)})
    optimizer = TableOptimizer(tables)
    g = torch.Generator().manual_seed(R)
    times = []
    for _ in range(args.steps + 3):
        ids = torch.randint(0, R, (args.batch,), generator=g)
        t0 = time.perf_counter()
        rows, idx = tables.rows("t", ids)
        _pool(rows, idx).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[3:])


def time_ps(R: int, opt: str, args: argparse.Namespace) -> float:
    tc = TableConfig(name="t", dim=args.dim, optimizer=opt)
    store = LocalStore.create(PSConfig(tables=(tc,)))
    store.push(0, torch.arange(R), torch.zeros(R, args.dim))        # every row exists, as after warm-up
    g = torch.Generator().manual_seed(R)
    times = []
    for _ in range(args.steps + 3):
        ids = torch.randint(0, R, (args.batch,), generator=g)
        t0 = time.perf_counter()
        uniq, inverse, _ = native.unique(ids, False)
        rows = store.pull(0, uniq).requires_grad_(True)
        _pool(rows, inverse).sum().backward()
        store.push(0, uniq, rows.grad)
        times.append(time.perf_counter() - t0)
    store.close()
    return 1e3 * statistics.median(times[3:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rows", default="1000,10000,30000,100000")
    p.add_argument("--optimizers", default="rowwise_adagrad,adam")
    args = p.parse_args()
    torch.set_num_threads(1)
    out: dict = {"batch": args.batch, "dim": args.dim, "threads": 1, "results": {}}
    for opt in args.optimizers.split(","):
        for R in (int(x) for x in args.rows.split(",")):
            rep, ps = time_replicated(R, opt, args), time_ps(R, opt, args)
            out["results"].setdefault(opt, {})[str(R)] = {
                "replicated_ms": round(rep, 3), "ps_ms": round(ps, 3), "ratio_replicated_vs_ps": round(rep / ps, 3)}
            if not args.json:
                print(f"{opt:16s} R={R:>8,d}  replicated {rep:7.2f} ms  ps {ps:7.2f} ms  ratio {rep / ps:5.2f}",
                      flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
