"""In-process microbenchmarks of one PS shard's core (no network).

    python benchmarks/ps_table.py [--json] [--rows 2000000] [--batch 100000] [--repeats 15] [--threads 1]
                                  [--native on|off|both] [--kernels]

1. id -> slot map: lookups of present ids, lookups of absent ids, inserts of new ids, and the
   push pattern "look up a batch, insert what is missing" (10% new), on a map of --rows ids.
2. ShardState pull / push (row-wise Adagrad) of --batch unique present ids, dim 16 and 64, on a
   table of --rows rows; and the baseline: plain `index_select` / `index_add_` on a preallocated
   [rows, D] tensor with the same indices (what a shard with no map, optimizer or counters costs).
3. Resident bytes per row at dim 64 (weights + row-wise Adagrad state + map + counters), measured
   as the RSS growth of a fresh subprocess that fills a table with --rss-rows rows (after
   `release_free_heap()`, which a shard runs after each sweep; the untrimmed growth is printed
   too; the growth includes constant per-process buffers, e.g. the [batch, D] update scratch),
   against the raw fp32 row (4 * 64 = 256 bytes).
--native: with (`on`, the default) or without (`off`, as EMBEDDING_PS_NATIVE=0) the C fast path of
embedding_ps/native.py; `both` runs sections 1-2 twice and suffixes every key `_native` / `_pure`.
4. --kernels (alone: sections 1-3 are skipped): push rows/s of each update path a table can run,
   per optimizer fbgemm updates on CPU (sgd, adagrad, rowwise_adagrad), without weight decay and
   with l2 / decoupled decay, fp32 and fp16 rows, dim 64 and 16: --batch unique present ids into
   a --rows table through ShardState.push. Paths: with the C library loaded, fbgemm's fused CPU
   TBE op (`fbgemm`) and the C update (`native`); without it, fbgemm (`fbgemm_pure`) and vectorized
   torch (`torch`), both with the numpy id map. Ratios fbgemm / native and fbgemm_pure / torch.
   The product's default is the native update; a table whose machine measures fbgemm faster here
   sets `kernel = "fbgemm"` (BENCHMARKS.md, "benchmarks/ps_table.py").
Every timing is the median of --repeats runs after one warm-up; rows/s count unique rows, and
`pull_push_*` counts pulled plus pushed rows: 2 * N / (t_pull + t_push).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

from embedding_ps import native
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.idmap import IdMap
from embedding_ps.shard.state import ShardState, release_free_heap


CPU_CLOCK = [False]  # --clock cpu: time.process_time (robust on a shared, overloaded machine)


def median_s(fn, repeats: int, setup=None) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up (wall clock, or process CPU time)."""
    clock = time.process_time if CPU_CLOCK[0] else time.perf_counter
    if setup:
        setup()
    fn()
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(np.median(times))


