"""Local launcher: `recsys train` starts the PS shards and the trainers on this machine.

    launcher ──Popen──> ps shard 0..N-1   (python -m recsys.cli ps ...; die with the launcher)
             ──torch.distributed.elastic──> trainer rank 0..W-1 (run_worker; gloo / NCCL)

It writes the run directory (resolved config, processes.json, metrics.jsonl, metrics.json),
waits, reports, and on exit, error or Ctrl-C tears every process down: no orphans.

Recovery: when a shard or a trainer is killed (it exits by a signal: kill -9, the OOM killer),
every process of the attempt is stopped and the job starts again from the latest good checkpoint
(fresh shards load their part of it, any shard count), up to `train.max_restarts` times; each
restart is logged and appended to `run_dir/restarts.jsonl`. An error the job raises itself (bad
data, bad config) is not retried: it would fail the same way.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from recsys.config import JobConfig, to_toml

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0


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


def write_run_dir(cfg: JobConfig, run_dir: Path, *, fresh: bool = True) -> Path:
    """Create the run directory and write the resolved config (atomically); `fresh` forgets a
    previous run's trainer pids."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "pids").mkdir(exist_ok=True)
    for old in (run_dir / "pids").glob("trainer-*.json") if fresh else ():
        old.unlink()
    path = run_dir / "config.toml"
    tmp = run_dir / f"config.toml.{os.getpid()}.tmp"
    tmp.write_text(to_toml(cfg))
    os.replace(tmp, path)
    return path


