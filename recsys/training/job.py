"""What a training job is, whichever engine runs it (`recsys.training.launch` or `.ray_launch`: both
import this module, neither the other; what is where: docs/architecture.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from data.parquet import with_id_types
from embedding_ps.wire.shm import sweep_dead
from recsys import storage
from recsys.config import ConfigError, JobConfig, read_toml, to_toml
from recsys.models.replicated import log_placement, resolve_placement
from recsys.training.checkpoint import check_resume_tables, load_saved_config, read_manifest, resolve_resume
from recsys.training.warm_start import InitSource, check_init_tables, resolve_init
from recsys.training.procs import StopNow
from recsys.rundir import (RunDirError, RunLock, UriLock, existing_run, local_run_dir, move_aside, run_path)

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A trainer raised an error (bad rows, a non-finite loss, ...): its one-line message, naming the
    file / row group / column, the rank and the log with the traceback."""


class StopRequests:
    """The launcher's SIGTERM / SIGINT handling while `launch_train` runs (main thread only).

    First signal: `requested` is set and every trainer that has written its pid file (run_dir/pids)
    gets SIGUSR1, also those that start later (a thread watches until the block ends). Second: StopNow.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.requested = threading.Event()
        self._done = threading.Event()
        self._signalled: set[int] = set()
        self._old: dict[int, object] = {}
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested.is_set():
            raise StopNow(signum)
        self.requested.set()
        logger.warning("%s: the trainers finish the current step and write a checkpoint, then every "
                       "process exits (signal again to stop at once)", signal.Signals(signum).name)
        self._thread = threading.Thread(target=self._forward, name="stop-forward", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        while True:
            for pid in {r["pid"] for r in trainer_records(self.run_dir, "pids") if "pid" in r} - self._signalled:
                self._signalled.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            if self._done.wait(0.1):
                return


def trainer_records(run_dir: Path, kind: str) -> list[dict]:
    """The JSON records RUN_DIR/KIND/trainer-R.json (KIND: pids, errors, exits) that read whole, in
    rank-file order; one being written, or unreadable, is left out."""
    out = []
    for f in sorted((run_dir / kind).glob("trainer-*.json")):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue
    return out


def read_worker_error(run_dir: Path) -> str | None:
    """The first (earliest) trainer error of the attempt: the other ranks usually fail because of it. The
    job's own errors (data, config, non-finite numbers: "own" in the record, `worker.report_failure`) come
    before any other: a rank whose data error unwinds through its process group's teardown can write it
    after a peer has already failed on the closed connection."""
    errors = trainer_records(run_dir, "errors")
    if not errors:
        return None
    e = min(errors, key=lambda x: (not x.get("own", False), x["time"]))
    return f"{e['error']} [trainer rank {e['rank']}; traceback in {e['log']}]"


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited",
             "Connection refused")          # what a collective (gloo, NCCL) or rendezvous says of a gone peer


def silent_ranks(run_dir: Path, world: int, since: float) -> list[int]:
    """Trainer ranks that left no error of their own this attempt (errors written after `since`)
    and did not return from their job either (exits/trainer-R.json, `worker.report_exit`), while
    every rank that did leave an error only lost its connection to a peer (PEER_LOST): the killed
    ones, when the launcher saw the others' errors before the kill (the trainer group reports the
    ranks that had failed when it first saw one, `procs.run_trainers`). [] otherwise: a rank that
    returned while its peers were still in a collective is a bug in the job, not a kill worth a
    restart."""
    def records(kind: str) -> list[dict]:
        return [e for e in trainer_records(run_dir, kind) if e.get("time", 0.0) >= since]

    errors = records("errors")
    if not errors or not all(any(p in e.get("error", "") for p in PEER_LOST) for e in errors):
        return []
    spoke = {int(e["rank"]) for e in errors} | {int(e["rank"]) for e in records("exits")}
    return sorted(set(range(world)) - spoke)


def write_run_dir(cfg: JobConfig, run_dir: Path, *, fresh: bool = True) -> Path:
    """Create the run directory and write the resolved config (atomically); `fresh` forgets a
    previous run's trainer pids and errors and its stop."""
    (run_dir / "pids").mkdir(parents=True, exist_ok=True)
    if fresh:
        for old in [*(run_dir / "pids").glob("trainer-*.json"), *(run_dir / "errors").glob("trainer-*.json")]:
            old.unlink()
        (run_dir / "stopped.json").unlink(missing_ok=True)
    path = run_dir / "config.toml"
    storage.write_text(path, to_toml(cfg))
    return path


