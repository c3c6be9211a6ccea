"""Model quality: test AUC of LR, FM and DeepFM trained through `recsys train`, against the same models in plain PyTorch.

    python benchmarks/quality.py [--json] [--quick] [--seeds 0,1,2] [--presets onehot,longtail]
                                 [--models lr,fm,deepfm] [--variants auto,ps_global,ps] [--l2 1e-4]

Issue #26: on real one-hot CTR data our DeepFM through the CLI reached test AUC 0.92 where 200 lines of
plain PyTorch reached 0.95. Per seed and preset, data is generated into a temporary directory
(`data.synthetic.generate`, data seed = the seed; the planted model is fixed):

- `onehot`: ten one-hot fields (data/onehot.py), 50,000 / 6,000 / 30,000 rows (train / validation / test);
- `longtail`: eight id columns built to overfit (data/synthetic.py), 10,000 / 10,000 / 10,000 rows.

Then each model is trained twice, on the same files, with the same protocol: Adam lr 1e-3 on everything
(embeddings and dense), batch 256, whole-table L2 `--l2` on every embedding table, validation logloss
after every epoch, early stopping (patience 2, at most --max-epochs epochs), the best epoch's model
scores the test file:

- `ref_auc`: `benchmarks/quality_reference.py` (nn.Embedding per field, the penalty added to the loss);
- ours: `recsys train --config benchmarks/quality.toml --set ...` as a subprocess (1 PS shard, 1 trainer,
  sync), its metrics.json `test.auc`, once per placement variant:
  `ps` every table on the PS, lazy L2 (`weight_decay_mode = "l2"`: only the rows a step touches);
  `ps_global` every table on the PS, `weight_decay_mode = "global"` (every row decayed every step,
  caught up lazily; decoupled, as AdamW: weight_decay --global-wd, default 2 x --l2);
  `auto` `placement = "auto"`: tables of at most ps.replicate_max_rows ids replicated on the trainer
  (a dense parameter, torch Adam with weight_decay = 2 x --l2: exactly the reference's penalty).

Models through our CLI (no separate LR or FM arch exists; the closest, named in the output's `arch`):
`lr` = wide_deep with model.top_mlp = [] and dim-1 tables (the wide part plus one linear layer over the
dim-1 embeddings: first-order terms only); `fm` = deepfm with model.top_mlp = [] (the DNN reduces to one
linear layer over the embeddings: first order + the FM's pairs); `deepfm` = deepfm, top_mlp [64, 32],
batch norm, dropout 0.2 (the reference's tower).

It prints, per preset / model / variant, `auc`, `ref_auc` and `ratio_auc_vs_reference` = auc / ref_auc
(the target: >= 0.99), with the oracle AUC (of the data's p_true) and LR's for scale. --seeds: every
figure is the median over the seeds (each run's own figures under `runs`). --json: one JSON object,
e.g. `{"onehot": {"deepfm": {"auto": {"auc", "ref_auc", "ratio_auc_vs_reference", ...}, "ps_global":
{...}, "ps": {...}, "ref_auc": ..., "arch": ...}, "lr": ..., "fm": ...}, "longtail": ..., "config": ...}`.
--quick: small data (10,000 / 2,000 / 5,000 rows; longtail 3 x 3,000), 3 epochs, deepfm only unless
--models: a smoke run of a few minutes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: spinning OpenMP starves 2 cores

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))          # quality_reference, also when loaded by a test

from data.onehot import ONEHOT_FIELDS  # noqa: E402
from data.synthetic import generate, preset_schema  # noqa: E402
from quality_reference import RefConfig, train_reference  # noqa: E402  (benchmarks/, the script's folder)

BASE = ROOT / "benchmarks" / "quality.toml"
MODELS = {
    "lr": ("wide_deep, model.top_mlp = [], dim-1 tables (first order only)",
           ["model.arch='wide_deep'", "model.top_mlp=[]", "ps.table_defaults.dim=1"]),
    "fm": ("deepfm, model.top_mlp = [] (first order + FM pairs + one linear layer over the embeddings)",
           ["model.arch='deepfm'", "model.top_mlp=[]"]),
    "deepfm": ("deepfm, top_mlp [64, 32], batch norm, dropout 0.2", ["model.arch='deepfm'"]),
}
VARIANTS = ("auto", "ps_global", "ps")
SPLITS = {"onehot": (50_000, 6_000, 30_000), "longtail": (10_000, 10_000, 10_000)}
QUICK_SPLITS = {"onehot": (10_000, 2_000, 5_000), "longtail": (3_000, 3_000, 3_000)}


def fields(preset: str) -> tuple[str, ...]:
    return ONEHOT_FIELDS if preset == "onehot" else tuple(preset_schema(preset)["sparse"])


def variant_overrides(variant: str, args: argparse.Namespace) -> list[str]:
    wd = 2 * args.l2
    if variant == "auto":
        return ["ps.table_defaults.placement='auto'", f"ps.table_defaults.weight_decay={wd!r}",
                "ps.table_defaults.weight_decay_mode='l2'"]
    if variant == "ps_global":
        gwd = args.global_wd if args.global_wd is not None else wd
        return ["ps.table_defaults.placement='ps'", f"ps.table_defaults.weight_decay={gwd!r}",
                "ps.table_defaults.weight_decay_mode='global'"]
    return ["ps.table_defaults.placement='ps'", f"ps.table_defaults.weight_decay={wd!r}",
            "ps.table_defaults.weight_decay_mode='l2'"]


def overrides(preset: str, model: str, variant: str, data: Path, run_dir: Path, seed: int,
              args: argparse.Namespace) -> list[str]:
    """The --set overrides of benchmarks/quality.toml for one run."""
    cols = list(fields(preset))
    return [f"data.train_paths=['{data}/part-00000.parquet']", f"data.eval_paths=['{data}/part-00001.parquet']",
            f"data.test_paths=['{data}/part-00002.parquet']", f"data.sparse_columns={cols!r}",
            f"train.run_dir='{run_dir}'", f"train.seed={seed}", f"train.epochs={args.max_epochs}",
            *MODELS[model][1], *variant_overrides(variant, args)]


def train_ours(preset: str, model: str, variant: str, data: Path, run_dir: Path, seed: int,
               args: argparse.Namespace) -> dict:
    """`recsys train` of one model / variant; its metrics.json test figures (or the error)."""
    sets = overrides(preset, model, variant, data, run_dir, seed, args)
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", str(BASE)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    secs = time.perf_counter() - t0
    if p.returncode != 0:
        err = [line for line in p.stderr.splitlines() if line.strip()]
        return {"error": (err[-1] if err else f"exit {p.returncode}")[:400], "seconds": round(secs, 1)}
    m = json.loads((run_dir / "metrics.json").read_text())
    out = {"auc": m["test"]["auc"], "logloss": m["test"]["logloss"], "best_val_logloss": m.get("best_val_logloss"),
           "epochs": m.get("val_passes"), "seconds": round(secs, 1)}
    placement = run_dir / "placement.json"
    if placement.exists():
        report = json.loads(placement.read_text())
        out["replicated_tables"] = sum(1 for e in report.values() if e.get("placement") == "replicated")
        out["ps_tables"] = sum(1 for e in report.values() if e.get("placement") == "ps")
    return out


def one_seed(seed: int, args: argparse.Namespace, tmp: Path, log) -> dict:
    res: dict = {}
    for preset in args.presets:
        data = tmp / f"{preset}-{seed}"
        split = (QUICK_SPLITS if args.quick else SPLITS)[preset]
        summary = generate(preset=preset, rows=sum(split), num_files=3, out_dir=str(data), seed=seed,
                           rows_per_file=split)
        pr: dict = {"oracle_auc": summary["oracle_auc"], "rows": list(split)}
        paths = [[str(data / f"part-0000{i}.parquet")] for i in range(3)]
        for model in args.models:
            ref_cfg = RefConfig(arch=model, l2=args.l2, max_epochs=args.max_epochs, seed=seed)
            t0 = time.perf_counter()
            ref = train_reference(ref_cfg, fields(preset), *paths)
            ref["seconds"] = round(time.perf_counter() - t0, 1)
            mr: dict = {"ref_auc": ref["auc"], "ref": ref}
            log(f"seed {seed} {preset:8s} {model:6s} reference  test AUC {ref['auc']:.4f}  "
                f"({ref['epochs']} epochs, {ref['seconds']:.0f} s)")
            for variant in args.variants:
                run = train_ours(preset, model, variant, data, tmp / f"run-{preset}-{model}-{variant}-{seed}",
                                 seed, args)
                if "auc" in run:
                    run["ref_auc"] = ref["auc"]
                    run["ratio_auc_vs_reference"] = run["auc"] / ref["auc"]
                    log(f"seed {seed} {preset:8s} {model:6s} {variant:10s} test AUC {run['auc']:.4f}  ratio "
                        f"{run['ratio_auc_vs_reference']:.3f}  ({run['epochs']} epochs, {run['seconds']:.0f} s)")
                else:
                    log(f"seed {seed} {preset:8s} {model:6s} {variant:10s} failed: {run['error']}")
                mr[variant] = run
            pr[model] = mr
        res[preset] = pr
    return res


def _median(values: list) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict], args: argparse.Namespace) -> dict:
    """Medians over the seeds, in the layout of the module docstring."""
    out: dict = {}
    for preset in args.presets:
        pr: dict = {"oracle_auc": _median([r[preset]["oracle_auc"] for r in runs]), "rows": runs[0][preset]["rows"]}
        for model in args.models:
            mr: dict = {"arch": MODELS[model][0], "ref_auc": _median([r[preset][model]["ref_auc"] for r in runs])}
            for variant in args.variants:
                per = [r[preset][model][variant] for r in runs]
                v = {k: _median([p.get(k) for p in per]) for k in ("auc", "ref_auc", "ratio_auc_vs_reference")}
                errors = [p["error"] for p in per if "error" in p]
                if errors:
                    v["errors"] = errors
                mr[variant] = v
            pr[model] = mr
        out[preset] = pr
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="small data, 3 epochs, deepfm only (unless --models)")
    p.add_argument("--seeds", default="0", help="comma-separated; figures are medians over them")
    p.add_argument("--presets", default="onehot,longtail")
    p.add_argument("--models", default=None, help="of lr, fm, deepfm (default: all; --quick: deepfm)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--l2", type=float, default=1e-4, help="whole-table L2 of the reference (ours: weight_decay 2 x l2)")
    p.add_argument("--global-wd", type=float, default=None, help="ps_global's weight_decay (default 2 x --l2)")
    p.add_argument("--max-epochs", type=int, default=None, help="default 15 (--quick: 3)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per recsys train run")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the data and run dirs here (default: a temp dir)")
    args = p.parse_args()
    args.presets = args.presets.split(",")
    args.models = (args.models or ("deepfm" if args.quick else "lr,fm,deepfm")).split(",")
    args.variants = args.variants.split(",")
    args.max_epochs = args.max_epochs or (3 if args.quick else 15)
    bad = [m for m in args.models if m not in MODELS] + [v for v in args.variants if v not in VARIANTS]
    if bad or any(pr not in SPLITS for pr in args.presets):
        p.error(f"unknown model, variant or preset in {args.models} {args.variants} {args.presets}")
    torch.set_num_threads(1)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="quality-") as t:
        tmp = Path(args.keep) if args.keep else Path(t)
        runs = [one_seed(s, args, tmp, log) for s in seeds]
    out = summarize(runs, args)
    out["config"] = {"seeds": seeds, "l2": args.l2, "global_wd": args.global_wd if args.global_wd is not None
                     else 2 * args.l2, "max_epochs": args.max_epochs, "quick": args.quick, "base": str(BASE.relative_to(ROOT))}
    out["runs"] = runs
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"\n{'preset':9s} {'model':7s} {'variant':10s} {'auc':>7s} {'ref_auc':>8s} {'ratio':>6s}")
    for preset in args.presets:
        for model in args.models:
            for variant in args.variants:
                v = out[preset][model][variant]
                fmt = lambda x: f"{x:.4f}" if x is not None else "  -   "   # noqa: E731
                ratio = f"{v['ratio_auc_vs_reference']:.3f}" if v["ratio_auc_vs_reference"] is not None else "  -  "
                print(f"{preset:9s} {model:7s} {variant:10s} {fmt(v['auc']):>7s} {fmt(v['ref_auc']):>8s} {ratio:>6s}")
        print(f"{preset:9s} oracle AUC {out[preset]['oracle_auc']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
