"""Two processes: ours (trainers + PS shards) against TorchRec DistributedModelParallel on 2 gloo ranks.

    python benchmarks/train_distributed.py [--json] [--allow-missing-baseline] [--repeats R] [--steps S]

One criteo-like Parquet dataset (`data.synthetic.generate`, zstd) in a temporary directory, read by
every configuration with `data.loader.ParquetLoader` (each rank its share of the rows, shuffle on,
prefetch on). The job is train_throughput.py's: 26 one-id sparse features C1..C26 + 13 dense
I1..I13 (log1p), embedding dim D = 64, DLRM with bottom_mlp [128, 64] and top_mlp [128, 64]
(configs/quickstart.toml's model), BCE loss, dense Adam (quickstart's dense_lr), row-wise Adagrad
(lr 0.05) on the embeddings, one global batch G = --global-batch rows a step (G / W per trainer).

- `ours_{sync,async}_{T}t{S}s`: `recsys.training.launch.launch_train` (the real launcher: S shard
  processes + T trainer processes through torch.distributed.elastic, DDP on gloo for the dense
  part), ps.mode sync / async, for (T, S) in (2, 2), (1, 2), (2, 1). Rate: the trainers'
  `perf/samples_per_s` lines in metrics.jsonl (summed over ranks by the trainer).
- `torchrec_dmp_tw`: the same DLRM under `torchrec.distributed.DistributedModelParallel` on 2
  spawned gloo processes, 26 tables of min(vocab, --cap) rows in an EmbeddingBagCollection, every
  table sharded table-wise (planner constrained to `table_wise`), fbgemm's fused CPU kernel with
  EXACT_ROWWISE_ADAGRAD applied in backward (`apply_optimizer_in_backward(RowWiseAdagrad)`), the
  dense part wrapped in DDP by DMP itself, dense Adam through DMP's KeyedOptimizerWrapper.
- `torchrec_dmp_planner`: the same, with the planner free to choose (its choice is reported).
  On CPU, torchrec 1.8.0's EmbeddingBagCollectionSharder offers only data_parallel (`dense`
  kernel), table_wise, column_wise and table_column_wise (`fused` kernel: fbgemm's CPU TBE);
  row_wise, table_row_wise and grid_shard are CUDA-only there (`sharding_types("cpu")`). Both DMP
  variants ran here with gloo + fbgemm-gpu-cpu 1.8.0; the planner chose table_wise/fused for all
  26 tables (BENCHMARKS.md, "benchmarks/train_distributed.py").

The baselines map each 64-bit id to `id % min(vocab, --cap)` inside the timed step; our PS keeps a
collisionless id -> row map that grows instead. DMP sums the two ranks' row gradients of a table
(each rank's loss is a mean over its G / 2 rows) where our sync PS applies the mean over G: a
constant factor 2 that row-wise Adagrad's update is invariant to (up to its eps).

Timing: --log-every + --steps steps per run, in windows of --log-every steps; the first window is
warm-up and dropped, a run's rate is the median of its other windows (global samples/s), the
reported rate the median over --repeats runs (configurations interleaved per repeat, the order
rotated between repeats, after one untimed warm-up run unless --no-warmup). Every trainer
process (ours and DMP's ranks) gets --threads torch threads, our shard processes 1 each: on this
2-core machine ours runs T + S processes, DMP 2.

CPU: every process of a configuration (trainers or DMP's ranks, shards, the launcher) is sampled
from /proc (`cpu_time.ProcessCpuSampler`) and its CPU ms per global step over the timed windows
reported per role (`detail.<config>.cpu_ms_per_step`); `cpu_ratio_vs_torchrec_dmp` (and `_async_`) =
DMP's total / ours: on 2 busy cores the samples/s ratio follows it, and it moves far less with load.

The headline `ratio_vs_torchrec_dmp` = ours_sync_2t2s / torchrec_dmp_tw: like for like, DMP is
synchronous (every step's embedding updates land before the next step's lookup), as is our sync
mode. `ratio_async_vs_torchrec_dmp` (ours async: rows prefetched one step ahead) and the ratios
against the planner's choice are reported too, and `ratios_per_repeat` (the two ratios within each
repeat, whose spread shows the noise). Target: ratio_vs_torchrec_dmp >= 1.0.

--json prints one line with every rate (samples/s; null when not run), every ratio, the planner's
choice, per-configuration detail and notes. When TorchRec cannot run (not importable, or DMP fails)
the script exits 1 unless --allow-missing-baseline (then the baseline and its ratios are null and a
note says why). Timings on a shared 2-core machine are noisy: compare ratios from one run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: spinning OpenMP starves 2 cores

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_throughput  # noqa: E402  (the single-process benchmark's job config)
from cpu_time import ProcessCpuSampler  # noqa: E402
from train_throughput import SPARSE, SPARSE_LR, table_rows  # noqa: E402  (ours and DMP: the same tables and lr)

from data.synthetic import generate  # noqa: E402
from recsys.config import JobConfig  # noqa: E402

TARGET = 1.0
LAYOUTS = ((2, 2), (1, 2), (2, 1))     # (trainers, shards) of ours
OURS = tuple(f"ours_{m}_{t}t{s}s" for t, s in LAYOUTS for m in ("sync", "async"))
DMP = ("torchrec_dmp_tw", "torchrec_dmp_planner")
CONFIGS = OURS + DMP
DMP_WORLD = 2
JOIN_TIMEOUT_S = 900.0


def job_config(args: argparse.Namespace, data_dir: str, run_dir: str, mode: str,
               trainers: int, shards: int) -> JobConfig:
    """train_throughput's job (26 one-id features, D = --dim) with --global-batch rows split over
    `trainers`, on `shards` PS shards."""
    return train_throughput.job_config(args, data_dir, run_dir, mode, trainers=trainers, shards=shards,
                                       global_batch=args.global_batch)


def cpu_per_step(sampler: ProcessCpuSampler, t0: float, t1: float, steps: int) -> dict[str, float]:
    """CPU ms per (global) step of each role (trainer: ours or DMP's ranks; ps; launcher) over the
    timed windows: every process's CPU between the end of the warm-up window and the last window."""
    cpu = sampler.cpu_between(t0, t1)
    out = {role: round(1e3 * v / steps, 2) for role, v in sorted(cpu.items())}
    out["total"] = round(sum(1e3 * v / steps for v in cpu.values()), 2)
    return out


def windows_summary(rates: list[float], where: str) -> dict:
    """A run's rate: the median of its windows after the first (warm-up) one."""
    timed = rates[1:]
    if not timed:
        raise RuntimeError(f"{where}: {len(rates)} timing windows, need >= 2")
    return {"samples_per_s": statistics.median(timed), "windows": [round(r) for r in timed]}


# ---------------------------------------------------------------------------------------------
# ours: the real launcher, T trainers + S shard processes


def run_ours(cfg: JobConfig) -> dict:
    """Launch the job; its rate from metrics.jsonl (global samples/s per window) and PS timings."""
    from recsys.training.launch import launch_train

    run_dir = Path(cfg.train.run_dir)
    with ProcessCpuSampler() as sampler:
        launch_train(cfg)
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines() if s.strip()]
    lines = [x for x in lines if x.get("perf/samples_per_s") is not None]
    out = windows_summary([float(x["perf/samples_per_s"]) for x in lines], str(run_dir / "metrics.jsonl"))
    out["cpu_ms_per_step"] = cpu_per_step(sampler, lines[0]["time"], lines[-1]["time"],
                                          lines[-1]["step"] - lines[0]["step"])
    for key, name in (("ps/pull_ms", "pull_ms"), ("ps/push_ms", "push_ms"), ("data/wait_frac", "data_wait_frac")):
        vals = [float(x[key]) for x in lines[1:] if x.get(key) is not None]
        out[name] = statistics.median(vals) if vals else None
    return out


