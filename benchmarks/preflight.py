"""How fast a bad job is refused: `recsys train` on a config error and on a schema error.

    python benchmarks/preflight.py [--json] [--repeats 3]

Each case runs the real CLI as a new process (python start-up and imports included) on tiny
generated data and must end with exit code 2 and one `error:` line; the figure is the median
wall time over --repeats runs. Target (#13): under 5 s for a config or schema problem.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {
    "config: unknown key": ["--set", "train.epoch=3"],
    "config: lr = nan": ["--set", "train.dense_lr=nan"],
    "schema: missing column": ["--set", "data.dense_columns=['I1', 'nope']"],
    "config: feature without a table": ["--set", "data.sparse_columns=['C1', 'C2', 'C3', 'C4', 'M1', 'C9']"],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from data.synthetic import generate

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        generate(preset="tiny", rows=4000, num_files=2, out_dir=tmp, seed=1)
        base = [sys.executable, "-m", "recsys.cli", "train", "--config", str(ROOT / "configs" / "tiny.toml"),
                "--set", f"data.train_paths=['{tmp}/part-00000.parquet']",
                "--set", f"data.eval_paths=['{tmp}/part-00001.parquet']", "--set", f"train.run_dir='{tmp}/run'"]
        for name, extra in CASES.items():
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                r = subprocess.run(base + extra, capture_output=True, text=True, timeout=300)
                times.append(time.perf_counter() - t0)
                lines = [x for x in r.stderr.splitlines() if x.strip()]
                if r.returncode != 2 or len(lines) != 1 or not lines[0].startswith("error: "):
                    raise SystemExit(f"{name}: expected exit 2 and one error line, got {r.returncode}:\n{r.stderr}")
            out[name] = statistics.median(times)
    if args.json:
        print(json.dumps({"seconds": out, "target_s": 5.0, "meets_target": max(out.values()) < 5.0}))
        return
    for name, s in out.items():
        print(f"{name:36s} {s:6.2f} s  ({'under' if s < 5 else 'OVER'} the 5 s target)")


if __name__ == "__main__":
    main()
