"""Local launcher: `recsys train` starts the PS shards and the trainers on this machine.

    launcher ──Popen──> ps shard 0..N-1   (python -m recsys.cli ps ...; die with the launcher)
             ──torch.distributed.elastic──> trainer rank 0..W-1 (run_worker; gloo / NCCL)

It writes the run directory (resolved config, processes.json, metrics.jsonl, metrics.json),
waits, reports, and on exit, error or Ctrl-C tears every process down: no orphans.

Recovery: when a shard or a trainer is killed (it exits by a signal: kill -9, the OOM killer),
every process of the attempt is stopped and the job starts again from the latest good checkpoint
(fresh shards load their part of it, any shard count), up to `train.max_restarts` times; each
restart is logged and appended to `run_dir/restarts.jsonl`. An error the job raises itself (bad
data, bad config) is not retried: it would fail the same way; the first failing trainer's one-line
error (`run_dir/errors/`) is raised as `WorkerError`, its traceback stays in `run_dir/logs/`.

Graceful stop: the launcher keeps SIGTERM / SIGINT for itself (torch elastic is told to handle only
SIGHUP / SIGQUIT). The first one is forwarded to the trainers as SIGUSR1: they finish the current
step, agree on it, write a checkpoint and exit 0; the shards are stopped after them and
`launch_train` returns `{"stopped": 1, "step": N, "checkpoint": DIR}`. A second signal raises
`StopNow`: torch elastic terminates the trainers at once (SIGTERM), the shards are stopped, nothing
is saved. Shards and trainers leave the terminal's process group, so a Ctrl-C reaches the launcher
alone; both die with it (PR_SET_PDEATHSIG) if it is killed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from recsys.config import JobConfig
from recsys.training.warm_start import InitSource
from recsys.training.jobauth import job_auth
from recsys.rundir import READY_TIMEOUT_S, run_path, wait_for_shards
# the job's life, shared with the Ray engine (also importable from here)
from recsys.training.job import (PEER_LOST, JobFailure, closing_summary, StopNow, StopRequests, WorkerError,  # noqa: F401
                                 placements_of, prepared_run, read_worker_error, run_attempts, silent_ranks,
                                 with_run_id, write_processes, write_run_dir)

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when the launcher dies (even by SIGKILL)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # spinning OpenMP workers starve 2 cores
    env["OMP_NUM_THREADS"] = str(threads)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # elastic restarts hang without it
    return env


def spawn_shards(cfg: JobConfig, config_path: Path, run_dir: Path,
                 restore: Path | str | None = None, init: Path | str | None = None, overrides: Sequence[str] = ()
                 ) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start ps.num_shards shard processes on ephemeral ports, without waiting for them; return them
    and their ready files (each holds the shard's address once it serves: `wait_for_shards`).

    restore: a saved PS directory (a checkpoint's model/ps) each shard loads its part of first.
    init: a warm start's saved PS directory (its tables taken by name, `reshard.init_shard`).
    overrides: `--set` values for the shards (the job's auth: `jobauth.job_auth`).
    """
    procs: list[subprocess.Popen] = []
    ready_files = []
    for shard in range(cfg.ps.num_shards):
        ready = run_dir / f"ps-{shard}.ready"
        ready.unlink(missing_ok=True)
        ready_files.append(ready)
        log = open(run_dir / f"ps-{shard}.log", "ab")
        cmd = [sys.executable, "-m", "recsys.cli", "ps", "--config", str(config_path),
               "--shard", str(shard), "--port", "0", "--ready-file", str(ready)]
        for value in overrides:
            cmd += ["--set", value]
        if restore is not None:
            cmd += ["--restore", str(restore)]
        elif init is not None:
            cmd += ["--init-from", str(init)]
        procs.append(subprocess.Popen(cmd, env=child_env(1), stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=_die_with_parent, start_new_session=True))
        log.close()
    return procs, ready_files


def start_shards(cfg: JobConfig, config_path: Path, run_dir: Path,
                 restore: Path | str | None = None, init: Path | str | None = None, overrides: Sequence[str] = ()
                 ) -> tuple[list[subprocess.Popen], list[str]]:
    """`spawn_shards`, then wait until every shard serves; return them and their addresses."""
    procs, ready_files = spawn_shards(cfg, config_path, run_dir, restore, init, overrides)
    deadline = time.monotonic() + READY_TIMEOUT_S
    for shard, (proc, ready) in enumerate(zip(procs, ready_files)):
        while not ready.exists():
            if proc.poll() is not None:
                log = run_dir / f"ps-{shard}.log"
                raise RuntimeError(f"ps shard {shard} exited with code {proc.returncode} before it was "
                                   f"ready{shard_error(log)}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ps shard {shard} not ready after {READY_TIMEOUT_S:.0f} s; "
                                   f"see {run_dir / f'ps-{shard}.log'}")
            time.sleep(0.05)
    return procs, wait_for_shards(ready_files, 0.0)


