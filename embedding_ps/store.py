"""The one contract between a trainer (or predictor) and wherever the embedding rows live.

    rows = store.pull_many_async([0, 1], [ids0, ids1], step).result()   # float32 [N0 + N1, D]
    store.push_many_async([0, 1], [ids0, ids1], grads, step)            # grads float32 [N0 + N1, D]
    store.barrier(step)                                                  # sync: the step is applied

Two Protocols, and nothing else is used at these seams (no `getattr` probing, no private
members): `EmbeddingStore`, implemented by `embedding_ps.client.client.PSClient` (the shards over the
network), `embedding_ps.local.LocalStore` (the shards' states in this process: offline eval, tests)
and `embedding_ps.client.cache.CachingStore` (a row cache in front of either), and its read-only half
`RowSource`. Test doubles implement them too. A store that subclasses one explicitly (`LocalStore`,
`CachingStore`) inherits `pull` / `push` as one-part calls of the `*_many_async` ones, blocking.

Rows are addressed by table index (into `ps.tables`) and int64 ids; the tables of one multi-table
call share the embedding dim D; rows and gradients are in the caller's order, table after table.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

import torch

from embedding_ps.wire.config import PSConfig


@runtime_checkable
class RowSource(Protocol):
    """The read-only half: pulls, steps, stats, close. What scoring needs (the sparse arch's
    lookups); an export's rows (`recsys.serving.export_store.ExportStore`) are only this."""

    step: int
    """The training step requests carry when none is given; `barrier(t)` sets it to t + 1."""

    def pull_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor],
                        step: int | None = None) -> "Future[torch.Tensor]":
        """A Future of float32 rows [sum N_t, D] of every table's int64 ids [N_t], in order."""
        ...

    def pull(self, table: int, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        """float32 rows [N, D] of one table's int64 ids [N] (a one-part pull, blocking)."""
        return self.pull_many_async([table], [ids], step).result()

    def barrier(self, step: int) -> None:
        """Wait for this worker's pushes, then tell the store it is done with `step` (sync mode: the
        step is applied once every worker is done with it). Sets `step` to `step + 1`."""
        ...

    def barrier_async(self, step: int) -> "Future":
        """`barrier` without waiting (async mode: a progress report for ps.max_staleness)."""
        ...

    def stats(self) -> list[dict]:
        """Per shard: row counts, memory, request counters (whatever the store knows)."""
        ...

    def close(self) -> None:
        """Release sockets / threads. Idempotent."""
        ...


@runtime_checkable
class EmbeddingStore(RowSource, Protocol):
    """`RowSource` plus what training needs: pushes, TTL sweeps, save and load."""

    def push_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor], grads: torch.Tensor,
                        step: int | None = None) -> "Future[None]":
        """Send float32 grads [sum N_t, D] (rows in pull_many_async's order); the store applies each
        table's optimizer (sync mode: at the step's barrier). Duplicate ids get the sum."""
        ...

    def push(self, table: int, ids: torch.Tensor, grads: torch.Tensor, step: int | None = None) -> None:
        """Send one table's grads [N, D] of ids [N] and wait for the acknowledgement."""
        self.push_many_async([table], [ids], grads, step).result()

    def sweep(self, step: int) -> list[dict]:
        """Every shard drops rows unseen for their table's ttl_steps as of `step`; per-shard counts."""
        ...

    def save(self, directory: str, step: int | None = None, background: bool = False) -> list[dict]:
        """Every shard saves its part under `directory` (one `embedding_ps.shard.snapshot` directory each)."""
        ...

    def wait_saved(self, directory: str, timeout_s: float) -> list[dict]:
        """Block until every shard's last save is `directory` and written; per-shard statuses."""
        ...

    def load(self, directory: str) -> list[dict]:
        """Every shard loads its part of a save under `directory`."""
        ...


def done_future(value: object) -> Future:
    """A Future already holding `value`: what a store whose work is done at once returns."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


class UnknownTableError(IndexError, ValueError):
    """A table number outside ps.tables: an IndexError (as `LocalStore` and `ShardState` raise) and a
    ValueError (a bad argument)."""


def call_dim(config: PSConfig, tables: Sequence[int], ids: Sequence[torch.Tensor],
             grads: torch.Tensor | None = None) -> int:
    """The dim D of a `*_many_async` call's tables. ValueError unless tables and ids pair up (>= 1),
    the tables share one dim, each part's ids are int64 [N_t] and a push's `grads` is float
    [sum N_t, D]; UnknownTableError for a table outside ps.tables."""
    if len(tables) != len(ids) or not tables:
        raise ValueError(f"{len(tables)} tables for {len(ids)} id tensors (need as many, >= 1)")
    for t in tables:
        if not 0 <= t < len(config.tables):
            raise UnknownTableError(f"table {t} out of range [0, {len(config.tables)}) (ps.tables)")
    dims = {config.tables[t].dim for t in tables}
    if len(dims) != 1:
        raise ValueError(f"tables {list(tables)} of one call must share one dim, got {sorted(dims)}")
    for t, x in zip(tables, ids):
        if x.dtype != torch.int64 or x.dim() != 1:
            raise ValueError(f"table {t}: ids must be int64 [N], got {x.dtype} {list(x.shape)}")
    dim = dims.pop()
    if grads is not None:
        total = sum(x.numel() for x in ids)
        if grads.dim() != 2 or grads.shape != (total, dim) or not grads.is_floating_point():
            raise ValueError(f"push to tables {list(tables)}: grads must be [{total}, {dim}] (float), got "
                             f"{grads.dtype} {list(grads.shape)}")
    return dim


def cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts back to back (a single part itself: no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def pull_each(store: RowSource, tables: Sequence[int], ids: Sequence[torch.Tensor],
              step: int | None = None) -> Future[torch.Tensor]:
    """`pull_many_async` of a store that answers at once (an export, replicated tables): a done Future of
    its one-table `pull`s, in order."""
    parts = [store.pull(t, x, step) for t, x in zip(tables, ids)]
    return done_future(cat(parts))


__all__ = ["EmbeddingStore", "RowSource", "UnknownTableError", "call_dim", "cat", "done_future", "pull_each"]
