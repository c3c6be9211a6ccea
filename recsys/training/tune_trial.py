"""One `recsys tune` trial as a Ray Tune class trainable: a real `recsys train` job in a subprocess
(a crash of the job cannot take the Tune driver down), followed through its `metrics.jsonl`.

    setup:   start `python -m recsys.cli train --config BASE --set ... --set train.run_dir=TUNE_DIR/trials/ID`
             (`--resume latest` when that run has checkpoints: a resumed search continues it)
    step:    wait for the job's next validation line; report its `val/*` metrics (one Tune
             iteration per pass: ASHA's rungs count passes); `done` when the job has exited
    cleanup: ASHA stopped the trial, or the search ends: the job gets SIGTERM (a graceful stop:
             it checkpoints and exits), a second one after STOP_TIMEOUT_S, then SIGKILL

A job that exits non-zero raises its last `error:` line: Tune records the trial as ERROR, the
others go on. Imported only by recsys/training/tune.py, with Ray installed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ray import tune

from recsys.training.plot import read_metrics
from recsys.training.procs import die_with_parent
from recsys.tune_space import override, trial_overrides

logger = logging.getLogger(__name__)

FINISHED = "job_finished"
"""In the last result of a trial whose job ran to its end (Tune's own `done` is also set when ASHA stops it)."""
STOPPED = "stopped"
"""Marks a trial that ASHA stopped (Tune's on_trial_complete without FINISHED; a Ctrl-C stops trials without it)."""
POLL_S = 0.25
STOP_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What every trial shares: the base config, its overrides, where trials go, the working directory."""

    config: str
    overrides: tuple[str, ...]
    trials_dir: str
    cwd: str
    metric: str
    env_names: tuple[str, ...] = ()
    """The names of `recsys tune`'s own environment variables: a job gets the Tune worker's environment
    without those Ray added (RAY_RAYLET_PID, RAY_JOB_ID, ... of Tune's instance: a job on the Ray engine
    would lose its actors on the cluster). Names only: the values (maybe secrets) are the worker's,
    inherited from this command, and stay out of Ray's object store."""


def val_lines(run_dir: Path) -> list[dict]:
    """The validation passes in `run_dir/metrics.jsonl` so far (a line being written is skipped)."""
    try:
        rows = read_metrics(run_dir / "metrics.jsonl", partial=True)
    except FileNotFoundError:
        return []
    return [{k: v for k, v in row.items() if k == "step" or k.startswith("val/")}
            for row in rows if any(k.startswith("val/") for k in row)]


def record(run_dir: Path, kind: str) -> Path:
    """TUNE_DIR/trials/<id>.json (the trial's values), .error (its one-line error), .job_finished (its
    job ran to its end) and .stopped (ASHA stopped it), beside its run directory: results.csv reads them,
    also after a resume (Tune keeps no error or values of a restored trial)."""
    return run_dir.with_name(f"{run_dir.name}.{kind}")


def job_command(spec: JobSpec, values: dict, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "recsys.cli", "train", "--config", spec.config]
    for item in (*spec.overrides, *trial_overrides(values), override("train.run_dir", str(run_dir))):
        cmd += ["--set", item]
    if any((run_dir / "checkpoints").glob("step-*")):
        cmd += ["--resume", "latest"]          # a resumed search: this trial's job was stopped with a checkpoint
    elif run_dir.exists():
        cmd += ["--overwrite"]                 # started, nothing kept: train it again
    return cmd


class JobTrial(tune.Trainable):
    """A Tune trial that is one training job (see the module docstring)."""

    def setup(self, config: dict, spec: JobSpec) -> None:
        self.spec, self.passes, self.last = spec, 0, {}
        self.run_dir = Path(spec.trials_dir) / self.trial_id
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir.parent / f"{self.trial_id}.log"
        for kind in ("error", FINISHED, STOPPED):
            record(self.run_dir, kind).unlink(missing_ok=True)
        record(self.run_dir, "json").write_text(json.dumps(config, default=lambda v: v.item()))   # its values
        cmd = job_command(spec, config, self.run_dir)
        names = set(spec.env_names)       # none: the job gets this process's environment, unchanged
        env = {k: v for k, v in os.environ.items() if k in names} if names else None
        with open(self.log_path, "ab") as log:
            # the job gets SIGTERM (a graceful stop) if this trial's worker dies
            self.proc = subprocess.Popen(cmd, cwd=spec.cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                         start_new_session=True, env=env)

    def step(self) -> dict:
        while True:
            exited = self.proc.poll() is not None
            lines = val_lines(self.run_dir)
            if len(lines) > self.passes:
                self.passes += 1
                self.last = lines[self.passes - 1]
                return dict(self.last)
            if exited:
                if self.proc.returncode != 0:
                    error = f"trial {self.trial_id}: {self._error_line()}"
                    record(self.run_dir, "error").write_text(error)
                    raise RuntimeError(error)
                if not self.last:
                    raise RuntimeError(f"trial {self.trial_id}: the job wrote no validation pass "
                                       f"({self.run_dir}/metrics.jsonl)")
                record(self.run_dir, FINISHED).touch()
                return {**self.last, FINISHED: 1, "done": True}
            time.sleep(POLL_S)

    def save_checkpoint(self, checkpoint_dir: str) -> dict:
        return {}                     # the job checkpoints itself in its run directory (cleanup stops it with one)

    def load_checkpoint(self, checkpoint: dict) -> None:
        pass

    def _error_line(self) -> str:
        """The job's `error:` line (the launcher writes it last), else its last line of output."""
        lines = [x.strip() for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error:")]
        last = errors[-1] if errors else (lines[-1] if lines else "no output")
        return f"job exited {self.proc.returncode}: {last} (log: {self.log_path})"

    def cleanup(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):   # graceful, at once, kill
            proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
                return
            except subprocess.TimeoutExpired:
                logger.warning("trial %s: job %d still running after %s", self.trial_id, proc.pid, sig)


class LogTrials(tune.Callback):
    """One log line as each trial ends; marks the trials ASHA stopped (record(run_dir, STOPPED))."""

    def __init__(self, metric: str, trials_dir: str) -> None:
        self.metric, self.trials_dir = metric, Path(trials_dir)

    def on_trial_complete(self, iteration: int, trials: list, trial: object, **info: object) -> None:
        last = trial.last_result or {}
        if not last.get(FINISHED):
            record(self.trials_dir / trial.trial_id, STOPPED).touch()
        logger.info("trial %s: %s after %s passes, %s %s", trial.trial_id,
                    "done" if last.get(FINISHED) else "stopped by ASHA", last.get("training_iteration", 0),
                    self.metric, last.get(self.metric))

    def on_trial_error(self, iteration: int, trials: list, trial: object, **info: object) -> None:
        logger.warning("trial %s: failed (recorded in results.csv; the search goes on)", trial.trial_id)


__all__ = ["FINISHED", "STOPPED", "JobSpec", "JobTrial", "LogTrials", "job_command", "record", "val_lines"]
