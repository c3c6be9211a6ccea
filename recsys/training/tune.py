"""`recsys tune`: hyperparameter search over a job config with Ray Tune and an ASHA scheduler.

What a search runs and writes (one real `recsys train` job per trial, recsys/training/tune_trial.py,
in `TUNE_DIR/trials/<trial id>/`; the engine its jobs run on; results.csv, best.toml, trials.png) and
how a Ctrl-C'd search resumes: README.md, "Hyperparameter search". Tune runs on a local Ray instance
of `--max-concurrent` CPUs with its state in TUNE_DIR/ray: a resumed search keeps the first run's
space and --trials (Tune restores them; a changed --space is not read again).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from recsys.config import ConfigError, load_config, to_toml
from recsys.tune_space import Param, check_space, distinct_trials, override, read_space, trial_overrides

logger = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 100 * 1024 * 1024     # trials pass nothing through it


def trial_defaults(config: str, overrides: Sequence[str]) -> list[str]:
    """Overrides that make every trial validate each epoch and stop early, where the config does not say."""
    try:
        cfg = load_config(config, overrides)
    except ConfigError:
        cfg = None                  # e.g. early_stop_patience without validate_every: the default below mends it
    out = []
    if cfg is None or cfg.train.validate_every == 0:
        out.append('train.validate_every="epoch"')
        cfg = load_config(config, [*overrides, *out])     # any other error (no data.eval_paths too) is raised here
    if cfg.train.early_stop_patience == 0:
        out.append("train.early_stop_patience=2")
    return out


def run_tune(config: str, overrides: Sequence[str], space: str, out: str, *, trials: int, max_concurrent: int,
             metric: str | None = None, mode: str | None = None) -> int:
    params = read_space(space)
    overrides = [*overrides, *trial_defaults(config, overrides)]
    base = check_space(params, config, overrides, space)       # before Ray: a bad key is one line, exit 2
    metric = metric or f"val/{base.train.early_stop_metric}"
    if not metric.startswith("val/"):
        raise ConfigError(f"--metric {metric!r}: trials report validation metrics, val/auc, val/logloss, val/ne, ...")
    mode = mode or ("max" if metric.endswith("auc") else "min")
    try:
        import ray
        from recsys.training.tune_trial import JobSpec
    except ImportError as e:
        raise RuntimeError(f"recsys tune needs Ray Tune (the [ray] extra: pip install -e '.[ray]'): {e}") from None
    root = Path(out).absolute()
    (root / "trials").mkdir(parents=True, exist_ok=True)
    spec = JobSpec(config=str(Path(config).absolute()), overrides=tuple(overrides),
                   trials_dir=str(root / "trials"), cwd=os.getcwd(), metric=metric, env_names=tuple(os.environ))
    ray.init(address="local", num_cpus=max_concurrent, include_dashboard=False, log_to_driver=False,
             object_store_memory=OBJECT_STORE_BYTES, configure_logging=False)
    try:
        grid = _fit(params, spec, root, trials, max_concurrent, metric, mode)
    finally:
        ray.shutdown()
    rows = collect(grid, params, root, metric, mode)
    write_results(root / "results.csv", rows, params, metric)
    unfinished = [r for r in rows if r["status"] == "unfinished"]
    if unfinished:
        sys.stderr.write(f"interrupted: {len(rows) - len(unfinished)} of {len(rows)} trials finished; run the same "
                         f"command again (--out {out}) to resume\n")
        return 130
    plot_trials(root / "trials.png", rows, metric)
    best = best_row(rows, mode)
    if best is None:
        raise RuntimeError(f"all {len(rows)} trials failed (first: {rows[0]['error'] if rows else '-'}); "
                           f"see {root / 'results.csv'}")
    write_best(Path(out) / "best.toml", best, params, config, overrides, Path(out) / "best-run", metric)
    sys.stdout.write(f"best: trial {best['trial_id']} {metric} {best['best']:.6g} at step {best['best_step']} "
                     f"({', '.join(f'{p.key}={best[p.key]!r}' for p in params)}); results {out}/results.csv, "
                     f"config {out}/best.toml\n")
    return 0


def _fit(params: list[Param], spec: object, root: Path, trials: int, max_concurrent: int, metric: str, mode: str):
    """Run (or resume) the search in root/ray; Tune's ResultGrid."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from recsys.training.tune_trial import JobTrial, LogTrials

    trainable = tune.with_resources(tune.with_parameters(JobTrial, spec=spec), {"cpu": 1})
    experiment = root / "ray"
    if tune.Tuner.can_restore(str(experiment)):
        logger.info("resuming the search in %s: finished trials are kept, unfinished ones continue", root)
        return tune.Tuner.restore(str(experiment), trainable, resume_unfinished=True, resume_errored=False,
                                  restart_errored=False).fit()
    points = distinct_trials(params, trials)      # a space of discrete keys: no trial twice
    if points is not None and len(points) < trials:
        logger.warning("the space has %d distinct trials: each runs once (--trials %d)", len(points), trials)
    tuner = tune.Tuner(
        trainable, param_space={p.key: p.domain() for p in params},
        tune_config=tune.TuneConfig(
            metric=metric, mode=mode, num_samples=trials if points is None else len(points),
            search_alg=None if points is None else BasicVariantGenerator(points_to_evaluate=points),
            max_concurrent_trials=max_concurrent,
            scheduler=ASHAScheduler(time_attr="training_iteration", max_t=10_000, grace_period=1, reduction_factor=2),
            trial_dirname_creator=lambda t: t.trial_id),
        run_config=tune.RunConfig(name="ray", storage_path=str(root), verbose=0,
                                  callbacks=[LogTrials(metric, spec.trials_dir)],
                                  failure_config=tune.FailureConfig(max_failures=0),
                                  checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False)))
    return tuner.fit()