def shard_error(log: Path) -> str:
    """": <the shard's own error line>" from its log (the `error: ...` line `recsys ps` writes, or the
    last line of a traceback), or "" when it has none: so that the launcher's line names the cause
    (a changed table dim on resume, a port in use) and not only the log."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines()[-200:] if x.strip()]
    except OSError:
        return ""
    mine = [x for x in lines if x.startswith("error: ")]
    if mine:
        return ": " + mine[-1].removeprefix("error: ")
    logged = [m.group(1) for x in lines if (m := re.search(r" ERROR [\w.]+: (.*)$", x))]
    if logged:                                   # `recsys ps`'s own report of an unexpected error
        return ": " + logged[-1]
    if lines and "Error" in lines[-1].split(":", 1)[0]:
        return ": " + lines[-1]
    return ""


def stop(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


class ShardWatchdog(threading.Thread):
    """Ends the job at once when a PS shard process dies, instead of trainers timing out on it.

    It signals this process with SIGHUP (SIGTERM is a graceful stop request); torch elastic's agent
    (in the main thread) then tears the trainers down, and `launch_train` raises an error naming
    the shard and its log. It watches from the shards' start (the trainers start beside them and wait
    for their ready files), logs their addresses once all serve, and says whether a dead shard ever did.
    """

    def __init__(self, shards: list[subprocess.Popen], ready_files: list[Path] = (), poll_s: float = 0.1) -> None:
        super().__init__(name="ps-watchdog", daemon=True)
        self.shards, self.ready_files, self.poll_s = shards, list(ready_files), poll_s
        self.dead: tuple[int, int, bool] | None = None          # (shard, exit code, it had served)
        self.serving = not self.ready_files
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            if not self.serving and all(f.exists() for f in self.ready_files):
                self.serving = True
                logger.info("ps shards ready at %s", ", ".join(wait_for_shards(self.ready_files, 0.0)))
            for i, p in enumerate(self.shards):
                if p.poll() is not None:
                    served = not self.ready_files or self.ready_files[i].exists()
                    self.dead = (i, p.returncode, served)
                    logger.error("ps shard %d exited with code %s %s; stopping the job", i, p.returncode,
                                 "during training" if served else "before it was ready")
                    os.kill(os.getpid(), signal.SIGHUP)
                    return

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)


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
    # the shards wait for every trainer's barrier: they must know how many there are
    cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, num_workers=cfg.train.num_trainers))
    with prepared_run(cfg, resume, overwrite) as (cfg, run_dir, config_path, checkpoint, init), \
            StopRequests(run_dir) as stops, job_auth(cfg.ps, run_dir) as auth:
        return run_attempts(cfg, config_path, run_dir, checkpoint, stops, verbose, functools.partial(_attempt, auth),
                            init=init)


def _attempt(auth: list[str], cfg: JobConfig, config_path: Path, run_dir: Path, checkpoint: Path | None,
             earlier: list[dict], stops: StopRequests, verbose: bool, init: InitSource | None = None) -> dict | None:
    """One start of the shards and trainers; the final metrics, or None after a graceful stop.
    auth: the job's `--set` values for ps.auth (`jobauth.job_auth`), given to shards and trainers.
    Raises JobFailure when a process of it is killed, WorkerError when a trainer fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from recsys.training.worker import worker_main

    (run_dir / "metrics.json").unlink(missing_ok=True)
    started = time.time()                 # trainer errors written from now on are this attempt's
    shards: list[subprocess.Popen] = []
    try:
        # the trainers start while the shards do (both import torch first) and wait for their ready files
        shards, ready_files = spawn_shards(cfg, config_path, run_dir,
                                           None if checkpoint is None else run_path(checkpoint, "model", "ps"),
                                           None if init is None else
                                           init.root if init.export else run_path(init.model_dir, "ps"), auth)
        write_processes(run_dir, shards, earlier)
        if stops.requested.is_set():
            return None              # asked to stop while the shards started: no trainer yet
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        lc = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=cfg.train.num_trainers,
            run_id=f"recsys-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.2,
            start_method="spawn", local_addr="127.0.0.1",
            signals_to_handle="SIGHUP,SIGQUIT",    # SIGTERM / SIGINT are StopRequests'
        )
        watchdog = ShardWatchdog(shards, ready_files)
        watchdog.start()
        try:
            elastic_launch(lc, worker_main)(str(config_path), [str(f) for f in ready_files], str(run_dir),
                                           None if checkpoint is None else str(checkpoint), False, verbose,
                                           None if init is None else str(init.root), auth)
        except BaseException as e:
            if watchdog.dead is not None:
                shard, code, served = watchdog.dead
                log = run_dir / f"ps-{shard}.log"
                raise JobFailure(f"ps shard {shard} exited with code {code} "
                                 f"{'during training' if served else 'before it was ready'}"
                                 f"{'' if code < 0 else shard_error(log)}; see {log}", killed=code < 0) from e
            if isinstance(e, ChildFailedError):
                killed = [f for f in e.failures.values() if f.exitcode < 0]
                if killed:            # the cause (others then fail on the dead peer): worth a restart
                    f = killed[0]
                    raise JobFailure(f"trainer rank {f.local_rank} (pid {f.pid}) was killed by signal "
                                     f"{-f.exitcode} ({f.signal_name()})", killed=True) from e
                silent = silent_ranks(run_dir, cfg.train.num_trainers, started)
                if silent:            # the same, seen in the other order: the survivors' errors first
                    raise JobFailure(f"trainer rank {silent[0]} exited without an error of its own (killed?) "
                                     f"and the others lost their connection to it", killed=True) from e
                line = read_worker_error(run_dir)    # the first trainer's own error
                if line is not None:
                    raise WorkerError(line) from None
            raise
        finally:
            watchdog.stop()
        write_processes(run_dir, shards, earlier)
        if (run_dir / "stopped.json").exists():
            return None
        metrics = json.loads((run_dir / "metrics.json").read_text())
        logger.info("%s", closing_summary(cfg, metrics))
        return metrics
    finally:
        stop(shards)
        earlier[:] = write_processes(run_dir, shards, earlier)
