"""GPU training throughput (issue #14 item 5): the dense model and the row cache on the GPU, the PS
shards on the host's CPU cores, against TorchRec with every table on the same GPU.

    python benchmarks/train_gpu.py [--json] [--shards 4] [--steps 100] [--repeats 3]

Needs a CUDA GPU (exit 2 without one). The job is `benchmarks/train_throughput.py`'s DLRM (26
one-id features C1..C26 + 13 dense, D = --dim, bottom_mlp [128, D], top_mlp [128, 64], BCE, dense
Adam lr 1e-3, row-wise Adagrad lr 0.05 on the embeddings) on its Zipf(1.05) criteo-like data
(`ours_cache_zipf`'s): every sparse feature's ids drawn Zipf(1.05) over its own vocabulary.

- `ours_gpu_cache`: `launch_train` with train.device = "cuda", 1 trainer, --shards PS shard processes
  on the host's cores (ps.mode async, ps.max_staleness --cache-staleness), and a trainer-side row
  cache of --cache-frac (5%) of each feature's vocabulary per table, held on the GPU
  (`embedding_ps.client.cache`, rows pooled there).
- `ours_gpu`: the same job without the cache (every row pulled from the shards each step, pooled
  on the host, the pooled [B, F, D] copied to the GPU).
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
over each run's timed intervals, averaged. Hit rate: the trainer's `cache/hit_rate` lines (hits /
distinct ids looked up), and per lookup.

--json prints one line: each configuration's samples/s (null when not run), `gpu_busy_pct`
(ours_gpu_cache), `gpu_busy_pct_<configuration>`, `cache_hit_rate`, `cache_hit_rate_per_lookup`,
`ratio_vs_torchrec_gpu` (ours_gpu_cache / torchrec_gpu), `ratio_nocache_vs_torchrec_gpu`,
`ratio_cache_vs_nocache`, `targets` / `meets_targets` (GPU busy >= 50%, >= 0.5x TorchRec), the
device's name, per-configuration detail and `notes`. A missing torchrec is an error (exit 2) unless
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

CONFIGS = ("ours_gpu_cache", "ours_gpu", "torchrec_gpu", "plain_gpu")
TARGETS = {"gpu_busy_pct": 50.0, "ratio_vs_torchrec_gpu": 0.5}
"""Issue #14's GPU targets, each checked against the key of the same name (>=)."""


class GpuBusy:
    """NVML utilization of GPU 0 sampled every `period_s` in a thread: (unix time, percent)."""

    def __init__(self, period_s: float = 0.05) -> None:
        import pynvml          # nvidia-ml-py

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-busy", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.time(), self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def __enter__(self) -> GpuBusy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def mean_between(self, t0: float, t1: float) -> float | None:
        got = [u for t, u in self.samples if t0 <= t <= t1]
        return round(statistics.fmean(got), 1) if got else None


def gpu_config(args: argparse.Namespace, data_dir: str, run_dir: str, cache: bool):
    """train_throughput's async job on the GPU: --shards shards, the row cache on or off."""
    cfg = job_config(args, data_dir, run_dir, "async", cache_rows_of(args.cache_frac) if cache else None,
                     args.cache_staleness, shards=args.shards)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="cuda"))


def run_ours_gpu(cfg, busy: GpuBusy) -> dict:
    """launch_train (train_throughput.run_ours), plus the GPU busy % over the timed lines."""
    out = run_ours(cfg)
    lines = [json.loads(s) for s in (Path(cfg.train.run_dir) / "metrics.jsonl").read_text().splitlines() if s.strip()]
    timed = [x for x in lines if x.get("perf/samples_per_s") is not None]
    out["gpu_busy_pct"] = busy.mean_between(timed[0]["time"], timed[-1]["time"])
    return out


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
    dev = torch.device("cuda")
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
    if "torchrec_gpu" in configs and (why := torchrec_missing()):
        if not args.allow_missing_baseline:
            raise MissingBaseline(f"{why}: the TorchRec baseline cannot run (install torchrec and fbgemm-gpu "
                                  f"for this CUDA, or pass --allow-missing-baseline)")
        notes.append(f"{why}; torchrec_gpu reported as null (--allow-missing-baseline)")
        configs.remove("torchrec_gpu")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp, GpuBusy() as busy:
        data_dir = os.path.join(tmp, "data-zipf")
        t0 = time.perf_counter()
        write_preset(zipf_preset(), args.rows, data_dir)
        gen_s = time.perf_counter() - t0
        for r in range(args.repeats):
            for c in configs:
                run_dir = os.path.join(tmp, f"run-{c}-{r}")
                cfg = gpu_config(args, data_dir, run_dir, cache=c == "ours_gpu_cache")
                res = run_ours_gpu(cfg, busy) if c.startswith("ours") else run_inprocess_gpu(c, cfg, args, busy)
                results[c].append(res)
                print(f"  repeat {r + 1}/{args.repeats} {c:15s} {res['samples_per_s']:10,.0f} samples/s, "
                      f"GPU busy {res['gpu_busy_pct']}%", file=sys.stderr, flush=True)
                if args.partial:    # the summary so far, rewritten after every run (a cut run keeps it)
                    Path(args.partial).write_text(json.dumps(summarize(args, results, notes, gen_s)) + "\n")
    return summarize(args, results, notes, gen_s)


