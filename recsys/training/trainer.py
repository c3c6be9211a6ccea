"""Trainer: one process per rank. Sparse rows come from the PS, the dense model trains under DDP.

A step, in both modes::

    ids --unique--> pull rows [U, D] --embedding_bag--> pooled [B, F, D] --model--> logits [B]
    loss.backward()  -> dense grads allreduced by DDP, row grads [U, D] pushed to the PS

`sync`: push(t), then barrier(t); the PS applies the step's summed row gradients once, and the
next pull waits for that. Row gradients are scaled by 1/W so that, with DDP averaging the dense
gradients, W trainers compute exactly what one process computes on the concatenated batch.
`async`: the next batch's rows are pulled while the current batch computes, and each push is
applied by the PS on arrival.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from data.batch import Batch
from data.loader import ParquetLoader
from recsys.config import JobConfig
from recsys.metrics import MetricSink, StreamingAUC
from embedding_ps.store import EmbeddingStore
from recsys.models import SparseLookup, build_job_model
from recsys.training.checkpoint import Checkpointer, restore_trainer
from recsys.training.dense import build_optimizer, build_scheduler, wrap_ddp

logger = logging.getLogger(__name__)


@dataclass
class StepTimes:
    """Seconds spent per phase since the last log line."""

    data: float = 0.0
    pull: float = 0.0
    push: float = 0.0
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
        }


class Trainer:
    """Build / train_step / train / predict / close for one rank."""

    def __init__(self, cfg: JobConfig, store: EmbeddingStore, *, rank: int = 0, world_size: int = 1,
                 metric_logger: MetricSink | None = None) -> None:
        self.cfg, self.store, self.rank, self.world_size = cfg, store, rank, world_size
        self.device = torch.device(cfg.train.device)
        self.sparse, model = build_job_model(cfg)
        self.model = model.to(self.device)
        self.ddp = wrap_ddp(self.model, cfg.train, self.device)
        self.optimizer = build_optimizer(list(self.model.parameters()), cfg.train)
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.metric_logger = metric_logger
        self.step = 0
        self._in_flight: list = []         # async: the last step's push and barrier futures
        self._sweeps = any(t.ttl_steps > 0 for t in cfg.ps.tables)
        self._loader: ParquetLoader | None = None
        self.scheduler = build_scheduler(self.optimizer, cfg.train, cfg.train.max_steps)
        self.checkpointer = Checkpointer(cfg, rank=rank, world_size=world_size)
        self.start_step = 0
        self._start_epoch = 0

    def restore(self, checkpoint: str) -> dict:
        """Continue from a checkpoint (see recsys.training.checkpoint); the shards load their part
        separately. Async mode: tells the shards this worker's progress, for the staleness bound."""
        manifest = restore_trainer(self, checkpoint)
        self.start_step = self.checkpointer.last_step = self.step    # no second checkpoint of this step
        self.store.step = self.step        # the step its pushes carry (a barrier advances it from here)
        self._start_epoch = int(self.loader.state_dict()["epoch"])
        if self.cfg.ps.mode == "async" and self.step > 0:
            self.store.barrier(self.step - 1)
        return manifest

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
        model = self.ddp if train else self.model
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.train.autocast):
            logits = model(batch.dense.to(self.device), pooled.to(self.device),
                           None if linear is None else linear.to(self.device))
        return logits.float()

    def train_step(self, batch: Batch, lookup: SparseLookup, times: StepTimes) -> float:
        """Forward, backward, push row grads, dense optimizer step. Returns the batch loss."""
        acc = self.cfg.train.grad_accum_steps
        last_micro = (self.step + 1) % acc == 0
        sync_ctx = self.ddp.no_sync() if (not last_micro and hasattr(self.ddp, "no_sync")) else _null()
        with sync_ctx:
            logits = self.forward(batch, lookup)
            loss = self.loss_fn(logits, batch.labels.to(self.device))
            (loss / acc).backward()
        times.auc.update(batch.labels, torch.sigmoid(logits.detach()).cpu())
        t0 = time.perf_counter()
        futures = lookup.push(scale=1.0 / (self.world_size * acc))
        if self.cfg.ps.mode == "sync":
            for fut in futures:
                fut.result()
            self.store.barrier(self.step)        # the shards apply the step once all workers are here
        else:
            # async: the previous step's pushes must be acknowledged (errors surface, at most one
            # step of gradients in flight); this step's fly while the next batch computes. The
            # barrier reports progress so the shards can hold a trainer to ps.max_staleness.
            for fut in self._in_flight:
                fut.result()
            self._in_flight = [*futures, self.store.barrier_async(self.step)]
        times.push += time.perf_counter() - t0
        times.pull += lookup.pull_s
        if last_micro:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    # -- loops ----------------------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[Batch, float, dict]]:
        """Training batches over all epochs (from a restored position on), with the seconds spent
        waiting for each and the reader position after it."""
        for epoch in range(self._start_epoch, self.cfg.train.epochs):
            self.loader.set_epoch(epoch)        # a restored position of this epoch is kept
            # ranks' shares differ by up to one row: every rank takes the smallest batch count, or
            # DDP's allreduce and the PS barrier would wait for a rank that has already finished
            steps = self._min_over_ranks(self.loader.remaining_batches)
            it = iter(self.loader)
            for _ in range(steps):
                t0 = time.perf_counter()
                batch = next(it, None)
                if batch is None:    # rows skipped as bad (data.on_bad_rows = "skip")
                    break
                yield batch, time.perf_counter() - t0, self.loader.state_dict()

    def train(self) -> dict[str, float]:
        cfg = self.cfg
        times = StepTimes()
        t_start = t_log = time.perf_counter()
        prefetch = cfg.ps.mode == "async"
        pending: tuple[Batch, SparseLookup, dict] | None = None
        batches = self._batches()
        samples = 0
        trace: list[np.ndarray] = []
        self.model.train()
        total = cfg.train.max_steps or cfg.train.epochs * self.loader.num_batches
        bar = progress_bar(total, enabled=self.rank == 0)
        if bar is not None:
            bar.update(self.step)
        position = self.loader.state_dict()
        while not cfg.train.max_steps or self.step < cfg.train.max_steps:
            if pending is None:
                nxt = next(batches, None)
                if nxt is None:
                    break
                times.data += nxt[1]
                pending = (nxt[0], self.sparse.lookup(nxt[0], self.store, self.step), nxt[2])
            batch, lookup, position = pending
            pending = None
            if prefetch:   # async: the next batch's pulls fly while this one computes
                nxt = next(batches, None)
                if nxt is not None:
                    times.data += nxt[1]
                    pending = (nxt[0], self.sparse.lookup(nxt[0], self.store, self.step + 1), nxt[2])
            if cfg.train.trace_column:
                trace.append(np.asarray(batch.extras[cfg.train.trace_column]))
            loss = self.train_step(batch, lookup, times)
            self.step += 1
            times.steps += 1
            times.samples += batch.batch_size
            samples += batch.batch_size
            times.loss_sum += loss
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if self.step % cfg.train.log_every == 0:
                if self._sweeps and self.rank == 0:   # TTL eviction on the shards
                    self.store.sweep(self.step)
                times.total = time.perf_counter() - t_log
                self._log(times.as_metrics())
                times, t_log = StepTimes(), time.perf_counter()
            if self.checkpointer.due(self.step):
                self.checkpoint(position)
            else:
                self.checkpointer.maybe_prepare(self)
        self.drain()
        if self.checkpointer.enabled and self.checkpointer.last_step != self.step:
            self.checkpoint(position)           # the end of this run: a later one can continue it
        self.checkpointer.join()
        if bar is not None:
            bar.close()
        if trace:
            self._write_trace(np.concatenate(trace))
        elapsed = time.perf_counter() - t_start
        out = {"steps": float(self.step), "train_s": elapsed, "samples": float(samples)}
        if self.checkpointer.pauses:
            out["checkpoint_pause_s"] = float(np.median(self.checkpointer.pauses))
        return out

    def drain(self) -> None:
        """Wait until every push this rank sent is acknowledged (async mode keeps one step in flight)."""
        for fut in self._in_flight:
            fut.result()
        self._in_flight = []

    def checkpoint(self, position: dict) -> None:
        """A checkpoint after `self.step` steps; `position`: the reader state after the last trained batch."""
        self.drain()
        self.checkpointer.save(self, position)

    def _write_trace(self, values: np.ndarray) -> None:
        out = Path(self.cfg.train.run_dir) / "trace"
        out.mkdir(parents=True, exist_ok=True)
        np.save(out / f"rank{self.rank}-steps{self.start_step}-{self.step}.npy", values, allow_pickle=False)

    def predict(self, paths: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, dict[str, np.ndarray]]:
        """Labels [N], scores [N] (sigmoid of logits) and passthrough columns [N] of this rank's part of `paths`.

        Rows come in file order (no shuffle); the next batch's pulls fly while the current one computes.
        """
        labels, scores = [], []
        extras: dict[str, list[np.ndarray]] = {}
        self.model.eval()
        data_cfg = dataclasses.replace(self.cfg.data, shuffle=False)
        with torch.no_grad(), ParquetLoader(data_cfg, paths, rank=self.rank,
                                            world_size=self.world_size) as loader:
            it = iter(loader)
            batch = next(it, None)
            lookup = self.sparse.lookup(batch, self.store) if batch is not None else None
            while batch is not None:
                nxt = next(it, None)
                nxt_lookup = self.sparse.lookup(nxt, self.store) if nxt is not None else None
                scores.append(torch.sigmoid(self.forward(batch, lookup, train=False)))
                labels.append(batch.labels)
                for name, col in batch.extras.items():
                    extras.setdefault(name, []).append(np.asarray(col))
                batch, lookup = nxt, nxt_lookup
        self.model.train()
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)
        return cat(labels), cat(scores), {k: np.concatenate(v) for k, v in extras.items()}

    def _min_over_ranks(self, n: int) -> int:
        if not dist.is_initialized() or self.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def _log(self, values: dict[str, float]) -> None:
        if dist.is_initialized() and self.world_size > 1:
            t = torch.tensor(list(values.values()), dtype=torch.float64)
            dist.all_reduce(t)
            values = dict(zip(values, (t / self.world_size).tolist()))
            values["perf/samples_per_s"] *= self.world_size
        if self.rank == 0 and self.metric_logger is not None:
            self.metric_logger.log(values, self.step)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()


def progress_bar(total: int, enabled: bool):
    """A tqdm bar on stderr when it is a terminal (rank 0 only), else None."""
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="step", dynamic_ncols=True, leave=False)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
