"""The Ray engine's overhead on one machine: the quickstart job through the local launcher and through
`[cluster] engine = "ray"` (a local Ray instance started by the job), alternated.

    python benchmarks/ray_overhead.py [--json] [--repeats 3] [--steps 300] [--rows 0]

configs/quickstart.toml as it is (DLRM on the criteo-like preset, 1 PS shard + 1 trainer, async),
on a fresh criteo-like dataset in a temporary directory, shortened to --steps steps
(train.max_steps) without the eval pass, logging every step. Each repeat runs `local` then `ray`
(the order swapped every other repeat); the reported figures are medians over --repeats.

- `samples_per_s`: the trainers' own rate (metrics.json "samples_per_s": samples / training time,
  after start-up), the same figure for both engines.
- `ratio_vs_local` = ray / local samples/s (target >= 0.9).
- `start_to_first_step_s`: from the `launch_train` call to the first step's metrics line
  (metrics.jsonl "time" of step 1): Ray's includes starting the local Ray instance, the shard
  actors and the Ray Train worker group (target <= 30 s); the local launcher's is reported beside it.

The local launcher is the baseline: if it fails the script exits 1. Timings on a shared 2-core
machine are noisy: compare the ratio from one run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads: spinning OpenMP starves 2 cores
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # the local Ray instance stays on 127.0.0.1

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from data.synthetic import generate  # noqa: E402
from recsys.config import load_config  # noqa: E402
from recsys.training.launch import launch_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.toml"


def run_once(engine: str, data: Path, run_dir: Path, steps: int) -> dict:
    cfg = load_config(QUICKSTART, [f"data.train_paths=['{data}/part-*.parquet']", "data.eval_paths=[]",
                                   f"train.max_steps={steps}", "train.log_every=1", f"train.run_dir='{run_dir}'",
                                   f"cluster.engine='{engine}'"])
    t0 = time.time()
    metrics = launch_train(cfg)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = min((x for x in lines if "loss/train" in x), key=lambda x: x["step"])
    return {"samples_per_s": metrics["samples_per_s"], "steps": metrics["steps"],
            "start_to_first_step_s": first["time"] - t0, "wall_s": time.time() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="training steps per run (train.max_steps)")
    p.add_argument("--rows", type=int, default=0, help="dataset rows (0: enough for --steps batches)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    batch = load_config(QUICKSTART).data.batch_size
    rows = args.rows or (args.steps + 8) * batch
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory(prefix="ray-overhead-") as tmp:
        data = Path(tmp) / "data"
        generate(preset="criteo-like", rows=rows, num_files=2, out_dir=str(data), seed=0)
        for r in range(args.repeats):
            for engine in (("local", "ray") if r % 2 == 0 else ("ray", "local")):
                try:
                    runs[engine].append(run_once(engine, data, Path(tmp) / f"{engine}-{r}", args.steps))
                except Exception as e:
                    if engine == "local":
                        print(f"error: the local baseline failed: {e}", file=sys.stderr)
                        return 1
                    raise
                if not args.json:
                    print(f"repeat {r} {engine:5s}: " + " ".join(f"{k}={v:.4g}" for k, v in runs[engine][-1].items()))

    def med(engine: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[engine])

    out = {"steps": args.steps, "batch_size": batch, "repeats": args.repeats,
           "local_samples_per_s": med("local", "samples_per_s"), "ray_samples_per_s": med("ray", "samples_per_s"),
           "ratio_vs_local": med("ray", "samples_per_s") / med("local", "samples_per_s"),
           "ratios_per_repeat": [y["samples_per_s"] / x["samples_per_s"] for x, y in zip(runs["local"], runs["ray"])],
           "start_to_first_step_s": med("ray", "start_to_first_step_s"),
           "local_start_to_first_step_s": med("local", "start_to_first_step_s"),
           "targets": {"ratio_vs_local": ">= 0.9", "start_to_first_step_s": "<= 30"}}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
