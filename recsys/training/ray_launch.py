"""Ray engine: `recsys train` with `[cluster] engine = "ray"` places the same job on a Ray cluster.

    driver (this process) ──placement group (ps bundles, SPREAD | PACK)──> ShardActor 0..N-1
                             each runs `embedding_ps.shard.loop.serve` (the code behind `recsys ps`) on its
                             node's address, ps.auth = "token" with a per-job token handed over by Ray
                          ──ray.train.torch.TorchTrainer(ScalingConfig)──> trainer rank 0..W-1
                             Ray Train sets up torch.distributed (gloo / NCCL); each runs `run_worker`,
                             the local launcher's trainer loop, with the shard addresses from the driver

A launcher, not a second trainer: the local launcher's run directory files, attempt loop
(`job.run_attempts`) and `WorkerError`; resources and the token's in-memory files: docs/cluster.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import shutil
import re
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from recsys.config import ConfigError, JobConfig, load_config, load_ps_config, to_toml
from recsys.rundir import READY_TIMEOUT_S, run_path
from recsys.runtime import apply_environment, setup_logging
from recsys.training.jobauth import memory_file
from recsys.training.job import (JobFailure, StopRequests, WorkerError, prepared_run, read_worker_error,
                                 run_attempts, write_processes)

logger = logging.getLogger(__name__)


class ClusterResourceError(RuntimeError):
    """The cluster cannot grant the resources of a role (nodes lost, a custom resource nobody offers)."""


# ---------------------------------------------------------------------------------------------
# In the actors and trainers


def _private_config(config_toml: str, token: str) -> tuple[list[int], Path, list[str]]:
    """The job config and the token as in-memory files of this process: their fds (close them when
    done), the config's path and the overrides that point ps.auth at the token."""
    token_fd, token_path = memory_file("recsys-ps-token", token)
    config_fd, config_path = memory_file("recsys-config.toml", config_toml)
    return [token_fd, config_fd], config_path, ["ps.auth='token'", f"ps.token_file='{token_path}'"]


def this_node() -> dict[str, str]:
    """The Ray node this process runs on: its id and the address Ray knows it by (the address its
    processes serve on; 127.0.0.1 for a local instance or a loopback test cluster)."""
    node_id = ray.get_runtime_context().get_node_id()
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), None)
    return {"node_id": node_id, "node_ip": ip or ray.util.get_node_ip_address()}


