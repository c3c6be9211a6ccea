"""`Predictor`: scores from an export directory, with no PS and no training code path at run time.

    p = Predictor("exports/tiny")                          # memory-maps tables/*.safetensors
    p = Predictor("exports/base", deltas=["exports/d1"])   # or p.apply_delta("exports/d1")
    scores = p.predict(pa_table)          # float32 [N]: click probabilities, rows decoded as in training
    scores = p.predict(batch)             # a data.batch.Batch
    scores = p.predict([{"I1": 3, "C1": 7, "M1": [1, 2]}, ...])     # rows as dicts (JSON values), as `recsys serve`'s
    rows = p.lookup("C1", ids)            # float32 [N, D] (dequantized for int8 / int4)
    ids, scores = p.topk(user_rows, k)    # two_tower exports: the ANN index of `export --index ann`, else exact

Lookup: `export_store.TableView` (an id the table lacks gets the table's default, as a PS pull).

Pooling (the hot path): `native_fused.NativePooling` where it builds, else (or with `fused=False`, the
reference) the per-table path: fp32 / fp16 rows through `ExportStore` to the training `SparseArch`,
int8 / int4 through fbgemm's TBE (`tbe_pool.QuantizedPooling`). Both, and what they cost: docs/serving.md.

Scores: sigmoid(logits), calibrated as the manifest's "calibration" section says (`recsys.calibration`);
`logits` stay the dense model's own.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from data.batch import Batch
from data.decode import TableDecoder
from recsys.calibration import manifest_score_rate, probabilities
from recsys.config import load_config
from recsys.models import build_sparse_arch
from recsys.models.two_tower import tower_data, tower_sparse_arch
from recsys.serving.ann import AnnIndex
from recsys.serving.delta import check_applicable, merge_table, read_table
from recsys.serving.dense_export import load_dense
from recsys.serving.export import read_manifest
from recsys.serving.export_store import ExportStore, TableView
from recsys.serving.native_fused import NativePooling, make_pooling
from recsys.serving.quantize import QUANTIZED
from recsys.serving.retrieval import ExactIndex, ItemIndex, read_items
from recsys.serving.rows import Columns, to_table
from recsys.serving.tbe_pool import QuantizedPooling
from recsys.serving.errors import ExportError
from recsys.storage import download_dir, exists, is_uri, join

logger = logging.getLogger(__name__)

_CHUNK_ROWS = 65536


class Predictor:
    """Scores of a full export (optionally with deltas applied). Not thread-safe."""

    def __init__(self, export_dir: str | Path, deltas: list[str | Path] | tuple = (), verify: bool = True,
                 fused: bool = True, index: str = "auto") -> None:
        """`fused` False: pool through the per-table path (module docstring). `export_dir` and `deltas`
        may be URIs (`s3://...`, as `recsys.storage` reads them): they are fetched into a temporary
        directory that lives as long as the Predictor (its tables are memory-mapped from there). `index`
        (two_tower exports: what `topk` searches): "auto" the export's ANN index when it has one,
        else exact; "exact"; "ann" the export's ANN index, or one built at load when it has none."""
        if index not in ("auto", "exact", "ann"):
            raise ValueError(f"index must be 'auto', 'exact' or 'ann', got {index!r}")
        self.index_mode = index
        self._fetched: tempfile.TemporaryDirectory | None = None
        self.root = self._local(export_dir)
        self.verify = verify
        self.manifest = read_manifest(self.root, verify)
        if self.manifest["kind"] != "full":
            raise ExportError(f"{self.root}: a {self.manifest['kind']} export; open its base export with "
                              f"Predictor(base, deltas=[{str(self.root)!r}])")
        self.config = load_config(self.root / "config.toml")
        self.precision = self.manifest["precision"]
        self.step = int(self.manifest["step"])
        self.score_rate = manifest_score_rate(self.manifest)       # 1.0: scores are sigmoid(logits)
        self.sparse = build_sparse_arch(self.config)
        self.sequences = bool(self.config.model.sequence_features)     # din: behavior rows per position too
        if self.sequences and self.precision in QUANTIZED:
            raise ExportError(f"{self.root}: a {self.precision} export of a din model; din serves fp32 / fp16 only")
        self.tables: list[TableView] = []
        for entry, cfg in zip(self.manifest["tables"], self.config.ps.tables):
            t = read_table(self.root, entry)
            self.tables.append(TableView(cfg, t["ids"], t["weight"], self.precision))
        self._by_name = {t.cfg.name: i for i, t in enumerate(self.tables)}
        self.scorer = load_dense(self.root / "dense.pt2")
        # tables -> Batch as training decodes them, but a bad value is an error: a dropped row would leave
        # fewer scores than rows (data.on_bad_rows = "skip" is for training files)
        self.decoder = TableDecoder(dataclasses.replace(self.config.data, on_bad_rows="error"))
        self.user_decoder: TableDecoder | None = None          # two_tower: the user columns' rows
        self.index: ItemIndex | None = None           # two_tower exports: top-k over the item vectors
        self.exact_index: ExactIndex | None = None    # ... always exact (the same as index without an ANN)
        if "retrieval" in self.manifest:
            self._open_retrieval(self.manifest["retrieval"], self.root)
        self.fused = fused              # pooled() through NativePooling where it builds (False: the per-table path)
        self.apply_delta(*deltas)

    def apply_delta(self, *delta_dirs: str | Path) -> None:
        """Merge delta exports, in order, into the tables (in memory) and take the last one's dense model and step."""
        try:
            for delta_dir in delta_dirs:
                delta_dir = self._local(delta_dir)
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
                self.score_rate = manifest_score_rate(delta)               # the delta's model, the delta's run config
                if "retrieval" in delta:            # a two_tower delta holds every item vector and the user tower
                    self._open_retrieval(delta["retrieval"], delta_dir)
                logger.info("applied delta %s: now at step %d", delta_dir, self.step)
        finally:            # the rows served are the tables' as merged so far, also after a delta that failed
            self._store = ExportStore(self.tables)
            self._pooling: QuantizedPooling | None = None
            self.native: NativePooling | None = (make_pooling(self.sparse.plans, self.tables, self.precision)
                                                 if self.fused else None)

    def _local(self, path: str | Path) -> Path:
        """`path` itself, or a URI's export fetched into this Predictor's temporary directory."""
        if not is_uri(path):
            return Path(path)
        if self._fetched is None:
            self._fetched = tempfile.TemporaryDirectory(prefix="recsys-export-")
        local = Path(self._fetched.name) / str(len(list(Path(self._fetched.name).iterdir())))
        if not exists(join(str(path), "manifest.json")):
            raise ExportError(f"{path}: no manifest.json (not an export, or not written yet)")
        download_dir(path, local)
        logger.info("fetched %s into %s", path, local)
        return local

    # -- lookups ----------------------------------------------------------------------------------

    def lookup(self, table: str | int, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows float32 [N, D] of raw ids int64 [N] of a table (by name or index)."""
        t = self._by_name[table] if isinstance(table, str) else table
        return self.tables[t].rows(torch.as_tensor(ids, dtype=torch.int64))

    def pooled(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pooled embeddings [B, F, D] and linear terms [B, F_lin] (None without linear tables)."""
        if self.native is not None:
            return self.native.pool(batch)
        if self.precision in QUANTIZED:
            if self._pooling is None:
                self._pooling = QuantizedPooling(self.sparse.plans, self.tables, self.precision)
            return self._pooling.pool(batch)
        return self.sparse.lookup(batch, self._store).wait()

    # -- scores -----------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, batch: Batch) -> torch.Tensor:
        """float32 [B] logits of a Batch."""
        if self.sequences:          # din: (dense, pooled, behaviors, mask), from one lookup
            lookup = self.sparse.lookup(batch, self._store)
            pooled, _ = lookup.wait()
            behaviors, mask = self.sparse.behaviors(lookup)                       # [B, S, L, D], [B, S, L]
            return self.scorer(batch.dense, pooled.detach(), behaviors.detach(), mask)
        pooled, linear = self.pooled(batch)
        args = (batch.dense, pooled.detach()) + ((linear.detach(),) if linear is not None else ())
        return self.scorer(*args)

    # -- retrieval (two_tower exports) ---------------------------------------------------------------

    def _open_retrieval(self, info: dict, root: Path) -> None:
        ids, vectors = read_items(root, info)
        self.index = self.exact_index = ExactIndex(ids, vectors)
        if self.index_mode != "exact" and "index" in info:
            self.index = AnnIndex.load(root, info["index"], ids, self.exact_index)
        elif self.index_mode == "ann":
            self.index = AnnIndex.build(ids, vectors, self.exact_index)
        self.user_tower = load_dense(root / info["user_tower_file"])
        self.user_decoder = TableDecoder(dataclasses.replace(
            tower_data(self.config, self.config.model.user_features), on_bad_rows="error"))
        self._user_sparse = tower_sparse_arch(self.config, self.config.model.user_features)

    @torch.no_grad()
    def user_vectors(self, user_features: Batch | pa.Table | list[dict]) -> torch.Tensor:
        """float32 [B, d] user vectors of rows holding the user columns (model.user_features); a
        Batch must hold exactly those columns (dense, then sparse, in the data's column order)."""
        if self.index is None:
            raise ExportError(f"{self.root}: not a two_tower export (no item vectors): topk needs one")
        if isinstance(user_features, pa.Table):
            user_features = self.user_decoder.decode(user_features, "<user features>")
        elif isinstance(user_features, list):
            user_features = self._batch_of_rows(user_features, self.user_decoder)
        pooled, _ = self._user_sparse.lookup(user_features, self._store).wait()        # [B, F_u, D]
        return self.user_tower(user_features.dense, pooled.detach())                  # [B, d]

    def topk(self, user_features: Batch | pa.Table | list[dict], k: int,
             exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The k items of largest <user, item> for every row: (item ids int64 [B, k], scores float32 [B, k]),
        best first, searched by `self.index` (the `index` of __init__; an ANN index may miss some of the
        exact top k); `exact` True: `ExactIndex` (batched matmul) whatever the Predictor holds."""
        queries = self.user_vectors(user_features)          # raises for an export without item vectors
        return (self.exact_index if exact else self.index).search(queries, k)

    def predict(self, data: Batch | pa.Table | list[dict]) -> np.ndarray:
        """float32 [B] click probabilities (calibrated, see the module docstring) of a Batch, of a pyarrow
        Table or of rows as dicts (column -> JSON value, `recsys serve`'s rows), decoded like training data
        but never dropping a row: a bad value raises `DataError` naming its column and row."""
        if isinstance(data, list):
            data = self._batch_of_rows(data, self.decoder)
        if isinstance(data, Batch):
            return probabilities(self.logits(data), self.score_rate).numpy()
        if not isinstance(data, pa.Table):
            raise TypeError(f"predict takes a data.batch.Batch, a pyarrow.Table or a list of dicts, got "
                            f"{type(data).__name__}")
        out = [probabilities(self.logits(self.decoder.decode(data.slice(i, _CHUNK_ROWS), f"<table rows {i}..>")),
                             self.score_rate).numpy()
               for i in range(0, data.num_rows, _CHUNK_ROWS)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    @staticmethod
    def _batch_of_rows(rows: list[dict], decoder: TableDecoder) -> Batch:
        """The common rows straight to a Batch (`TableDecoder.decode_rows`), others through a table of them."""
        batch = decoder.decode_rows(rows)
        return batch if batch is not None else decoder.decode(to_table(rows, Columns.of(decoder.cfg)), "<rows>")