# ---------------------------------------------------------------------------------------------
# TorchRec DistributedModelParallel on 2 gloo processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _DMPModel(torch.nn.Module):
    """EmbeddingBagCollection (sharded by DMP) + our DLRM dense part: (dense [B, Dn], KJT) -> logits [B]."""

    def __init__(self, ebc: torch.nn.Module, dense: torch.nn.Module, num_features: int, dim: int) -> None:
        super().__init__()
        self.ebc, self.dense, self.F, self.D = ebc, dense, num_features, dim

    def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        pooled = self.ebc(kjt).values().view(-1, self.F, self.D)     # [B, F * D] -> [B, F, D]
        return self.dense(dense, pooled, None)                         # [B]


def _dmp_build(cfg: JobConfig, args: argparse.Namespace, planner: str, pg) -> tuple:
    """The DMP-wrapped model, its dense optimizer and the plan's summary on this rank."""
    import torchrec.optim
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from recsys.models import build_dense_model, build_sparse_arch

    tables = [EmbeddingBagConfig(name=f"t_{c}", embedding_dim=args.dim, num_embeddings=n, feature_names=[c])
              for c, n in zip(SPARSE, table_rows(args.cap))]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {"lr": SPARSE_LR})
    model = _DMPModel(ebc, build_dense_model(cfg, build_sparse_arch(cfg)), len(tables), args.dim)
    constraints = ({t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables}
                   if planner == "tw" else None)
    sharders = [EmbeddingBagCollectionSharder()]
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=DMP_WORLD, compute_device="cpu"),
        batch_size=cfg.data.batch_size, constraints=constraints,
    ).collective_plan(model, sharders, pg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=plan, sharders=sharders)
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=cfg.train.dense_lr))
    chosen: dict[str, int] = {}
    for module_plan in plan.plan.values():
        for ps in module_plan.values():
            key = f"{ps.sharding_type}/{ps.compute_kernel}"
            chosen[key] = chosen.get(key, 0) + 1
    return dmp, dense_opt, chosen