class ShardActor:
    """PS shard `shard` in a Ray actor: `serve` in a thread, on this node's address, token auth.

    restore: a saved PS directory (a checkpoint's model/ps) the shard loads its part of first.
    """

    def __init__(self, config_toml: str, shard: int, token: str, run_dir: str, restore: str | None) -> None:
        from embedding_ps.shard.loop import serve
        from recsys.training.reshard import shard_factory

        setup_logging(role=f"ps{shard}", log_file=str(Path(run_dir) / f"ps-{shard}.log"))
        apply_environment()
        self._fds, path, overrides = _private_config(config_toml, token)
        ps = load_ps_config(path, overrides)
        self._ready = Path(tempfile.mkdtemp(prefix=f"recsys-ps{shard}-")) / "ready"     # (no secret)
        self._node = this_node()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._address: str | None = None

        def run() -> None:
            try:
                serve(ps, shard, bind=self._node["node_ip"], port=0, ready_file=str(self._ready),
                      state_factory=shard_factory(restore), stop=self._stop)
            except BaseException as e:        # reported by ready() / wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"ps-shard-{shard}", daemon=True)
        self._thread.start()

    def ready(self, timeout_s: float) -> dict:
        """Once the shard serves: its address, pid and node."""
        deadline = time.monotonic() + timeout_s
        while self._address is None and not self._ready.exists():
            if not self._thread.is_alive():
                raise RuntimeError(f"ps shard stopped before it served: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ps shard not serving after {timeout_s:.0f} s")
            time.sleep(0.02)
        if self._address is None:
            self._address = self._ready.read_text().strip()
            shutil.rmtree(self._ready.parent, ignore_errors=True)      # nothing left behind, even after kill -9
        return {"address": self._address, "pid": os.getpid(), **self._node}

    def wait(self) -> None:
        """Returns when the shard stops (its ObjectRef fails when the actor dies: kill -9, a lost node)."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        shutil.rmtree(self._ready.parent, ignore_errors=True)
        for fd in self._fds:
            os.close(fd)


def _watch_shards(shards: list, done: threading.Event, rank: int) -> None:
    """A trainer's watchdog: a shard that ends during training ends this trainer at once (else it would
    wait ps.timeout_s x retries on it), so Ray Train fails the attempt and the driver restarts it."""
    refs = [s.wait.remote() for s in shards]
    while not done.is_set():
        ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
        if ready and not done.is_set():
            logger.error("trainer %d: ps shard %d is gone; ending this attempt", rank, refs.index(ready[0]))
            logging.shutdown()
            os._exit(3)


def train_loop(config: dict) -> None:
    """The Ray Train function: `run_worker` (the local launcher's trainer loop) in the process group
    Ray Train set up (RANK / WORLD_SIZE / LOCAL_RANK in the environment, as torch elastic sets them)."""
    from recsys.training.worker import log_path, report_failure, run_worker

    rank, run_dir, verbose = int(os.environ.get("RANK", "0")), config["run_dir"], config["verbose"]
    setup_logging(verbose, role=f"trainer{rank}", log_file=str(log_path(run_dir, rank)))
    apply_environment()
    fds, path, overrides = _private_config(config["config"], config["token"])
    done = threading.Event()
    threading.Thread(target=_watch_shards, args=(config["shards"], done, rank), daemon=True).start()
    try:
        resolved_fd, resolved = memory_file("recsys-config.toml", to_toml(load_config(path, overrides)))
        fds.append(resolved_fd)                 # ps.token_file -> this trainer's in-memory token
        run_worker(str(resolved), config["addresses"], run_dir, config["resume"], node=this_node())
    except Exception as e:
        raise RuntimeError(report_failure(e, run_dir, rank, verbose)) from None
    finally:
        done.set()
        for fd in fds:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# In the driver


def connect(cfg: JobConfig) -> bool:
    """Join cluster.address (or start a local Ray instance sized for the job); True when this call
    started or joined Ray (the caller shuts it down)."""
    if ray.is_initialized():
        return False
    if cfg.cluster.address:
        ray.init(address=cfg.cluster.address, log_to_driver=False)
        return True
    need = Counter({k: v * cfg.ps.num_shards for k, v in cfg.cluster.ps_bundle().items()})
    need.update({k: v * cfg.train.num_trainers for k, v in cfg.cluster.trainer_bundle().items()})
    custom = {k: v for k, v in need.items() if k not in ("CPU", "GPU", "memory")}
    ray.init(address="local",                 # a new instance, not one `ray start` left on this machine
             num_cpus=max(os.cpu_count() or 1, int(need.get("CPU", 0) + 0.999)), resources=custom or None,
             include_dashboard=False, log_to_driver=False)
    return True


def _absolute(cfg: JobConfig) -> JobConfig:
    """Local paths made absolute: actors and trainers do not run in this process's directory."""
    def fix(p: str) -> str:
        return p if "://" in p or not p else str(Path(p).resolve())

    data = dataclasses.replace(cfg.data, **{k: tuple(fix(p) for p in getattr(cfg.data, k))
                                            for k in ("train_paths", "eval_paths", "test_paths", "item_paths")})
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, run_dir=fix(cfg.train.run_dir)),
                               ps=dataclasses.replace(cfg.ps, storage_root=fix(cfg.ps.storage_root)))


