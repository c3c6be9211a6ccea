"""Approximate top-k retrieval: `AnnIndex`, a faiss HNSW graph over the item vectors by inner product.

    ann = AnnIndex.build(ids, vectors)               # ids int64 [I], vectors float32 [I, d]
    section = ann.save(out)                          # out/items.faiss; -> manifest["retrieval"]["index"]
    ann = AnnIndex.load(root, section, ids, exact)   # the graph read, the vectors memory-mapped
    ids, scores = ann.search(user_vectors, k)        # as ExactIndex.search: int64 [B, k], float32 [B, k]

The index is faiss's `IndexHNSWFlat` with METRIC_INNER_PRODUCT: the same score as `ExactIndex`
(<user, item>, the vectors stored unquantized), so a found item's score equals its exact score and
only the set can differ. Its labels are row numbers of items.parquet. Parameters (in the manifest):
`M` (graph degree), `ef_construction` (build beam) and `ef_search` (search beam; at least k).
Why faiss-cpu over hnswlib: BENCHMARKS.md, "benchmarks/retrieval.py" (hnswlib also compiles at install
and has had no release since 2023).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from recsys.serving.errors import ExportError

logger = logging.getLogger(__name__)

ANN_FILE = "items.faiss"
KIND = "faiss_hnsw_flat_ip"
DEFAULTS = {"M": 32, "ef_construction": 100, "ef_search": 100}


class AnnIndex:
    """Approximate top-k by inner product (faiss HNSW); rows the graph search leaves short of k
    (possible only when k approaches the number of items) are answered by `exact`."""

    def __init__(self, ids: np.ndarray, index, params: dict, exact=None) -> None:
        self.ids = ids                                   # int64 [I]: label r is item ids[r]
        self.index = index
        self.params = dict(params)
        self.exact = exact                               # an ExactIndex over the same items, or None

    @classmethod
    def build(cls, ids: np.ndarray, vectors: torch.Tensor, exact=None, M: int = DEFAULTS["M"],
              ef_construction: int = DEFAULTS["ef_construction"],
              ef_search: int = DEFAULTS["ef_search"]) -> "AnnIndex":
        import faiss        # a dependency, imported (slowly) at the first use
        t0 = time.perf_counter()
        x = np.ascontiguousarray(vectors.detach().numpy(), dtype=np.float32)
        index = faiss.IndexHNSWFlat(x.shape[1], M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
        index.add(x)
        seconds = time.perf_counter() - t0
        logger.info("ANN index (faiss HNSW, M %d, ef_construction %d) over %d items built in %.1f s",
                    M, ef_construction, x.shape[0], seconds)
        params = {"M": M, "ef_construction": ef_construction, "ef_search": ef_search,
                  "build_seconds": round(seconds, 1)}
        return cls(ids, index, params, exact)

    def save(self, root: Path) -> dict:
        """Write the index to root / ANN_FILE; returns the manifest's retrieval "index" section."""
        import faiss
        faiss.write_index(self.index, str(root / ANN_FILE))
        return {"kind": KIND, "file": ANN_FILE, "library": "faiss-cpu", "library_version": faiss.__version__,
                "metric": "inner_product", "num_items": int(self.index.ntotal), **self.params}

    @classmethod
    def load(cls, root: Path, section: dict, ids: np.ndarray, exact=None) -> "AnnIndex":
        """The index of an export's manifest section (the vectors memory-mapped, the graph read)."""
        if section.get("kind") != KIND:
            raise ExportError(f"{root}: retrieval index kind {section.get('kind')!r}, this version reads {KIND!r}")
        import faiss
        path = root / section["file"]
        try:
            index = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
        except RuntimeError as e:
            raise ExportError(f"{path}: not a readable faiss index ({str(e).splitlines()[0]})") from None
        if index.ntotal != ids.size or int(section["num_items"]) != ids.size:
            raise ExportError(f"{path}: an index of {index.ntotal} items, the export has {ids.size}")
        params = {k: section[k] for k in ("M", "ef_construction", "ef_search", "build_seconds") if k in section}
        return cls(ids, index, params, exact)

    def search(self, queries: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """queries float32 [B, d] -> (item ids int64 [B, k], scores float32 [B, k]), best first."""
        import faiss
        k = min(k, self.ids.size)
        q = np.ascontiguousarray(queries.detach().numpy(), dtype=np.float32)
        if q.shape[0] == 0 or k == 0:
            return np.zeros((q.shape[0], k), np.int64), np.zeros((q.shape[0], k), np.float32)
        params = faiss.SearchParametersHNSW(efSearch=max(int(self.params["ef_search"]), k))
        scores, rows = self.index.search(q, k, params=params)                  # [B, k], [B, k]; -1: none
        ids = self.ids[np.maximum(rows, 0)]
        short = np.flatnonzero((rows < 0).any(axis=1))
        if short.size:
            if self.exact is None:
                raise ExportError(f"ANN search found fewer than {k} items for {short.size} queries")
            ids[short], scores[short] = self.exact.search(torch.from_numpy(q[short]), k)
        return ids, scores.astype(np.float32, copy=False)


__all__ = ["ANN_FILE", "AnnIndex", "DEFAULTS", "KIND"]