def start_shards(cfg: JobConfig, config_path: Path, run_dir: Path,
                 restore: Path | None = None) -> tuple[list[subprocess.Popen], list[str]]:
    """Start ps.num_shards shard processes on ephemeral ports; return them and their addresses.

    restore: a saved PS directory (a checkpoint's model/ps) each shard loads its part of first.
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
        if restore is not None:
            cmd += ["--restore", str(restore)]
        procs.append(subprocess.Popen(cmd, env=child_env(1), stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=_die_with_parent))
        log.close()
    addresses = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    for shard, (proc, ready) in enumerate(zip(procs, ready_files)):
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"ps shard {shard} exited with code {proc.returncode} before it was "
                                   f"ready; see {run_dir / f'ps-{shard}.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ps shard {shard} not ready after {READY_TIMEOUT_S:.0f} s; "
                                   f"see {run_dir / f'ps-{shard}.log'}")
            time.sleep(0.05)
        addresses.append(ready.read_text().strip())
    return procs, addresses


def write_processes(run_dir: Path, shards: list[subprocess.Popen], earlier: list[dict] = ()) -> list[dict]:
    """processes.json: this launcher, the current attempt's shards and trainers, then `earlier`
    attempts' processes."""
    entries = [{"role": "launcher", "rank": 0, "pid": os.getpid()}]
    entries += [{"role": "ps", "rank": i, "pid": p.pid} for i, p in enumerate(shards)]
    for f in sorted((run_dir / "pids").glob("trainer-*.json")):
        entries.append(json.loads(f.read_text()))
    entries += [e for e in earlier if e["role"] != "launcher"]
    (run_dir / "processes.json").write_text(json.dumps(entries, indent=1))
    return entries


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

    It signals this process with SIGTERM; torch elastic's agent (in the main thread) then tears the
    trainers down, and `launch_train` raises an error naming the shard and its log.
    """

    def __init__(self, shards: list[subprocess.Popen], poll_s: float = 0.2) -> None:
        super().__init__(name="ps-watchdog", daemon=True)
        self.shards, self.poll_s = shards, poll_s
        self.dead: tuple[int, int] | None = None          # (shard, exit code)
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            for i, p in enumerate(self.shards):
                if p.poll() is not None:
                    self.dead = (i, p.returncode)
                    logger.error("ps shard %d exited with code %s during training; stopping the job",
                                 i, p.returncode)
                    os.kill(os.getpid(), signal.SIGTERM)
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


class JobFailure(RuntimeError):
    """An attempt of the job failed; `killed` when a process died by a signal (worth a restart)."""

    def __init__(self, message: str, killed: bool) -> None:
        super().__init__(message)
        self.killed = killed


def launch_train(cfg: JobConfig, resume: str | None = None) -> dict:
    """Run a whole training job locally; returns the final metrics (also in run_dir/metrics.json).

    resume: `latest` (the run directory's newest good checkpoint; none yet: start afresh) or a
    checkpoint path. The trainer and shard counts may differ from the checkpoint's.
    """
    from recsys.training.checkpoint import resolve_resume

    check_devices(cfg)
    # the shards wait for every trainer's barrier: they must know how many there are
    cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, num_workers=cfg.train.num_trainers))
    run_dir = Path(cfg.train.run_dir)
    config_path = write_run_dir(cfg, run_dir)
    checkpoint = resolve_resume(run_dir, resume) if resume else None
    if resume == "latest" and checkpoint is None:
        logger.warning("--resume latest: %s has no checkpoint yet; starting from step 0", run_dir)
    earlier: list[dict] = []
    restarts = 0
    while True:
        try:
            return _attempt(cfg, config_path, run_dir, checkpoint, earlier)
        except JobFailure as e:
            if not e.killed or restarts >= cfg.train.max_restarts:
                raise RuntimeError(str(e) + ("" if not e.killed else
                                   f" (after {restarts} restarts; train.max_restarts = {cfg.train.max_restarts})")) from e
            restarts += 1
            checkpoint = resolve_resume(run_dir, "latest") or checkpoint    # none written yet: where it began
            where = f"checkpoint {checkpoint}" if checkpoint else "step 0 (no checkpoint yet)"
            logger.warning("%s; restart %d/%d from %s", e, restarts, cfg.train.max_restarts, where)
            with open(run_dir / "restarts.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time(), "restart": restarts, "reason": str(e),
                                    "checkpoint": str(checkpoint) if checkpoint else None}) + "\n")
            write_run_dir(cfg, run_dir)          # forget the dead attempt's trainer pids


def _attempt(cfg: JobConfig, config_path: Path, run_dir: Path, checkpoint: Path | None,
             earlier: list[dict]) -> dict:
    """One start of the shards and trainers; raises JobFailure when a process of it fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from recsys.training.worker import worker_main

    (run_dir / "metrics.json").unlink(missing_ok=True)
    shards: list[subprocess.Popen] = []
    try:
        shards, addresses = start_shards(cfg, config_path, run_dir,
                                         None if checkpoint is None else checkpoint / "model" / "ps")
        write_processes(run_dir, shards, earlier)
        logger.info("ps shards ready at %s", ", ".join(addresses))
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        lc = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=cfg.train.num_trainers,
            run_id=f"recsys-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0, monitor_interval=0.2,
            start_method="spawn", local_addr="127.0.0.1",
        )
        watchdog = ShardWatchdog(shards)
        watchdog.start()
        try:
            elastic_launch(lc, worker_main)(str(config_path), list(addresses), str(run_dir),
                                           None if checkpoint is None else str(checkpoint))
        except BaseException as e:
            if watchdog.dead is not None:
                shard, code = watchdog.dead
                raise JobFailure(f"ps shard {shard} exited with code {code} during training; see "
                                 f"{run_dir / f'ps-{shard}.log'}", killed=code < 0) from e
            if isinstance(e, ChildFailedError):
                killed = [f for f in e.failures.values() if f.exitcode < 0]
                if killed:
                    f = killed[0]
                    raise JobFailure(f"trainer rank {f.local_rank} (pid {f.pid}) was killed by signal "
                                     f"{-f.exitcode} ({f.signal_name()})", killed=True) from e
            raise
        finally:
            watchdog.stop()
        write_processes(run_dir, shards, earlier)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        logger.info("done: %s", " ".join(f"{k}={v:.4g}" for k, v in metrics.items()
                                         if isinstance(v, (int, float))))
        return metrics
    finally:
        stop(shards)
        earlier[:] = write_processes(run_dir, shards, earlier)
