"""Hot-row cache policies (embedding_ps.cache): LFU against LRU on Zipf id streams.

    python benchmarks/row_cache.py [--json] [--vocab 100000 1000000] [--steps 300] [--batch 4096]

Per configuration one table of `vocab` ids; every step looks up the distinct ids of `batch` draws
of a Zipf(--zipf) rank (data.synthetic.zipf_ranks, the generator's sampler) mapped to 64-bit ids;
the cache holds --cache-frac of the vocabulary and serves a row for --max-age steps after its pull
(the trainer's max_age = ps.max_staleness - train.prefetch_batches). The wrapped store is a stub
that returns zero rows at once, so what is timed is the cache's own work per step (lookup,
eviction, assembly) and what is counted is its hit rate: hits / distinct ids looked up (the rows
the store does not send), over the steps after the first --warmup ones (and over all steps), and
per draw (`hit_rate_per_occurrence`: the batch's ids, duplicates included, that find a fresh row). `DEFAULT_POLICY` in embedding_ps/cache.py
cites this measurement.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: spinning OpenMP starves 2 cores

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.hashing import splitmix64_finalize  # noqa: E402
from data.synthetic import zipf_ranks  # noqa: E402
from embedding_ps.cache import CachingStore  # noqa: E402
from embedding_ps.config import PSConfig, TableConfig  # noqa: E402
from embedding_ps.store import done_future  # noqa: E402


class ZeroStore:
    """The least store a CachingStore needs: zero rows at once (no shard work in the timing)."""

    def __init__(self, dim: int) -> None:
        self.dim, self.step = dim, 0

    def pull_many_async(self, tables, ids, step=None):
        return done_future(torch.zeros(sum(x.numel() for x in ids), self.dim))


def stream(vocab: int, zipf: float, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    """Per step: int64 ids [batch], ranks ~ Zipf(zipf) over vocab, as 63-bit ids (one per rank)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ranks = zipf_ranks(rng.random(batch), vocab, zipf).astype(np.uint64)
        ids = (splitmix64_finalize(ranks) & np.uint64((1 << 63) - 1)).astype(np.int64)
        out.append(torch.from_numpy(ids))
    return out


def measure(ids: list[torch.Tensor], vocab: int, policy: str, args: argparse.Namespace) -> dict:
    rows = max(1, int(vocab * args.cache_frac))
    cfg = PSConfig(tables=(TableConfig(name="t", dim=args.dim, cache_rows=rows),))
    store = CachingStore(ZeroStore(args.dim), cfg, max_age=args.max_age, policy=policy)   # type: ignore[arg-type]
    hits = misses = warm_hits = warm_misses = 0
    occ_hits = occ_total = 0
    secs = 0.0
    cache = store.caches[0]
    for step, x in enumerate(ids):
        u, counts = torch.unique(x, return_counts=True)
        if step >= args.warmup:          # per occurrence: which of the batch's draws find a fresh row
            slot = cache.map.lookup(u.numpy())
            have = slot >= 0
            age = step - cache.pulled[slot[have]]
            fresh = np.zeros(u.numel(), dtype=bool)
            fresh[have] = (age >= 0) & (age <= args.max_age)
            occ_hits += int(counts.numpy()[fresh].sum())
            occ_total += x.numel()
        t0 = time.perf_counter()
        store.pull_many_async([0], [u], step).result()              # the sparse arch sends distinct ids
        secs += time.perf_counter() - t0
        h, m = store.cache_stats()["t"]
        hits, misses = hits + h, misses + m
        if step >= args.warmup:
            warm_hits, warm_misses = warm_hits + h, warm_misses + m
    return {"policy": policy, "vocab": vocab, "cache_rows": rows,
            "hit_rate": round(warm_hits / (warm_hits + warm_misses), 4),
            "hit_rate_all_steps": round(hits / (hits + misses), 4),
            "hit_rate_per_occurrence": round(occ_hits / occ_total, 4),
            "cache_ms_per_step": round(1e3 * secs / len(ids), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--vocab", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--cache-frac", type=float, default=0.05)
    p.add_argument("--max-age", type=int, default=7)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.warmup >= a.steps:
        p.error(f"--warmup ({a.warmup}) must be < --steps ({a.steps})")
    torch.set_num_threads(a.threads)
    results = []
    for vocab in a.vocab:
        ids = stream(vocab, a.zipf, a.steps, a.batch, seed=0)
        for policy in ("lfu", "lru"):
            results.append(measure(ids, vocab, policy, a))
    best = {}
    for vocab in a.vocab:
        rates = {r["policy"]: r["hit_rate"] for r in results if r["vocab"] == vocab}
        best[str(vocab)] = max(rates, key=rates.get)
    out = {"zipf": a.zipf, "cache_frac": a.cache_frac, "max_age": a.max_age, "steps": a.steps, "warmup": a.warmup,
           "batch": a.batch, "results": results, "better_policy": best}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"Zipf({a.zipf}) ids, batch {a.batch}, cache {a.cache_frac:.0%} of the vocabulary, max_age {a.max_age}, "
          f"{a.steps} steps (hit rate after {a.warmup})")
    print(f"  {'vocab':>10s} {'policy':6s} {'rows':>8s} {'hit rate':>9s} {'all steps':>9s} {'per draw':>9s} "
          f"{'ms/step':>8s}")
    for r in results:
        print(f"  {r['vocab']:10,d} {r['policy']:6s} {r['cache_rows']:8,d} {r['hit_rate']:9.4f} "
              f"{r['hit_rate_all_steps']:9.4f} {r['hit_rate_per_occurrence']:9.4f} {r['cache_ms_per_step']:8.2f}")
    print(f"  better: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