def _dmp_rank(rank: int, port: int, cfg: JobConfig, args: argparse.Namespace, planner: str, out: str) -> None:
    """One DMP rank: train log_every + steps steps of G / 2 rows; rank 0 writes the windows to `out`."""
    import torch.distributed as dist

    from data.loader import ParquetLoader

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DMP_WORLD)
    try:
        dmp, dense_opt, chosen = _dmp_build(cfg, args, planner, dist.group.WORLD)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        rows = torch.tensor(table_rows(args.cap), dtype=torch.int64)
        total, rates, steps, n = cfg.train.max_steps, [], 0, 0
        ends: list[float] = []                  # wall-clock time (unix s) of each window's end
        with ParquetLoader(cfg.data, cfg.data.train_paths, rank=rank, world_size=DMP_WORLD) as loader:
            t_log = time.perf_counter()
            for epoch in range(cfg.train.epochs):
                loader.set_epoch(epoch)
                for batch in loader:
                    kj = batch.sparse
                    per_feature = kj.lengths.view(len(kj.keys), -1).sum(dim=1, dtype=torch.int64)   # [F]
                    mod = torch.repeat_interleave(rows, per_feature, output_size=kj.values.numel())  # [N]
                    kjt = type(kj)(kj.keys, torch.remainder(kj.values, mod), kj.lengths).to_torchrec()
                    loss = loss_fn(dmp(batch.dense, kjt), batch.labels)
                    dense_opt.zero_grad()
                    loss.backward()                     # embeddings: fused row-wise Adagrad here
                    dense_opt.step()
                    steps += 1
                    n += batch.batch_size * DMP_WORLD   # every rank trains an equal share
                    if steps % cfg.train.log_every == 0:
                        now = time.perf_counter()
                        rates.append(n / (now - t_log))
                        ends.append(time.time())
                        n, t_log = 0, now
                    if steps >= total:
                        break
                if steps >= total:
                    break
        if rank == 0:
            res = windows_summary(rates, f"torchrec_dmp_{planner}")
            res.update(plan=chosen, final_loss=float(loss.detach()), window_ends=ends,
                       timed_steps=cfg.train.log_every * (len(ends) - 1))
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _dmp_entry(rank: int, port: int, cfg: JobConfig, args: argparse.Namespace, planner: str, out: str) -> None:
    try:
        _dmp_rank(rank, port, cfg, args, planner, out)
    except BaseException:
        Path(f"{out}.err{rank}").write_text(traceback.format_exc())
        raise


