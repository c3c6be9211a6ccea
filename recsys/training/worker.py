"""One trainer process: joins the process group, trains, evaluates, saves (rank 0), reports: an error
as one line and its traceback in the rank's log (`report_failure`, exit code 2; the launcher prints the
first rank's line last), a stop request with a checkpoint and `run_dir/stopped.json` (`worker_main`).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from data.parquet import DataError
from embedding_ps.client.client import PSClient
from embedding_ps.store import EmbeddingStore
from recsys.config import ConfigError, JobConfig, load_config
from recsys.dist import all_reduce, barrier
from recsys.manifest import write_json_atomic
from recsys.metrics import MetricLogger, NullMetricLogger
from recsys.models.replicated import load_bytes
from recsys.models.replicated import read_replicated as saved_replicated
from recsys.training import stopping
from recsys.training.checkpoint import checkpoint_path, read_manifest, write_model_state
from recsys.training.warm_start import resolve_init, source_replicated
from recsys.training.trainer import Trainer
from recsys.runtime import apply_environment, setup_logging
from recsys import storage
from recsys.rundir import READY_TIMEOUT_S, best_dir, has_best, run_path, wait_for_shards

logger = logging.getLogger(__name__)


def save_model(trainer: Trainer, store: EmbeddingStore, model_dir: Path | str) -> None:
    """Dense state (rank 0) plus every shard's own dump, written by the shards themselves
    (`model_dir` may be a URI: then the shards upload their parts, see embedding_ps.remote)."""
    write_model_state(model_dir, trainer.model, trainer.replicated)
    if trainer.cfg.train.save_program and not storage.is_uri(model_dir):
        from recsys.serving.dense_export import save_program   # torch.export: loaded here by the optimizer

        save_program(trainer.cfg, Path(model_dir))
    store.save(ps_dir(model_dir))


def ps_dir(model_dir: Path | str) -> str:
    """MODEL_DIR/ps as the shards are told it: absolute when local, the URI itself when remote."""
    path = run_path(model_dir, "ps")
    return path if isinstance(path, str) else str(path.resolve())


def publish_run_files(local: Path, run_dir: str, names: tuple[str, ...]) -> None:
    """A URI run directory: copy rank 0's local run files `names` (metrics, shard stats) to it."""
    for name in names:
        if (local / name).is_file():
            storage.write_bytes(run_path(run_dir, name), (local / name).read_bytes())


def check_shards(store: PSClient, world: int) -> None:
    """At connect time: every shard expects this job's trainer count and shard count, else one
    ConfigError naming the shard and the flag to start it with (not a refused PUSH under a gloo
    traceback later). Shards started by hand are then told to exit by `recsys.train` (`stop_shards_after`)."""
    n = len(store.addresses)
    expected = (("num_workers", world, f"{world} trainers run"), ("num_shards", n, f"ps.addresses names {n}"))
    for info, address in zip(store.health(), store.addresses):
        for key, want, but in expected:
            if info[key] != want:
                raise ConfigError(f"ps shard {info['shard']} at {address} was started with ps.{key} = {info[key]}, "
                                  f"but {but}: start the shards with --set ps.{key}={want}")


def log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"trainer-{rank}.log"


def write_record(run_dir: str | Path, kind: str, rank: int, record: dict) -> Path:
    """RUN_DIR/KIND/trainer-R.json (KIND: pids, errors, exits; `job.trainer_records` reads them), written
    whole or not at all (`manifest.write_json_atomic`): the launcher reads them while trainers write."""
    path = Path(run_dir) / kind / f"trainer-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return path


def report_exit(run_dir: str | Path, rank: int) -> None:
    """exits/trainer-R.json: this rank returned from its job (exit code 0) at this time. The launcher
    then never takes its silence for a kill (`job.silent_ranks`). A record that cannot be
    written is logged, never an error: the job itself succeeded."""
    try:
        write_record(run_dir, "exits", rank, {"rank": rank, "time": time.time(), "code": 0})
    except OSError as e:
        logger.warning("could not record this trainer's exit in %s: %s", Path(run_dir) / "exits", e)


def one_line(e: BaseException) -> str:
    """The error as one line: our errors (ValueError and its kin: data, config, checkpoints, non-finite
    numbers) by their message, which names the file / key / column; anything else with its type."""
    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, DataError):
        return f"{msg} (fix those rows, or set data.on_bad_rows = 'skip' to drop them)"
    return msg if isinstance(e, ValueError) else f"{type(e).__name__}: {msg}"


