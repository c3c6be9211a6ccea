"""The export's rows as an `embedding_ps.store.RowSource`: what the predictor's SparseArch pulls from.

    store = ExportStore([TableView(cfg, ids, matrix, "fp32"), ...])   # one view per ps.tables entry
    rows = store.pull_many_async([0, 1], [ids0, ids1]).result()      # float32 [N0 + N1, D]

Lookup: raw ids -> keys (`keys_of`: hashed tables map ids to rows) -> `np.searchsorted` on the
sorted ids; an id the table lacks gets the table's default (its deterministic init row, or zeros
under `unadmitted = "zeros"`), exactly what a PS pull returns in training and eval. The store is
read-only: it has no push, save, load or sweep (a `RowSource`, not an `EmbeddingStore`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch

from embedding_ps.wire.config import TableConfig
from embedding_ps.init import init_rows
from embedding_ps.wire.sharding import keys_of
from embedding_ps.store import done_future, pull_each
from recsys.serving.quantize import dequantize


def find_sorted(sorted_ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64 [N], found bool [N]) of keys [N] in the sorted, distinct array `sorted_ids`."""
    if sorted_ids.size == 0:
        return np.zeros(keys.shape[0], np.int64), np.zeros(keys.shape[0], bool)
    pos = np.minimum(np.searchsorted(sorted_ids, keys), sorted_ids.size - 1)
    return pos, sorted_ids[pos] == keys


class TableView:
    """One table of an export: sorted ids [R] and their stored rows [R, W] (memory-mapped or merged)."""

    def __init__(self, cfg: TableConfig, ids: np.ndarray, matrix: np.ndarray, precision: str) -> None:
        # plain ndarray views of the memory maps: np.memmap's per-index bookkeeping costs time on every
        # call (benchmarks/history/figures-from-the-code.md)
        self.cfg, self.ids, self.matrix, self.precision = cfg, np.asarray(ids), np.asarray(matrix), precision

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    def keys(self, ids: torch.Tensor) -> np.ndarray:
        """Raw ids int64 [N] -> the keys the export stores, int64 [N]."""
        return keys_of(ids, self.cfg).numpy()

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions int64 [N], found bool [N]) of keys in the sorted ids."""
        return find_sorted(self.ids, keys)

    def defaults(self, keys: np.ndarray) -> torch.Tensor:
        """float32 [N, D]: what a PS pull returns for keys without a row."""
        c = self.cfg
        if c.unadmitted == "zeros":
            return torch.zeros(keys.shape[0], c.dim)
        return init_rows(torch.from_numpy(np.ascontiguousarray(keys)), c.dim, c.seed, c.init, c.init_scale)

    @property
    def has_default(self) -> bool:
        """Whether the default rows can be non-zero."""
        return self.cfg.unadmitted == "init" and self.cfg.init != "zeros"

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Raw ids int64 [N] -> float32 [N, D] (dequantized rows; defaults for unknown ids)."""
        keys = self.keys(ids)
        pos, found = self.locate(keys)
        if found.all():
            return dequantize(self.matrix[pos], self.precision, self.cfg.dim)
        out = torch.empty(keys.shape[0], self.cfg.dim)
        hit = torch.from_numpy(found)
        if found.any():
            out[hit] = dequantize(self.matrix[pos[found]], self.precision, self.cfg.dim)
        out[~hit] = self.defaults(keys[~found])
        return out


class ExportStore:
    """`RowSource` over an export's tables (indexed like `ps.tables`): pulls only.

    Pulls are answered at once (the Futures are done); `barrier` only advances `step`.
    """

    def __init__(self, tables: Sequence[TableView]) -> None:
        self.tables = list(tables)
        self.step = 0

    def pull(self, table: int, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        return self.tables[table].rows(ids)

    def pull_many_async(self, tables: Sequence[int], ids: Sequence[torch.Tensor],
                        step: int | None = None) -> "Future[torch.Tensor]":
        return pull_each(self, tables, ids, step)

    def barrier(self, step: int) -> None:
        self.step = step + 1

    def barrier_async(self, step: int) -> Future:
        self.barrier(step)
        return done_future(None)

    def stats(self) -> list[dict]:
        """One entry: every table's name, row count and precision."""
        return [{"tables": [{"name": t.cfg.name, "rows": t.num_rows, "precision": t.precision}
                            for t in self.tables]}]

    def close(self) -> None:
        pass