def run_dmp(cfg: JobConfig, args: argparse.Namespace, planner: str, tmp: str) -> dict:
    """Spawn the 2 DMP ranks (127.0.0.1, a free port), wait with a timeout, return rank 0's result."""
    ctx = mp.get_context("spawn")
    out = os.path.join(tmp, f"dmp-{planner}-{time.monotonic_ns()}.json")
    port = _free_port()
    procs = [ctx.Process(target=_dmp_entry, args=(r, port, cfg, args, planner, out), daemon=True)
             for r in range(DMP_WORLD)]
    sampler = ProcessCpuSampler()
    try:
        with sampler:
            for p in procs:
                p.start()
            deadline = time.monotonic() + JOIN_TIMEOUT_S
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    errs = [Path(f"{out}.err{r}") for r in range(DMP_WORLD)]
    if codes != [0] * DMP_WORLD or not os.path.exists(out):
        why = next((e.read_text().strip().splitlines()[-1] for e in errs if e.exists()), "no traceback")
        raise RuntimeError(f"torchrec DMP ({planner}) failed: exit codes {codes}: {why}")
    res = json.loads(Path(out).read_text())
    ends = res.pop("window_ends")
    res["cpu_ms_per_step"] = cpu_per_step(sampler, ends[0], ends[-1], res.pop("timed_steps"))
    return res


def torchrec_missing() -> str | None:
    """None when TorchRec's DMP imports, else why not."""
    try:
        import torchrec.optim  # noqa: F401
        from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: F401
    except Exception as e:   # ImportError, or an fbgemm/torch mismatch failing at import
        return f"torchrec not importable ({type(e).__name__}: {e})"
    return None


# ---------------------------------------------------------------------------------------------
# the run


def _one(c: str, args: argparse.Namespace, data_dir: str, tmp: str, r: int) -> dict:
    run_dir = os.path.join(tmp, f"run-{c}-{r}")
    if c in DMP:
        cfg = job_config(args, data_dir, run_dir, "sync", DMP_WORLD, 1)
        return run_dmp(cfg, args, c.removeprefix("torchrec_dmp_"), tmp)
    _, mode, layout = c.split("_")
    trainers, shards = int(layout[0]), int(layout[2])
    return run_ours(job_config(args, data_dir, run_dir, mode, trainers, shards))


def run(args: argparse.Namespace) -> tuple[dict, bool]:
    """Every configuration, interleaved per repeat; (summary, whether the baseline is missing)."""
    notes: list[str] = []
    configs = [c for c in CONFIGS if c in args.configs]
    missing = False
    if any(c in DMP for c in configs) and (why := torchrec_missing()):
        notes.append(why)
        configs = [c for c in configs if c not in DMP]
        missing = True
    results: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        data_dir = os.path.join(tmp, "data")
        t0 = time.perf_counter()
        generate(preset="criteo-like", rows=args.rows, num_files=args.files, out_dir=data_dir, seed=0)
        gen_s = time.perf_counter() - t0
        first = next((c for c in configs if c in OURS), None)
        if args.warmup and first:   # the first launch of a session ran slower in every run: not timed
            _one(first, args, data_dir, tmp, -1)
            notes.append(f"one untimed warm-up run of {first} before the repeats")
        for r in range(args.repeats):
            shift = r * len(configs) // args.repeats     # rotate the order: no configuration always first
            for c in configs[shift:] + configs[:shift]:
                try:
                    res = _one(c, args, data_dir, tmp, r)
                except RuntimeError as e:
                    if c not in DMP:
                        raise
                    notes.append(str(e))
                    configs.remove(c)
                    del results[c]
                    missing = True
                    continue
                results[c].append(res)
                if not args.json:
                    print(f"  repeat {r + 1}/{args.repeats} {c:22s} {res['samples_per_s']:10,.0f} samples/s",
                          file=sys.stderr, flush=True)
    return summarize(args, results, notes, gen_s), missing


