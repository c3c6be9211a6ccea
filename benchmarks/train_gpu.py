"""GPU training throughput (issues #14, #32): our trainer on the GPU, the PS shards on the host's CPU
cores, against TorchRec with every table on the same GPU.

    python benchmarks/train_gpu.py [--json] [--shards 4] [--steps 100] [--repeats 3]
    python benchmarks/train_gpu.py --quick [--out DIR]        # the device check: one run, <= 8 min
    python benchmarks/train_gpu.py --quick --device cpu       # the same script on the CPU (no GPU baseline)

The job is `benchmarks/train_throughput.py`'s DLRM (26 one-id features C1..C26 + 13 dense, D = --dim,
bottom_mlp [128, D], top_mlp [128, 64], BCE, dense Adam lr 1e-3, row-wise Adagrad lr 0.05 on the
embeddings) on its Zipf(1.05) criteo-like data: every sparse feature's ids drawn Zipf(1.05) over its
own vocabulary.

- `ours_gpu`: `launch_train` with train.device = --device, 1 trainer, every table on the PS: --shards
  shard processes on the host's cores (ps.mode async, ps.max_staleness --cache-staleness). On a GPU
  the batch's ids cross once and are deduplicated there, the pulled rows are pooled there and only
  unique ids, rows and row gradients cross (`recsys.models.on_device`).
- `ours_gpu_auto`: the same with placement = "auto" (small tables replicated on the device, trained
  in the step; the rest on the PS).
- `ours_gpu_cache`: `ours_gpu` with a trainer-side row cache of --cache-frac (5%) of each feature's
  vocabulary per table, held on the device (`embedding_ps.client.cache`).
- `torchrec_gpu`: the same DLRM in this process, embeddings in torchrec's FusedEmbeddingBagCollection
  on the GPU (fbgemm's CUDA TBE, EXACT_ROWWISE_ADAGRAD fused into backward), each table
  min(vocab, --cap) rows (by default the whole vocabulary: no id shares a row), ids mapped to
  id % rows on the host, then copied to the GPU.
- `plain_gpu`: the same with one nn.EmbeddingBag(sparse=True) per feature on the GPU and
  torch.optim.Adagrad (element-wise): a reference that needs no torchrec.

Every configuration reads the same Parquet file with `data.loader.ParquetLoader` and runs
--log-every + --steps steps, timed in intervals of --log-every steps (first interval dropped; the
in-process ones synchronize the GPU at each interval's end). A run's rate is the median of its
intervals; the reported rate the median over --repeats runs (configurations interleaved).
GPU busy %: NVML's utilization (the share of time a kernel ran on the GPU), sampled every 50 ms
over each run's timed intervals, averaged. Host CPU: every process of the job (trainer, shards,
launcher), CPU ms per timed step (`benchmarks/cpu_time.py`).

--quick (the device check of #32): 300k rows, 40 timed steps, 1 repeat of ours_gpu, ours_gpu_auto and
torchrec_gpu; first `pytest -q tests/integration/test_cuda.py` (its result in `test_cuda`, its output in
--out's test_cuda.txt), last a
torch profiler summary of our trainer (in this process on in-process shards, --profile-steps steps)
written to --out (default $OUT, else nothing written). --device cpu: our configurations on the CPU,
no NVML, no GPU baseline (its ratios null), test_cuda not run.

--json prints one line: each configuration's samples/s (null when not run), `ratio_vs_torchrec_gpu`
(ours_gpu / torchrec_gpu: every table on the PS), `ratio_vs_torchrec_gpu_auto` (ours_gpu_auto /
torchrec_gpu), `ratio_cache_vs_torchrec_gpu` (ours_gpu_cache / torchrec_gpu: what #14 called
ratio_vs_torchrec_gpu), `gpu_busy_pct` and `host_cpu_ms_per_step` (of ours_gpu, else the first of ours
that ran), `gpu_busy_pct_<configuration>`, `cache_hit_rate`, `targets` / `meets_targets`, the device's
name, per-configuration detail and `notes`. A missing torchrec is an error (exit 2) unless
--allow-missing-baseline.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from data.loader import ParquetLoader  # noqa: E402
from data.synthetic import PRESETS  # noqa: E402
from recsys.models import build_dense_model, build_sparse_arch  # noqa: E402
from train_throughput import (SPARSE, SPARSE_LR, PlainSparse, batches, cache_rows_of, frozen_gc,  # noqa: E402
                              job_config, remap, run_ours, torchrec_missing, write_preset, zipf_preset)

CONFIGS = ("ours_gpu", "ours_gpu_auto", "ours_gpu_cache", "torchrec_gpu", "plain_gpu")
OURS = tuple(c for c in CONFIGS if c.startswith("ours"))
QUICK_CONFIGS = ("ours_gpu", "ours_gpu_auto", "torchrec_gpu")
TARGETS = {"ratio_vs_torchrec_gpu": 0.5, "ratio_vs_torchrec_gpu_auto": 0.8}
"""Issue #32's GPU targets, each checked against the key of the same name (>=)."""


