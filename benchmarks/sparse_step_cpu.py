"""CPU time of the sparse part of one training step: our sparse arch + shard work against TorchRec's FusedEBC.

    python benchmarks/sparse_step_cpu.py [--json] [--steps S] [--threads T]

train_throughput.py's job (criteo-like data, 26 one-id features C1..C26, B = 4096, D = 64,
row-wise Adagrad lr 0.05), one process, no dense model: each step's pooled output gets a random
upstream gradient, so only the sparse work is timed, phase by phase, in process CPU ms (every
thread of this process, `time.process_time`), median over --steps steps after 3 warm-up steps:

- ours, trainer side: `lookup` (ids per table -> unique ids, inverse, order; the pull request
  issued to a store that returns zeros at once), `pool_fwd` (`lookup.wait()`: example-major
  order + embedding_bag), `pool_bwd` (sum pooling's backward: the row gradients [U, D]),
  `push` (the push call on that store);
- ours, shard side, in process: `shard_pull` / `shard_push` (a `LocalStore`'s pull of the unique
  ids and push of their gradients: id map, gather, row-wise Adagrad update; what the shard
  process does besides decoding requests);
- TorchRec: `remap` (id % rows, as the benchmark's baseline does), `ebc_fwd`, `ebc_bwd` (fbgemm
  TBE backward with the row-wise Adagrad update fused in).

`ours_trainer_ms`, `ours_shard_ms` and `torchrec_ms` sum the phases. Our trainer's sparse work
competes for the same 2 cores as the shard's, so the sum of both against TorchRec's is what the
end-to-end ratio feels (beside the dense model, which is the same in both):
`cpu_ratio_vs_torchrec` = torchrec_ms / (ours_trainer_ms + ours_shard_ms), measured in the same run.
The TorchRec baseline (`pip install -e .[bench]`, or `make bench-deps`) is required: without it the
script exits 2 naming what is missing, unless --allow-missing-baseline (then its figures are null).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput as tt  # noqa: E402
from data.loader import ParquetLoader  # noqa: E402
from data.synthetic import generate  # noqa: E402
from embedding_ps.local import LocalStore  # noqa: E402
from embedding_ps.store import done_future  # noqa: E402
from recsys.models import build_sparse_arch  # noqa: E402

WARMUP = 3


class ZeroStore:
    """Pulls return zeros [N, D] at once, pushes do nothing: the trainer side alone."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def pull_many_async(self, tables, ids, step=None):
        return done_future(torch.zeros(sum(x.numel() for x in ids), self.dim))

    def push_many_async(self, tables, ids, grads, step=None):
        return done_future(None)


class Phases:
    """CPU ms per phase, one list per phase name."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = {}

    def time(self, name: str, fn):
        t0 = time.process_time()
        out = fn()
        self.ms.setdefault(name, []).append(1e3 * (time.process_time() - t0))
        return out

    def medians(self) -> dict[str, float]:
        return {k: round(statistics.median(v[WARMUP:]), 3) for k, v in self.ms.items()}


def load_batches(args: argparse.Namespace, tmp: str):
    generate(preset="criteo-like", rows=args.rows, num_files=1, out_dir=os.path.join(tmp, "data"), seed=0)
    ns = argparse.Namespace(batch_size=args.batch_size, dim=args.dim, ps_kernel=args.ps_kernel, rows=args.rows,
                            log_every=1, steps=1, threads=args.threads, ps_shared_memory="false")
    cfg = tt.job_config(ns, os.path.join(tmp, "data"), os.path.join(tmp, "run"), "async")
    batches = []
    with ParquetLoader(cfg.data, cfg.data.train_paths) as loader:
        for b in loader:
            batches.append(b)
            if len(batches) >= args.batches:
                break
    return cfg, batches


def run_ours(cfg, batches, steps: int) -> tuple[dict, float]:
    sparse, zero, store = build_sparse_arch(cfg), ZeroStore(cfg.ps.tables[0].dim), LocalStore.create(cfg.ps)
    tables = [p.table for p in sparse.plans]
    ph, uniq = Phases(), []
    for i in range(WARMUP + steps):
        batch = batches[i % len(batches)]
        look = ph.time("lookup", lambda: sparse.lookup(batch, zero, i))
        pooled, _ = ph.time("pool_fwd", look.wait)
        up = torch.randn_like(pooled)
        ph.time("pool_bwd", lambda: pooled.backward(up))
        ph.time("push", lambda: look.push(1.0))
        ph.time("shard_pull", lambda: store.pull_many_async(tables, look.ids, i).result())
        ph.time("shard_push", lambda: store.push_many_async(tables, look.ids, look.rows[0].grad, i).result())
        uniq.append(look.rows[0].shape[0])
    return ph.medians(), statistics.median(uniq)


def run_torchrec(args: argparse.Namespace, batches, steps: int) -> dict:
    rows = tt.table_rows(args.cap)
    sparse, rows_t, ph = tt.TorchRecSparse(rows, args.dim), torch.tensor(rows, dtype=torch.int64), Phases()
    for i in range(WARMUP + steps):
        batch = batches[i % len(batches)]
        kj = ph.time("remap", lambda: tt.remap(batch.sparse, rows_t))
        pooled = ph.time("ebc_fwd", lambda: sparse(kj))
        up = torch.randn_like(pooled)
        ph.time("ebc_bwd", lambda: pooled.backward(up))
    return ph.medians()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=60_000)
    p.add_argument("--batches", type=int, default=12, help="distinct batches cycled through")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--cap", type=int, default=200_000)
    p.add_argument("--ps-kernel", choices=("auto", "native", "torch", "fbgemm"), default="auto")
    p.add_argument("--allow-missing-baseline", action="store_true",
                   help="without torchrec, report its figures as null instead of failing")
    a = p.parse_args()
    missing = tt.torchrec_missing()
    if missing and not a.allow_missing_baseline:
        print(f"sparse_step_cpu.py: {missing}: the TorchRec baseline cannot run (make bench-deps, or pass "
              f"--allow-missing-baseline)", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench-sparse-") as tmp:
        cfg, batches = load_batches(a, tmp)
        ours, unique = run_ours(cfg, batches, a.steps)
        trec = None if missing else run_torchrec(a, batches, a.steps)
    trainer_ms = round(sum(ours[k] for k in ("lookup", "pool_fwd", "pool_bwd", "push")), 2)
    shard_ms = round(ours["shard_pull"] + ours["shard_push"], 2)
    trec_ms = None if trec is None else round(sum(trec.values()), 2)
    out = {"ours": ours, "torchrec": trec, "unique_rows_per_step": unique,
           "ids_per_step": int(batches[0].sparse.values.numel()),
           "ours_trainer_ms": trainer_ms, "ours_shard_ms": shard_ms, "torchrec_ms": trec_ms,
           "cpu_ratio_vs_torchrec": None if trec_ms is None else round(trec_ms / (trainer_ms + shard_ms), 3),
           "baseline": missing or "torchrec FusedEmbeddingBagCollection", "threads": a.threads, "steps": a.steps}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"sparse step, CPU ms (median of {a.steps}), {a.threads} threads, {out['ids_per_step']} ids, "
          f"{unique:.0f} unique rows a step")
    for side, phases in (("ours", ours), ("torchrec", trec or {})):
        for k, v in phases.items():
            print(f"  {side:9s} {k:11s} {v:7.2f}")
    for k in ("ours_trainer_ms", "ours_shard_ms", "torchrec_ms", "cpu_ratio_vs_torchrec"):
        print(f"  {k:21s} {'null' if out[k] is None else f'{out[k]:7.2f}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