def best_of(lines: list[dict], metric: str, mode: str) -> tuple[float, int] | tuple[None, None]:
    """The best (value, step) of `metric` over a run's validation lines."""
    points = [(float(x[metric]), int(x["step"])) for x in lines if metric in x and not math.isnan(float(x[metric]))]
    if not points:
        return None, None
    return (max if mode == "max" else min)(points, key=lambda p: p[0])


def collect(grid: object, params: list[Param], root: Path, metric: str, mode: str) -> list[dict]:
    """One row per trial of Tune's ResultGrid: its status and values from the records beside its run
    (tune_trial.record), its best metric from its run's metrics.jsonl."""
    from recsys.training.tune_trial import FINISHED, STOPPED, record, val_lines

    rows = []
    for result in grid:
        trial_id = Path(result.path).name
        run_dir = root / "trials" / trial_id
        curve = val_lines(run_dir)
        value, step = best_of(curve, metric, mode)
        saved = record(run_dir, "error")
        error = saved.read_text().strip() if saved.exists() else _one_line(result.error)
        values = result.config or (json.loads(record(run_dir, "json").read_text())
                                   if record(run_dir, "json").exists() else {})
        if error:
            state = "error"
        elif (result.metrics or {}).get(FINISHED) or record(run_dir, FINISHED).exists():
            state = "terminated"
        else:
            state = "stopped" if record(run_dir, STOPPED).exists() else "unfinished"    # unfinished: a Ctrl-C
        rows.append({"trial_id": trial_id, "status": state, **{p.key: values.get(p.key) for p in params},
                     "best": value, "best_step": step, "run_dir": str(run_dir), "error": error,
                     "curve": curve})
    return sorted(rows, key=lambda r: r["trial_id"])


def _one_line(error: BaseException | None) -> str:
    """A trial's error as one line: its last line (Ray wraps it in a traceback)."""
    if error is None:
        return ""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    return lines[-1] if lines else type(error).__name__


def best_row(rows: list[dict], mode: str) -> dict | None:
    scored = [r for r in rows if r["best"] is not None and r["status"] != "error"]
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda r: r["best"])


def write_results(path: Path, rows: list[dict], params: list[Param], metric: str) -> None:
    """results.csv: trial_id, status, the searched keys, best_<metric>, best_step, run_dir, error."""
    header = ["trial_id", "status", *(p.key for p in params), f"best_{metric}", "best_step", "run_dir", "error"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in rows:
            w.writerow([r["trial_id"], r["status"], *(r[p.key] for p in params),
                        "" if r["best"] is None else r["best"], "" if r["best_step"] is None else r["best_step"],
                        r["run_dir"], r["error"]])


def write_best(path: Path, row: dict, params: list[Param], config: str, overrides: Sequence[str], run_dir: Path,
               metric: str) -> None:
    """best.toml: the base config + the best trial's values, complete, with its own run directory."""
    values = {p.key: row[p.key] for p in params}
    cfg = load_config(config, [*overrides, *trial_overrides(values), override("train.run_dir", str(run_dir))])
    head = (f"# recsys tune: the best trial, {row['trial_id']} ({metric} {row['best']:.6g} at step {row['best_step']}),"
            f" of {config} with\n" + "".join(f"#   {k} = {v!r}\n" for k, v in values.items()))
    path.write_text(head + to_toml(cfg))


def plot_trials(path: Path, rows: list[dict], metric: str) -> Path | None:
    """trials.png: `metric` per step of every trial (dashed: stopped by ASHA); None without matplotlib."""
    from recsys.training.plot import pyplot, save_plot

    try:
        plt = pyplot("trials.png")
    except ImportError as e:
        logger.warning("no %s: %s", path.name, e)
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = 0
    for r in rows:
        points = [(x["step"], x[metric]) for x in r["curve"] if metric in x]
        if points:
            plotted += 1
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".",
                    linestyle="--" if r["status"] == "stopped" else "-", label=f"{r['trial_id']} ({r['status']})")
    if 0 < plotted <= 12:
        ax.legend(fontsize=7)
    return save_plot(fig, ax, path, metric, f"recsys tune: {metric} of {len(rows)} trials")


def add_tune_parser(sub: Any, add_config_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """`recsys tune`'s flags (cli.py calls this)."""
    p = sub.add_parser("tune", help="hyperparameter search over a config with Ray Tune (ASHA): one training "
                                    "job per trial; results.csv, best.toml, trials.png in --out")
    add_config_args(p)
    p.add_argument("--space", required=True, help="search space TOML: \"section.key\" = { choice = [...] }, "
                                                  "loguniform / uniform / randint / qrandint / grid")
    p.add_argument("--trials", type=int, default=8, help="trials sampled (with grid keys: times the grid)")
    p.add_argument("--max-concurrent", type=int, default=2, help="trials running at once (1 CPU each for Ray)")
    p.add_argument("--out", required=True, help="TUNE_DIR: trials/, results.csv, best.toml, trials.png; "
                                                "the same --out again resumes an interrupted search")
    p.add_argument("--metric", default=None, help="val/* metric to optimize (default: val/<train.early_stop_metric>)")
    p.add_argument("--mode", choices=["min", "max"], default=None, help="default: max for auc, min for the rest")
    p.set_defaults(func=_cmd_tune)


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.trials < 1 or args.max_concurrent < 1:
        raise ConfigError("--trials and --max-concurrent must be >= 1")
    return run_tune(args.config, args.overrides, args.space, args.out, trials=args.trials,
                    max_concurrent=args.max_concurrent, metric=args.metric, mode=args.mode)


__all__ = ["add_tune_parser", "best_of", "best_row", "collect", "plot_trials", "run_tune", "write_best",
           "write_results"]