def summarize(args: argparse.Namespace, results: dict[str, list[dict]], notes: list[str], gen_s: float) -> dict:
    rate = {c: (round(statistics.median(x["samples_per_s"] for x in results[c])) if results.get(c) else None)
            for c in CONFIGS}
    ratio = lambda a, b: round(rate[a] / rate[b], 3) if rate[a] and rate[b] else None   # noqa: E731
    detail = {}
    for c, runs in results.items():
        d: dict = {"runs_samples_per_s": [round(x["samples_per_s"]) for x in runs],
                   "windows": [x["windows"] for x in runs]}
        for k in ("pull_ms", "push_ms", "data_wait_frac", "final_loss"):
            vals = [x[k] for x in runs if x.get(k) is not None]
            if vals:
                d[k] = round(statistics.median(vals), 3)
        if runs and "plan" in runs[0]:
            d["plan"] = runs[0]["plan"]
        cpus = [x["cpu_ms_per_step"] for x in runs if x.get("cpu_ms_per_step")]
        if cpus:
            d["cpu_ms_per_step"] = {role: round(statistics.median(x.get(role, 0.0) for x in cpus), 2)
                                    for role in sorted({k for x in cpus for k in x})}
        detail[c] = d
    out = {**rate,
           "ratio_vs_torchrec_dmp": ratio("ours_sync_2t2s", "torchrec_dmp_tw"),
           "ratio_async_vs_torchrec_dmp": ratio("ours_async_2t2s", "torchrec_dmp_tw"),
           "ratio_vs_torchrec_dmp_planner": ratio("ours_sync_2t2s", "torchrec_dmp_planner"),
           "ratio_async_vs_torchrec_dmp_planner": ratio("ours_async_2t2s", "torchrec_dmp_planner"),
           "scaling_sync_2t2s_vs_1t2s": ratio("ours_sync_2t2s", "ours_sync_1t2s"),
           "scaling_sync_2t2s_vs_2t1s": ratio("ours_sync_2t2s", "ours_sync_2t1s"),
           "scaling_async_2t2s_vs_1t2s": ratio("ours_async_2t2s", "ours_async_1t2s"),
           "scaling_async_2t2s_vs_2t1s": ratio("ours_async_2t2s", "ours_async_2t1s"),
           "headline": "ours_sync_2t2s / torchrec_dmp_tw (both synchronous)", "target": TARGET}
    cpu = lambda c: detail.get(c, {}).get("cpu_ms_per_step", {}).get("total")   # noqa: E731
    for key, ours in (("cpu_ratio_vs_torchrec_dmp", "ours_sync_2t2s"),
                      ("cpu_ratio_async_vs_torchrec_dmp", "ours_async_2t2s")):
        # DMP's CPU ms per global step / ours (all processes): on busy cores the rate follows it
        out[key] = round(cpu("torchrec_dmp_tw") / cpu(ours), 3) if cpu("torchrec_dmp_tw") and cpu(ours) else None
    pairs = {"ratio_vs_torchrec_dmp": ("ours_sync_2t2s", "torchrec_dmp_tw"),
             "ratio_async_vs_torchrec_dmp": ("ours_async_2t2s", "torchrec_dmp_tw")}
    out["ratios_per_repeat"] = {   # the same repeat's runs paired (they ran minutes apart, not months)
        k: [round(x["samples_per_s"] / y["samples_per_s"], 3) for x, y in zip(results.get(a, []), results.get(b, []))]
        for k, (a, b) in pairs.items()}
    r = out["ratio_vs_torchrec_dmp"]
    out["meets_target"] = None if r is None else r >= TARGET
    out["torchrec_dmp_planner_choice"] = detail.get("torchrec_dmp_planner", {}).get("plan")
    out.update({"rows": args.rows, "steps": args.steps, "log_every": args.log_every, "repeats": args.repeats,
                "global_batch": args.global_batch, "dim": args.dim, "threads": args.threads, "cap": args.cap,
                "ps_kernel": args.ps_kernel, "gen_s": round(gen_s, 2), "cpus": os.cpu_count(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "detail": detail, "notes": notes})
    return out


def print_table(r: dict) -> None:
    print(f"criteo-like, {r['rows']:,} rows, 26 one-id features + 13 dense, D={r['dim']}, global batch "
          f"{r['global_batch']}, {r['steps']} timed steps (+{r['log_every']} warm-up), median of {r['repeats']}, "
          f"{r['threads']} torch threads per trainer, {r['cpus']} cpus")
    print(f"  {'configuration':26s} {'samples/s':>10s} {'pull ms':>8s} {'push ms':>8s} {'data wait':>9s} "
          f"{'CPU ms/step':>11s}  plan")
    for c in CONFIGS:
        d, v = r["detail"].get(c, {}), r[c]
        fmt = lambda k, f: (f.format(d[k]) if k in d else "-")   # noqa: E731
        print(f"  {c:26s} {('%10.0f' % v) if v else '      null'} {fmt('pull_ms', '{:8.1f}'):>8s} "
              f"{fmt('push_ms', '{:8.1f}'):>8s} {fmt('data_wait_frac', '{:9.3f}'):>9s} "
              f"{d.get('cpu_ms_per_step', {}).get('total', '-'):>11}  {d.get('plan', '')}")
    for k, v in r.items():
        if k.startswith(("ratio_", "scaling_", "cpu_ratio_")):
            print(f"  {k:36s} {'null' if v is None else f'{v:.3f}'}")
    for k, v in r["ratios_per_repeat"].items():
        print(f"  {k} per repeat: {v}")
    verdict = {True: "met", False: "NOT met", None: "not measured"}[r["meets_target"]]
    print(f"  target {r['headline']} >= {r['target']}: {verdict}")
    for n in r["notes"]:
        print(f"  note: {n}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--allow-missing-baseline", action="store_true",
                   help="report null for TorchRec DMP (and exit 0) when it cannot run")
    p.add_argument("--rows", type=int, default=200_000, help="rows of generated data (read in epochs)")
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (after --log-every warm-up steps)")
    p.add_argument("--log-every", type=int, default=5, help="steps per timing window")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (median)")
    p.add_argument("--global-batch", type=int, default=4096, help="rows per step over all trainers")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of every trainer / DMP rank")
    p.add_argument("--cap", type=int, default=200_000,
                   help="most rows per baseline table (ids map to id %% min(vocab, cap))")
    p.add_argument("--ps-kernel", choices=("native", "fbgemm", "auto", "torch"), default="native",
                   help="ps.tables[*].kernel")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the untimed warm-up run before the repeats")
    a = p.parse_args()
    if a.steps < a.log_every:
        p.error(f"--steps ({a.steps}) must be >= --log-every ({a.log_every})")
    if a.global_batch % 2:
        p.error(f"--global-batch ({a.global_batch}) must be even (2 trainers / 2 DMP ranks)")
    a.steps = a.log_every * math.ceil(a.steps / a.log_every)
    logging.basicConfig(level=logging.WARNING)
    r, missing = run(a)
    print(json.dumps(r) if a.json else "", end="\n" if a.json else "")
    if not a.json:
        print_table(r)
    if missing and not a.allow_missing_baseline:
        print("error: the TorchRec DMP baseline did not run (see notes); --allow-missing-baseline to report "
              "it as null", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
