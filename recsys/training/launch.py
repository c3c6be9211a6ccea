"""Local launcher: `recsys train` starts the PS shards and the trainers on this machine, as forks of
one preloaded process, out of the terminal's process group, that die with the launcher
(`recsys.training.procs`, its diagram). It writes the run directory (resolved config, processes.json,
metrics.jsonl, metrics.json), waits, reports, and on exit, error or Ctrl-C tears every process down.

Recovery (restarts after a kill, `job.run_attempts`), the graceful stop (`job.StopRequests`) and an
error the job raises itself (not retried: `job.WorkerError`, from `run_dir/errors/`): docs/operations.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from recsys.config import JobConfig
from recsys.training.warm_start import InitSource
from recsys.training.jobauth import job_auth
from recsys.rundir import run_path, wait_for_shards
# free_port and write_run_dir: also imported from here (tests, benchmarks, recsys.train)
from recsys.training.procs import (ForkedProcess, TrainersFailed, child_env, free_port,  # noqa: F401
                                   job_zygote, run_trainers, stop, zygote, zygote_pid)
from recsys.training.job import (JobFailure, StopRequests, WorkerError, prepared_run,  # noqa: F401
                                 read_worker_error, run_attempts, silent_ranks, write_processes, write_run_dir)

logger = logging.getLogger(__name__)


def spawn_shards(cfg: JobConfig, config_path: Path, run_dir: Path,
                 restore: Path | str | None = None, init: Path | str | None = None, overrides: Sequence[str] = ()
                 ) -> tuple[list[ForkedProcess], list[Path]]:
    """Start ps.num_shards shard processes (`recsys ps ...`, forked by the zygote) on ephemeral ports,
    without waiting for them; return them and their ready files (each holds the shard's address once
    it serves: `wait_for_shards`).

    restore: a saved PS directory (a checkpoint's model/ps) each shard loads its part of first.
    init: a warm start's saved PS directory (its tables taken by name, `reshard.init_shard`).
    overrides: `--set` values for the shards (the job's auth: `jobauth.job_auth`).
    """
    extra = [a for value in overrides for a in ("--set", value)]
    extra += (["--restore", str(restore)] if restore is not None else
              ["--init-from", str(init)] if init is not None else [])
    ready_files = [run_dir / f"ps-{shard}.ready" for shard in range(cfg.ps.num_shards)]
    procs: list[ForkedProcess] = []
    for shard, ready in enumerate(ready_files):
        ready.unlink(missing_ok=True)
        argv = ["ps", "--config", str(config_path), "--shard", str(shard), "--port", "0", "--ready-file", str(ready)]
        procs.append(zygote().start("shard", [*argv, *extra], child_env(1), log=str(run_dir / f"ps-{shard}.log"),
                                    session=True))
    return procs, ready_files


def shard_error(log: Path) -> str:
    """": <the shard's own error line>" from its log (the `error: ...` line `recsys ps` writes, or the
    last line of a traceback), or "" when it has none: so that the launcher's line names the cause
    (a changed table dim on resume, a port in use) and not only the log."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines()[-200:] if x.strip()]
    except OSError:
        return ""
    mine = [x.removeprefix("error: ") for x in lines if x.startswith("error: ")]
    # else `recsys ps`'s own report of an unexpected error, else a traceback's last line
    logged = [m.group(1) for x in lines if (m := re.search(r" ERROR [\w.]+: (.*)$", x))]
    found = mine or logged or [x for x in lines[-1:] if "Error" in x.split(":", 1)[0]]
    return ": " + found[-1] if found else ""


class ShardWatchdog:
    """Ends the job at once when a PS shard process dies, instead of trainers timing out on it.

    `check` (called by `run_trainers` at every poll, from the shards' start: the trainers start beside
    them and wait for their ready files) logs the shards' addresses once all serve and raises
    ShardDied when one has exited (saying whether it ever served); the trainers are then torn down
    and `launch_train` raises an error naming the shard and its log.
    """

    def __init__(self, shards: list[ForkedProcess], ready_files: list[Path]) -> None:
        self.shards, self.ready_files = shards, list(ready_files)
        self.dead: tuple[int, int, bool] | None = None          # (shard, exit code, it had served)
        self.serving = False

    def check(self) -> None:
        if self.dead is None:
            if not self.serving and all(f.exists() for f in self.ready_files):
                self.serving = True
                logger.info("ps shards ready at %s", ", ".join(wait_for_shards(self.ready_files, 0.0)))
            for i, p in enumerate(self.shards):
                if p.poll() is not None:
                    served = self.ready_files[i].exists()
                    self.dead = (i, p.returncode, served)
                    logger.error("ps shard %d exited with code %s %s; stopping the job", i, p.returncode,
                                 "during training" if served else "before it was ready")
                    break
        if self.dead is not None:
            raise ShardDied(f"ps shard {self.dead[0]} exited with code {self.dead[1]}")


class ShardDied(RuntimeError):
    """A PS shard process exited (`ShardWatchdog.dead` says which, its code, whether it had served)."""


def _write_processes(run_dir: Path, shards: list[ForkedProcess], earlier: list[dict]) -> list[dict]:
    """processes.json, with the zygote's entry (it forks the shards and trainers: `procs`)."""
    pid = zygote_pid()
    return write_processes(run_dir, [{"pid": p.pid} for p in shards], earlier,
                           helpers=[] if pid is None else [{"role": "zygote", "rank": 0, "pid": pid}])


def _failure(e: ShardDied | TrainersFailed, watchdog: ShardWatchdog, cfg: JobConfig, run_dir: Path,
             started: float) -> Exception:
    """What a failed attempt raises: JobFailure (a process was killed or a shard died: `killed` says
    whether a restart is worth it), WorkerError (a trainer's own error), else `e`."""
    with contextlib.suppress(ShardDied):
        watchdog.check()                      # a trainer that failed on a dead shard: the shard is the cause
    if watchdog.dead is not None:
        shard, code, served = watchdog.dead
        log = run_dir / f"ps-{shard}.log"
        return JobFailure(f"ps shard {shard} exited with code {code} "
                          f"{'during training' if served else 'before it was ready'}"
                          f"{'' if code < 0 else shard_error(log)}; see {log}", killed=code < 0)
    killed = {r: f for r, f in e.failures.items() if f[0] < 0}
    if killed:                  # the cause (others then fail on the dead peer): worth a restart
        rank, (code, pid) = next(iter(killed.items()))
        return JobFailure(f"trainer rank {rank} (pid {pid}) was killed by signal {-code} "
                          f"({signal.Signals(-code).name})", killed=True)
    silent = silent_ranks(run_dir, cfg.train.num_trainers, started)
    if silent:                  # the same, seen in the other order: the survivors' errors first
        return JobFailure(f"trainer rank {silent[0]} exited without an error of its own (killed?) "
                          f"and the others lost their connection to it", killed=True)
    line = read_worker_error(run_dir)      # the first trainer's own error
    return WorkerError(line) if line is not None else e


def check_devices(cfg: JobConfig) -> None:
    """train.device = "cuda": one GPU per local trainer (NCCL refuses two ranks on one GPU)."""
    if cfg.train.device != "cuda":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < cfg.train.num_trainers:
        raise ValueError(f"train.device = 'cuda' with train.num_trainers = {cfg.train.num_trainers}, but this "
                         f"machine has {gpus} GPU(s): each trainer needs its own GPU (set train.num_trainers "
                         f"<= {gpus}, or train.device = 'cpu')")


def launch_train(cfg: JobConfig, resume: str | None = None, verbose: bool = False,
                 overwrite: bool | None = None) -> dict:
    """Run a whole training job locally; returns the final metrics (also in run_dir/metrics.json),
    or {"stopped": 1, "step", "checkpoint"} after a graceful stop (SIGTERM / SIGINT).

    resume: `latest` (the run directory's newest good checkpoint; none yet: start afresh) or a
    checkpoint path. The trainer and shard counts may differ from the checkpoint's.
    verbose: trainers also print their tracebacks (else only their logs have them).
    overwrite: what to do with a run directory that already holds a run (`prepared_run`).
    Raises WorkerError (a trainer's one-line error), StopNow (a second signal).
    With cluster.engine = "ray" the job runs on Ray instead (recsys.training.ray_launch; Ray is
    imported only then).
    """
    if cfg.cluster.engine == "ray":
        from recsys.training.ray_launch import launch_train_ray

        return launch_train_ray(cfg, resume=resume, verbose=verbose, overwrite=overwrite)
    check_devices(cfg)
    with job_zygote(), prepared_run(cfg, resume, overwrite) as (cfg, run_dir, config_path, checkpoint, init), \
            StopRequests(run_dir) as stops, job_auth(cfg.ps, run_dir) as auth:
        return run_attempts(cfg, config_path, run_dir, checkpoint, stops, verbose, functools.partial(_attempt, auth),
                            init=init)


def _attempt(auth: list[str], cfg: JobConfig, config_path: Path, run_dir: Path, checkpoint: Path | None,
             earlier: list[dict], stops: StopRequests, verbose: bool, init: InitSource | None = None) -> dict | None:
    """One start of the shards and trainers; the final metrics, or None after a graceful stop.
    auth: the job's `--set` values for ps.auth (`jobauth.job_auth`), given to shards and trainers.
    Raises JobFailure when a process of it is killed, WorkerError when a trainer fails."""
    started = time.time()                 # trainer errors written from now on are this attempt's
    shards: list[ForkedProcess] = []
    try:
        # the trainers start while the shards do and wait for their ready files
        shards, ready_files = spawn_shards(cfg, config_path, run_dir,
                                           None if checkpoint is None else run_path(checkpoint, "model", "ps"),
                                           None if init is None else
                                           init.root if init.export else run_path(init.model_dir, "ps"), auth)
        _write_processes(run_dir, shards, earlier)
        if stops.requested.is_set():
            return None              # asked to stop while the shards started: no trainer yet
        watchdog = ShardWatchdog(shards, ready_files)
        try:
            run_trainers(cfg.train.num_trainers,
                         [str(config_path), [str(f) for f in ready_files], str(run_dir),
                          None if checkpoint is None else str(checkpoint), False, verbose,
                          None if init is None else str(init.root), list(auth)], check=watchdog.check)
        except (ShardDied, TrainersFailed) as e:
            raise _failure(e, watchdog, cfg, run_dir, started) from None
        _write_processes(run_dir, shards, earlier)
        return None if (run_dir / "stopped.json").exists() else json.loads((run_dir / "metrics.json").read_text())
    finally:
        stop(shards)
        earlier[:] = _write_processes(run_dir, shards, earlier)
