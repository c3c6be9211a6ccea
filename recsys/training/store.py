"""Embedding stores for the sparse arch: the PS client (training) or in-process shards (offline).

Both route ids with `embedding_ps.sharding.route`, so a run's saved shards serve offline exactly
as they served in training.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

from embedding_ps.config import PSConfig
from embedding_ps.server import shard_dir
from embedding_ps.shard import ShardState
from embedding_ps.sharding import route
from recsys.config import JobConfig


def _done(value: object) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class LocalStore:
    """`ps.num_shards` ShardStates in this process; the same routing as the network client."""

    def __init__(self, config: PSConfig, states: list[ShardState]) -> None:
        self.config = config
        self.states = states
        self.step = 0

    @classmethod
    def create(cls, config: PSConfig) -> "LocalStore":
        return cls(config, [ShardState(config, i) for i in range(config.num_shards)])

    @classmethod
    def from_dir(cls, config: PSConfig, root: str | Path) -> "LocalStore":
        store = cls.create(config)
        for i, state in enumerate(store.states):
            state.load(shard_dir(str(root), i))
        return store

    def _buckets(self, table: int, ids: torch.Tensor) -> list[torch.Tensor]:
        owner = route(ids, self.config.tables[table], self.config.num_shards)   # [N]
        return [torch.nonzero(owner == s).flatten() for s in range(self.config.num_shards)]

    def pull(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        if len(self.states) == 1:
            return self.states[0].pull(table, ids, self.step)
        out = torch.empty(ids.numel(), self.config.tables[table].dim)
        for s, pos in enumerate(self._buckets(table, ids)):
            if pos.numel():
                out[pos] = self.states[s].pull(table, ids[pos], self.step)
        return out

    def push(self, table: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        if len(self.states) == 1:
            return self.states[0].push(table, ids, grads, self.step)
        for s, pos in enumerate(self._buckets(table, ids)):
            if pos.numel():
                self.states[s].push(table, ids[pos], grads[pos], self.step)

    def pull_async(self, table: int, ids: torch.Tensor, step: int | None = None) -> Future:
        return _done(self.pull(table, ids))

    def push_async(self, table: int, ids: torch.Tensor, grads: torch.Tensor) -> Future:
        self.push(table, ids, grads)
        return _done(None)

    def pull_many_async(self, tables: list[int], ids: list[torch.Tensor], step: int | None = None) -> Future:
        """Rows [sum N_t, D] of every table's ids, table after table (tables of one dim)."""
        return _done(torch.cat([self.pull(t, x) for t, x in zip(tables, ids)]))

    def push_many_async(self, tables: list[int], ids: list[torch.Tensor], grads: torch.Tensor) -> Future:
        for t, x, g in zip(tables, ids, torch.split(grads, [x.numel() for x in ids])):
            self.push(t, x, g)
        return _done(None)

    def barrier(self, step: int) -> None:
        self.step = step + 1

    def barrier_async(self, step: int) -> Future:
        self.barrier(step)
        return _done(None)

    def stats(self) -> list[dict]:
        return [state.stats() for state in self.states]

    def sweep(self, step: int) -> list[dict]:
        return [state.sweep(step) for state in self.states]

    def save(self, root: str, step: int | None = None, background: bool = False) -> list[dict]:
        """Every shard's state under `root` (written at once: `background` only matters over the network)."""
        for i, state in enumerate(self.states):
            state.save(shard_dir(str(root), i))
        return [{"shard": i, "directory": shard_dir(str(root), i)} for i in range(len(self.states))]

    def prepare_save(self) -> Future:
        return _done([])

    def wait_saved(self, root: str, timeout_s: float) -> list[dict]:
        return [{"shard": i, "directory": shard_dir(str(root), i), "state": "done"} for i in range(len(self.states))]

    def close(self) -> None:
        pass


def connect_store(cfg: JobConfig, addresses: list[str], worker_id: int):
    """The network client to the run's shards, speaking the EmbeddingStore protocol."""
    from embedding_ps.client import PSClient

    return PSClient(cfg.ps, addresses, worker_id=worker_id, dedup=False)  # the sparse arch sends unique ids
