"""The README's quickstart: generate criteo-like data, then run the main job on it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from recsys.config import load_config

logger = logging.getLogger(__name__)

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"


def run_demo(out: str, rows: int = 400_000) -> int:
    """Generate `rows` examples into `out/data` (4 files: 3 train, 1 eval) and stream them."""
    from data.loader import ParquetLoader
    from data.synthetic import generate

    data_dir = Path(out) / "data"
    if not any(data_dir.glob("*.parquet")):
        t0 = time.perf_counter()
        generate(preset="criteo-like", rows=rows, num_files=4, out_dir=str(data_dir), seed=0)
        logger.info("generated %d rows in %s in %.1f s", rows, data_dir, time.perf_counter() - t0)
    cfg = load_config(QUICKSTART, [
        f"data.train_paths=['{data_dir}/part-0000[0-2].parquet']",
        f"data.eval_paths=['{data_dir}/part-00003.parquet']",
        "data.batch_size=4096",
    ])
    with ParquetLoader(cfg.data, cfg.data.train_paths) as loader:
        t0 = time.perf_counter()
        n = sum(batch.batch_size for batch in loader)
        dt = time.perf_counter() - t0
    logger.info("streamed %d rows Parquet -> Batch in %.2f s: %.0f rows/s", n, dt, n / dt)
    return 0
