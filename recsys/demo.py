"""The README's quickstart: generate criteo-like data, train DLRM on 1 PS + 1 trainer, evaluate.

    recsys demo [--out demo] [--rows 600000]

Writes `OUT/data` (4 Parquet files: 3 train, 1 eval) once, then runs the quickstart config (package
data `recsys/configs/quickstart.toml`, so an installed package has it; `configs/quickstart.toml`
of a checkout is the same file, a test checks) with the local launcher into `OUT/run` and prints the eval
AUC next to the oracle AUC (the AUC of the true click probabilities the generator drew the labels from).
"""

from __future__ import annotations

import logging
import sys
import time
from importlib import resources
from pathlib import Path

from recsys.config import load_config
from recsys.tune_space import override

logger = logging.getLogger(__name__)

QUICKSTART = resources.files("recsys") / "configs" / "quickstart.toml"


def run_demo(out: str, rows: int = 600_000) -> int:
    from recsys.training.procs import prestart

    prestart()          # the zygote imports torch and the trainer meanwhile (recsys.training.procs)
    from data.synthetic import generate
    from recsys.training.launch import launch_train

    t0 = time.perf_counter()
    data_dir = Path(out) / "data"
    if not any(data_dir.glob("*.parquet")):
        generate(preset="criteo-like", rows=rows, num_files=4, out_dir=str(data_dir), seed=0)
        logger.info("generated %d rows in %s in %.1f s", rows, data_dir, time.perf_counter() - t0)
    with resources.as_file(QUICKSTART) as quickstart:
        cfg = load_config(quickstart, [override("data.train_paths", [f"{data_dir}/part-0000[0-2].parquet"]),
                                       override("data.eval_paths", [f"{data_dir}/part-00003.parquet"]),
                                       override("train.run_dir", str(Path(out) / "run"))])
    metrics = launch_train(cfg)
    sys.stdout.write(
        f"\nquickstart: eval AUC {metrics['auc']:.4f} vs oracle AUC {metrics['oracle_auc']:.4f} "
        f"({metrics['auc'] / metrics['oracle_auc']:.3f}x), logloss {metrics['logloss']:.4f}, NE {metrics['ne']:.4f}, "
        f"{metrics['samples_per_s']:.0f} samples/s, {time.perf_counter() - t0:.0f} s in all; "
        f"run directory {cfg.train.run_dir}\n")
    return 0
