"""int8 / int4 pooling through fbgemm's inference TBE against the trainer's SparseArch on the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.batch import Batch, KeyedJagged
from embedding_ps.wire.config import TableConfig
from recsys.serving.export_store import ExportStore, TableView
from recsys.serving.quantize import dequantize, quantize
from recsys.serving.tbe_pool import QuantizedPooling
from recsys.models.sparse_arch import SparseArch, plan_tables

FEATURES = ("a", "b", "c", "d")
TABLES = (
    TableConfig(name="a", dim=8, init_scale=0.5),                              # sum, weighted
    TableConfig(name="b", dim=8, kind="hashed", num_embeddings=13),            # mean
    TableConfig(name="c", dim=8, unadmitted="zeros"),                          # unknown ids pull zeros
    TableConfig(name="a_lin", dim=1, init="normal", init_scale=0.3),           # linear terms, odd width
)


def make_views(precision: str, seed: int = 0) -> list[TableView]:
    g = torch.Generator().manual_seed(seed)
    views = []
    for cfg in TABLES:
        n = 13 if cfg.kind == "hashed" else 40
        ids = np.arange(n, dtype=np.int64) * (1 if cfg.kind == "hashed" else 3)    # ids 0, 3, 6, ...
        rows = torch.randn(n, cfg.dim, generator=g)
        views.append(TableView(cfg, ids, quantize(rows, precision), precision))
    return views


def make_batch(B: int, seed: int = 1) -> Batch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=(len(FEATURES), B))                       # some empty bags
    values = rng.integers(0, 150, size=int(lengths.sum()))                       # unknown ids too
    weights = rng.uniform(0.1, 2.0, size=values.size).astype(np.float32)
    return Batch(dense=torch.zeros(B, 0), labels=torch.zeros(B),
                 sparse=KeyedJagged(FEATURES, torch.from_numpy(values), torch.from_numpy(lengths.reshape(-1).astype(np.int32))),
                 weights=torch.from_numpy(weights))


@pytest.mark.parametrize("precision, atol, rtol", [("int4", 1e-5, 0.0), ("int8", 5e-3, 0.0)])
@pytest.mark.parametrize("weighted", [True, False])
def test_tbe_pooling_equals_sparse_arch(precision: str, atol: float, rtol: float, weighted: bool) -> None:
    plans = plan_tables(FEATURES, TABLES, {"d": "a"}, {"a": "a_lin", "b": "a_lin"}, {"b": "mean"})
    views = make_views(precision)
    batch = make_batch(B=9)
    if not weighted:
        batch = Batch(batch.dense, batch.sparse, batch.labels)
    want_pooled, want_linear = SparseArch(plans).lookup(batch, ExportStore(views)).wait()
    got_pooled, got_linear = QuantizedPooling(plans, views, precision).pool(batch)
    assert got_pooled.shape == want_pooled.shape == (9, 4, 8)
    assert got_linear.shape == want_linear.shape == (9, 2)
    # int8: the TBE keeps scale and bias in fp16 (quantize.py), so it differs by their rounding
    torch.testing.assert_close(got_pooled, want_pooled.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got_linear, want_linear.detach(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("dim", [1, 3, 8, 13])
def test_quantize_round_trip(precision: str, dim: int) -> None:
    rows = torch.randn(50, dim)
    back = dequantize(quantize(rows, precision), precision, dim)
    assert back.shape == (50, dim) and back.dtype == torch.float32
    span = (rows.max(dim=1).values - rows.min(dim=1).values).unsqueeze(1)        # [50, 1]
    # fp16: 2^-11 relative for normal values, and half the subnormal step (2^-25) for |x| < 2^-14
    tol = {"fp32": 0.0, "fp16": 1e-3 * rows.abs() + 2**-25, "int8": span / 255 / 2 + 1e-6, "int4": span / 15 / 2 + 2e-3}[precision]
    assert ((back - rows).abs() <= tol).all()
