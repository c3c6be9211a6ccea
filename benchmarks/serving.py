"""Serving: batch-1 latency and batch-4096 throughput of `recsys.serving.Predictor`, against TorchRec.

    python benchmarks/serving.py [--json] [--rows N] [--extra-rows N] [--zipf A] [--unseen P]
                                 [--requests N] [--threads T] [--allow-missing-baseline]
                                 [--latencies FILE] [--timed-s S] [--workdir DIR]

Builds a criteo-like model in-process (configs/quickstart.toml: DLRM, 26 one-id + 2 multi-hot
mean-pooled features, D = 16): trains it for a few steps on `--rows` synthetic rows, adds
`--extra-rows` rows to table C1, saves it as a run and exports it in fp32, fp16, int8 and int4.

The id stream: the eval file's rows (dense values, bag lengths), with every id redrawn: per
feature, a Zipf(`--zipf`) rank over a random order of the table's stored ids (ranks past a small
table wrap around), except a fraction `--unseen` of ids: fresh random 62-bit ids the export has
never seen (they get the table's default row). Every request has its own draws (not the same
hot ids).

Per precision, in the same run, on the same exported tables:
- ours, batch 1: `Predictor.predict(batch)` latency p50 / p99 over `--requests` requests (raw
  ids -> fused lookup -> pooling -> dense program -> sigmoid), and the pooling alone (`pooled`);
- ours, batch 4096: pooled rows/s of `Predictor.pooled` (raw ids -> pooled [B, F, D]; the
  Predictor's pooling is `NativePooling`, the C kernel, or the per-table path without a compiler:
  `pooling` says which) and predictions/s of `Predictor.predict`; `per_table_per_s_b4096`: the
  per-table path (`Predictor(fused=False)`: SparseArch over the export, or fbgemm's TBE for
  int8 / int4) on the same requests, for comparison;
- memory: `pooling_rows_mib` / `pooling_maps_mib`, what `NativePooling` holds (row matrices per
  table: fp32 / fp16 as stored, int8 / int4 as scale | bias | codes; hash maps);
- baseline: TorchRec's quantized inference `torchrec.quant.embedding_modules.EmbeddingBagCollection`
  (one fbgemm IntNBit TBE per pooling mode, data type = the export's precision, loaded with the
  export's own rows) on the same requests, pooling only. TorchRec takes row indices, not raw
  ids: the ids are mapped to rows before timing (unknown ids -> an all-zero row), so the baseline
  does less work than ours (no id lookup, no default rows); `baseline_with_id_map_per_s_b4096`
  times it with that mapping (per-table `np.searchsorted`, as the per-table Predictor did) for a
  like-for-like figure. Without torchrec the run stops (exit status 1, saying how to install
  it) unless `--allow-missing-baseline`: then the baseline is one plain `nn.EmbeddingBag` per
  table over the dequantized rows, labelled as such.

Batch-4096 rates of ours, the baseline and the per-table path are timed interleaved (5 rounds of
>= 0.3 s each, medians), so that a load change on a shared machine hits all of them alike.
Threads: `--threads T` sets `torch.set_num_threads(T)` for everything: fbgemm's kernels get
what torch gives them, and the native kernel splits its work over `torch.get_num_threads()`.

`--json` prints one line: `p50_ms_b1` / `p99_ms_b1` (the worse of fp32 and int8, the target
precisions), `ratio_b4096_vs_baseline` (the lowest over the precisions of our pooled rows/s over
the baseline's at B = 4096), `baseline`, and everything else under `detail`. `--latencies FILE`
also writes every timed batch-1 call, per precision (`predict_latency_ms_b1`, ours end to end, and
`baseline_latency_ms_b1`), as JSON: `benchmarks/plots.py --serving FILE` draws their histogram.
Measured figures: BENCHMARKS.md, "benchmarks/serving.py".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.batch import Batch, KeyedJagged  # noqa: E402
from data.decode import decode_table  # noqa: E402
from data.synthetic import generate  # noqa: E402
from embedding_ps.local import LocalStore  # noqa: E402
from recsys.config import load_config, to_toml  # noqa: E402
from recsys.serving import Predictor  # noqa: E402
from recsys.serving.export import export_model  # noqa: E402
from recsys.serving.quantize import dequantize, tbe_rows  # noqa: E402
from recsys.serving.source import resolve_source  # noqa: E402
from recsys.training.trainer import Trainer  # noqa: E402
from recsys.training.worker import save_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "fp16", "int8", "int4")
TARGETED = ("fp32", "int8")
BIG = 4096
INSTALL = "install the baseline with `make bench-deps` (pip install -e '.[bench]' + torchrec 1.8.0 --no-deps)"


def make_run(tmp: Path, rows: int, extra_rows: int, steps: int) -> tuple[Path, Path]:
    data = tmp / "data"
    generate(preset="criteo-like", rows=rows, num_files=2, out_dir=str(data), seed=0)
    cfg = load_config(ROOT / "configs" / "quickstart.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
        f"train.run_dir='{tmp / 'run'}'", f"train.max_steps={steps}", "ps.mode='sync'"])
    store = LocalStore.create(cfg.ps)
    trainer = Trainer(cfg, store)
    trainer.train()
    trainer.close()
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(1, 2**62, size=extra_rows, dtype=np.int64))
    store.push(0, ids, torch.zeros(extra_rows, cfg.ps.tables[0].dim))      # admits them: a large C1
    run = tmp / "run"
    save_model(trainer, store, run / "model")
    (run / "config.toml").write_text(to_toml(cfg))
    (run / "metrics.json").write_text(json.dumps({"steps": trainer.step}))
    return run, data / "part-00001.parquet"


# -- the id stream ------------------------------------------------------------------------------

def zipf_stream(p: Predictor, batch: Batch, a: float, unseen: float, seed: int) -> Batch:
    """`batch` with every id redrawn: Zipf ranks over each feature's table's stored ids (ranks past a
    small table wrap around), and a fraction `unseen` of fresh ids."""
    rng = np.random.default_rng(seed)
    kj = batch.sparse
    B = batch.batch_size
    table_of = {f: plan.table for plan in p.sparse.plans if not plan.linear for f in plan.features}
    counts = kj.lengths.view(len(kj.keys), B).sum(dim=1).tolist()
    parts = []
    for f, n in enumerate(counts):
        ids = p.tables[table_of[f]].ids
        order = np.random.default_rng(f).permutation(ids.shape[0])          # which stored ids are hot
        rank = (rng.zipf(a, n) - 1) % max(1, ids.shape[0])
        fresh = (rng.random(n) < unseen) | (ids.shape[0] == 0)
        out = rng.integers(2**61, 2**62, size=n, dtype=np.int64)             # never stored (w.h.p.)
        out[~fresh] = ids[order[rank[~fresh]]]
        parts.append(out)
    values = torch.from_numpy(np.concatenate(parts))
    return Batch(batch.dense, KeyedJagged(kj.keys, values, kj.lengths), batch.labels)


def take(batch: Batch, lo: int, hi: int) -> Batch:
    """Rows lo..hi of a Batch (a copy)."""
    return takes(batch, [(lo, hi)])[0]


def takes(batch: Batch, spans: list[tuple[int, int]]) -> list[Batch]:
    """Rows lo..hi of a Batch for every (lo, hi) of `spans` (copies). The [F, B] bag bounds are
    computed once: per span they were 3 x F x B x 8 bytes of temporaries, which for 2,000 batch-1
    requests fragmented glibc's heap up to ~20 GB resident."""
    kj, B = batch.sparse, batch.batch_size
    lengths = kj.lengths.view(len(kj.keys), B).to(torch.int64)              # [F, B]
    ends = torch.cumsum(lengths.reshape(-1), 0).view(len(kj.keys), B)       # [F, B]
    starts = (ends - lengths).tolist()
    ends = ends.tolist()
    out = []
    for lo, hi in spans:
        pieces = [kj.values[starts[f][lo]:ends[f][hi - 1]] for f in range(len(kj.keys))]
        sub = KeyedJagged(kj.keys, torch.cat(pieces).clone(), lengths[:, lo:hi].reshape(-1).to(torch.int32).clone())
        out.append(Batch(batch.dense[lo:hi].clone(), sub, batch.labels[lo:hi].clone()))
    return out