def bench_map(rows: int, batch: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**63), 2**63 - 1, rows + (repeats + 2) * batch * 2, dtype=np.int64)
    m = IdMap()
    for i in range(0, rows, 1 << 20):
        m.insert(keys[i : min(i + (1 << 20), rows)], np.arange(i, min(i + (1 << 20), rows), dtype=np.int32))
    present = keys[rng.integers(0, rows, batch)]
    absent = keys[rows : rows + batch]
    out = {"map_size": float(len(m)), "map_load": len(m) / m.num_buckets}
    out["map_lookup_hit_ids_per_s"] = batch / median_s(lambda: m.lookup(present), repeats)
    out["map_lookup_miss_ids_per_s"] = batch / median_s(lambda: m.lookup(absent), repeats)
    cursor = [rows]

    def fresh_batch(n_new: int) -> np.ndarray:
        new = keys[cursor[0] : cursor[0] + n_new]
        cursor[0] += n_new
        return np.concatenate([new, keys[rng.integers(0, rows, batch - n_new)]])

    def insert_new() -> None:
        m.insert(keys[cursor[0] : cursor[0] + batch], np.zeros(batch, dtype=np.int32))
        cursor[0] += batch

    out["map_insert_new_ids_per_s"] = batch / median_s(insert_new, repeats)
    pending = [None]

    def lookup_insert() -> None:
        b = pending[0]
        slots = m.lookup(b)
        miss = slots < 0
        m.insert(b[miss], np.zeros(int(miss.sum()), dtype=np.int32))

    def prep() -> None:
        pending[0] = np.unique(fresh_batch(batch // 10))

    out["map_lookup_insert_10pct_new_ids_per_s"] = batch / median_s(lookup_insert, repeats, setup=prep)
    return out


def combined(pull_rate: float, push_rate: float) -> float:
    """Rows pulled plus rows pushed per second when a shard alternates equal pulls and pushes."""
    return 2.0 / (1.0 / pull_rate + 1.0 / push_rate)


def bench_shard(rows: int, batch: int, dim: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(2)
    out = _time_shard(rows, batch, dim, repeats, g)  # the shard's memory is freed when it returns
    out.update(_time_baseline(rows, batch, dim, repeats, g))
    return out


def filled_state(rows: int, dim: int, all_ids: torch.Tensor, **table: object) -> ShardState:
    """A one-table shard holding rows `all_ids` int64 [rows] (zero gradients pushed at step 0)."""
    state = ShardState(PSConfig(tables=(TableConfig(name="t", dim=dim, **table),)), 0)
    for i in range(0, rows, 1 << 18):
        chunk = all_ids[i : i + (1 << 18)]
        state.push(0, chunk, torch.zeros(chunk.shape[0], dim), step=0)
    return state


def _time_shard(rows: int, batch: int, dim: int, repeats: int, g: torch.Generator) -> dict[str, float]:
    """ShardState pull and push (row-wise Adagrad) of `batch` unique present ids."""
    all_ids = torch.from_numpy(np.random.default_rng(1).permutation(rows * 7)[:rows].astype(np.int64) - rows)
    state = filled_state(rows, dim, all_ids, optimizer="rowwise_adagrad")
    ids = all_ids[torch.randperm(rows, generator=g)[:batch]]
    grads = torch.randn(batch, dim, generator=g)
    step = [1]

    def push() -> None:
        state.push(0, ids, grads, step[0])
        step[0] += 1

    out = {
        f"pull_d{dim}_rows_per_s": batch / median_s(lambda: state.pull(0, ids), repeats),
        f"push_d{dim}_rows_per_s": batch / median_s(push, repeats),
    }
    out[f"pull_push_d{dim}_rows_per_s"] = combined(out[f"pull_d{dim}_rows_per_s"], out[f"push_d{dim}_rows_per_s"])
    return out


def _time_baseline(rows: int, batch: int, dim: int, repeats: int, g: torch.Generator) -> dict[str, float]:
    """Plain index_select / index_add_ of `batch` rows of a preallocated [rows, dim] tensor."""
    weights = torch.empty(rows, dim)
    weights.normal_()
    idx = torch.randperm(rows, generator=g)[:batch]
    grads = torch.randn(batch, dim, generator=g)
    out = {
        f"baseline_index_select_d{dim}_rows_per_s": batch / median_s(lambda: weights.index_select(0, idx), repeats),
        f"baseline_index_add_d{dim}_rows_per_s": batch / median_s(lambda: weights.index_add_(0, idx, grads), repeats),
    }
    out[f"baseline_pull_push_d{dim}_rows_per_s"] = combined(
        out[f"baseline_index_select_d{dim}_rows_per_s"], out[f"baseline_index_add_d{dim}_rows_per_s"]
    )
    return out


KERNEL_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")  # what fbgemm's CPU TBE backward updates
KERNEL_DECAYS = {"none": {}, "l2": {"weight_decay": 1e-4, "weight_decay_mode": "l2"},
                 "decoupled": {"weight_decay": 1e-4, "weight_decay_mode": "decoupled"}}
# path -> (TableConfig.kernel, C library on): fbgemm's fused op and the C ps_update with the C library
# loaded (its id map too); fbgemm and vectorized torch without it (numpy id map), as on a machine
# without a C compiler or with EMBEDDING_PS_NATIVE=0
KERNEL_PATHS = {"fbgemm": ("fbgemm", True), "native": ("native", True),
                "fbgemm_pure": ("fbgemm", False), "torch": ("native", False)}


def bench_kernels(rows: int, batch: int, repeats: int, dims: tuple[int, ...] = (64, 16),
                  dtypes: tuple[str, ...] = ("fp32", "fp16")) -> dict[str, float]:
    """Push rows/s of each update path, per optimizer, weight-decay mode, row dtype and dim.

    One table of `rows` rows per (dtype, dim, optimizer); `batch` unique present ids are pushed
    through `ShardState.push` (id map, duplicate check, update, counters) with the table's config
    switched between the paths (same rows, same state layout). Every push takes a fresh random id
    set (a repeated one would sit in the last-level cache: 100k rows of d64 are 26 MB). Keys:
    `push_<optimizer>_<decay>_<dtype>_d<dim>_<path>_rows_per_s` and the ratios of fbgemm to
    native (C library loaded) and of fbgemm_pure to torch (without it).
    """
    from embedding_ps.shard import kernels

    if not kernels.fbgemm_available():
        raise RuntimeError(f"--kernels: fbgemm_gpu does not import: {kernels.fbgemm_error()}")
    if not native.available():
        raise RuntimeError("--kernels: the native C library is unavailable (no C compiler?): no baseline to compare")
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(4)
    all_ids = torch.arange(rows, dtype=torch.int64)
    id_sets = [all_ids[torch.randperm(rows, generator=g)[:batch]] for _ in range(16)]
    for dtype in dtypes:
        for dim in dims:
            grads = torch.randn(batch, dim, generator=g).mul_(1e-2)
            for optimizer in KERNEL_OPTIMIZERS:
                state = filled_state(rows, dim, all_ids, optimizer=optimizer, kernel="native", dtype=dtype)
                for decay in KERNEL_DECAYS:
                    key = f"{optimizer}_{decay}_{dtype}_d{dim}"
                    rates = _time_paths(state, decay, id_sets, grads, repeats)
                    out.update({f"push_{key}_{path}_rows_per_s": r for path, r in rates.items()})
                    out[f"ratio_fbgemm_vs_native_{key}"] = rates["fbgemm"] / rates["native"]
                    out[f"ratio_fbgemm_pure_vs_torch_{key}"] = rates["fbgemm_pure"] / rates["torch"]
                del state  # free this table before the next one is filled
    return out


def _time_paths(state: ShardState, decay: str, id_sets: list[torch.Tensor], grads: torch.Tensor,
                repeats: int) -> dict[str, float]:
    """{path: rows/s} of pushes into table 0 of `state`, its config switched to each path in turn.

    The paths alternate inside every round, in an order rotated each round, so load from other
    jobs on a shared machine and cache left by the previous push hit all of them alike; one
    warm-up round, then the median of `repeats`.
    """
    clock = time.process_time if CPU_CLOCK[0] else time.perf_counter
    table = state.tables[0]
    base = table.cfg
    # a concrete kernel ("torch" is the native path), as TableShard.__init__ resolves "auto"
    cfgs = {p: dataclasses.replace(base, kernel="fbgemm" if k == "fbgemm" else "native", **KERNEL_DECAYS[decay])
            for p, (k, _) in KERNEL_PATHS.items()}
    paths = list(KERNEL_PATHS)
    times: dict[str, list[float]] = {p: [] for p in paths}
    step = 1
    try:
        for r in range(repeats + 1):
            for i in range(len(paths)):
                path = paths[(i + r) % len(paths)]
                table.cfg = cfgs[path]
                native.set_enabled(KERNEL_PATHS[path][1])
                ids = id_sets[(r * len(paths) + i) % len(id_sets)]
                t0 = clock()
                state.push(0, ids, grads, step)
                if r:
                    times[path].append(clock() - t0)
                step += 1
    finally:
        native.set_enabled(True)
        table.cfg = base
    return {p: grads.shape[0] / float(np.median(t)) for p, t in times.items()}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(rows: int, dim: int, batch: int) -> None:
    """Subprocess body: print JSON with the RSS growth of filling one table with `rows` rows, `batch` per push."""
    cfg = PSConfig(tables=(TableConfig(name="t", dim=dim, optimizer="rowwise_adagrad"),))
    state = ShardState(cfg, 0)
    ids = torch.from_numpy(np.random.default_rng(3).integers(-(2**63), 2**63 - 1, rows, dtype=np.int64))
    state.push(0, ids[:1000], torch.zeros(1000, dim), step=0)  # warm up allocators and torch
    before = rss_bytes()
    for i in range(1000, rows, batch):
        chunk = ids[i : i + batch]
        state.push(0, chunk, torch.zeros(chunk.shape[0], dim), step=0)
    after = rss_bytes()
    release_free_heap()  # what a shard does after sweeps: free heap chunks of temporaries go back
    trimmed = rss_bytes()
    st = state.stats()
    print(json.dumps({"rows": st["rows"], "rss_growth": after - before, "rss_growth_trimmed": trimmed - before,
                      "map_buckets": st["t/map_buckets"], "capacity": st["t/capacity"],
                      "accounted_bytes": st["t/bytes"]}))


def bench_rss(rows: int, dim: int, batch: int) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--rss-child", str(rows), "--dim", str(dim), "--batch", str(batch),
         "--native", "on" if native.available() else "off"],
        capture_output=True, text=True, timeout=1200, env=env, check=True,
    )
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    added = r["rows"] - 1000
    per_row = r["rss_growth_trimmed"] / added
    return {
        "rss_rows": float(r["rows"]),
        f"rss_bytes_per_row_untrimmed_d{dim}": r["rss_growth"] / added,
        f"rss_bytes_per_row_d{dim}": per_row,
        f"raw_fp32_row_bytes_d{dim}": 4.0 * dim,
        f"rss_ratio_d{dim}": per_row / (4.0 * dim),
        f"accounted_bytes_per_row_d{dim}": r["accounted_bytes"] / r["rows"],
        "rss_map_load": r["rows"] / r["map_buckets"],
    }


def print_kernels(res: dict[str, float | str], as_json: bool) -> None:
    """Section 4 as JSON, or one line per (optimizer, decay, dtype, dim): M rows/s of each path and the ratios."""
    if as_json:
        print(json.dumps(res, indent=1))
        return
    print(f"push of {res['batch']:.0f} unique rows into a {res['rows']:.0f}-row table, median, "
          f"{res['threads']:.0f} thread(s), {res['clock']} clock; M rows/s. With the C library: fbgemm, native; "
          "without: fbgemm_pure, torch")
    print(f"{'optimizer_decay_dtype_dim':34s}" + "".join(f"{p:>12s}" for p in KERNEL_PATHS)
          + f"{'fbgemm/native':>14s}{'fbgemm_pure/torch':>18s}")
    for k in res:
        if not k.startswith("ratio_fbgemm_vs_native_"):
            continue
        key = k.removeprefix("ratio_fbgemm_vs_native_")
        rates = "".join(f"{res[f'push_{key}_{p}_rows_per_s'] / 1e6:12.2f}" for p in KERNEL_PATHS)
        print(f"{key:34s}{rates}{res[k]:14.2f}{res[f'ratio_fbgemm_pure_vs_torch_{key}']:18.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--batch", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: process CPU time, for a machine shared with other jobs (1 thread only)")
    p.add_argument("--rss-rows", type=int, default=5_000_000)
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--kernels", action="store_true",
                   help="only section 4: push rows/s of fbgemm's fused update vs the native C and torch paths")
    p.add_argument("--native", choices=("on", "off", "both"), default="on",
                   help="the C fast path (embedding_ps/native.py) on, off, or both (keys suffixed _native/_pure)")
    p.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, default=64, help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    CPU_CLOCK[0] = args.clock == "cpu"
    if args.rss_child:
        native.set_enabled(args.native != "off")
        rss_child(args.rss_child, args.dim, args.batch)
        return
    res: dict[str, float | str] = {"clock": args.clock, "threads": float(args.threads), "batch": float(args.batch),
                                   "rows": float(args.rows)}
    if args.kernels:
        res.update(bench_kernels(args.rows, args.batch, args.repeats))
        print_kernels(res, args.json)
        return
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.native]
    for use_native in modes:
        native.set_enabled(use_native)
        part = bench_map(args.rows, args.batch, args.repeats)
        for dim in (16, 64):
            part.update(bench_shard(args.rows, args.batch, dim, args.repeats))
        if args.native == "both":
            suffix = "_native" if use_native else "_pure"
            part = {k + suffix if k.endswith("_per_s") else k: v for k, v in part.items()}
        res.update(part)
    res["native"] = "both" if args.native == "both" else ("on" if native.available() else "off")
    native.set_enabled(args.native != "off")
    if not args.skip_rss:
        res.update(bench_rss(args.rss_rows, 64, args.batch))
    for dim in (16, 64):
        for sfx in ("_native", "_pure") if args.native == "both" else ("",):
            res[f"ratio_pull_vs_index_select_d{dim}{sfx}"] = (
                res[f"pull_d{dim}_rows_per_s{sfx}"] / res[f"baseline_index_select_d{dim}_rows_per_s{sfx}"])
            res[f"ratio_push_vs_index_add_d{dim}{sfx}"] = (
                res[f"push_d{dim}_rows_per_s{sfx}"] / res[f"baseline_index_add_d{dim}_rows_per_s{sfx}"])
    if args.json:
        print(json.dumps(res, indent=1))
        return
    targets = {"map_lookup_insert_10pct_new_ids_per_s": 20e6, "pull_push_d64_rows_per_s": 10e6, "rss_ratio_d64": 1.3}
    if args.native == "both":
        targets.update({k + "_native": v for k, v in targets.items()})
    for k, v in res.items():
        if isinstance(v, str):
            print(f"{k:45s} {v:>12s}")
            continue
        note = ""
        if k in targets:
            ok = v <= targets[k] if k.startswith("rss_ratio") else v >= targets[k]
            note = f"   target {'<=' if k.startswith('rss_ratio') else '>='} {targets[k]:g}: {'ok' if ok else 'MISSED'}"
        shown = f"{v / 1e6:10.2f} M" if v >= 1e5 else f"{v:12.3f}"
        print(f"{k:45s} {shown}{note}")


if __name__ == "__main__":
    main()