def report_failure(e: BaseException, run_dir: str | Path, rank: int, verbose: bool = False) -> str:
    """Write the traceback to the rank's log only (and stderr when `verbose`), the one-line error to
    errors/trainer-R.json (the launcher prints the first rank's, our own errors before the others: `one_line`);
    returns the line."""
    line = one_line(e)
    text = "".join(traceback.format_exception(e))
    log = log_path(run_dir, rank)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"trainer {rank} failed: {text}")
    if verbose:
        logger.error("failed:\n%s", text)
    write_record(run_dir, "errors", rank, {"rank": rank, "time": time.time(), "error": line, "log": str(log),
                                           "own": isinstance(e, ValueError)})
    return line


def worker_main(config_path: str, ready_files: list[str], run_dir: str, resume: str | None = None,
                load_shards: bool = False, verbose: bool = False, init: str | None = None,
                overrides: Sequence[str] = ()) -> None:
    """Entry point of a trainer process started by the local launcher (a fork of its zygote,
    `recsys.training.procs.run_trainers`, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; the
    shards start with it: their addresses come from their ready files). `overrides`: the job's ps.auth
    (`jobauth.job_auth`). SIGUSR1 (the launcher's stop request) ends training after the current step
    with a checkpoint; SIGTERM (the launcher stopping the trainers after a failure) ends it at once."""
    rank = int(os.environ.get("RANK", "0"))
    stopping.install(signal.SIGUSR1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # only the launcher's requests count
    setup_logging(verbose, role=f"trainer{rank}", log_file=str(log_path(run_dir, rank)))
    apply_environment()
    try:
        addresses = wait_for_shards(ready_files, READY_TIMEOUT_S)
        run_worker(config_path, addresses, run_dir, resume, load_shards=load_shards, init=init, overrides=overrides)
    except Exception as e:
        report_failure(e, run_dir, rank, verbose)
        raise SystemExit(2) from None
    report_exit(run_dir, rank)


def run_worker(config_path: str, addresses: list[str], run_dir: str, resume: str | None = None,
               load_shards: bool = False, node: dict | None = None, init: str | None = None,
               overrides: Sequence[str] = ()) -> None:
    """One trainer process's job (its entry points, which set up logging, are `recsys.train`).

    resume: a checkpoint directory to continue from. load_shards: rank 0 also tells the (already
    running, same-count) shards to load the checkpoint's rows; the local launcher instead starts
    fresh shards that load their part themselves (any shard count). node: where this trainer runs
    (the Ray engine's node_id / node_ip), added to its pid file.
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(config_path, list(overrides))
    if cfg.ps.num_workers != world:
        raise ValueError(f"{config_path}: ps.num_workers = {cfg.ps.num_workers} but {world} trainers run; "
                         f"the shards would wait for workers that never come")
    torch.set_num_threads(cfg.train.num_threads or max(1, (os.cpu_count() or 1) // world))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cfg.train.device == "cuda" else "gloo")
    if cfg.train.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    out = Path(run_dir)
    write_record(out, "pids", rank, {"role": "trainer", "rank": rank, "pid": os.getpid(), **(node or {})})
    if resume is not None and rank == 0:
        trim_metrics(out / "metrics.jsonl", read_manifest(resume)["step"])
    metric_logger = (MetricLogger(out / "metrics.jsonl", append=resume is not None) if rank == 0
                     else NullMetricLogger())
    # the sparse arch sends unique ids; a GPU trainer's pulled rows land in page-locked memory
    store = PSClient(cfg.ps, addresses, worker_id=rank, dedup=False, pin_rows=cfg.train.device == "cuda")
    check_shards(store, world)
    trainer = None
    try:
        # a resumed run's replicated tables keep their saved vocabulary, a warm start's join it with the
        # new data's (shapes fixed before DDP wraps them)
        source = resolve_init(init, verify=False) if init is not None and resume is None else None
        saved = saved_replicated(run_path(resume, "model")) if resume is not None else \
            source_replicated(source) if source is not None else None
        trainer = Trainer(cfg, store, rank=rank, world_size=world, metric_logger=metric_logger,
                          replicated_state=saved, warm=source is not None)
        store = trainer.store          # the row cache's wrapper when a table caches (a LOAD clears it)
        if resume is not None:
            if load_shards and rank == 0:
                store.load(ps_dir(run_path(resume, "model")))
            if load_shards:
                barrier()                 # nobody pulls before the shards hold the checkpoint's rows
            trainer.restore(resume)
        elif source is not None:
            trainer.warm_start(source)        # the shards took the source's rows when they started
        # what exists now (modules, model, client) lives for the whole run: without this every full
        # collection during training walks its ~200k objects again (benchmarks/history/figures-from-the-code.md)
        gc.collect()
        gc.freeze()
        t0 = time.perf_counter()
        summary = trainer.train()
        if trainer.stopped:                # a stop request: the checkpoint is written, nothing else
            if rank == 0:
                where = checkpoint_path(cfg.train.run_dir, trainer.step)
                (out / "stopped.json").write_text(json.dumps({"step": trainer.step, "checkpoint": str(where)}))
                logger.info("stopped at step %d; checkpoint %s", trainer.step, where)
                if storage.is_uri(cfg.train.run_dir):      # the log so far, for a resume on another machine
                    publish_run_files(out, cfg.train.run_dir, ("metrics.jsonl",))
            barrier()
            return
        samples_per_s = summary["samples"] / max(summary["train_s"], 1e-9)
        final: dict[str, float] = {"steps": summary["steps"], "train_s": time.perf_counter() - t0}
        final["samples_per_s"] = float(all_reduce(torch.tensor([samples_per_s], dtype=torch.float64)).item())
        final.update({k: summary[k] for k in ("checkpoint_pause_s", "val_passes", "best_step", "best_val_logloss",
                                              "best_val_auc", "early_stopped") if k in summary})
        barrier()      # every rank's last pushes (drained by `train`) are acknowledged before the shards save
        if rank == 0:           # the model first: a failing eval below loses nothing of the training
            save_model(trainer, store, run_path(cfg.train.run_dir, "model"))
            (out / "ps_stats.json").write_text(json.dumps(store.stats(), indent=1))
        barrier()      # nobody pulls rows to score while the shards save
        if cfg.data.eval_paths:
            final.update(trainer.evaluate(cfg.data.eval_paths))
        report: dict = {"run_id": cfg.train.run_id, **final}
        if "stopped_end_of_data" in summary:
            report["stopped"] = "end of data"
        if cfg.data.test_paths:
            report["test"] = score_test(trainer, store, cfg, cfg.train.run_dir, rank)
        if rank == 0:
            metric_logger.log({f"final/{k}": v for k, v in final.items()}, trainer.step)
            if "test" in report:
                metric_logger.log({f"test/{k}": v for k, v in report["test"].items()
                                   if isinstance(v, (int, float))}, trainer.step)
            (out / "metrics.json").write_text(json.dumps(report, indent=1))
            logger.info("final metrics: %s", report)
            if storage.is_uri(cfg.train.run_dir):
                publish_run_files(out, cfg.train.run_dir, ("metrics.json", "metrics.jsonl", "ps_stats.json"))
        barrier()
    finally:
        if trainer is not None:
            trainer.close()
        store.close()
        metric_logger.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def score_test(trainer: Trainer, store: EmbeddingStore, cfg: JobConfig, out: Path | str, rank: int) -> dict:
    """metrics.json's "test" section: data.test_paths scored with the best model (run_dir/best, when
    validation kept one; else the last model). Collective: every rank scores its part.

    The best model goes into the running shards with a LOAD (after run_dir/model was written: the
    run is over) and into this trainer's dense model."""
    best = best_dir(out)
    use_best = trainer.validation.keep_best and trainer.validation.state.best_step >= 0 and has_best(out)
    if use_best:
        barrier()                 # every rank is done with the last model's rows
        if rank == 0:
            store.load(ps_dir(run_path(best, "model")))
        barrier()                 # nobody pulls before the shards hold the best rows
        trainer.model.load_state_dict(load_bytes(storage.read_bytes(run_path(best, "model", "dense.pt"))))
        if trainer.replicated is not None:
            trainer.replicated.load_state(saved_replicated(run_path(best, "model")), where=str(best))
        trainer.strategy.resumed(trainer.step)       # async: progress again after the LOAD
    m = trainer.evaluate(cfg.data.test_paths)
    m["examples"] = m.pop("eval_examples")
    m["model"] = "best" if use_best else "last"
    m["step"] = float(trainer.validation.state.best_step if use_best else trainer.step)
    return m


def trim_metrics(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` from metrics.jsonl (logged by an attempt that died after
    its last checkpoint: the resumed run logs those steps again)."""
    if not path.exists():
        return
    def before(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except ValueError:           # a line cut short by the kill
            return False

    lines = path.read_text().splitlines(keepends=True)
    keep = [x for x in lines if before(x)]
    if len(keep) != len(lines):
        storage.write_text(path, "".join(keep))      # atomic: a temporary file renamed into place