def _reserve(cfg: JobConfig, role: str, key: str, bundle: dict[str, float], count: int):
    """A ready placement group of `count` bundles (cluster.placement), or after cluster.start_timeout_s a
    ClusterResourceError: one line saying what the cluster lacks and which nodes are dead (totals count
    the living nodes only: `ray.cluster_resources()` still counts a node lost moments ago)."""
    pg = placement_group([dict(bundle)] * count, strategy=cfg.cluster.placement.upper(), name=f"recsys-{role}")
    try:
        ray.get(pg.ready(), timeout=cfg.cluster.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        nodes, free = ray.nodes(), ray.available_resources()
        total = sum((Counter(n["Resources"]) for n in nodes if n["Alive"]), Counter())
        short = [f"{k} {v * count:g} needed, {free.get(k, 0.0):g} free of {total.get(k, 0.0):g}"
                 for k, v in bundle.items() if v * count > free.get(k, 0.0) + 1e-9]
        dead = [f"{n['NodeID'][:12]} ({n['NodeManagerAddress']})" for n in nodes if not n["Alive"]]
        remove_placement_group(pg)
        raise ClusterResourceError(f"cannot place {count} {role}(s) of {key} = {bundle}: "
                                   f"{'; '.join(short) or 'no single node offers one bundle'}"
                                   f"{'; lost nodes: ' + ', '.join(dead) if dead else ''}"
                                   f" (waited cluster.start_timeout_s = {cfg.cluster.start_timeout_s:g} s)") from None
    return pg


def _write_processes(run_dir: Path, infos: list[dict], earlier: list[dict]) -> list[dict]:
    """processes.json as the local launcher writes it, with each process's node (node_id, node_ip)."""
    shards = [{k: v for k, v in info.items() if k != "address"} for info in infos]
    return write_processes(run_dir, shards, earlier, node=this_node())


def _failure(e: BaseException, run_dir: Path, actors: list, infos: list[dict]) -> Exception:
    """What a failed fit() means: a shard or a trainer process died (JobFailure, worth a restart), or a
    trainer's own error (WorkerError, its one line)."""
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    from ray.train.v2.api.exceptions import WorkerGroupError

    for i, (a, info) in enumerate(zip(actors, infos)):
        try:
            ray.get(a.ready.remote(1.0), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return JobFailure(f"ps shard {i} (pid {info['pid']} on node {info['node_ip']} {info['node_id'][:12]}) "
                              f"died during training", killed=True)
    failures = getattr(e, "worker_failures", {}) if isinstance(e, WorkerGroupError) else {}
    # a dead worker process: its actor's error, or the health check that found the actor gone
    died = sorted(r for r, err in failures.items()
                  if isinstance(err, (ray.exceptions.RayActorError, WorkerHealthCheckFailedError)))
    if died or not failures:
        what = f"trainer rank {died[0]} died" if died else "the trainers failed"
        detail = " ".join(str(failures.get(died[0], e) if died else e).split())[:300]
        return JobFailure(f"{what}: {detail}", killed=True)
    line = read_worker_error(run_dir)
    return WorkerError(line if line is not None else " ".join(str(e).split())[:500])


class StepLines(threading.Thread):
    """Prints rank 0's step lines (`recsys.metrics.step_line`) on the driver while the Ray trainers run
    (Ray does not forward the workers' output: log_to_driver is off): it follows
    run_dir/logs/trainer-0.log, which rank 0 writes on storage every node sees, from where it ended
    when this attempt began."""

    STEP_LINE = re.compile(r" trainer0: (epoch \d+/\d+ )?step \d+")

    def __init__(self, path: Path, poll_s: float = 0.5) -> None:
        super().__init__(name="rank 0 step lines", daemon=True)
        self.path, self.poll_s, self.done = path, poll_s, threading.Event()
        self.offset = path.stat().st_size if path.exists() else 0

    def run(self) -> None:
        while not self.done.wait(self.poll_s):
            self.forward()
        self.forward()

    def forward(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1          # whole lines only: the rest comes next time
        self.offset += end
        for line in chunk[:end].decode("utf-8", "replace").splitlines():
            if self.STEP_LINE.search(line):
                logger.info("%s", line.split(" trainer0: ", 1)[1])

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


def _attempt(token: str, cfg: JobConfig, config_path: Path, run_dir: Path, checkpoint: Path | str | None,
             earlier: list[dict], stops: StopRequests, verbose: bool, init: None = None) -> dict:
    """One start of the shard actors and the Ray Train trainers; the final metrics. Raises JobFailure
    when a process of it died, WorkerError when a trainer failed, ClusterResourceError."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    actors, infos, pg = [], [], None
    try:                                  # ps.num_shards shard actors in one placement group, one bundle each
        bundle = cfg.cluster.ps_bundle()
        pg = _reserve(cfg, "ps shard", "cluster.ps_resources", bundle, cfg.ps.num_shards)
        remote, text = ray.remote(ShardActor), to_toml(cfg)
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        restore = None if checkpoint is None else str(run_path(checkpoint, "model", "ps"))
        actors = [remote.options(
            num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0), memory=bundle.get("memory"),
            resources=custom or None, max_restarts=0, max_concurrency=cfg.train.num_trainers + 4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(text, i, token, cfg.train.run_dir, restore) for i in range(cfg.ps.num_shards)]
        infos = ray.get([a.ready.remote(READY_TIMEOUT_S) for a in actors], timeout=READY_TIMEOUT_S + 30)
        _write_processes(run_dir, infos, earlier)
        logger.info("ps shards ready at %s", ", ".join(f"{i['address']} (node {i['node_id'][:12]})" for i in infos))
        bundle, strategy = cfg.cluster.trainer_bundle(), cfg.cluster.placement.upper()    # SPREAD | PACK
        remove_placement_group(_reserve(cfg, "trainer", "cluster.trainer_resources", bundle,
                                        cfg.train.num_trainers))   # fail fast, in one line
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"config": text, "token": token, "addresses": [i["address"] for i in infos],
                               "run_dir": str(run_dir), "verbose": verbose, "shards": actors,
                               "resume": None if checkpoint is None else str(checkpoint)},
            scaling_config=ScalingConfig(num_workers=cfg.train.num_trainers, use_gpu=cfg.cluster.use_gpu,
                                         resources_per_worker=bundle, placement_strategy=strategy),
            run_config=RunConfig(name=f"recsys-{secrets.token_hex(4)}", storage_path=str(run_dir / "ray"),
                                 failure_config=FailureConfig(max_failures=0)))
        lines = StepLines(run_dir / "logs" / "trainer-0.log")     # worker.log_path(run_dir, 0)
        lines.start()
        try:
            trainer.fit()
        except Exception as e:
            lines.stop()
            raise _failure(e, run_dir, actors, infos) from e
        lines.stop()
        return json.loads((run_dir / "metrics.json").read_text())
    finally:
        if actors:                        # a clean stop, then kill; their placement group freed
            refs = [a.stop.remote() for a in actors]
            try:
                ray.wait(refs, num_returns=len(refs), timeout=15)
            finally:
                for a in actors:
                    ray.kill(a, no_restart=True)
                remove_placement_group(pg)
        earlier[:] = _write_processes(run_dir, infos, earlier)


def launch_train_ray(cfg: JobConfig, resume: str | None = None, verbose: bool = False,
                     overwrite: bool | None = None) -> dict:
    """Run a whole training job on Ray (cluster.address, or a local Ray instance); the final metrics,
    as `launch_train` returns them. Same run directory, same resume and restart rules."""
    cfg = _absolute(cfg)
    no_warm_start = ConfigError("train.init_from: a warm start runs with cluster.engine = 'local' for now (the "
                                "Ray engine's shard actors restore only checkpoints); use --resume of a run with a "
                                "checkpoint, or the local engine")
    if cfg.train.init_from and not resume:
        raise no_warm_start
    with prepared_run(cfg, resume, overwrite) as (cfg, run_dir, config_path, checkpoint, init):
        if init is not None:                # --resume of a run without a checkpoint yet: the warm start
            raise no_warm_start
        token = secrets.token_hex(32)       # per job; only Ray carries it (task arguments), never a shared file
        started = connect(cfg)
        # never entered: the Ray engine forwards no stop request (Ctrl-C ends the driver; see docs/cluster.md)
        try:
            return run_attempts(cfg, config_path, run_dir, checkpoint, StopRequests(run_dir), verbose,
                                functools.partial(_attempt, token))
        finally:
            if started:
                ray.shutdown()