class MissingBaseline(RuntimeError):
    """A baseline the run needs cannot run (and --allow-missing-baseline was not given)."""


def summarize(args: argparse.Namespace, results: dict[str, list[dict]], notes: list[str], gen_s: float) -> dict:
    med = lambda runs, k: (round(statistics.median(x[k] for x in runs), 4)    # noqa: E731
                           if runs and all(x.get(k) is not None for x in runs) else None)
    rate = {c: (round(med(results[c], "samples_per_s")) if results.get(c) else None) for c in CONFIGS}
    ratio = lambda a, b: round(rate[a] / rate[b], 3) if rate[a] and rate[b] else None   # noqa: E731
    detail = {}
    for c, runs in results.items():
        d = {"runs_samples_per_s": [round(x["samples_per_s"]) for x in runs],
             "runs_gpu_busy_pct": [x["gpu_busy_pct"] for x in runs]}
        for k in ("step_ms", "pull_ms", "push_ms", "ps_wait_ms", "data_wait_frac", "cache_hit_rate",
                  "cache_hit_rate_per_lookup", "final_loss", "max_gpu_memory_gib", "gpu_busy_pct"):
            if (v := med(runs, k)) is not None:
                d[k] = v
        if runs and all("cpu_ms_per_step" in x for x in runs):
            d["cpu_ms_per_step"] = {role: statistics.median(x["cpu_ms_per_step"].get(role, 0.0) for x in runs)
                                    for role in sorted({r for x in runs for r in x["cpu_ms_per_step"]})}
        detail[c] = d
    out = {**rate, "gpu_busy_pct": detail.get("ours_gpu_cache", {}).get("gpu_busy_pct"),
           **{f"gpu_busy_pct_{c}": detail.get(c, {}).get("gpu_busy_pct") for c in CONFIGS},
           "cache_hit_rate": med(results.get("ours_gpu_cache", []), "cache_hit_rate"),
           "cache_hit_rate_per_lookup": med(results.get("ours_gpu_cache", []), "cache_hit_rate_per_lookup"),
           "ratio_vs_torchrec_gpu": ratio("ours_gpu_cache", "torchrec_gpu"),
           "ratio_nocache_vs_torchrec_gpu": ratio("ours_gpu", "torchrec_gpu"),
           "ratio_cache_vs_nocache": ratio("ours_gpu_cache", "ours_gpu"),
           "ratio_vs_plain_gpu": ratio("ours_gpu_cache", "plain_gpu")}
    out["targets"] = dict(TARGETS)
    out["meets_targets"] = {k: (None if out[k] is None else out[k] >= v) for k, v in TARGETS.items()}
    out.update({"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "cpus": os.cpu_count(), "torch": torch.__version__,
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
    for k in ("ratio_vs_torchrec_gpu", "ratio_nocache_vs_torchrec_gpu", "ratio_cache_vs_nocache", "ratio_vs_plain_gpu"):
        print(f"  {k:32s} {r[k]}")
    for k, want in r["targets"].items():
        verdict = {True: "met", False: "NOT met", None: "not measured"}[r["meets_targets"][k]]
        print(f"  target {k} >= {want}: {verdict}")
    for n in r["notes"]:
        print(f"  note: {n}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows of generated data (read in epochs)")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run (after --log-every warm-up steps)")
    p.add_argument("--log-every", type=int, default=10, help="steps per timing interval")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (median)")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=4, help="torch threads of the trainer / baseline process")
    p.add_argument("--shards", type=int, default=4, help="PS shard processes of our runs")
    p.add_argument("--cap", type=int, default=10_000_000, help="most rows per baseline table (ids map to id %% rows)")
    p.add_argument("--ps-kernel", choices=("auto", "native", "torch", "fbgemm"), default="auto")
    p.add_argument("--ps-shared-memory", choices=("auto", "true", "false"), default="auto")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--cache-frac", type=float, default=0.05, help="cache_rows per table / its feature's vocabulary")
    p.add_argument("--cache-staleness", type=int, default=8, help="ps.max_staleness of our runs")
    p.add_argument("--partial", metavar="FILE", help="rewrite FILE with the JSON summary of the runs so far after each run")
    p.add_argument("--allow-missing-baseline", action="store_true",
                   help="report torchrec_gpu as null when torchrec cannot run, instead of failing")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA GPU (this benchmark needs one; see benchmarks/train_throughput.py for the CPU one)",
              file=sys.stderr)
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