class GpuBusy:
    """NVML utilization of GPU 0 sampled every `period_s` in a thread: (unix time, percent)."""

    def __init__(self, period_s: float = 0.05, enabled: bool = True) -> None:
        self.samples: list[tuple[float, int]] = []
        self.enabled = enabled
        if not enabled:           # --device cpu: no GPU to sample
            return
        import pynvml          # nvidia-ml-py

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.time(), self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def __enter__(self) -> GpuBusy:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join(timeout=5)

    def mean_between(self, t0: float, t1: float) -> float | None:
        got = [u for t, u in self.samples if t0 <= t <= t1]
        return round(statistics.fmean(got), 1) if got else None


def gpu_config(args: argparse.Namespace, data_dir: str, run_dir: str, config: str = "ours_gpu"):
    """train_throughput's async job on --device: --shards shards; `config` picks the placement
    (ours_gpu_auto: "auto") and the row cache (ours_gpu_cache)."""
    placed = argparse.Namespace(**{**vars(args), "placement": "auto" if config == "ours_gpu_auto" else "ps"})
    cache = cache_rows_of(args.cache_frac) if config == "ours_gpu_cache" else None
    cfg = job_config(placed, data_dir, run_dir, "async", cache, args.cache_staleness, shards=args.shards)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=args.device))


def run_ours_gpu(cfg, busy: GpuBusy) -> dict:
    """launch_train (train_throughput.run_ours), plus the GPU busy % over the timed lines."""
    out = run_ours(cfg)
    lines = [json.loads(s) for s in (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines() if s.strip()]
    timed = [x for x in lines if x.get("perf/samples_per_s") is not None]
    out["gpu_busy_pct"] = busy.mean_between(timed[0]["time"], timed[-1]["time"])
    if "cpu_ms_per_step" in out:
        out["host_cpu_ms_per_step"] = round(sum(out["cpu_ms_per_step"].values()), 2)
    return out


def profile_ours(cfg, steps: int, out_dir: str) -> str:
    """Our trainer in this process (in-process shards: `embedding_ps.local.LocalStore`) for `steps`
    steps under the torch profiler; its op table (by self CPU time, and by self CUDA time on a GPU)
    written to out_dir/train_gpu_profile.txt. Returns the file's path."""
    from torch.profiler import ProfilerActivity, profile

    from embedding_ps.local import LocalStore
    from recsys.training.trainer import Trainer

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps, log_every=steps))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.train.device == "cuda" else [])
    trainer = Trainer(cfg, LocalStore.create(cfg.ps))
    try:
        with profile(activities=activities) as prof:
            trainer.train()
    finally:
        trainer.close()
    table = prof.key_averages()
    parts = [f"# our trainer, {steps} steps, train.device = {cfg.train.device}, in-process shards "
             f"(benchmarks/train_gpu.py --quick)\n", "## by self CPU time\n",
             table.table(sort_by="self_cpu_time_total", row_limit=40)]
    if cfg.train.device == "cuda":
        parts += ["\n## by self device (CUDA) time\n", table.table(sort_by="self_device_time_total", row_limit=40)]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "train_gpu_profile.txt")
    Path(path).write_text("".join(parts))
    return path


def run_test_cuda(out_dir: str | None) -> dict:
    """`pytest -q tests/integration/test_cuda.py` (the CUDA path against the CPU run): its exit code
    and last line; its whole output to out_dir/test_cuda.txt when out_dir is given."""
    root = Path(__file__).resolve().parents[1]
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(root / "tests" / "integration" / "test_cuda.py")],
                           cwd=root, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"rc": None, "summary": "timed out after 300 s"}
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        Path(out_dir, "test_cuda.txt").write_text(p.stdout + p.stderr)
    return {"rc": p.returncode, "summary": lines[-1] if lines else ""}


