"""recsys.serving.export_store.ExportStore implements embedding_ps.store.RowSource (the read-only half)."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from embedding_ps.wire.config import TableConfig
from embedding_ps.store import EmbeddingStore, RowSource
from recsys.serving.export_store import ExportStore, TableView

TABLES = (TableConfig(name="a", dim=4), TableConfig(name="b", dim=4, unadmitted="zeros"))


def make_store() -> ExportStore:
    g = torch.Generator().manual_seed(0)
    views = [TableView(cfg, np.arange(10, dtype=np.int64) * 2, torch.randn(10, 4, generator=g).numpy(), "fp32")
             for cfg in TABLES]
    return ExportStore(views)


def protocol_members() -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(RowSource).items()
            if callable(member) and not name.startswith("_")}


def test_conforms_to_the_protocol() -> None:
    store = make_store()
    assert isinstance(store, RowSource) and not isinstance(store, EmbeddingStore)
    assert isinstance(store.step, int)
    members = protocol_members()
    assert {"pull_many_async", "pull", "barrier", "stats", "close"} <= set(members)
    for name, want in members.items():
        got = inspect.signature(getattr(ExportStore, name))
        assert list(got.parameters) == list(want.parameters), name     # same names, same order
        for p, q in zip(got.parameters.values(), want.parameters.values()):
            assert p.default == q.default and p.kind == q.kind, (name, p.name)


def test_pulls_rows_and_defaults_in_order() -> None:
    store = make_store()
    ids = [torch.tensor([0, 3, 4]), torch.tensor([2, 5])]     # 3 and 5 have no row
    rows = store.pull_many_async([0, 1], ids).result()
    assert rows.shape == (5, 4)
    torch.testing.assert_close(rows[:3], torch.cat([store.pull(0, ids[0])]))
    torch.testing.assert_close(rows[3:], store.tables[1].rows(ids[1]))
    assert torch.all(rows[4] == 0)                               # b: unadmitted = "zeros"
    torch.testing.assert_close(rows[0], torch.from_numpy(store.tables[0].matrix[0]))


def test_is_read_only() -> None:
    store = make_store()
    ids = torch.tensor([0, 2])
    for name in ("push", "push_many_async", "save", "load", "sweep", "wait_saved"):
        assert not hasattr(store, name), name          # no writes to offer
    assert torch.equal(store.pull(0, ids), store.pull(0, ids))
    store.barrier(4)
    assert store.step == 5 and store.barrier_async(5).result() is None
    assert store.stats()[0]["tables"][0] == {"name": "a", "rows": 10, "precision": "fp32"}
    store.close()
