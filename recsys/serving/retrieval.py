"""Retrieval export and top-K serving of a two-tower run.

    info = export_retrieval(cfg, model_dir, out)    # -> manifest["retrieval"]; writes, into out:
        items.parquet      item_id int64, vector fixed_size_list<float32>[d]: every item of data.item_paths
        user_tower.pt2     torch.export program: (dense_user [B, Dn_u], pooled_user [B, F_u, D]) -> [B, d]
    index = ExactIndex(item_ids, item_vectors)      # what Predictor.topk searches
    ids, scores = index.search(user_vectors, k)     # int64 [B, k], float32 [B, k], best first

The item vectors are the item tower over the item corpus with the trained rows (pulled from the
saved shards); the user tower takes the user columns (model.user_features: dense in
data.dense_columns order, sparse pooled in data.sparse_columns order) as the trainer feeds them.
`ItemIndex` is what `Predictor.topk` calls: `ExactIndex`, or `ann.AnnIndex` (faiss HNSW) when the
export holds one (`recsys export --index ann`: items.faiss, its parameters in the section's "index").
No pickle: the program is saved as dense_export saves the dense model, and loaded through its check.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from embedding_ps.local import LocalStore
from recsys.config import JobConfig
from recsys.models import build_job_model
from recsys.models.replicated import ReplicatedStore, build_replicated, read_replicated
from recsys.models.two_tower import item_vectors, tower_data
from recsys.serving.dense_export import export_program
from recsys.serving.ann import AnnIndex
from recsys.serving.errors import ExportError

logger = logging.getLogger(__name__)

ITEMS_FILE = "items.parquet"
USER_TOWER_FILE = "user_tower.pt2"


class ItemIndex(Protocol):
    """Top-k search over item vectors by inner product: `ExactIndex` or `ann.AnnIndex`."""

    def search(self, queries: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries float32 [B, d] -> (item ids int64 [B, k], scores float32 [B, k]), best first."""
        ...


class ExactIndex:
    """Exact top-k by inner product, in blocks: for each block of `item_block` items one matmul
    [B, d] x [d, c] and a `torch.topk` of k, then a topk over the B x (k * blocks) candidates.
    Memory: one [B, c] score block (B = 256, c = 65536: 64 MB), never the full [B, I] matrix.
    """

    def __init__(self, ids: np.ndarray, vectors: torch.Tensor, item_block: int = 1 << 16,
                 query_block: int = 1024) -> None:
        self.ids = ids                                   # int64 [I]
        self.vectors = vectors.contiguous()              # float32 [I, d]
        self.item_block, self.query_block = item_block, query_block

    def search(self, queries: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.ids.size)
        ids, scores = [], []
        with torch.no_grad():
            for q0 in range(0, queries.shape[0], self.query_block):
                top_s, top_i = self._search_block(queries[q0:q0 + self.query_block], k)
                ids.append(self.ids[top_i.numpy()])
                scores.append(top_s.numpy())
        if not ids:
            return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
        return np.concatenate(ids), np.concatenate(scores)

    def _search_block(self, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q [b, d] -> (scores [b, k], item rows [b, k]), best first."""
        vals, rows = [], []
        for start in range(0, self.vectors.shape[0], self.item_block):
            s = q @ self.vectors[start:start + self.item_block].t()           # [b, c]
            top = torch.topk(s, min(k, s.shape[1]), dim=1)                     # [b, <= k]
            vals.append(top.values)
            rows.append(top.indices + start)
        if len(vals) == 1:
            return vals[0], rows[0]
        vals_c, rows_c = torch.cat(vals, dim=1), torch.cat(rows, dim=1)       # [b, k * blocks]
        best = torch.topk(vals_c, k, dim=1)                                    # [b, k]
        return best.values, rows_c.gather(1, best.indices)


def export_retrieval(cfg: JobConfig, model_dir: Path, out: Path, index: str = "exact") -> dict:
    """Write items.parquet and user_tower.pt2 (`index` "ann": also items.faiss, ann.py) into `out`;
    returns the manifest's "retrieval" section."""
    sparse, model = build_job_model(cfg)
    model.load_state_dict(torch.load(model_dir / "dense.pt", map_location="cpu", weights_only=True))
    model.eval()
    store = LocalStore.from_dir(cfg.ps, model_dir / "ps")
    if (saved := read_replicated(model_dir)) is not None:        # tables trained on the trainers
        store = ReplicatedStore(store, build_replicated(cfg, saved), [t.name for t in cfg.ps.tables])
    try:
        ids, vectors = item_vectors(cfg, store, model)                     # [I], [I, d]
    finally:
        store.close()
    d = vectors.shape[1]
    flat = pa.array(vectors.numpy().reshape(-1), pa.float32())
    table = pa.table({"item_id": pa.array(ids, pa.int64()), "vector": pa.FixedSizeListArray.from_arrays(flat, d)})
    pq.write_table(table, out / ITEMS_FILE)
    user_cfg = tower_data(cfg, cfg.model.user_features)
    Dn, F = len(user_cfg.dense_columns), len(user_cfg.sparse_columns)
    D = next(p.dim for p in sparse.plans if not p.linear)
    export_program(model.user_tower, (torch.zeros(2, Dn), torch.zeros(2, F, D)), out / USER_TOWER_FILE)
    logger.info("retrieval export: %d item vectors of dim %d, user tower over %s", ids.size, d,
                list(cfg.model.user_features))
    section = {"items_file": ITEMS_FILE, "user_tower_file": USER_TOWER_FILE, "num_items": int(ids.size), "dim": d,
               "item_id_feature": cfg.model.item_id_feature, "user_dense_columns": list(user_cfg.dense_columns),
               "user_sparse_columns": list(user_cfg.sparse_columns),
               "user_tower_inputs": [{"name": "dense", "shape": ["B", Dn]}, {"name": "pooled", "shape": ["B", F, D]}],
               "output": "user vectors [B, d] float32, L2-normalized; score = <user, item>"}
    if index == "ann":
        section["index"] = AnnIndex.build(ids, vectors).save(out)
    return section


def read_items(root: Path, info: dict) -> tuple[np.ndarray, torch.Tensor]:
    """The exported item ids int64 [I] and vectors float32 [I, d]."""
    table = pq.read_table(root / info["items_file"])
    vec = table.column("vector").combine_chunks()
    d = int(info["dim"])
    if vec.type.list_size != d or table.num_rows != int(info["num_items"]):
        raise ExportError(f"{root / info['items_file']}: {table.num_rows} vectors of dim {vec.type.list_size}, "
                          f"the manifest says {info['num_items']} of dim {d}")
    matrix = vec.values.to_numpy(zero_copy_only=False).reshape(-1, d).copy()
    return table.column("item_id").to_numpy(), torch.from_numpy(matrix)


__all__ = ["ExactIndex", "ItemIndex", "export_retrieval", "read_items", "ITEMS_FILE", "USER_TOWER_FILE"]