class TorchRecGpu(nn.Module):
    """26 tables in one FusedEmbeddingBagCollection on the GPU: a torchrec KJT on the GPU -> [B, F, D]."""

    def __init__(self, rows: list[int], dim: int, device: torch.device) -> None:
        super().__init__()
        import torchrec.optim
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        tables = [EmbeddingBagConfig(name=f"t_{c}", embedding_dim=dim, num_embeddings=n, feature_names=[c])
                  for c, n in zip(SPARSE, rows)]
        self.ebc = FusedEmbeddingBagCollection(tables=tables, optimizer_type=torchrec.optim.RowWiseAdagrad,
                                               optimizer_kwargs={"lr": SPARSE_LR}, device=device)
        self.F, self.D = len(tables), dim

    def forward(self, kjt) -> torch.Tensor:
        return self.ebc(kjt).values().view(-1, self.F, self.D)


def run_inprocess_gpu(kind: str, cfg, args: argparse.Namespace, busy: GpuBusy) -> dict:
    """The same DLRM with every table on the GPU, in this process; median samples/s per interval."""
    dev = torch.device(args.device)
    torch.set_num_threads(args.threads)
    vocab = {s.name: s.vocab for s in PRESETS["criteo-like"].sparse}
    rows = [min(vocab[c], args.cap) for c in SPARSE]
    rows_t = torch.tensor(rows, dtype=torch.int64)
    model = build_dense_model(cfg, build_sparse_arch(cfg)).to(dev)
    if kind == "torchrec_gpu":
        sparse, sparse_opt = TorchRecGpu(rows, args.dim, dev), None
    else:
        sparse = PlainSparse(rows, args.dim).to(dev)
        sparse_opt = torch.optim.Adagrad(sparse.parameters(), lr=SPARSE_LR)
    dense_opt = torch.optim.Adam(model.parameters(), lr=cfg.train.dense_lr)
    loss_fn = nn.BCEWithLogitsLoss()
    rates, n, steps, t_first = [], 0, 0, None
    frozen_gc()
    with ParquetLoader(cfg.data, cfg.data.train_paths) as loader:
        it = batches(loader, cfg.train.epochs)
        torch.cuda.synchronize()
        t_log = time.perf_counter()
        while steps < cfg.train.max_steps:
            batch = next(it)
            kj = remap(batch.sparse, rows_t)
            if kind == "torchrec_gpu":
                pooled = sparse(kj.to_torchrec().to(dev, non_blocking=True))       # [B, F, D]
            else:
                kj = type(kj)(kj.keys, kj.values.to(dev, non_blocking=True), kj.lengths.to(dev, non_blocking=True))
                pooled = sparse(kj)
            logits = model(batch.dense.to(dev, non_blocking=True), pooled, None)
            loss = loss_fn(logits, batch.labels.to(dev, non_blocking=True))
            dense_opt.zero_grad(set_to_none=True)
            if sparse_opt is not None:
                sparse_opt.zero_grad(set_to_none=True)
            loss.backward()                               # torchrec: rows updated here
            dense_opt.step()
            if sparse_opt is not None:
                sparse_opt.step()
            steps += 1
            n += batch.batch_size
            if steps % cfg.train.log_every == 0:
                torch.cuda.synchronize()
                now = time.perf_counter()
                rates.append(n / (now - t_log))
                n, t_log = 0, now
                if t_first is None:
                    t_first = time.time()
    t_last = time.time()
    gc.unfreeze()
    timed = rates[1:]
    if not timed:
        raise RuntimeError(f"{kind}: {len(rates)} intervals, need >= 2")
    out = {"samples_per_s": statistics.median(timed), "intervals": timed, "final_loss": float(loss.detach()),
           "gpu_busy_pct": busy.mean_between(t_first, t_last),
           "max_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    del sparse, model, dense_opt, sparse_opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def run(args: argparse.Namespace) -> dict:
    notes: list[str] = []
    configs = [c for c in CONFIGS if c in args.configs]
    if args.device == "cpu" and any(c not in OURS for c in configs):
        notes.append("--device cpu: no GPU baseline (torchrec_gpu / plain_gpu not run)")
        configs = [c for c in configs if c in OURS]
    extra = {}
    if args.quick and args.device == "cuda":
        extra["test_cuda"] = run_test_cuda(args.out)
        print(f"  test_cuda.py: {extra['test_cuda']['summary']}", file=sys.stderr, flush=True)
    if "torchrec_gpu" in configs and (why := torchrec_missing()):
        if not args.allow_missing_baseline:
            raise MissingBaseline(f"{why}: the TorchRec baseline cannot run (install torchrec and fbgemm-gpu "
                                  f"for this CUDA, or pass --allow-missing-baseline)")
        notes.append(f"{why}; torchrec_gpu reported as null (--allow-missing-baseline)")
        configs.remove("torchrec_gpu")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp, GpuBusy(enabled=args.device == "cuda") as busy:
        data_dir = os.path.join(tmp, "data-zipf")
        t0 = time.perf_counter()
        write_preset(zipf_preset(), args.rows, data_dir)
        gen_s = time.perf_counter() - t0
        for r in range(args.repeats):
            for c in configs:
                run_dir = os.path.join(tmp, f"run-{c}-{r}")
                cfg = gpu_config(args, data_dir, run_dir, c)
                res = run_ours_gpu(cfg, busy) if c in OURS else run_inprocess_gpu(c, cfg, args, busy)
                results[c].append(res)
                print(f"  repeat {r + 1}/{args.repeats} {c:15s} {res['samples_per_s']:10,.0f} samples/s, "
                      f"GPU busy {res['gpu_busy_pct']}%", file=sys.stderr, flush=True)
                if args.partial:    # the summary so far, rewritten after every run (a cut run keeps it)
                    Path(args.partial).write_text(json.dumps(summarize(args, results, notes, gen_s, extra)) + "\n")
        if args.out and args.profile_steps:
            cfg = gpu_config(args, data_dir, os.path.join(tmp, "run-profile"), "ours_gpu")
            extra["profile"] = profile_ours(cfg, args.profile_steps, args.out)
            print(f"  profile: {extra['profile']}", file=sys.stderr, flush=True)
    return summarize(args, results, notes, gen_s, extra)


class MissingBaseline(RuntimeError):
    """A baseline the run needs cannot run (and --allow-missing-baseline was not given)."""


def summarize(args: argparse.Namespace, results: dict[str, list[dict]], notes: list[str], gen_s: float,
              extra: dict | None = None) -> dict:
    med = lambda runs, k: (round(statistics.median(x[k] for x in runs), 4)    # noqa: E731
                           if runs and all(x.get(k) is not None for x in runs) else None)
    rate = {c: (round(med(results[c], "samples_per_s")) if results.get(c) else None) for c in CONFIGS}
    ratio = lambda a, b: round(rate[a] / rate[b], 3) if rate[a] and rate[b] else None   # noqa: E731
    detail = {}
    for c, runs in results.items():
        d = {"runs_samples_per_s": [round(x["samples_per_s"]) for x in runs],
             "runs_gpu_busy_pct": [x["gpu_busy_pct"] for x in runs]}
        for k in ("step_ms", "pull_ms", "push_ms", "ps_wait_ms", "data_wait_frac", "cache_hit_rate",
                  "cache_hit_rate_per_lookup", "final_loss", "max_gpu_memory_gib", "gpu_busy_pct",
                  "host_cpu_ms_per_step"):
            if (v := med(runs, k)) is not None:
                d[k] = v
        if runs and all("cpu_ms_per_step" in x for x in runs):
            d["cpu_ms_per_step"] = {role: statistics.median(x["cpu_ms_per_step"].get(role, 0.0) for x in runs)
                                    for role in sorted({r for x in runs for r in x["cpu_ms_per_step"]})}
        detail[c] = d
    main = next((c for c in OURS if results.get(c)), "ours_gpu")     # ours_gpu, else the first of ours run
    out = {**rate, "gpu_busy_pct": detail.get(main, {}).get("gpu_busy_pct"),
           "host_cpu_ms_per_step": detail.get(main, {}).get("host_cpu_ms_per_step"),
           **{f"gpu_busy_pct_{c}": detail.get(c, {}).get("gpu_busy_pct") for c in CONFIGS},
           "cache_hit_rate": med(results.get("ours_gpu_cache", []), "cache_hit_rate"),
           "cache_hit_rate_per_lookup": med(results.get("ours_gpu_cache", []), "cache_hit_rate_per_lookup"),
           "ratio_vs_torchrec_gpu": ratio("ours_gpu", "torchrec_gpu"),
           "ratio_vs_torchrec_gpu_auto": ratio("ours_gpu_auto", "torchrec_gpu"),
           "ratio_cache_vs_torchrec_gpu": ratio("ours_gpu_cache", "torchrec_gpu"),
           "ratio_auto_vs_ps": ratio("ours_gpu_auto", "ours_gpu"),
           "ratio_cache_vs_nocache": ratio("ours_gpu_cache", "ours_gpu"),
           "ratio_vs_plain_gpu": ratio("ours_gpu", "plain_gpu"), **(extra or {})}
    out["targets"] = dict(TARGETS)
    out["meets_targets"] = {k: (None if out[k] is None else out[k] >= v) for k, v in TARGETS.items()}
    on_cpu = getattr(args, "device", "cuda") == "cpu"
    out.update({"device": "cpu" if on_cpu else torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "cpus": os.cpu_count(), "torch": torch.__version__,
                "rows": args.rows, "steps": args.steps, "log_every": args.log_every, "repeats": args.repeats,
                "batch_size": args.batch_size, "dim": args.dim, "threads": args.threads, "shards": args.shards,
                "cap": args.cap, "cache_frac": args.cache_frac, "cache_staleness": args.cache_staleness,
                "gen_s": round(gen_s, 2), "detail": detail, "notes": notes})
    return out


def print_table(r: dict) -> None:
    print(f"{r['device']}, {r['cpus']} cpus; Zipf(1.05) criteo-like, {r['rows']:,} rows, D={r['dim']}, "
          f"B={r['batch_size']}, {r['steps']} timed steps, median of {r['repeats']}, {r['shards']} shards")
    print(f"  {'configuration':16s} {'samples/s':>10s} {'GPU busy %':>10s} {'hit rate':>8s} {'ps wait ms':>10s}")
    for c in CONFIGS:
        d = r["detail"].get(c, {})
        v = r[c]
        print(f"  {c:16s} {('%10.0f' % v) if v else '      null'} {str(d.get('gpu_busy_pct', '-')):>10s} "
              f"{str(d.get('cache_hit_rate', '-')):>8s} {str(d.get('ps_wait_ms', '-')):>10s}")
    for k in ("ratio_vs_torchrec_gpu", "ratio_vs_torchrec_gpu_auto", "ratio_cache_vs_torchrec_gpu", "ratio_auto_vs_ps",
              "ratio_cache_vs_nocache", "ratio_vs_plain_gpu", "host_cpu_ms_per_step"):
        print(f"  {k:32s} {r[k]}")
    for k, want in r["targets"].items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[r["meets_targets"][k]]
        print(f"  target {k} >= {want}: {verdict}")
    for n in r["notes"]:
        print(f"  note: {n}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--quick", action="store_true",
                   help="the device check: fewer rows and steps, 1 repeat, test_cuda.py first, a profile to --out")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where our trainer runs")
    p.add_argument("--out", default=os.environ.get("OUT"), help="where --quick writes its profile (default $OUT)")
    p.add_argument("--profile-steps", type=int, default=None, help="steps of the profiled run (--quick: 20)")
    p.add_argument("--rows", type=int, default=None, help="rows of generated data, read in epochs (1M; --quick 300k)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run after --log-every warm-up (100; --quick 40)")
    p.add_argument("--log-every", type=int, default=10, help="steps per timing interval")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration, median (3; --quick 1)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=4, help="torch threads of the trainer / baseline process")
    p.add_argument("--shards", type=int, default=4, help="PS shard processes of our runs")
    p.add_argument("--cap", type=int, default=10_000_000, help="most rows per baseline table (ids map to id %% rows)")
    p.add_argument("--ps-kernel", choices=("auto", "native", "torch", "fbgemm"), default="auto")
    p.add_argument("--ps-shared-memory", choices=("auto", "true", "false"), default="auto")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=None, help="(all; --quick: " + " ".join(QUICK_CONFIGS) + ")")
    p.add_argument("--cache-frac", type=float, default=0.05, help="cache_rows per table / its feature's vocabulary")
    p.add_argument("--cache-staleness", type=int, default=8, help="ps.max_staleness of our runs")
    p.add_argument("--partial", metavar="FILE", help="rewrite FILE with the JSON summary of the runs so far after each run")
    p.add_argument("--allow-missing-baseline", action="store_true",
                   help="report torchrec_gpu as null when torchrec cannot run, instead of failing")
    a = p.parse_args()
    for key, full, quick in (("rows", 1_000_000, 300_000), ("steps", 100, 40), ("repeats", 3, 1),
                             ("configs", list(CONFIGS), list(QUICK_CONFIGS)), ("profile_steps", 0, 20)):
        if getattr(a, key) is None:
            setattr(a, key, quick if a.quick else full)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU (this benchmark needs one, or --device cpu; benchmarks/train_throughput.py is the CPU "
              "one)", file=sys.stderr)
        return 2
    if a.steps < a.log_every:
        p.error(f"--steps ({a.steps}) must be >= --log-every ({a.log_every})")
    a.steps = a.log_every * math.ceil(a.steps / a.log_every)
    logging.basicConfig(level=logging.WARNING)
    try:
        r = run(a)
    except MissingBaseline as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if a.json else "", end="\n" if a.json else "")
    if not a.json:
        print_table(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