# -- the baseline -------------------------------------------------------------------------------

class Baseline:
    """TorchRec's quantized inference EBC (or plain nn.EmbeddingBag) over the export's tables."""

    def __init__(self, p: Predictor, keys: tuple[str, ...], allow_missing: bool) -> None:
        self.p, self.keys = p, keys
        self.plans = [plan for plan in p.sparse.plans if not plan.linear]
        try:
            self.module = self._torchrec()
            import torchrec
            self.label = f"torchrec {torchrec.__version__} quant EmbeddingBagCollection"
            self.torchrec = True
        except ImportError as e:
            if not allow_missing:
                raise SystemExit(f"serving.py: the TorchRec baseline cannot run ({e}); {INSTALL}, "
                                 "or pass --allow-missing-baseline to measure plain nn.EmbeddingBag instead") from None
            self.label = "plain nn.EmbeddingBag per table (torchrec not installed)"
            self.torchrec = False
            self.bags = [torch.nn.EmbeddingBag.from_pretrained(self._rows_fp32(plan.table), mode=plan.pooling)
                         for plan in self.plans]

    def _rows_fp32(self, t: int) -> torch.Tensor:
        view = self.p.tables[t]
        rows = dequantize(np.asarray(view.matrix), view.precision, view.cfg.dim)
        return torch.cat([rows, torch.zeros(1, view.cfg.dim)])                # + the zero row of unknown ids

    def _torchrec(self):
        from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
        from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
        dtype = {"fp32": DataType.FP32, "fp16": DataType.FP16, "int8": DataType.INT8, "int4": DataType.INT4}
        prec = self.p.precision
        configs, weights = [], {}
        for plan in self.plans:
            view = self.p.tables[plan.table]
            configs.append(EmbeddingBagConfig(
                name=plan.name, embedding_dim=plan.dim, num_embeddings=view.num_rows + 1,
                feature_names=[self.keys[f] for f in plan.features],
                pooling=PoolingType.MEAN if plan.pooling == "mean" else PoolingType.SUM, data_type=dtype[prec]))
            if prec in ("int8", "int4"):
                rows = np.concatenate([tbe_rows(np.asarray(view.matrix), prec),
                                       np.zeros((1, 4 + (plan.dim if prec == "int8" else plan.dim // 2)), np.uint8)])
                t = torch.from_numpy(rows)
                weights[plan.name] = (t[:, 4:].contiguous(), t[:, :4].contiguous())    # codes, f16 scale | bias
            else:
                rows = self._rows_fp32(plan.table).to(torch.float16 if prec == "fp16" else torch.float32)
                weights[plan.name] = (rows.view(torch.uint8), None)
        return QuantEBC(configs, is_weighted=False, device=torch.device("cpu"),
                        table_name_to_quantized_weights=weights)

    def inputs(self, batch: Batch):
        """The request as the baseline takes it: row indices (unknown ids -> the zero row), mapped untimed."""
        kj, B = batch.sparse, batch.batch_size
        feats = [f for plan in self.plans for f in plan.features]
        lengths = kj.lengths.view(len(kj.keys), B)
        rows = []
        for plan in self.plans:
            view = self.p.tables[plan.table]
            for f in plan.features:
                pos, found = view.locate(view.keys(kj[kj.keys[f]].values))
                rows.append(torch.from_numpy(np.where(found, pos, view.num_rows)))
        values, lens = torch.cat(rows), lengths[feats].reshape(-1)
        if not self.torchrec:
            return values, lens, B
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
        return KeyedJaggedTensor(keys=[kj.keys[f] for f in feats], values=values, lengths=lens)

    def __call__(self, x) -> torch.Tensor:
        if self.torchrec:
            return self.module(x).values()                                   # [B, sum D]
        values, lens, B = x
        offsets = torch.cumsum(lens, 0) - lens
        out, k = [], 0
        for bag, plan in zip(self.bags, self.plans):
            n = len(plan.features) * B
            start = int(offsets[k]) if k < lens.numel() else 0
            end = start + int(lens[k:k + n].sum())
            out.append(bag(values[start:end], offsets[k:k + n] - start))
            k += n
        return torch.cat(out, dim=1) if B else torch.zeros(0)


# -- timing -------------------------------------------------------------------------------------

def latencies(fn, xs: list, warmup: int = 100) -> list[float]:
    for x in xs[:warmup]:
        fn(x)
    out = []
    for x in xs:
        t0 = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t0)
    return out


def rate(fn, xs: list, work: int, reps: int = 5, min_s: float = 0.3) -> float:
    """Median units of `work` per second over `reps` timings of at least `min_s` each (cycling xs)."""
    fn(xs[0])
    rates = []
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn(xs[n % len(xs)])
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        rates.append(n * work / dt)
    return statistics.median(rates)


def rates(fns: dict, xs: dict, work: int, reps: int = 5, min_s: float = 0.3) -> dict:
    """`rate` of several functions with their timings interleaved (a, b, c, a, b, c, ...): on a shared
    machine a load change then hits every one alike rather than whichever ran at the time."""
    for name, fn in fns.items():
        fn(xs[name][0])
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out[name].append(rate(fn, xs[name], work, reps=1, min_s=min_s))
    return {name: statistics.median(r) for name, r in out.items()}


def ms(xs: list[float], q: float) -> float:
    return round(float(np.quantile(np.array(xs), q)) * 1e3, 4)


def check_baseline(p: Predictor, base: Baseline, decoded: Batch, a: float) -> float:
    """Largest |ours - baseline| of pooled rows on 256 requests of stored ids only; raises past 1e-2."""
    batch = zipf_stream(p, take(decoded, 0, 256), a, 0.0, seed=7)
    ours = p.pooled(batch)[0]                                                # [B, F, D]
    theirs = base(base.inputs(batch)).view(ours.shape)
    diff = float((ours - theirs).abs().max())
    if not diff <= 1e-2:
        raise SystemExit(f"serving.py: the baseline's pooled rows differ from ours by {diff} ({p.precision})")
    return round(diff, 6)


def bench_precision(export: Path, decoded: Batch, a: float, unseen: float, requests: int,
                    allow_missing: bool, min_s: float = 0.3) -> tuple[dict, str, dict[str, list[float]]]:
    """One precision's figures, the baseline's label and every batch-1 call's latency (ms)."""
    t0 = time.perf_counter()
    p = Predictor(export)
    out = {"open_s": round(time.perf_counter() - t0, 3)}
    base = Baseline(p, decoded.sparse.keys, allow_missing)
    out["baseline_max_abs_diff"] = check_baseline(p, base, decoded, a)
    stream = zipf_stream(p, decoded, a, unseen, seed=1)
    ones = takes(stream, [(i, i + 1) for i in range(requests)])
    bigs = takes(stream, [(i * BIG, (i + 1) * BIG) for i in range(max(1, stream.batch_size // BIG))])
    ids = sum(int(b.sparse.values.numel()) for b in ones)
    miss = sum(int((~p.tables[0].locate(p.tables[0].keys(b.sparse["C1"].values))[1]).sum()) for b in ones)
    out["ids_per_request_b1"] = round(ids / requests, 2)
    out["unseen_frac_C1_b1"] = round(miss / requests, 3)              # C1: one id a request
    lat = latencies(p.predict, ones)
    out.update(p50_ms_b1=ms(lat, 0.5), p99_ms_b1=ms(lat, 0.99))
    calls = {"predict_latency_ms_b1": [round(x * 1e3, 4) for x in lat]}        # every call (--latencies)
    lat = latencies(p.pooled, ones)
    out.update(pooled_p50_ms_b1=ms(lat, 0.5), pooled_p99_ms_b1=ms(lat, 0.99))
    base_ones = [base.inputs(b) for b in ones]
    lat = latencies(base, base_ones)
    out.update(baseline_p50_ms_b1=ms(lat, 0.5), baseline_p99_ms_b1=ms(lat, 0.99))
    calls["baseline_latency_ms_b1"] = [round(x * 1e3, 4) for x in lat]
    base_bigs = [base.inputs(b) for b in bigs]
    out["pooling"] = type(p.native).__name__ if p.native is not None else "per-table"
    if p.native is not None:                                                 # NativePooling's rows and maps
        held = p.native.held_bytes()
        out.update(pooling_rows_mib=round(held["rows"] / 2**20, 1), pooling_maps_mib=round(held["maps"] / 2**20, 1))
    per_table = Predictor(export, fused=False)                               # the per-table path, same requests
    r = rates({"ours": p.pooled, "baseline": base, "per_table": per_table.pooled},
              {"ours": bigs, "baseline": base_bigs, "per_table": bigs}, BIG, min_s=min_s)
    out["pooled_per_s_b4096"] = round(r["ours"])
    out["per_table_per_s_b4096"] = round(r["per_table"])
    out["baseline_per_s_b4096"] = round(r["baseline"])
    out["predictions_per_s_b4096"] = round(rate(p.predict, bigs, BIG, min_s=min_s))
    out["ratio_b4096_vs_baseline"] = round(out["pooled_per_s_b4096"] / out["baseline_per_s_b4096"], 3)
    # like for like: the baseline plus the raw id -> row map it needs (per-table np.searchsorted)
    out["baseline_with_id_map_per_s_b4096"] = round(rate(lambda b: base(base.inputs(b)), bigs, BIG, min_s=min_s))
    out["ratio_b4096_vs_baseline_with_id_map"] = round(
        out["pooled_per_s_b4096"] / out["baseline_with_id_map_per_s_b4096"], 3)
    lat = latencies(per_table.predict, ones[:max(200, requests // 5)], warmup=20)
    out["per_table_p50_ms_b1"] = ms(lat, 0.5)
    return out, base.label, calls


def build(tmp: Path, a: argparse.Namespace) -> dict:
    """The trained run and its export in every precision under `tmp`, built once: a `--workdir` that
    holds them for the same sizes is reused, so two trees can be timed on one export."""
    sizes = {"rows": a.rows, "extra_rows": a.extra_rows, "steps": a.steps}
    done = tmp / "built.json"
    if done.exists():
        built = json.loads(done.read_text())
        if built["sizes"] != sizes:
            raise SystemExit(f"serving.py: --workdir {tmp} holds an export of {built['sizes']}, not {sizes}")
        return {**built, "reused": True}          # build_s: the run that built it
    t0 = time.perf_counter()
    run_dir, eval_file = make_run(tmp, a.rows, a.extra_rows, a.steps)
    build_s = time.perf_counter() - t0
    source = resolve_source(run=run_dir)
    for prec in PRECISIONS:
        m = export_model(source, tmp / prec, prec)
    built = {"sizes": sizes, "run_dir": str(run_dir), "eval_file": str(eval_file), "rows": m["rows"],
             "build_s": round(build_s, 1)}
    done.write_text(json.dumps(built))
    return built


def run(a: argparse.Namespace) -> dict:
    torch.set_num_threads(a.threads)
    scratch = contextlib.nullcontext(a.workdir) if a.workdir else tempfile.TemporaryDirectory(prefix="bench-serving-")
    with scratch as where:
        tmp = Path(where).resolve()
        tmp.mkdir(parents=True, exist_ok=True)
        built = build(tmp, a)
        source = resolve_source(run=built["run_dir"])
        table = pq.read_table(built["eval_file"])
        cfg = dataclasses.replace(source.config.data, shuffle=False)
        decoded = decode_table(cfg, table)
        res, label, calls = {}, "", {}
        for prec in PRECISIONS:
            res[prec], label, calls[prec] = bench_precision(tmp / prec, decoded, a.zipf, a.unseen,
                                                            a.requests, a.allow_missing_baseline, a.timed_s)
    b1 = {"p50_ms_b1": max(res[x]["p50_ms_b1"] for x in TARGETED),
          "p99_ms_b1": max(res[x]["p99_ms_b1"] for x in TARGETED)}
    if a.latencies:
        Path(a.latencies).write_text(json.dumps({**b1, "baseline": label, "calls": calls}))
    return {**b1,
            "ratio_b4096_vs_baseline": min(r["ratio_b4096_vs_baseline"] for r in res.values()),
            "baseline": label,
            "detail": {"rows_C1": built["rows"]["C1"], "rows_total": sum(built["rows"].values()),
                       "build_s": built["build_s"], "export_reused": built.get("reused", False), "threads": a.threads, "cpus": os.cpu_count(),
                       "zipf": a.zipf, "unseen": a.unseen, "requests_b1": a.requests, "results": res}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--rows", type=int, default=40_000, help="synthetic rows (half train, half eval)")
    ap.add_argument("--extra-rows", type=int, default=1_000_000, help="rows added to table C1")
    ap.add_argument("--steps", type=int, default=15, help="training steps (batch 1024)")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the id stream")
    ap.add_argument("--unseen", type=float, default=0.05, help="fraction of ids never seen by the export")
    ap.add_argument("--requests", type=int, default=2000, help="batch-1 requests timed per precision")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (ours and the baseline alike)")
    ap.add_argument("--workdir", metavar="DIR",
                    help="build the run and its exports here (default: a temporary directory); a later run with "
                         "the same DIR and sizes reuses them, e.g. to time two trees on one export")
    ap.add_argument("--timed-s", type=float, default=0.3,
                    help="seconds of each batch-4096 timing (5 of them per rate); small for a smoke run")
    ap.add_argument("--allow-missing-baseline", action="store_true",
                    help="without torchrec, measure plain nn.EmbeddingBag as the baseline instead of failing")
    ap.add_argument("--latencies", metavar="FILE",
                    help="also write every timed batch-1 call's latency, per precision, to FILE (JSON)")
    a = ap.parse_args()
    if a.rows // 2 < max(BIG, a.requests):
        ap.error(f"--rows {a.rows}: the eval half must hold a {BIG}-example batch and --requests rows; "
                 f"use --rows >= {2 * max(BIG, a.requests)}")
    r = run(a)
    if a.json:
        print(json.dumps(r))
        return 0
    d = r["detail"]
    print(f"quickstart DLRM export: C1 {d['rows_C1']:,} rows, {d['rows_total']:,} rows in all; {d['threads']} "
          f"torch thread(s), {d['cpus']} cpus; Zipf {d['zipf']}, unseen {d['unseen']}; baseline: {r['baseline']}")
    print(f"{'':5s} {'p50 ms b1':>9s} {'p99 ms b1':>9s} {'pool p50':>8s} {'base p50':>8s} {'per-table':>9s} "
          f"{'pooled/s b4096':>14s} {'base/s b4096':>12s} {'ratio':>6s} {'pred/s b4096':>12s}")
    for prec, x in d["results"].items():
        print(f"{prec:5s} {x['p50_ms_b1']:9.3f} {x['p99_ms_b1']:9.3f} {x['pooled_p50_ms_b1']:8.3f} "
              f"{x['baseline_p50_ms_b1']:8.3f} {x['per_table_p50_ms_b1']:9.3f} {x['pooled_per_s_b4096']:14,d} "
              f"{x['baseline_per_s_b4096']:12,d} {x['ratio_b4096_vs_baseline']:6.3f} {x['predictions_per_s_b4096']:12,d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
