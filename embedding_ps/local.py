"""`LocalStore`: every shard's state in this process, behind the `EmbeddingStore` contract.

    store = LocalStore.create(config)                       # or LocalStore.from_dir(config, "ckpt/model/ps")
    rows = store.pull_many_async([0, 1], [ids0, ids1]).result()    # float32 [N0 + N1, D]
    store.push_many_async([0, 1], [ids0, ids1], grads)             # applied at once
    store.barrier(step)

For offline evaluation, tests and benchmarks: no sockets, no threads. Ids go to the shard states
exactly as `PSClient` sends them over the network (`embedding_ps.wire.sharding.route`), so a run's saved
shards load here unchanged, and `num_shards` states give the same rows as one state would.

One worker, so the two modes coincide: a push is applied when it is made (sync mode would apply it
at the step's barrier, before the next pull, which is the same for a single worker as long as a
step pulls before it pushes). Within one push call the grads of duplicate ids are summed before
the optimizer runs, across the parts of one table too (as a sync shard sums a step's pushes); the
futures returned are already done.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from embedding_ps.wire.config import PSConfig
from embedding_ps.shard.state import ShardState
from embedding_ps.wire.sharding import route
from embedding_ps.shard.snapshot import shard_dir
from embedding_ps.store import EmbeddingStore, call_dim, cat, done_future


class LocalStore(EmbeddingStore):
    """`config.num_shards` ShardStates (state `i` is shard `i`), used through the EmbeddingStore Protocol."""

    def __init__(self, config: PSConfig, states: list[ShardState]) -> None:
        if [s.shard_index for s in states] != list(range(config.num_shards)):
            raise ValueError(f"LocalStore needs the states of shards 0..{config.num_shards - 1} in order, got "
                             f"{[s.shard_index for s in states]}")
        self.config = config
        self.states = states
        self.step = 0
        self._last_save: str | None = None

    @classmethod
    def create(cls, config: PSConfig) -> LocalStore:
        """Fresh shards (every row at its init value)."""
        return cls(config, [ShardState(config, i) for i in range(config.num_shards)])

    @classmethod
    def from_dir(cls, config: PSConfig, root: str | os.PathLike) -> LocalStore:
        """The shards saved under `root` (`save(root)`, or a checkpoint's `model/ps`), same shard count."""
        store = cls.create(config)
        store.load(os.fspath(root))
        return store

    # -- rows -------------------------------------------------------------------------------------

    def pull_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor],
                        step: int | None = None) -> Future[torch.Tensor]:
        """A done Future of float32 rows [sum N_t, D] of every table's int64 ids [N_t], in order."""
        dim = call_dim(self.config, tables, ids)
        step = self.step if step is None else step
        out = torch.empty(sum(x.numel() for x in ids), dim)                  # [sum N_t, D]
        for t, x, part in zip(tables, ids, out.split([x.numel() for x in ids])):
            if len(self.states) == 1:
                self.states[0].pull(t, x, step, out=part)
            else:
                for state, pos in self._owners(t, x):
                    part[pos] = state.pull(t, x[pos], step)
        return done_future(out)

    def push_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor], grads: torch.Tensor,
                        step: int | None = None) -> Future[None]:
        """Apply float32 grads [sum N_t, D] (rows in pull_many_async's order) now; a done Future.

        The parts of one table are joined first, so duplicate ids get one update with the sum.
        """
        call_dim(self.config, tables, ids, grads)
        step = self.step if step is None else step
        by_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for t, x, g in zip(tables, ids, torch.split(grads.detach(), [x.numel() for x in ids])):
            by_table.setdefault(t, []).append((x, g))
        for t, parts in by_table.items():
            x, g = map(cat, zip(*parts))                      # ids [N], grads [N, D]
            if len(self.states) == 1:
                self.states[0].push(t, x, g, step)
            else:
                for state, pos in self._owners(t, x):
                    state.push(t, x[pos], g[pos], step)
        return done_future(None)

    # -- steps ------------------------------------------------------------------------------------

    def barrier(self, step: int) -> None:
        """Pushes are applied when made: only sets `step` to `step + 1`."""
        self.step = step + 1

    def barrier_async(self, step: int) -> Future[None]:
        return done_future(self.barrier(step))

    def sweep(self, step: int) -> list[dict]:
        """`ShardState.sweep(step)` of every shard, in shard order."""
        return [state.sweep(step) for state in self.states]

    # -- state ------------------------------------------------------------------------------------

    def save(self, directory: str, step: int | None = None, background: bool = False) -> list[dict]:
        """Every shard's state under `directory`/shard<i>, written before this returns (`background`
        only matters over the network; `step`, default `self.step`: the save's step, through which a
        table with global weight decay writes its rows decayed, `ShardState.save`).
        [{"shard", "directory", "background": False, "write_s", "bytes"}, ...] as PSClient.save."""
        step = self.step if step is None else step
        infos = [state.save(shard_dir(directory, i), step=step) for i, state in enumerate(self.states)]
        self._last_save = directory
        return [{"shard": i, "directory": info["directory"], "background": False, "write_s": info["write_s"],
                 "bytes": info["bytes"]} for i, info in enumerate(infos)]

    def wait_saved(self, directory: str, timeout_s: float) -> list[dict]:
        """The statuses of the last save, which `save` finished before returning; RuntimeError if it
        was not to `directory`."""
        if self._last_save != directory:
            raise RuntimeError(f"LocalStore: the last save is {self._last_save!r}, not {directory!r}")
        return [{"shard": i, "directory": shard_dir(directory, i), "state": "done"} for i in range(len(self.states))]

    def load(self, directory: str) -> list[dict]:
        """Every shard loads `directory`/shard<i> (saved with the same shard count and tables)."""
        for i, state in enumerate(self.states):
            state.load(shard_dir(directory, i))
        return [{"shard": i, "directory": shard_dir(directory, i)} for i in range(len(self.states))]

    def stats(self) -> list[dict]:
        """Per shard: {"shard", "num_shards", "mode", "state": ShardState.stats()} (PSClient's keys)."""
        return [{"shard": i, "num_shards": self.config.num_shards, "mode": self.config.mode, "state": state.stats()}
                for i, state in enumerate(self.states)]

    def close(self) -> None:
        """Nothing to release (no sockets, no threads)."""

    # -- helpers ----------------------------------------------------------------------------------

    def _owners(self, table: int, ids: torch.Tensor) -> list[tuple[ShardState, torch.Tensor]]:
        """(state, positions int64 [N_s]) of every shard that owns some of `ids` [N]."""
        owner = route(ids, self.config.tables[table], self.config.num_shards)      # [N]
        return [(state, pos) for s, state in enumerate(self.states)
                if (pos := torch.nonzero(owner == s).flatten()).numel()]


__all__ = ["LocalStore"]