def write_processes(run_dir: Path, shards: list[dict], earlier: list[dict] = (),
                    node: dict | None = None, helpers: list[dict] = ()) -> list[dict]:
    """processes.json: this launcher and its `helpers` (the local launcher's zygote), the current
    attempt's shards and trainers, then `earlier` attempts' processes. shards: each shard's fields (a
    "pid", and where it runs for the Ray engine's actors); node: fields added to the launcher's entry
    (its Ray node)."""
    entries = [{"role": "launcher", "rank": 0, "pid": os.getpid(), **(node or {})}, *helpers]
    entries += [{"role": "ps", "rank": i, **p} for i, p in enumerate(shards)]
    entries += trainer_records(run_dir, "pids")
    entries += [e for e in earlier if e["role"] not in ("launcher", *(h["role"] for h in helpers))]
    (run_dir / "processes.json").write_text(json.dumps(entries, indent=1))
    return entries


class JobFailure(RuntimeError):
    """An attempt of the job failed; `killed` when a process died by a signal (worth a restart)."""

    def __init__(self, message: str, killed: bool) -> None:
        super().__init__(message)
        self.killed = killed


@contextlib.contextmanager
def prepared_run(cfg: JobConfig, resume: str | None, overwrite: bool | None = None
                 ) -> Iterator[tuple[JobConfig, Path, Path, Path | str | None, InitSource | None]]:
    """Both engines' start of a job, held for the launcher's life: yields the config with every
    table's placement decided (`recsys.models.replicated.resolve_placement`; on resume, the
    checkpoint's) and its run id (new, or the resumed run's), the local run directory (train.run_dir,
    or this machine's train.scratch_dir when train.run_dir is a URI) with that config and
    placement.json written, the checkpoint `resume` names (None: start afresh), and the warm
    start's source (train.init_from, when there is no checkpoint to resume; else None).

    The run directory is locked (`recsys.rundir.RunLock`) until the block ends: a second launcher on
    it fails naming the holder. `overwrite`: None (library use) takes the directory as it is; False
    (`recsys train`) refuses one that holds a run unless resuming; True moves that run aside first.
    Everything that can refuse reads only: nothing is written before the lock is held."""
    # the shards wait for every trainer's barrier: they must know how many there are
    cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, num_workers=cfg.train.num_trainers))
    checkpoint = resolve_resume(cfg.train.run_dir, resume) if resume else None
    init = resolve_init(cfg.train.init_from) if cfg.train.init_from and checkpoint is None else None
    placement = resolve_placement(placements_of(cfg, checkpoint if init is None else init.root))
    cfg = placement.config
    if init is not None:         # a warm start: the source's tables must fit; its run joins the lineage
        check_init_tables(cfg, init)
        src = init.config.train
        lineage = tuple(dict.fromkeys((*src.lineage, *((src.run_id,) if src.run_id else ()))))
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_step=init.step, lineage=lineage,
                                                                 init_from=str(init.root)))
    elif checkpoint is not None:  # a resumed run keeps where it was warm-started from (its end step, lineage)
        check_resume_tables(cfg, checkpoint)
        cfg = _warm_start_of(cfg, checkpoint)
    run_dir = local_run_dir(cfg.train.run_dir, cfg.train.scratch_dir)
    lock = RunLock(run_dir, cfg.train.run_dir)
    uri_lock = None
    try:
        if storage.is_uri(cfg.train.run_dir):      # other machines: a lock object beside the run
            uri_lock = UriLock(cfg.train.run_dir)
        if (overwrite is False and resume == "latest" and checkpoint is None
                and storage.exists(run_path(cfg.train.run_dir, "metrics.json"))):      # finished
            raise RunDirError(
                f"train.run_dir = {cfg.train.run_dir}: holds a finished run (metrics.json) that kept no checkpoint: "
                f"--resume latest has nothing to continue and would train it again from step 0 over it; choose a "
                f"new train.run_dir, or pass --overwrite (moves it aside)")
        if overwrite is not None and not resume and (held := existing_run(cfg.train.run_dir)):
            if not overwrite:
                raise RunDirError(
                    f"train.run_dir = {cfg.train.run_dir}: holds a run ({', '.join(held)}): continue it with "
                    f"--resume latest, choose a new train.run_dir, or pass --overwrite (moves it aside)")
            if storage.is_uri(cfg.train.run_dir):
                raise RunDirError(f"train.run_dir = {cfg.train.run_dir}: --overwrite cannot move a URI run "
                                  f"directory aside; choose a new train.run_dir")
            logger.warning("--overwrite: moved the run in %s to %s", run_dir, move_aside(run_dir))
        lock.announce()
        cfg = with_run_id(cfg, checkpoint, resume)
        # the ids' types (data.id_types) of the run it warm-starts from bind the new data; else the first file's
        cfg = dataclasses.replace(cfg, data=with_id_types(cfg.data, init.config.data.id_types if init else {}))
        if uri_lock is not None:
            uri_lock.announce(cfg.train.run_id)
        log_placement(placement.report)
        config_path = write_run_dir(cfg, run_dir)
        (run_dir / "placement.json").write_text(json.dumps(placement.report, indent=1))
        if storage.is_uri(cfg.train.run_dir):
            logger.info("train.run_dir is %s; this machine's pids, ready files and logs are in %s "
                        "(train.scratch_dir)", cfg.train.run_dir, run_dir)
            storage.write_text(run_path(cfg.train.run_dir, "config.toml"), to_toml(cfg))
            if resume and not (run_dir / "metrics.jsonl").exists() and storage.is_file(
                    run_path(cfg.train.run_dir, "metrics.jsonl")):        # resumed on another machine
                (run_dir / "metrics.jsonl").write_bytes(
                    storage.read_bytes(run_path(cfg.train.run_dir, "metrics.jsonl")))
        if resume == "latest" and checkpoint is None:
            logger.warning("--resume latest: %s has no checkpoint yet; starting from step 0", cfg.train.run_dir)
        logger.info("run %s in %s%s", cfg.train.run_id, cfg.train.run_dir,
                    f", warm-started from {init.root} (step {init.step})" if init is not None else "")
        yield cfg, run_dir, config_path, checkpoint, init
    finally:
        if uri_lock is not None:
            uri_lock.release()
        lock.release()


