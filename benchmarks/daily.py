"""The daily job's cost: day 3 warm-started against retraining on days 1..3, and delta against full bytes.

    python benchmarks/daily.py [--json] [--rows 100000] [--repeats 2]

Generates the `daily` preset (4 day partitions of --rows rows, `data/daily.py`) in a temporary
directory, runs `recsys daily` (configs/daily.toml: 1 trainer + 1 PS shard, sync) for days 1, 2 and 3,
then `recsys train` from scratch on days 1..3 (the same config, train_paths = the three days). It times
whole commands (launcher start to exit: what a cron job waits for) and prints:

- `ratio_warm_vs_retrain`: wall time of day 3's `recsys daily` (train + next-day eval + full export +
  delta) / wall time of the from-scratch `recsys train` on days 1..3 (target <= 0.5);
- `train_s_warm` / `train_s_retrain`: the trainers' own training seconds (metrics.json train_s);
- `ratio_delta_vs_full_bytes`: day 3's delta export bytes / its full export bytes;
- next-day AUC of both (day 3 warm-started, and retrained).
Medians over --repeats (each repeat runs the whole sequence in a fresh directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.daily import generate_daily  # noqa: E402

DAYS = ["2026-11-25", "2026-11-26", "2026-11-27"]


def _recsys(*argv: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "recsys.cli", *argv], capture_output=True, text=True,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"recsys {' '.join(argv)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return time.perf_counter() - t0


def one_repeat(args: argparse.Namespace, tmp: Path) -> dict:
    data = tmp / "data"
    generate_daily(days=4, rows=args.rows, out_dir=str(data), seed=0, start=DAYS[0])
    sets = ["--set", f"data.train_paths=['{data}/day={{date}}/']", "--set", f"data.eval_paths=['{data}/day={{date+1}}/']"]
    config = str(ROOT / "configs" / "daily.toml")
    walls = [_recsys("daily", "--config", config, "--date", d, "--root", str(tmp / "daily"), *sets) for d in DAYS]
    paths = ", ".join(f"'{data}/day={d}/'" for d in DAYS)
    retrain = _recsys("train", "--config", config, "--date", DAYS[-1], *sets, "--set", f"data.train_paths=[{paths}]",
                      "--set", f"train.run_dir='{tmp / 'retrain'}'")
    day3 = json.loads((tmp / "daily" / DAYS[-1] / "metrics.json").read_text())
    full = json.loads((tmp / "retrain" / "metrics.json").read_text())
    rec = json.loads((tmp / "daily" / "published" / "published.json").read_text())[-1]
    return {"wall_s_day": walls, "wall_s_retrain": retrain, "ratio_warm_vs_retrain": walls[-1] / retrain,
            "train_s_warm": day3["train_s"], "train_s_retrain": full["train_s"],
            "ratio_delta_vs_full_bytes": rec["delta_bytes"] / rec["full_bytes"],
            "delta_bytes": rec["delta_bytes"], "full_bytes": rec["full_bytes"],
            "next_day_auc_warm": day3["next_day"]["auc"], "next_day_auc_retrain": full["auc"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--rows", type=int, default=100_000, help="rows per day")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-daily-") as tmp:
            runs.append(one_repeat(args, Path(tmp)))
    keys = [k for k in runs[0] if k != "wall_s_day"]
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out.update(rows_per_day=args.rows, repeats=args.repeats, target_ratio_warm_vs_retrain=0.5,
               meets_target=out["ratio_warm_vs_retrain"] <= 0.5, runs=runs)
    if args.json:
        print(json.dumps(out))
    else:
        for k in keys:
            print(f"{k:28s} {out[k]:.4g}")
        print(f"target ratio_warm_vs_retrain <= 0.5: {'met' if out['meets_target'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
