"""`Predictor`: scores from an export directory, with no PS and no training code path at run time.

    p = Predictor("exports/tiny")                          # memory-maps tables/*.safetensors
    p = Predictor("exports/base", deltas=["exports/d1"])   # or p.apply_delta("exports/d1")
    scores = p.predict(pa_table)          # float32 [N]: sigmoid(logits), rows decoded as in training
    scores = p.predict(batch)             # a data.batch.Batch
    rows = p.lookup("C1", ids)            # float32 [N, D] (dequantized for int8 / int4)

Lookup: raw ids -> keys (`keys_of`: hashed tables map ids to rows) -> `np.searchsorted` on the
sorted ids; an id the table lacks gets the table's default (its deterministic init row, or zeros
under `unadmitted = "zeros"`), exactly what a PS pull returns in training and eval.

Pooling: fp32 / fp16 exports feed the rows to the trainer's own `SparseArch` (unique ids ->
rows -> `embedding_bag` per group of tables), so fp32 scores equal the trained model's eval
scores. int8 / int4 exports pool in one call of fbgemm's `IntNBitTableBatchedEmbeddingBagsCodegen`
(SUM with per-id weights; mean pooling as weights 1/length); ids without a row point at an
all-zero extra row and their default rows are added in float32. The TBE holds its own copy of
the quantized rows (its row layout is f16 scale | f16 bias | codes, see quantize.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from data.batch import Batch
from data.decode import decode_table
from embedding_ps.config import TableConfig
from embedding_ps.init import init_rows
from embedding_ps.sharding import keys_of
from recsys.config import load_config
from recsys.serving.delta import check_applicable, merge_table, read_table
from recsys.serving.dense_export import load_dense
from recsys.serving.export import read_manifest
from recsys.serving.quantize import QUANTIZED, dequantize
from recsys.serving.tbe_pool import QuantizedPooling
from recsys.serving.tensorfile import ExportError
from recsys.training.trainer import build_sparse_arch

logger = logging.getLogger(__name__)

_CHUNK_ROWS = 65536


class TableView:
    """One table of an export: sorted ids [R] and their stored rows [R, W] (memory-mapped or merged)."""

    def __init__(self, cfg: TableConfig, ids: np.ndarray, matrix: np.ndarray, precision: str) -> None:
        # plain ndarray views of the memory maps: np.memmap's per-index bookkeeping costs ~8 us a call
        self.cfg, self.ids, self.matrix, self.precision = cfg, np.asarray(ids), np.asarray(matrix), precision

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    def keys(self, ids: torch.Tensor) -> np.ndarray:
        """Raw ids int64 [N] -> the keys the export stores, int64 [N]."""
        return keys_of(ids, self.cfg).numpy()

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions int64 [N], found bool [N]) of keys in the sorted ids."""
        if self.num_rows == 0:
            return np.zeros(keys.shape[0], np.int64), np.zeros(keys.shape[0], bool)
        pos = np.minimum(np.searchsorted(self.ids, keys), self.num_rows - 1)
        return pos, self.ids[pos] == keys

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


class _ExportStore:
    """The EmbeddingStore protocol's pull side, over the export's tables (for SparseArch)."""

    def __init__(self, tables: list[TableView]) -> None:
        self.tables = tables

    def pull_async(self, table: int, ids: torch.Tensor, step: int | None = None) -> Future:
        f: Future = Future()
        f.set_result(self.tables[table].rows(ids))
        return f


class Predictor:
    """Scores of a full export (optionally with deltas applied). Not thread-safe."""

    def __init__(self, export_dir: str | Path, deltas: list[str | Path] | tuple = (), verify: bool = True) -> None:
        self.root = Path(export_dir)
        self.verify = verify
        self.manifest = read_manifest(self.root, verify)
        if self.manifest["kind"] != "full":
            raise ExportError(f"{self.root}: a {self.manifest['kind']} export; open its base export with "
                              f"Predictor(base, deltas=[{str(self.root)!r}])")
        self.config = load_config(self.root / "config.toml")
        self.precision = self.manifest["precision"]
        self.step = int(self.manifest["step"])
        self.sparse = build_sparse_arch(self.config)
        self.tables: list[TableView] = []
        for entry, cfg in zip(self.manifest["tables"], self.config.ps.tables):
            t = read_table(self.root, entry)
            self.tables.append(TableView(cfg, t["ids"], t["weight"], self.precision))
        self._by_name = {t.cfg.name: i for i, t in enumerate(self.tables)}
        self.scorer = load_dense(self.root / "dense.pt2")
        self.num_inputs = len(self.manifest["dense"]["inputs"])
        self._store = _ExportStore(self.tables)
        self._pooling: QuantizedPooling | None = None
        for d in deltas:
            self.apply_delta(d)

    def apply_delta(self, delta_dir: str | Path) -> None:
        """Merge a delta export into the tables (in memory) and take its dense model and step."""
        delta_dir = Path(delta_dir)
        delta = read_manifest(delta_dir, self.verify)
        mine = dict(self.manifest, step=self.step)
        check_applicable(mine, delta, f"{self.root} (at step {self.step})", str(delta_dir))
        for i, entry in enumerate(delta["tables"]):
            d = read_table(delta_dir, entry)
            view = self.tables[i]
            ids, matrix = merge_table(view.ids, view.matrix, d["ids"], d["weight"], d["tombstones"])
            self.tables[i] = TableView(view.cfg, ids, matrix, self.precision)
        self.scorer = load_dense(delta_dir / "dense.pt2")
        self.step = int(delta["step"])
        self._store = _ExportStore(self.tables)
        self._pooling = None
        logger.info("applied delta %s: now at step %d", delta_dir, self.step)

    # -- lookups ----------------------------------------------------------------------------------

    def lookup(self, table: str | int, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows float32 [N, D] of raw ids int64 [N] of a table (by name or index)."""
        t = self._by_name[table] if isinstance(table, str) else table
        ids = torch.as_tensor(ids, dtype=torch.int64)
        return self.tables[t].rows(ids)

    def pooled(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pooled embeddings [B, F, D] and linear terms [B, F_lin] (None without linear tables)."""
        if self.precision in QUANTIZED:
            if self._pooling is None:
                self._pooling = QuantizedPooling(self.sparse.plans, self.tables, self.precision)
            return self._pooling.pool(batch)
        return self.sparse.lookup(batch, self._store).wait()

    # -- scores -----------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, batch: Batch) -> torch.Tensor:
        """float32 [B] logits of a Batch."""
        pooled, linear = self.pooled(batch)
        args = (batch.dense, pooled.detach()) + ((linear.detach(),) if self.num_inputs == 3 else ())
        return self.scorer(*args)

    def predict(self, data: Batch | pa.Table) -> np.ndarray:
        """float32 [B] click probabilities of a Batch or of a pyarrow Table (decoded like training data)."""
        if isinstance(data, Batch):
            return torch.sigmoid(self.logits(data)).numpy()
        if not isinstance(data, pa.Table):
            raise TypeError(f"predict takes a data.batch.Batch or a pyarrow.Table, got {type(data).__name__}")
        out = [torch.sigmoid(self.logits(decode_table(self.config.data, data.slice(i, _CHUNK_ROWS),
                                                      f"<table rows {i}..>"))).numpy()
               for i in range(0, data.num_rows, _CHUNK_ROWS)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)
