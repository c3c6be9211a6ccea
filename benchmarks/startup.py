"""Start-up: the seconds before a job does work, on configs/tiny.toml (1 shard, 1 trainer).

    python benchmarks/startup.py [--json] [--repeats 5]

Generates the `tiny` preset (20,000 rows in 2 files) in a temporary directory, then, --repeats times:
- `recsys train --config configs/tiny.toml` (train.log_every = 1, train.max_steps = 20): the seconds from
  the command's start to the end of step 1 (`train_first_step_s`, from metrics.jsonl's first line, whose
  "time" the trainer writes when step 1 is done) and to the command's exit (`train_wall_s`);
- `recsys eval --run RUN --data part-00001.parquet` (10,000 rows): the command's wall time (`eval_s`).
Whole commands as a user runs them (`python -m recsys.cli`, a fresh interpreter each: imports included).
Prints the medians; the targets (#30: first step <= 3 s, eval <= 2 s on a quiet 2-core machine) beside them.
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
TARGETS = {"train_first_step_s": 3.0, "eval_s": 2.0}


def _run(*argv: str) -> float:
    """Seconds of one whole `recsys` command; raises with its stderr when it fails."""
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "recsys.cli", *argv], capture_output=True, text=True,
                       env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"), timeout=600, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"recsys {' '.join(argv)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return time.time() - t0


def one_repeat(data: Path, run: Path) -> dict[str, float]:
    t0 = time.time()
    wall = _run("train", "--config", str(ROOT / "configs" / "tiny.toml"), "--overwrite",
                "--set", f"data.train_paths=['{data}/part-00000.parquet']",
                "--set", f"data.eval_paths=['{data}/part-00001.parquet']",
                "--set", f"train.run_dir='{run}'", "--set", "train.log_every=1", "--set", "train.max_steps=20")
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    if first["step"] != 1:
        raise RuntimeError(f"{run}/metrics.jsonl starts at step {first['step']}, not 1")
    eval_s = _run("eval", "--run", str(run), "--data", str(data / "part-00001.parquet"),
                  "--out", str(run / "eval.json"))
    return {"train_first_step_s": first["time"] - t0, "train_wall_s": wall, "eval_s": eval_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        data = Path(tmp) / "data"
        _run("gen-data", "--preset", "tiny", "--rows", "20000", "--files", "2", "--out", str(data))
        runs = [one_repeat(data, Path(tmp) / "run") for _ in range(args.repeats)]
    out: dict = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out.update(repeats=args.repeats, targets=TARGETS, runs=runs,
               meets_targets={k: out[k] <= v for k, v in TARGETS.items()})
    if args.json:
        print(json.dumps(out))
    else:
        for k in runs[0]:
            target = f"  (target <= {TARGETS[k]:g} s: {'met' if out[k] <= TARGETS[k] else 'NOT met'})" \
                if k in TARGETS else ""
            print(f"{k:20s} {out[k]:.2f} s{target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