def _saved_train(path: Path | str) -> dict:
    """The [train] section of a saved config.toml ({} when it is missing or unreadable)."""
    try:
        train = read_toml(path).get("train", {})
    except (OSError, ValueError):             # (ConfigError is a ValueError)
        return {}
    return train if isinstance(train, dict) else {}


def _warm_start_of(cfg: JobConfig, checkpoint: Path | str) -> JobConfig:
    """`cfg` with train.init_from, init_step and lineage as the checkpoint's run had them."""
    saved = _saved_train(run_path(checkpoint, "config.toml")).items()
    keep = {k: tuple(v) if k == "lineage" else v for k, v in saved if k in ("init_from", "init_step", "lineage")}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **keep)) if keep else cfg


def with_run_id(cfg: JobConfig, checkpoint: Path | str | None, resume: str | None) -> JobConfig:
    """`cfg` with train.run_id: the resumed run's (its checkpoint's, or with `--resume latest` and no
    checkpoint yet the run directory's config), else a new random one."""
    runs = ([checkpoint] if checkpoint is not None else []) + ([cfg.train.run_dir] if resume else [])
    saved = (_saved_train(run_path(run, "config.toml")).get("run_id") for run in runs)     # read lazily, in order
    # none saved: a new run, a new id (a copied config.toml's is not kept)
    run_id = next((x for x in saved if isinstance(x, str) and x), None) or uuid.uuid4().hex[:16]
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_id=run_id))


def placements_of(cfg: JobConfig, checkpoint: Path | str | None) -> JobConfig:
    """`cfg` whose `auto` tables take the placement they had in `checkpoint` (a resumed run keeps
    where each table trains, whatever the data says now)."""
    if checkpoint is None or not any(t.placement == "auto" for t in cfg.ps.tables):
        return cfg
    try:
        saved = {t.name: t.placement for t in load_saved_config(checkpoint).ps.tables}
    except (FileNotFoundError, ConfigError) as e:
        logger.warning("%s: cannot read its table placement (%s); deciding 'auto' from the data", checkpoint, e)
        return cfg
    tables = tuple(dataclasses.replace(t, placement=saved[t.name]) if t.placement == "auto" and saved.get(t.name)
                   in ("ps", "replicated") else t for t in cfg.ps.tables)
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))


def _stopped(run_dir: Path, config_path: Path, checkpoint: Path | None) -> dict:
    """The result of a graceful stop, with the line saying how to continue."""
    stopped = run_dir / "stopped.json"         # none: stopped before the trainers ran, where the job began
    info = json.loads(stopped.read_text()) if stopped.exists() else {
        "step": read_manifest(checkpoint)["step"] if checkpoint else 0, "checkpoint": checkpoint and str(checkpoint)}
    logger.warning("stopped at step %d (checkpoint %s); continue with: recsys train --config %s --resume latest",
                   info["step"], info["checkpoint"] or "none: nothing trained yet", config_path)
    return {"stopped": 1, "step": info["step"], "checkpoint": info["checkpoint"]}


