"""Hot-row cache (embedding_ps.client.cache): hit rates, eviction policies, refresh ahead, the cache's own cost.

    python benchmarks/row_cache.py [--json] [--vocab 100000 1000000] [--steps 300] [--batch 4096]
    python benchmarks/row_cache.py --criteo [--steps 100]      # 26 criteo-like tables, one call a step

Per configuration one table of `vocab` ids (or, with --criteo, the 26 sparse features of the
criteo-like preset, each its own vocabulary, all pulled in one call a step as the trainer does);
every step looks up the distinct ids of `batch` draws per table of a Zipf(--zipf) rank
(data.synthetic.zipf_ranks, the generator's sampler) mapped to 64-bit ids; the cache holds
--cache-frac of each vocabulary and serves a row for --max-age steps after its pull (the trainer's
max_age = ps.max_staleness - train.pull_ahead_batches), with refresh ahead (the trainer's default,
`refresh_ahead` 1) and without (0). The wrapped store is a stub that returns zero rows at once, so
what is timed is the cache's own work per step (lookup, eviction, row copies: `cache_ms_per_step`,
median over the steps after --warmup) and what is counted is, over the steps after --warmup:

- `hit_rate_per_distinct`: hits / distinct ids looked up (what the trainer's `cache/hit_rate`
  and train_throughput's `cache_hit_rate` report);
- `hit_rate_per_lookup`: hits / ids drawn, a batch's duplicates counted (hits / accesses, the usual
  definition of a cache's hit rate: fbgemm's UVM cache stats count requested vs missed indices);
- `refresh_rate`: rows pulled ahead (still sent by the shard) / distinct ids looked up;
- `ideal_static_*`: a static cache of exactly the top --cache-frac ranks (the most probable ids,
  known in advance, never stale) on the same stream: the upper bound of any cache of that size
  that serves rows without a refresh miss.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: spinning OpenMP starves 2 cores

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.hashing import splitmix64_finalize  # noqa: E402
from data.synthetic import PRESETS, zipf_ranks  # noqa: E402
from embedding_ps.client.cache import CachingStore  # noqa: E402
from embedding_ps.wire.config import PSConfig, TableConfig  # noqa: E402
from embedding_ps.store import done_future  # noqa: E402


class ZeroStore:
    """The least store a CachingStore needs: zero rows at once (no shard work in the timing)."""

    def __init__(self, dim: int, most: int) -> None:
        self.dim, self.step = dim, 0
        self.rows = torch.zeros(most, dim)        # one buffer: no fresh pages in the timed calls

    def pull_many_async(self, tables, ids, step=None):
        return done_future(self.rows[:sum(x.numel() for x in ids)])


def stream(vocabs: list[int], zipf: float, steps: int, batch: int, seed: int, frac: float) -> list[list[tuple]]:
    """Per step, per table: (distinct ids [U], occurrences [U], in the top `frac` ranks bool [U])."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        parts = []
        for t, vocab in enumerate(vocabs):
            ranks = zipf_ranks(rng.random(batch), vocab, zipf).astype(np.uint64)       # [batch], 0 = most likely
            ids = (splitmix64_finalize(ranks + np.uint64(t << 40)) & np.uint64((1 << 63) - 1)).astype(np.int64)
            u, first, counts = np.unique(ids, return_index=True, return_counts=True)
            top = ranks[first] < max(1, int(vocab * frac))
            parts.append((torch.from_numpy(u), torch.from_numpy(counts), top))
        out.append(parts)
    return out


def measure(ids: list[list[tuple]], vocabs: list[int], policy: str, refresh: int, args: argparse.Namespace) -> dict:
    tables = tuple(TableConfig(name=f"t{i}", dim=args.dim, cache_rows=max(1, int(v * args.cache_frac)))
                   for i, v in enumerate(vocabs))
    store = CachingStore(ZeroStore(args.dim, args.batch * len(vocabs)), PSConfig(tables=tables),
                         max_age=args.max_age, policy=policy, refresh_ahead=refresh)   # type: ignore[arg-type]
    every = list(range(len(vocabs)))
    tot = dict.fromkeys(("hits", "misses", "refreshes", "lookups", "lookup_hits"), 0)
    ideal = {"distinct": 0, "distinct_hits": 0, "draws": 0, "draw_hits": 0}
    secs = []
    for step, parts in enumerate(ids):
        t0 = time.perf_counter()
        store.pull_many_async(every, [u for u, _, _ in parts], step, counts=[c for _, c, _ in parts]).result()
        secs.append(time.perf_counter() - t0)
        got = store.cache_counts()
        if step >= args.warmup:
            for c in got.values():
                for k in tot:
                    tot[k] += c[k]
            for u, c, top in parts:
                ideal["distinct"] += u.numel()
                ideal["distinct_hits"] += int(top.sum())
                ideal["draws"] += int(c.sum())
                ideal["draw_hits"] += int(c.numpy()[top].sum())
    distinct = tot["hits"] + tot["misses"]
    return {"policy": policy, "refresh_ahead": refresh, "vocab": vocabs[0] if len(vocabs) == 1 else "criteo-like",
            "cache_rows": sum(t.cache_rows for t in tables),
            "hit_rate_per_distinct": round(tot["hits"] / distinct, 4),
            "hit_rate_per_lookup": round(tot["lookup_hits"] / tot["lookups"], 4),
            "refresh_rate": round(tot["refreshes"] / distinct, 4),
            "ideal_static_per_distinct": round(ideal["distinct_hits"] / ideal["distinct"], 4),
            "ideal_static_per_lookup": round(ideal["draw_hits"] / ideal["draws"], 4),
            "cache_ms_per_step": round(1e3 * statistics.median(secs[args.warmup:]), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--vocab", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--criteo", action="store_true", help="the 26 criteo-like tables in one call a step")
    p.add_argument("--policies", nargs="+", choices=("lfu", "lru"), default=["lfu", "lru"])
    p.add_argument("--refresh", type=int, nargs="+", default=[1, 0], help="refresh_ahead values to run")
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
    settings = [[f.vocab for f in PRESETS["criteo-like"].sparse][:26]] if a.criteo else [[v] for v in a.vocab]
    results = []
    for vocabs in settings:
        ids = stream(vocabs, a.zipf, a.steps, a.batch, seed=0, frac=a.cache_frac)
        for policy in a.policies:
            for refresh in a.refresh:
                results.append(measure(ids, vocabs, policy, refresh, a))
    out = {"zipf": a.zipf, "cache_frac": a.cache_frac, "max_age": a.max_age, "steps": a.steps, "warmup": a.warmup,
           "batch": a.batch, "results": results}
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"Zipf({a.zipf}) ids, batch {a.batch} a table, cache {a.cache_frac:.0%} of each vocabulary, "
          f"max_age {a.max_age}, {a.steps} steps (counted after {a.warmup})")
    print(f"  {'vocab':>11s} {'policy':6s} {'refresh':>7s} {'rows':>9s} {'distinct':>8s} {'lookup':>7s} "
          f"{'refresh':>7s} {'ideal d':>7s} {'ideal l':>7s} {'ms/step':>8s}")
    for r in results:
        print(f"  {r['vocab']!s:>11s} {r['policy']:6s} {r['refresh_ahead']:7d} {r['cache_rows']:9,d} "
              f"{r['hit_rate_per_distinct']:8.4f} {r['hit_rate_per_lookup']:7.4f} {r['refresh_rate']:7.4f} "
              f"{r['ideal_static_per_distinct']:7.4f} {r['ideal_static_per_lookup']:7.4f} {r['cache_ms_per_step']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
