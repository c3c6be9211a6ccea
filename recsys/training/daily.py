"""The daily job (`recsys daily --config X --date D`): yesterday's model continues on today's partition,
is evaluated on tomorrow's, and its changed rows are published as a delta. What it does, step by step,
and its refusal / `--resume` / `--overwrite` rules: docs/daily.md ("The daily job"). Each step is an
existing command's function (train with --init-from, eval, export --since).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import shutil
from pathlib import Path

from recsys.config import ConfigError, JobConfig
from recsys.manifest import write_json_atomic
from recsys.rundir import has_best

logger = logging.getLogger(__name__)

PUBLISHED = "published.json"


def day_before(date: str) -> str:
    return (dt.date.fromisoformat(date) - dt.timedelta(days=1)).isoformat()


def _exists(paths) -> bool:
    from data.parquet import DataError, resolve_paths

    try:
        return bool(resolve_paths(tuple(paths)))
    except (DataError, OSError, ValueError):
        return False


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_daily(cfg: JobConfig, date: str, *, root: str | None = None, publish: str | None = None,
              keep: int = 3, source: str | None = None, next_day: list[str] | None = None,
              resume: bool = False, overwrite: bool = False) -> dict:
    """Train, evaluate and publish day `date` (docs/daily.md); returns the day's record. `next_day`:
    the files of the next-day evaluation (default: data.eval_paths, which name {date+1}). A day whose
    run exists already is refused unless `resume` or `overwrite`; either replaces that day's publication."""
    from recsys.preflight import preflight_train
    from recsys.training.evaluate import evaluate_run
    from recsys.training.launch import launch_train

    if keep < 1:
        raise ConfigError(f"--keep must be >= 1, got {keep}")
    own = Path(cfg.train.run_dir)     # no --root: train.run_dir, or its parent when it names the day (runs/ctr/{date})
    root_dir = Path(root) if root is not None else own.parent if own.name == date else own
    run_dir = root_dir / date
    prev = root_dir / day_before(date)
    init = source or (str(prev) if (prev / "metrics.json").exists() else "")
    if not init:
        logger.info("daily %s: no finished run for %s in %s: training from scratch", date, day_before(date), root_dir)
    # save_program: the trainer traces the served program with the model; the exports below copy it
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(run_dir), init_from=init,
                                                             save_program=True))
    paths = next_day if next_day is not None else list(cfg.data.eval_paths)
    if cfg.data.eval_paths and not _exists(cfg.data.eval_paths):     # tomorrow's data is not there yet
        logger.warning("daily %s: %s does not exist yet: training without validation, no next-day evaluation",
                       date, list(cfg.data.eval_paths))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_paths=()))
        paths = paths if next_day is not None else []
    preflight_train(cfg)
    # --resume: continue the day's run, or (a finished day without checkpoints) train it again in place
    metrics = launch_train(cfg, resume="latest" if resume else None, overwrite=None if resume else overwrite)
    if metrics.get("stopped") == 1:
        raise RuntimeError(f"daily {date}: the training was stopped; continue it with recsys daily --date {date} "
                           f"--resume")

    record: dict = {"date": date, "run_dir": str(run_dir), "init_from": init or None}
    trained = json.loads((run_dir / "metrics.json").read_text())
    nd = None
    if paths and next_day is None and "auc" in trained and not has_best(run_dir):
        # the job's final eval already scored the last model on data.eval_paths, the next day: reuse it
        keys = ("auc", "logloss", "ne", "calibration", "eval_examples", "oracle_auc")
        nd = {k: trained[k] for k in keys if k in trained}
    elif paths:
        try:
            nd = evaluate_run(run_dir, paths, out=str(run_dir / "next_day_metrics.json"))
        except (FileNotFoundError, ValueError) as e:     # tomorrow's data is not there yet
            logger.warning("daily %s: no next-day evaluation (%s)", date, e)
    if nd is not None:
        trained["next_day"] = nd
        (run_dir / "metrics.json").write_text(json.dumps(trained, indent=1))
        record["next_day_auc"] = nd.get("auc")

    publish_day(Path(publish) if publish else root_dir / "published", date, run_dir, record, resume or overwrite, keep)
    logger.info("daily %s: %s", date, json.dumps(record))
    return record


def publish_day(pub: Path, date: str, run_dir: Path, record: dict, again: bool, keep: int) -> None:
    """Publish day `date`'s run into `pub` (full-D, delta-D when the last publication is in its lineage,
    published.json; the newest `keep` full exports stay) and add what was published to `record`.
    `again`: the day's earlier publication is replaced."""
    from recsys.serving.export import export_model
    from recsys.serving.source import resolve_source

    pub.mkdir(parents=True, exist_ok=True)
    log = json.loads((pub / PUBLISHED).read_text()) if (pub / PUBLISHED).exists() else []
    if again:
        log = [e for e in log if e.get("date") != date]
    src = resolve_source(run=run_dir)
    full = pub / f"full-{date}"
    manifest = export_model(src, full, overwrite=again)
    record.update(run_id=manifest["run_id"], step=manifest["step"], full=str(full), full_bytes=_bytes(full))
    last = log[-1] if log else None
    if last is not None and last["step"] <= manifest["step"] and (
            last["run_id"] == manifest["run_id"] or last["run_id"] in manifest.get("lineage", [])):
        delta = pub / f"delta-{date}"
        export_model(src, delta, since=int(last["step"]), overwrite=True)
        record.update(delta=str(delta), since=int(last["step"]), delta_bytes=_bytes(delta))
    elif last is not None:
        logger.warning("daily %s: the last publication (%s, run %s) is not in this run's lineage: publishing a "
                       "full export only", date, last["date"], last["run_id"])
    log.append(record)
    write_json_atomic(pub / PUBLISHED, log)
    fulls = [e for e in log if e.get("full") and Path(e["full"]).exists()]
    for old in fulls[:-keep]:                        # rollback keeps the newest `keep` full exports (deltas stay)
        shutil.rmtree(old["full"], ignore_errors=True)
        logger.info("daily: removed full export %s (keeping %d)", old["full"], keep)

__all__ = ["run_daily", "day_before", "PUBLISHED"]
