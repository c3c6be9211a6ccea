"""Trainer: one process per rank. Sparse rows come from the PS, the dense model trains under DDP.

A step (docs/architecture.md "A step"; how it meets the PS in each ps.mode: `recsys.training.step`):
the batch's unique rows [U, D] pulled and pooled, the model's logits [B], backward; DDP allreduces
the dense gradients and the row gradients are pushed scaled by 1/W, so that in sync mode W trainers
compute exactly what one process computes on the concatenated batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from data.batch import Batch
from data.loader import ParquetLoader
from data.parquet import scoring_config, with_id_types
from embedding_ps.client.cache import CachingStore, cache_metrics
from embedding_ps.store import EmbeddingStore, RowSource
from recsys.calibration import data_score_rate, probabilities
from recsys.config import JobConfig
from recsys.dist import all_reduce, barrier, is_distributed
from recsys.metrics import MetricSink, StreamingAUC, eval_metrics
from recsys.models import SparseLookup, build_job_model
from recsys.models.on_device import to_host_async
from recsys.models.replicated import (ReplicatedStore, TableOptimizer, TrainModules, build_replicated,
                                      resolve_placement)
from recsys.training.checkpoint import Checkpointer, TrainParts, restore_trainer
from recsys.training.warm_start import InitSource, warm_start
from recsys.training import stopping
from recsys.training.dense import build_optimizer, build_scheduler, wrap_ddp
from recsys.training.loss import ctr_loss, row_weights
from recsys.training.retrieval import retrieval_metrics_of
from recsys.training.step import AsyncStep, SyncStep
from recsys.rundir import best_dir, local_run_dir
from recsys.training.validation import Validation

logger = logging.getLogger(__name__)


class NonFiniteLossError(ValueError):
    """A batch's loss is NaN or infinite; the message names the step and (from `train`) the batch's rows."""


@dataclass
class StepTimes:
    """Seconds spent per phase since the last log line."""

    data: float = 0.0
    pull: float = 0.0
    push: float = 0.0
    ps_wait: float = 0.0            # blocked on pull replies (the rest of `pull` is issuing them)
    ps_rows: int = 0                # rows pulled from the PS (and their gradients pushed)
    total: float = 0.0
    samples: int = 0
    loss_sum: float = 0.0
    steps: int = 0
    auc: StreamingAUC = field(default_factory=lambda: StreamingAUC(1000))   # train AUC of the window

    def as_metrics(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {
            "loss/train": self.loss_sum / n,
            "auc/train": self.auc.compute(),
            "perf/samples_per_s": self.samples / max(self.total, 1e-9),
            "data/wait_frac": self.data / max(self.total, 1e-9),
            "ps/pull_ms": 1e3 * self.pull / n,
            "ps/push_ms": 1e3 * self.push / n,
            "time/data_wait_ms": 1e3 * self.data / n,
            "time/ps_wait_ms": 1e3 * self.ps_wait / n,
            "ps/rows_per_step": self.ps_rows / n,
        }


@dataclass
class _Run:
    """What one `Trainer.train` call keeps across steps."""

    window: StepTimes               # the current log window
    t_start: float
    t_log: float                    # start of the window
    position: dict                  # the reader state after the last trained batch
    bar: Any = None                 # tqdm bar (rank 0 on a terminal) or None
    total: int = 0                  # the step the run ends at (train.max_steps, else the epochs' end)
    first: int = 0                  # the step it started from (a resumed or warm-started run's)
    samples: int = 0
    trace: list[np.ndarray] = field(default_factory=list)
    stop: bool = False              # early stopping: end the run after this step


def _ahead(items: Iterator, depth: int) -> Iterator:
    """`items` in order, each handed out once the `depth` items after it are taken (their pulls sent)."""
    taken: deque = deque()
    for item in items:
        taken.append(item)
        if len(taken) > depth:
            yield taken.popleft()
    yield from taken


class Trainer:
    """Build / train_step / train / predict / close for one rank."""

    def __init__(self, cfg: JobConfig, store: EmbeddingStore, *, rank: int = 0, world_size: int = 1,
                 metric_logger: MetricSink | None = None, replicated_state: dict | None = None,
                 warm: bool = False, scoring_only: bool = False) -> None:
        """`replicated_state`: saved replicated tables (model/replicated.pt) to start from; without it
        their vocabularies are read from data.train_paths (recsys.models.replicated); with `warm` (a
        warm start) both, joined (`build_replicated(grow=True)`). `scoring_only` (eval, predict): no
        optimizers and no LR schedule (a torch optimizer's first use imports torch._dynamo);
        `train` is then refused."""
        if any(t.placement == "auto" for t in cfg.ps.tables):    # the launcher resolves it; library use here
            cfg = resolve_placement(cfg).config
        if not scoring_only:                                      # so do its checkpoints' data.id_types
            cfg = dataclasses.replace(cfg, data=with_id_types(cfg.data))
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        # "cuda": this process's GPU by index (the worker's set_device; DDP's device_ids and a row
        # cache's rows name it so, and a bare "cuda" compares unequal to "cuda:0")
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.device == "cuda" \
            else torch.device(cfg.train.device)
        # a row cache (async mode only: JobConfig refuses it in sync), which train lookups pass the ids' counts;
        # rows pulled K = train.pull_ahead_batches ahead already miss K steps: cached ones live ps.max_staleness - K
        self._cached = any(t.cache_rows > 0 for t in cfg.ps.tables)
        self.store = CachingStore(store, cfg.ps, max_age=cfg.ps.max_staleness - cfg.train.pull_ahead_batches,
                                  device=self.device, background=True) if self._cached else store
        self.sparse, model = build_job_model(cfg)
        if self.device.type != "cpu":
            self.sparse.device = self.device     # pool on the GPU (SparseArch.device), ids deduplicated there
            self.sparse.device_ids = True
        self.model = model.to(self.device)
        self.replicated = build_replicated(cfg, replicated_state, grow=warm)   # None: every table on the PS
        if self.replicated is not None:
            self.replicated.to(self.device)
            self.sparse.use_replicated(self.replicated)
        self.ddp = wrap_ddp(TrainModules(self.model, self.replicated), cfg.train, self.device)
        self.scoring_only = scoring_only
        self.optimizer = None if scoring_only else build_optimizer(self.model, cfg.train)
        self.table_optimizer = TableOptimizer(self.replicated) \
            if self.replicated is not None and not scoring_only else None
        # in-batch softmax over the (global) batch's items, on logits [B, B_g]: the model's own loss
        self._in_batch = model.in_batch_softmax
        self.metric_logger = metric_logger
        self.step = 0
        self.strategy = (SyncStep if cfg.ps.mode == "sync" else AsyncStep)(self.store)   # chosen here once
        # sync mode with W ranks and a last batch that may be short: weight by each rank's share
        self._uneven_batches = cfg.ps.mode == "sync" and world_size > 1 and not cfg.data.drop_last
        # a rank's batch is short only at its epoch's last step, except when bad rows are skipped
        # (then any batch may be its rank's last): only those steps sum the global batch size
        self._any_step_uneven = cfg.data.on_bad_rows == "skip"
        self._sweeps = any(t.ttl_steps > 0 for t in cfg.ps.tables)
        self._loader: ParquetLoader | None = None
        self.scheduler = None if scoring_only else build_scheduler(self.optimizer, cfg.train, self._schedule_steps())
        self.checkpointer = Checkpointer(cfg, rank=rank, world_size=world_size)
        self.validation = Validation(cfg)
        self.start_step = 0
        self._start_epoch = 0
        self.stopped = False            # a stop request ended `train` early (see recsys.training.stopping)

    @property
    def parts(self) -> TrainParts:
        """What a checkpoint saves of this trainer (besides step and data position)."""
        return TrainParts(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, store=self.store,
                          replicated=self.replicated, table_optimizer=self.table_optimizer)

    def restore(self, checkpoint: str) -> None:
        """Continue from a checkpoint (see recsys.training.checkpoint); the shards load their part
        separately. Async mode: tells the shards this worker's progress, for the staleness bound."""
        step, validation = restore_trainer(self.parts, self.loader, checkpoint, world_size=self.world_size)
        self._continue_at(step)
        self._start_epoch = int(self.loader.state_dict()["epoch"])
        self.validation.load_state_dict(validation)      # best so far and patience go on

    def warm_start(self, source: InitSource) -> None:
        """Start from another run's model (train.init_from; the shards load its rows separately): its
        dense weights and optimizer state, the step counter continuing from its step, a fresh data
        position, LR schedule and early-stopping record."""
        warm_start(self.parts, source)
        self._continue_at(source.step)
        if self.rank == 0:
            logger.info("warm start from %s at step %d (train.max_steps counts the steps of this run)",
                        source.root, self.step)

    def _continue_at(self, step: int) -> None:
        """Go on from `step`: no second checkpoint of it, the pushes carry it, async shards learn it."""
        self.step = self.start_step = self.checkpointer.last_step = self.store.step = step
        self.strategy.resumed(step)

    def _schedule_steps(self) -> int:
        """Optimizer steps a linear / cosine LR decay spans: train.max_steps / grad_accum_steps, or
        without max_steps train.epochs x the batches of an epoch / grad_accum_steps, from the train
        files' row counts (the same on every rank: DDP's ranks must agree on the LR)."""
        t = self.cfg.train
        if t.max_steps or t.lr_decay not in ("linear", "cosine"):      # the other decays never read it
            return max(1, t.max_steps // t.grad_accum_steps)
        rows, B = self.loader.total_rows // self.world_size, self.cfg.data.batch_size
        batches = rows // B if self.cfg.data.drop_last else -(-rows // B)
        steps = max(1, t.epochs * batches // t.grad_accum_steps)
        if self.rank == 0:
            logger.info("train.lr_decay = %r over %d optimizer steps (train.epochs %d x %d batches of the data a rank "
                        "/ grad_accum_steps %d; set train.max_steps to choose)", t.lr_decay, steps, t.epochs, batches,
                        t.grad_accum_steps)
        return steps

    @property
    def _last_step(self) -> int:
        """The step this run ends at: train.max_steps steps after a warm start's first (0: the data's end)."""
        max_steps = self.cfg.train.max_steps
        return max_steps + self.cfg.train.init_step if max_steps else 0

    @property
    def loader(self) -> ParquetLoader:
        """The training reader (built on first use: eval / predict never open the train files)."""
        if self._loader is None:
            self._loader = ParquetLoader(self.cfg.data, self.cfg.data.train_paths, rank=self.rank,
                                         world_size=self.world_size)
        return self._loader

    # -- one step -------------------------------------------------------------------------------

    def forward(self, batch: Batch, lookup: SparseLookup, train: bool = True) -> torch.Tensor:
        """Logits [B] of a batch whose rows are (being) pulled in `lookup`."""
        pooled, linear = lookup.wait()                          # [B, F, D], [B, F_lin] | None
        args, kwargs = self.model.extra_inputs(self.sparse, lookup, batch, train)   # the model's hook
        args = [t.to(self.device) for t in args]
        kwargs = {k: v.to(self.device) for k, v in kwargs.items()}
        model = self.ddp if train else self.model
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.train.autocast):
            logits = model(batch.dense.to(self.device), pooled.to(self.device),
                           None if linear is None else linear.to(self.device), *args, **kwargs)
        return logits.float()

    def train_step(self, batch: Batch, lookup: SparseLookup, times: StepTimes, *,
                   end_of_epoch: bool = True) -> float:
        """Forward, backward, push row grads, dense optimizer step. Returns the batch loss.

        `end_of_epoch`: whether this may be the epoch's last step, the only one whose batches can differ
        in size between ranks (the loop knows; the default assumes it may)."""
        acc = self.cfg.train.grad_accum_steps
        last_micro = (self.step + 1) % acc == 0
        share = 1.0     # W * this rank's rows / every rank's rows this step: its part of the mean over all ranks' rows
        if self._uneven_batches and (end_of_epoch or self._any_step_uneven):
            share = self.world_size * batch.batch_size / int(all_reduce(torch.tensor([batch.batch_size])).item())
        sync_ctx = self.ddp.no_sync() if (not last_micro and hasattr(self.ddp, "no_sync")) else contextlib.nullcontext()
        with sync_ctx:
            logits = self.forward(batch, lookup)
            labels = batch.labels.to(self.device)
            # CTR: sum_i w_i * BCE_i / B (recsys.training.loss), the plain mean when no row has a weight
            loss = self.model.loss(logits, labels) if self._in_batch else \
                ctr_loss(logits, labels, row_weights(labels, batch.example_weights, self.cfg.data))
            if not torch.isfinite(loss.detach()):      # before any gradient reaches DDP or the shards
                raise NonFiniteLossError(f"step {self.step + 1}: the training loss is {float(loss.detach())}")
            (loss * share / acc).backward()             # loss * 1.0 is exact: no special case
        t0 = time.perf_counter()
        # rows.grad already carries share / acc (the loss was scaled): only DDP's 1/W is left to apply.
        # Host grads go now, with the step's barrier (the shards apply it while the optimizers step);
        # a GPU's are copied to the host while the optimizer steps are queued, and sent after them
        pushes = lookup.push_start(scale=1.0 / self.world_size)
        copying = bool(pushes.copies)
        if not copying:
            self.strategy.after_backward(pushes.send(), self.step)
        push_s = time.perf_counter() - t0
        # the loss and (a CTR logit per row, not in-batch softmax) the click probabilities for the train
        # AUC, to the host: on a GPU copied once backward is done, read without waiting for the optimizers
        ctr = logits.dim() == 1
        out = torch.cat([loss.detach().reshape(1), torch.sigmoid(logits.detach())]) if ctr else loss.detach().reshape(1)
        out, out_copied = to_host_async(out.float())
        times.pull += lookup.pull_s
        times.ps_wait += lookup.wait_s
        times.ps_rows += lookup.pulled_rows
        if last_micro:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.table_optimizer is not None:       # replicated tables: every row, every step
                self.table_optimizer.step()
                self.table_optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if copying:
            self.strategy.after_backward(pushes.send(), self.step)
        times.push += push_s + time.perf_counter() - t0
        if out_copied is not None:
            out_copied.synchronize()
        if ctr:
            times.auc.update(batch.labels, out[1:])
        return float(out[0])

    # -- the loop -------------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        if self.scoring_only:
            raise RuntimeError("this Trainer was built with scoring_only=True (eval / predict): it has no optimizer")
        self.model.train()
        total = self._last_step or self.start_step + self.cfg.train.epochs * self.loader.num_batches
        bar, redirect = None, contextlib.nullcontext()
        if self.rank == 0 and sys.stderr.isatty():      # a tqdm bar on stderr when it is a terminal
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            bar = tqdm(total=total, initial=self.step, unit="step", dynamic_ncols=True, leave=False)
            redirect = logging_redirect_tqdm()      # log lines print above the bar, not over it
        t = time.perf_counter()
        run = _Run(window=StepTimes(), t_start=t, t_log=t, position=self.loader.state_dict(), bar=bar, total=total,
                   first=self.step)
        # the steps until the data or train.max_steps ends; async mode sends the pulls of steps t + 1 .. t + K
        # (K = train.pull_ahead_batches, not past max_steps) before step t trains, sync mode none ahead
        steps = self._batches(run)
        if self._last_step:
            steps = itertools.islice(steps, max(0, self._last_step - self.step))
        steps = _ahead(steps, self.cfg.train.pull_ahead_batches if self.strategy.prefetch else 0)
        agreement = stopping.StopAgreement(self.world_size)
        with redirect:
            for batch, lookup, position, end_of_epoch in steps:
                try:
                    loss = self.train_step(batch, lookup, run.window, end_of_epoch=end_of_epoch)
                except NonFiniteLossError as e:
                    rows = self.loader.describe_rows(run.position, position)
                    raise NonFiniteLossError(f"{e} on the batch of {rows} (check those rows' values, or lower "
                                             f"train.dense_lr / the tables' lr)") from None
                self.step += 1
                self._after_step(run, batch, position, end_of_epoch, loss)
                if run.stop:
                    break
                if agreement.after_step():     # SIGTERM / SIGINT: every rank stops here (one step later)
                    self.stopped = True
                    break
        agreement.close()              # the reduction still in flight (on an error: the process ends)
        return self._finish_run(run)

    def _batches(self, run: _Run) -> Iterator[tuple[Batch, SparseLookup, dict, bool]]:
        """The training steps over all epochs (from a restored position on), numbered on from `self.step`:
        (batch, its rows' pulls sent, the reader position after it: what a checkpoint saves, whether it is
        the epoch's last). The seconds spent reading it go to the log window."""
        step = self.step
        for epoch in range(self._start_epoch, self.cfg.train.epochs):
            self.loader.set_epoch(epoch)        # a restored position of this epoch is kept
            # ranks' shares differ by up to one row: every rank takes the smallest batch count, or
            # DDP's allreduce and the PS barrier would wait for a rank that has already finished
            steps = int(all_reduce(torch.tensor([self.loader.remaining_batches]), dist.ReduceOp.MIN).item())
            it = iter(self.loader)
            for i in range(steps):
                t0 = time.perf_counter()
                batch = next(it, None)
                if batch is None:    # rows skipped as bad (data.on_bad_rows = "skip")
                    break
                run.window.data += time.perf_counter() - t0
                position = self.loader.state_dict()
                yield batch, self.sparse.lookup(batch, self.store, step, counts=self._cached), position, i == steps - 1
                step += 1

    def _after_step(self, run: _Run, batch: Batch, position: dict, end_of_epoch: bool, loss: float) -> None:
        """Bookkeeping after step `self.step`: progress, trace, log window (+ TTL sweep), checkpoint."""
        w = run.window
        run.position = position
        if self.cfg.train.trace_column:
            run.trace.append(np.asarray(batch.extras[self.cfg.train.trace_column]))
        w.steps += 1
        w.samples += batch.batch_size
        w.loss_sum += loss
        run.samples += batch.batch_size
        if run.bar is not None:
            run.bar.update(1)
            run.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if self.step % self.cfg.train.log_every == 0:
            self._end_window(run)
        if self.validation.due(self.step, end_of_epoch):
            self._validate(run)
        if self.checkpointer.due(self.step):
            self.checkpoint(run.position)

    def _end_window(self, run: _Run) -> None:
        """Log the window's metrics (averaged over ranks) and start a new one; rank 0 sweeps TTLs."""
        if self._sweeps and self.rank == 0:   # TTL eviction on the shards
            self.store.sweep(self.step)
        run.window.total = time.perf_counter() - run.t_log
        values = run.window.as_metrics()
        done = self.step - run.first            # progress: epoch e/E, step s/S and the ETA on the log line
        eta = (time.perf_counter() - run.t_start) / done * max(0, run.total - self.step) if done > 0 else math.nan
        values.update({"progress/epoch": float(run.position.get("epoch", 0)) + 1,
                       "progress/epochs": float(self.cfg.train.epochs), "progress/total_steps": float(run.total),
                       "progress/eta_s": eta})
        if self._in_batch:                  # no per-row click probability: no train AUC
            values.pop("auc/train")
        if isinstance(self.store, CachingStore):
            values.update(cache_metrics(self.store.cache_counts()))
        self._log(values)
        run.window, run.t_log = StepTimes(), time.perf_counter()

    def _validate(self, run: _Run) -> None:
        """One pass over data.eval_paths (every rank its part; metrics over all ranks): log `val/*`,
        keep a new best model in run_dir/best, decide on early stopping (the same on every rank)."""
        self.strategy.drain()
        # async: every rank's pushes applied before any rank pulls rows to score, so the pass
        # scores the very rows the best model's snapshot then saves (it waits the same way)
        barrier()
        t0 = time.perf_counter()
        metrics = self.evaluate(self.cfg.data.eval_paths)
        v = self.validation
        improved = v.record(metrics, self.step)
        values = {f"val/{k}": float(x) for k, x in metrics.items()}
        values[f"val/best_{v.metric}"] = v.state.best_value
        values["val/seconds"] = time.perf_counter() - t0
        if self.rank == 0 and self.metric_logger is not None:
            self.metric_logger.log(values, self.step)
        if improved and v.keep_best:
            self.checkpointer.save(self.parts, self.step, run.position, validation=v.state_dict(),
                                   target=best_dir(self.cfg.train.run_dir))
        if v.should_stop:
            run.stop = True
            if self.rank == 0:
                logger.info("early stop at step %d: no better val %s in %d passes (best %.6f at step %d)",
                            self.step, v.metric, v.patience, v.state.best_value, v.state.best_step)

    def _finish_run(self, run: _Run) -> dict[str, float]:
        self.strategy.drain()
        if (self.checkpointer.enabled or self.stopped) and self.checkpointer.last_step != self.step:
            self.checkpoint(run.position)       # the end of this run: a later one can continue it
        self.checkpointer.join()
        if run.bar is not None:
            run.bar.close()
        if run.trace:
            trace_dir = local_run_dir(self.cfg.train.run_dir, self.cfg.train.scratch_dir) / "trace"
            trace_dir.mkdir(parents=True, exist_ok=True)
            np.save(trace_dir / f"rank{self.rank}-steps{self.start_step}-{self.step}.npy", np.concatenate(run.trace),
                    allow_pickle=False)
        out = {"steps": float(self.step), "train_s": time.perf_counter() - run.t_start, "samples": float(run.samples)}
        max_steps = self._last_step
        if max_steps and self.step < max_steps and not (run.stop or self.stopped):
            # the data (train.epochs passes over data.train_paths) ran out first: say so once
            out["stopped_end_of_data"] = 1.0
            if self.rank == 0:
                logger.warning("train.max_steps = %d, but the data ended after %d steps (train.epochs = %d "
                               "over data.train_paths): stopped there", max_steps, self.step, self.cfg.train.epochs)
        state = self.validation.state
        if state.passes:
            out.update({"val_passes": float(state.passes), "best_step": float(state.best_step),
                        f"best_val_{self.validation.metric}": state.best_value, "early_stopped": float(run.stop)})
        if self.checkpointer.pauses:
            out["checkpoint_pause_s"] = float(np.median(self.checkpointer.pauses))
        return out

    def checkpoint(self, position: dict) -> None:
        """A checkpoint after `self.step` steps; `position`: the reader state after the last trained batch."""
        self.strategy.drain()
        self.checkpointer.save(self.parts, self.step, position, validation=self.validation.state_dict())

    @property
    def scoring_store(self) -> RowSource:
        """Where evaluation and prediction pull rows: the shards' current rows, never the row cache's
        (whose rows may be ps.max_staleness steps old), so that a validation pass scores the rows a
        checkpoint of this step saves. (The caller drains pushes first.) Replicated tables are read from
        the trainer's own copy (`ReplicatedStore`: two-tower's item corpus pulls by table)."""
        store = self.store.inner if isinstance(self.store, CachingStore) else self.store
        if self.replicated is None:
            return store
        return ReplicatedStore(store, self.replicated, [t.name for t in self.cfg.ps.tables])

    def evaluate(self, paths: tuple[str, ...]) -> dict[str, float]:
        """`eval_metrics` of the model on `paths` over every rank's part (collective): auc, logloss,
        ne, calibration, eval_examples, and oracle_auc when the data has a `p_true` column. ValueError
        when this rank's part of `paths` has no rows."""
        if self._in_batch:                              # a retrieval model: recall@K / ndcg@K over data.item_paths
            return retrieval_metrics_of(self.cfg, self.sparse, self.scoring_store, self.model, paths)
        labels, scores, weights, extras = self.score(paths)
        if labels.numel() == 0:                         # before any collective, as eval_metrics would refuse it
            part = f" for rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""
            raise ValueError(f"no rows in {list(paths)}{part}")
        p_true = torch.from_numpy(extras["p_true"]).double() if "p_true" in extras else None
        return eval_metrics(labels, scores, p_true, exact_auc=self.cfg.train.eval_auc == "exact", weights=weights)

    def predict(self, paths: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, dict[str, np.ndarray]]:
        """Labels [N], scores [N] and passthrough columns [N] of this rank's part of `paths` (see `score`)."""
        labels, scores, _, extras = self.score(paths)
        return labels, scores, extras

    def score(self, paths: tuple[str, ...]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, np.ndarray]]:
        """Labels [N], scores [N], example weights [N] (None without data.example_weight_column, or when
        the files of `paths` lack it) and passthrough columns [N] of this rank's part of `paths`. Scores
        are click probabilities: sigmoid(logits), calibrated for data.negative_sampling_rate (recsys.calibration).

        Rows come in file order (no shuffle); the next batch's pulls fly while the current one computes.
        """
        labels, scores, weights = [], [], []
        extras: dict[str, list[np.ndarray]] = {}
        rate = data_score_rate(self.cfg.data)                  # 1.0: plain sigmoid
        self.model.eval()
        data_cfg = dataclasses.replace(self.cfg.data, shuffle=False, drop_last=False)   # score every row
        data_cfg = scoring_config(data_cfg, paths)       # files without the example weight column: unweighted
        with torch.no_grad(), ParquetLoader(data_cfg, paths, rank=self.rank,
                                            world_size=self.world_size) as loader:
            store = self.scoring_store
            pulled = ((batch, self.sparse.lookup(batch, store)) for batch in loader)   # pulls sent as it is read
            for batch, lookup in _ahead(pulled, 1):
                scores.append(probabilities(self.forward(batch, lookup, train=False), rate))
                labels.append(batch.labels)
                if batch.example_weights is not None:
                    weights.append(batch.example_weights)
                for name, col in batch.extras.items():
                    extras.setdefault(name, []).append(np.asarray(col))
        self.model.train()
        def cat(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(xs) if xs else torch.zeros(0)

        return (cat(labels), cat(scores), cat(weights) if data_cfg.example_weight_column else None,
                {k: np.concatenate(v) for k, v in extras.items()})

    def _log(self, values: dict[str, float]) -> None:
        if self.world_size > 1 and is_distributed():
            t = all_reduce(torch.tensor(list(values.values()), dtype=torch.float64))
            values = dict(zip(values, (t / self.world_size).tolist()))
            values["perf/samples_per_s"] *= self.world_size
        if self.rank == 0 and self.metric_logger is not None:
            self.metric_logger.log(values, self.step)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()