def run_attempts(cfg: JobConfig, config_path: Path, run_dir: Path, checkpoint: Path | None, stops: StopRequests,
                 verbose: bool, attempt, init: InitSource | None = None) -> dict:
    """The attempt loop (restarts after a kill); `attempt`: one start of the job, `launch._attempt`
    (local) or the Ray engine's (recsys.training.ray_launch), with launch._attempt's arguments: the
    final metrics (logged here with the closing summary), or None after a graceful stop.
    `init`: a warm start's source, used while the run has no checkpoint of its own."""
    earlier: list[dict] = []
    restarts = 0
    sweep_segments("left by processes that are gone")
    try:
        while True:
            try:
                (run_dir / "metrics.json").unlink(missing_ok=True)
                metrics = attempt(cfg, config_path, run_dir, checkpoint, earlier, stops, verbose,
                                  init=init if checkpoint is None else None)
                if metrics is None:
                    return _stopped(run_dir, config_path, checkpoint)
                logger.info("%s", closing_summary(cfg, metrics))
                return metrics
            except JobFailure as e:         # raise unless it is worth a restart, else log and record it
                if stops.requested.is_set():
                    raise RuntimeError(f"{e} while stopping") from e
                if not e.killed or restarts >= cfg.train.max_restarts:
                    raise RuntimeError(str(e) + ("" if not e.killed else f" (after {restarts} restarts; "
                                       f"train.max_restarts = {cfg.train.max_restarts})")) from e
                restarts += 1
                checkpoint = resolve_resume(cfg.train.run_dir, "latest") or checkpoint  # none yet: where it began
                where = f"checkpoint {checkpoint}" if checkpoint else "step 0 (no checkpoint yet)"
                logger.warning("%s; restart %d/%d from %s", e, restarts, cfg.train.max_restarts, where)
                with open(run_dir / "restarts.jsonl", "a") as f:
                    f.write(json.dumps({"time": time.time(), "restart": restarts, "reason": str(e),
                                        "checkpoint": str(checkpoint) if checkpoint else None}) + "\n")
                write_run_dir(cfg, run_dir)          # forget the dead attempt's trainer pids
                sweep_segments("of the failed attempt")
    finally:
        sweep_segments("at exit")


CTR_METRICS = ("auc", "logloss", "ne", "calibration")     # the closing summary's metrics of a scored data set


def closing_summary(cfg: JobConfig, metrics: dict) -> str:
    """The lines a finished `recsys train` ends with (either engine): the run, the best pass and its
    validation metric, the test metrics of the model they came from, the final eval metrics of the
    last model, where the curves are, and the next commands."""
    run = cfg.train.run_dir
    nums = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    lines = [f"done: run {run} ({cfg.train.run_id}): {int(nums.get('steps', 0))} steps"
             + (f", {nums['samples_per_s']:,.0f} samples/s" if "samples_per_s" in nums else "")]
    best = int(nums.get("best_step", -1))
    if best >= 0:
        metric = cfg.train.early_stop_metric
        value = nums.get(f"best_val_{metric}")
        kept = f", kept in {run}/best" if cfg.train.keep_best else ""
        lines.append(f"  best pass: step {best}" + (f", val/{metric} {value:.4f}" if value is not None else "") + kept)
    test = metrics.get("test")
    if isinstance(test, dict):
        shown = " ".join(f"{k} {v:.4f}" for k, v in test.items()
                         if k in CTR_METRICS and isinstance(v, (int, float)))
        step = test.get("step")
        lines.append(f"  test ({test.get('model', 'last')} model, step "
                     f"{int(step) if isinstance(step, (int, float)) else '?'}): {shown}")
    final = " ".join(f"{k} {nums[k]:.4f}" for k in CTR_METRICS if k in nums)
    final += " ".join(f" {k} {v:.4f}" for k, v in nums.items() if k.startswith(("recall@", "ndcg@")))
    if final.strip():
        lines.append(f"  eval (last model, data.eval_paths): {final.strip()}")
    tb = (f"tensorboard --logdir {run}/tensorboard" if importlib.util.find_spec("tensorboard") is not None
          else "off (pip install -e '.[tensorboard]')")
    lines.append(f"  metrics: {run}/metrics.json, {run}/metrics.jsonl; curves: recsys plot {run}; TensorBoard: {tb}")
    lines.append(f"  next: recsys eval --run {run} --data FILES | recsys export --run {run} --out DIR")
    return "\n".join(lines)


def sweep_segments(what: str) -> None:
    """Remove this user's shared-memory segments (/dev/shm/recsys-ps-*) whose process is gone
    (`embedding_ps.wire.shm.sweep_dead`: a trainer killed with -9 leaves its own) and say so."""
    count, size = sweep_dead()
    if count:
        logger.info("removed %d shared-memory segments (%.1f MiB) %s", count, size / 2**20, what)

