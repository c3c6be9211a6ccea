"""The daily job: yesterday's model continues on today's partition, is evaluated on tomorrow's, and its
changed rows are published as a delta (`recsys daily`).

    recsys daily --config configs/daily.toml --date 2026-11-26 [--root runs/ctr] [--publish exports/ctr]

One config serves every day: its `data.*_paths` name `{date}` (`data.date` is set to --date), e.g.
`train_paths = ["data/day={date}/*.parquet"]`, `eval_paths = ["data/day={date+1}/*.parquet"]`. For
day D the job:

1. trains in ROOT/D (ROOT: --root, else the config's train.run_dir), warm-started (`--init-from`) from
   ROOT/D-1 when that run finished (its best model if it kept one), else from scratch (the first day,
   or --from RUN to name another source);
2. evaluates the model on `--next-day` files (default: the config's data.eval_paths, which name
   {date+1}): the next-day AUC, written into ROOT/D/metrics.json as "next_day" (skipped, with a line in
   the log, while that day's files do not exist yet);
3. publishes under PUBLISH (--publish, default ROOT/published): a full export PUBLISH/full-D, and a
   delta PUBLISH/delta-D since the last published step when the last publication is of a run in this
   run's lineage (ROOT/D-1's, normally), so serving applies the delta to what it has; records both in
   PUBLISH/published.json (date, run id, step, since, paths, bytes); keeps the newest --keep full
   exports for rollback (older ones are deleted; deltas stay, they are small).

A day that ran already is refused (its run directory holds a run): `--resume` continues a run that was
cut short from its latest checkpoint, `--overwrite` moves the day's run aside and trains it again;
both then replace the day's publication (its record in published.json, full-D and delta-D).

The steps are the existing commands' functions (train with --init-from, eval, export --since), so a
cron line is one command, and each step can also be run by hand.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import shutil
from pathlib import Path

from recsys.config import ConfigError, JobConfig
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
    """Train, evaluate and publish day `date` (see the module docstring); returns the day's record.

    A day whose run exists already is refused (the run directory's rule), unless `resume` (the run was
    cut short: continue it from its latest checkpoint) or `overwrite` (move it aside, train again);
    either replaces that day's publication."""
    from recsys.preflight import preflight_train
    from recsys.serving.export import export_model
    from recsys.serving.source import resolve_source
    from recsys.training.evaluate import evaluate_run
    from recsys.training.launch import launch_train

    try:
        dt.date.fromisoformat(date)
    except ValueError:
        raise ConfigError(f"--date {date!r}: not a date (YYYY-MM-DD)") from None
    if keep < 1:
        raise ConfigError(f"--keep must be >= 1, got {keep}")
    if root is None:           # train.run_dir, or its parent when it names the day (runs/ctr/{date})
        own = Path(cfg.train.run_dir)
        root = str(own.parent if own.name == date else own)
    root_dir = Path(root)
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
    if "stopped" in metrics and metrics.get("stopped") == 1:
        raise RuntimeError(f"daily {date}: the training was stopped; continue it with recsys daily --date {date} "
                           f"--resume")

    record: dict = {"date": date, "run_dir": str(run_dir), "init_from": init or None}
    trained = json.loads((run_dir / "metrics.json").read_text())
    if paths and next_day is None and "auc" in trained and not has_best(run_dir):
        # the job's final eval already scored the last model on data.eval_paths, the next day: reuse it
        keys = ("auc", "logloss", "ne", "calibration", "eval_examples", "oracle_auc")
        trained["next_day"] = {k: trained[k] for k in keys if k in trained}
        (run_dir / "metrics.json").write_text(json.dumps(trained, indent=1))
        record["next_day_auc"] = trained["auc"]
    elif paths:
        try:
            nd = evaluate_run(run_dir, paths, out=str(run_dir / "next_day_metrics.json"))
        except (FileNotFoundError, ValueError) as e:     # tomorrow's data is not there yet
            logger.warning("daily %s: no next-day evaluation (%s)", date, e)
        else:
            m = json.loads((run_dir / "metrics.json").read_text())
            m["next_day"] = nd
            (run_dir / "metrics.json").write_text(json.dumps(m, indent=1))
            record["next_day_auc"] = nd.get("auc")

    pub = Path(publish) if publish else root_dir / "published"
    pub.mkdir(parents=True, exist_ok=True)
    log = json.loads((pub / PUBLISHED).read_text()) if (pub / PUBLISHED).exists() else []
    again = resume or overwrite                      # this day's earlier publication is replaced
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
    tmp = pub / f".{PUBLISHED}.tmp"
    tmp.write_text(json.dumps(log, indent=1))
    tmp.replace(pub / PUBLISHED)
    fulls = [e for e in log if e.get("full") and Path(e["full"]).exists()]
    for old in fulls[:-keep]:                        # rollback keeps the newest `keep` full exports
        shutil.rmtree(old["full"], ignore_errors=True)
        logger.info("daily: removed full export %s (keeping %d)", old["full"], keep)
    logger.info("daily %s: %s", date, json.dumps(record))
    return record


__all__ = ["run_daily", "day_before", "PUBLISHED"]
