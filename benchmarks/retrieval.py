"""Top-K retrieval: the approximate index (`recsys.serving.ann.AnnIndex`, faiss HNSW, what
`Predictor.topk` searches in an export made with `--index ann`) against the exact one
(`recsys.serving.retrieval.ExactIndex`), recall and queries/s measured in the same run.

    python benchmarks/retrieval.py [--json] [--items 1000000] [--dim 64] [--batch 256] [--k 100]
                                   [--data clustered,random] [--ef-search 100,200] [--M 32]
                                   [--ef-construction 100] [--hnswlib] [--baselines]
                                   [--threads T] [--repeats R]

Per data set (`--data`; I items x d, B queries, seed 0):
- clustered: item and query vectors around 1,000 shared random centers (center + 0.5 x N(0, I)
  noise per coordinate, L2-normalized): embeddings with structure, as trained towers give;
- random: isotropic unit vectors (the data of this script before the ANN index): no structure
  at all, the worst case for any graph or cluster index (every item is about as far as any other).
The ANN index is built once per data set (`build_seconds`, both cores) and searched at each
`--ef-search`; `recall_at_{k}` = mean over the queries of |ANN ids & exact ids| / k, against
`ExactIndex`'s ids on the same queries. Queries/s: the batch of B queries, median of --repeats
after one warm-up, for both indexes; `speedup` = ann_queries_per_s / exact_queries_per_s.
`--hnswlib`: the same graph (M, ef_construction, ef_search, space "ip") with hnswlib (the library
comparison; an error before anything runs when it is not installed: `pip install hnswlib`).
`--baselines`: the exact search's own baselines, one [B, I] score matrix + torch.topk (`torch_full`)
and numpy argpartition, checked for the same ids.

The target (issue #31): recall@100 >= 0.95 at >= 20x the exact queries/s, 1M items x d64, k 100.
Figures: BENCHMARKS.md, "benchmarks/retrieval.py".
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

from recsys.serving.ann import AnnIndex  # noqa: E402
from recsys.serving.retrieval import ExactIndex  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, object]:
    out = fn()                                          # warm-up (and the result)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def vectors(kind: str, items: int, batch: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    norm = torch.nn.functional.normalize
    if kind == "random":
        return norm(torch.randn(items, dim, generator=g), dim=1), norm(torch.randn(batch, dim, generator=g), dim=1)
    centers = torch.randn(1000, dim, generator=g)

    def around(n: int) -> torch.Tensor:
        return norm(centers[torch.randint(1000, (n,), generator=g)] + 0.5 * torch.randn(n, dim, generator=g), dim=1)

    return around(items), around(batch)


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([np.intersect1d(a, b).size / b.size for a, b in zip(found, exact)]))


def hnswlib_runs(args, items: torch.Tensor, queries: torch.Tensor, ids: np.ndarray, want: np.ndarray,
                 exact_qps: float) -> dict:
    import hnswlib                               # main() refused --hnswlib without it

    t0 = time.perf_counter()
    index = hnswlib.Index(space="ip", dim=args.dim)
    index.init_index(max_elements=args.items, M=args.M, ef_construction=args.ef_construction, random_seed=0)
    index.add_items(items.numpy(), ids, num_threads=torch.get_num_threads())
    out = {"build_seconds": time.perf_counter() - t0, "runs": []}
    for ef in args.ef_search:
        index.set_ef(max(ef, args.k))
        sec, (found, _) = timed(lambda: index.knn_query(queries.numpy(), k=args.k,
                                                        num_threads=torch.get_num_threads()), args.repeats)
        qps = args.batch / sec
        out["runs"].append({"ef_search": ef, f"recall_at_{args.k}": recall(found, want), "queries_per_s": qps,
                            "speedup": qps / exact_qps})
    return out


def baselines(args, items: torch.Tensor, queries: torch.Tensor, ids: np.ndarray, want: np.ndarray,
              exact_ms: float) -> dict:
    items_np, queries_np = items.numpy(), queries.numpy()

    def torch_full() -> np.ndarray:
        return ids[torch.topk(queries @ items.t(), args.k, dim=1).indices.numpy()]                  # [B, I]

    def numpy_argpartition() -> np.ndarray:
        s = queries_np @ items_np.T                                                                  # [B, I]
        part = np.argpartition(-s, args.k - 1, axis=1)[:, :args.k]
        order = np.argsort(-np.take_along_axis(s, part, axis=1), axis=1)
        return ids[np.take_along_axis(part, order, axis=1)]

    out = {}
    for name, fn in (("torch_full", torch_full), ("numpy_argpartition", numpy_argpartition)):
        sec, got = timed(fn, args.repeats)
        same = float((got == want).mean())
        if same < 0.999:                                                   # ties aside, the same ids
            raise SystemExit(f"{name} disagrees with exact_index on {100 * (1 - same):.2f}% of the ids")
        out[name] = {"ms_per_batch": 1e3 * sec, "queries_per_s": args.batch / sec, "same_ids": same,
                     "ms_of_exact_index": 1e3 * sec / exact_ms}
    return out


def run_data(args, kind: str) -> dict:
    items, queries = vectors(kind, args.items, args.batch, args.dim)
    ids = np.arange(args.items, dtype=np.int64) * 7 + 3
    exact = ExactIndex(ids, items)
    sec, (want, _) = timed(lambda: exact.search(queries, args.k), args.repeats)
    exact_qps = args.batch / sec
    out: dict = {"exact_ms_per_batch": 1e3 * sec, "exact_queries_per_s": exact_qps}
    ann = AnnIndex.build(ids, items, M=args.M, ef_construction=args.ef_construction)
    out["ann"] = {"build_seconds": ann.params["build_seconds"], "runs": []}
    for ef in args.ef_search:
        ann.params["ef_search"] = ef
        sec, (found, _) = timed(lambda: ann.search(queries, args.k), args.repeats)
        qps = args.batch / sec
        out["ann"]["runs"].append({"ef_search": ef, f"recall_at_{args.k}": recall(found, want),
                                   "ann_queries_per_s": qps, "speedup": qps / exact_qps})
    if args.hnswlib:
        out["hnswlib"] = hnswlib_runs(args, items, queries, ids, want, exact_qps)
    if args.baselines:
        out["baselines"] = baselines(args, items, queries, ids, want, out["exact_ms_per_batch"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--data", default="clustered,random", help="comma-separated: clustered, random")
    ap.add_argument("--ef-search", default="100,200", help="comma-separated ef_search values (>= k is used)")
    ap.add_argument("--M", type=int, default=32)
    ap.add_argument("--ef-construction", type=int, default=100)
    ap.add_argument("--hnswlib", action="store_true", help="the same graph with hnswlib (pip install hnswlib)")
    ap.add_argument("--baselines", action="store_true", help="torch_full and numpy_argpartition too")
    ap.add_argument("--threads", type=int, default=0, help="torch and faiss threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.hnswlib:
        try:
            import hnswlib  # noqa: F401
        except ImportError:
            ap.error("--hnswlib: the hnswlib package is not installed (pip install hnswlib)")
    args.ef_search = [int(x) for x in args.ef_search.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    import faiss
    faiss.omp_set_num_threads(torch.get_num_threads())
    report = {"items": args.items, "dim": args.dim, "batch": args.batch, "k": args.k, "M": args.M,
              "ef_construction": args.ef_construction, "threads": torch.get_num_threads(),
              "faiss": faiss.__version__, "data": {}}
    for kind in args.data.split(","):
        report["data"][kind] = run_data(args, kind)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{args.items} items x d{args.dim}, batch {args.batch} queries, top-{args.k}, "
          f"{report['threads']} threads, HNSW M {args.M}, ef_construction {args.ef_construction}")
    for kind, r in report["data"].items():
        print(f"{kind}: exact_index {r['exact_ms_per_batch']:.1f} ms/batch, {r['exact_queries_per_s']:.0f} queries/s")
        for lib in ("ann", "hnswlib"):
            if lib not in r:
                continue
            name = "faiss HNSW (AnnIndex)" if lib == "ann" else "hnswlib"
            print(f"  {name}: built in {r[lib]['build_seconds']:.1f} s")
            for x in r[lib]["runs"]:
                qps = x.get("ann_queries_per_s", x.get("queries_per_s"))
                print(f"    ef_search {x['ef_search']:5d}: recall@{args.k} {x[f'recall_at_{args.k}']:.4f}, "
                      f"{qps:8.0f} queries/s, {x['speedup']:.1f}x exact")
        for name, b in r.get("baselines", {}).items():
            print(f"  {name}: {b['ms_per_batch']:.1f} ms/batch ({b['ms_of_exact_index']:.2f}x exact_index's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
