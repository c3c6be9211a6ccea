"""Pooling of int8 / int4 export rows with fbgemm's inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`).

One TBE holds every table the model reads (each with one extra all-zero row at the end, where ids
without a row point), one "feature" per (table, sparse feature) in `SparseArch` plan order, SUM
pooling with per-id weights: a feature's own weights for sum-pooled tables, 1 / bag length for
mean-pooled ones (= mean). Ids without a row add their table's default row (init or zeros) in
float32 afterwards, so an unknown id scores as it does in training. int4 tables of a width that is
not a multiple of 4 carry padding columns, dropped from the output. The TBE holds its own copy of
the quantized rows (its row layout is f16 scale | f16 bias | codes, see quantize.py).
"""

from __future__ import annotations

import numpy as np
import torch

from data.batch import Batch
from recsys.serving.quantize import tbe_dim, tbe_rows
from recsys.models.sparse_arch import TablePlan

from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
from fbgemm_gpu.tbe.config.embedding_config import BoundsCheckMode, EmbeddingLocation, PoolingMode


class QuantizedPooling:
    """Pools a Batch's ids over quantized tables: [B, F, D] pooled and [B, F_lin] linear terms."""

    def __init__(self, plans: list[TablePlan], tables: list, precision: str) -> None:
        """`tables`: predictor TableViews indexed like ps.tables (ids sorted, matrix quantized)."""
        self.plans, self.tables = plans, tables
        used = sorted({p.table for p in plans})
        slot = {t: i for i, t in enumerate(used)}                      # ps table index -> TBE table
        ty = SparseType.INT8 if precision == "int8" else SparseType.INT4
        specs = [(tables[t].cfg.name, tables[t].num_rows + 1, tbe_dim(precision, tables[t].cfg.dim), ty,
                  EmbeddingLocation.HOST) for t in used]
        feature_map = [slot[p.table] for p in plans for _ in p.features]
        self.tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            specs, feature_table_map=feature_map, pooling_mode=PoolingMode.SUM, device="cpu",
            output_dtype=SparseType.FP32, bounds_check_mode=BoundsCheckMode.NONE)
        self.tbe.initialize_weights()
        for t, (w, _) in zip(used, self.tbe.split_embedding_weights(split_scale_shifts=False)):
            n = tables[t].num_rows
            w[:n].copy_(torch.from_numpy(tbe_rows(np.asarray(tables[t].matrix), precision)))
            w[n:].zero_()                                                # scale 0, bias 0: pools to 0
        widths = [tbe_dim(precision, p.dim) for p in plans for _ in p.features]
        self.columns = np.concatenate([[0], np.cumsum(widths)]).tolist()  # TBE output column of each feature

    def pool(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        kj = batch.sparse
        B, F_all = batch.batch_size, len(kj.keys)
        lengths = kj.lengths.view(F_all, B).to(torch.int64)                  # [F, B]
        per_feature = lengths.sum(dim=1)
        starts = (torch.cumsum(per_feature, 0) - per_feature).tolist()
        counts = per_feature.tolist()
        indices, weights, lens_all, extra = [], [], [], []
        for plan in self.plans:
            view = self.tables[plan.table]
            values = torch.cat([kj.values[starts[f]:starts[f] + counts[f]] for f in plan.features])  # [N_t]
            lens = lengths[list(plan.features)].reshape(-1)                   # [F_t * B]
            keys = view.keys(values)
            pos, found = view.locate(keys)
            indices.append(torch.from_numpy(np.where(found, pos, view.num_rows)))
            if plan.pooling == "mean":
                w = torch.repeat_interleave(1.0 / lens.clamp(min=1).float(), lens)
            elif batch.weights is not None:
                w = torch.cat([batch.weights[starts[f]:starts[f] + counts[f]] for f in plan.features])
            else:
                w = torch.ones(values.shape[0])
            weights.append(w)
            lens_all.append(lens)
            extra.append(self._defaults(view, keys, found, w, lens) if view.has_default and not found.all() else None)
        lens = torch.cat(lens_all)
        offsets = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=offsets[1:])
        out = self.tbe(torch.cat(indices).to(torch.int32), offsets, torch.cat(weights).float())  # [B, sum W_f]
        return self._split(out, extra, B)

    @staticmethod
    def _defaults(view, keys: np.ndarray, found: np.ndarray, w: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """float32 [F_t * B, D]: the pooled default rows of the ids without a row."""
        miss = torch.from_numpy(~found)
        bag = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)     # [N_t] bag of each id
        rows = view.defaults(keys[~found]) * w[miss].unsqueeze(1)            # [M, D]
        out = torch.zeros(lens.shape[0], view.cfg.dim)
        return out.index_add_(0, bag[miss], rows)

    def _split(self, out: torch.Tensor, extra: list, B: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        pieces: dict[tuple[bool, int], torch.Tensor] = {}                    # (linear, feature) -> [B, D]
        k = 0
        for plan, add in zip(self.plans, extra):
            for j, f in enumerate(plan.features):
                piece = out[:, self.columns[k]:self.columns[k] + plan.dim]
                pieces[plan.linear, f] = piece if add is None else piece + add[j * B:(j + 1) * B]
                k += 1
        pooled = [pieces[key] for key in sorted(pieces) if not key[0]]
        linear = [pieces[key][:, 0] for key in sorted(pieces) if key[0]]
        return torch.stack(pooled, dim=1), torch.stack(linear, dim=1) if linear else None     # [B, F, D], [B, F_lin]
