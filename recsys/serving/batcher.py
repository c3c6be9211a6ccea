"""Micro-batching for `recsys serve`: the rows of concurrent requests scored in one `Predictor` call.

    served = Served("exports/base", workers=1)               # the model: K Predictors + its metadata
    batcher = MicroBatcher(served, max_batch=256, max_wait_ms=0.0, on_batch=metrics.batch)   # a loop per Predictor
    batcher.start()                                          # inside the event loop
    probs, by = await batcher.submit("predict", rows)        # float32 [len(rows)], the Served that scored them
    (ids, scores), by = await batcher.submit("topk", rows, k=10)
    batcher.served = Served(...)                             # reload: one reference, swapped

What a batch takes, `max_wait_ms`, `workers` and reload as the user sees them: docs/serving.md,
"`recsys serve`: the HTTP API" (Micro-batching, Reload). Here besides: a job that would overflow the
batch, or of the other kind (predict / topk), waits for the next batch; a batch runs in its loop's
own thread (`run_batch`: rows -> one Arrow table -> `Predictor.predict` / `topk`); the K loops pull
from one queue, each with its own `Predictor` (not thread-safe: scratch buffers); `Served` is built
whole (every Predictor opened and checked) before it replaces `batcher.served`, which a batch reads
once, when it starts.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa

from data.parquet import DataError
from recsys.serving.predictor import Predictor
from recsys.serving.rows import Columns, RequestError, field_of

logger = logging.getLogger(__name__)


class Served:
    """One loaded model: `workers` Predictors of one export (+ deltas), its columns and metadata."""

    def __init__(self, export: str | Path, deltas: list[str] | tuple = (), workers: int = 1,
                 generation: int = 0) -> None:
        first = Predictor(export, deltas=list(deltas))           # checks the files' sha256
        self.predictors = [first] + [Predictor(export, deltas=list(deltas), verify=False) for _ in range(workers - 1)]
        self.export, self.deltas, self.generation = str(export), [str(d) for d in deltas], generation
        self.columns = Columns.of(first.decoder.cfg)
        self.user_columns = None if first.user_decoder is None else Columns.of(first.user_decoder.cfg)
        m = first.manifest
        self.metadata = {
            "run_id": m.get("run_id", ""), "step": first.step, "precision": first.precision,
            "export": self.export, "deltas": self.deltas, "generation": generation, "arch": first.config.model.arch,
            "tables": [{"name": t.cfg.name, "dim": t.cfg.dim, "rows": int(t.ids.shape[0])} for t in first.tables],
            "columns": self.columns.describe(), "calibration": m.get("calibration"),
            "score_rate": first.score_rate, "topk": None if first.index is None else {
                "num_items": int(first.index.ids.size), "user_columns": self.user_columns.describe()},
        }

    @property
    def step(self) -> int:
        return self.predictors[0].step


@dataclasses.dataclass
class Job:
    kind: str                      # "predict" | "topk"
    rows: list[dict]
    k: int
    future: asyncio.Future


def _score(served: Served, worker: int, kind: str, rows: list[dict], k: int) -> object:
    """Probabilities [n] (calibrated) or (ids [n, k], scores [n, k]) of `rows`."""
    p = served.predictors[worker]
    return p.predict(rows) if kind == "predict" else p.topk(rows, k)


def _one(served: Served, worker: int, job: Job) -> object:
    """A job alone: its result, or the RequestError / exception its rows raise."""
    try:
        return _score(served, worker, job.kind, job.rows, job.k)
    except RequestError as e:
        return e
    except (DataError, pa.ArrowException) as e:
        return RequestError(f"rows: {e}", field_of(str(e)))
    except Exception as e:          # noqa: BLE001 - answered as a 500, the server goes on
        logger.exception("scoring a request failed")
        return e


def run_batch(served: Served, worker: int, jobs: list[Job]) -> list[object]:
    """Per job: probabilities [n] / (ids [n, k], scores [n, k]) of its rows, or an exception. All the
    jobs' rows in one Predictor call; if that raises (a bad value, columns of another id type in one
    request), each job alone, so that the error goes to the request that caused it."""
    if len(jobs) == 1:
        return [_one(served, worker, jobs[0])]
    kind, k = jobs[0].kind, max(j.k for j in jobs)
    try:
        out = _score(served, worker, kind, [r for j in jobs for r in j.rows], k)
    except (RequestError, DataError, pa.ArrowException):
        return [_one(served, worker, j) for j in jobs]
    results, start = [], 0
    for j in jobs:
        end = start + len(j.rows)
        results.append(out[start:end] if kind == "predict" else (out[0][start:end, :j.k], out[1][start:end, :j.k]))
        start = end
    return results


class MicroBatcher:
    """Jobs from the event loop -> batches of <= max_batch rows -> K worker threads (see the module docstring)."""

    def __init__(self, served: Served, max_batch: int, max_wait_ms: float, on_batch: Callable[[int, float], None]
                 ) -> None:
        self.served = served
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000.0
        self.workers = workers = len(served.predictors)      # a reload keeps the count (the server's --workers)
        self.on_batch = on_batch                   # (rows, seconds) of every batch run
        self._queue: asyncio.Queue[Job] = asyncio.Queue()
        self._held: collections.deque[Job] = collections.deque()      # taken, but for the next batch
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"recsys-serve-{i}") for i in range(workers)]
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.get_running_loop().create_task(self._loop(i)) for i in range(self.workers)]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ex in self._executors:
            ex.shutdown(wait=True)

    @property
    def queued(self) -> int:
        return self._queue.qsize() + len(self._held)

    async def submit(self, kind: str, rows: list[dict], k: int = 0) -> object:
        job = Job(kind, rows, k, asyncio.get_running_loop().create_future())
        self._queue.put_nowait(job)
        return await job.future

    async def _next(self, timeout: float | None) -> Job | None:
        if self._held:
            return self._held.popleft()
        if not self._queue.empty() or timeout is None:
            return await self._queue.get()
        if timeout <= 0:
            return None
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    async def _collect(self) -> list[Job]:
        first = await self._next(None)
        batch, rows = [first], len(first.rows)
        deadline = time.monotonic() + self.max_wait
        while rows < self.max_batch:
            job = await self._next(deadline - time.monotonic())
            if job is None:
                break
            if job.kind != first.kind or rows + len(job.rows) > self.max_batch:
                self._held.appendleft(job)
                break
            batch.append(job)
            rows += len(job.rows)
        return batch

    async def _loop(self, worker: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._collect()
            jobs = [j for j in jobs if not j.future.done()]          # a client that went away
            if not jobs:
                continue
            served = self.served                    # the model of this whole batch, read once
            t0 = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executors[worker], run_batch, served, worker, jobs)
            except Exception as e:                  # noqa: BLE001 - every job of the batch gets it
                results = [e] * len(jobs)
            self.on_batch(sum(len(j.rows) for j in jobs), time.perf_counter() - t0)
            for job, r in zip(jobs, results):
                if job.future.done():
                    continue
                if isinstance(r, BaseException):
                    job.future.set_exception(r)
                else:
                    job.future.set_result((r, served))


__all__ = ["Job", "MicroBatcher", "Served", "run_batch"]
