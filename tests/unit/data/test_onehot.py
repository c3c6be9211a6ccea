"""data.onehot: the `onehot` preset's columns, split, determinism, id distributions and planted model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.onehot import LOGIT_CLIP, ONEHOT, ONEHOT_FIELDS, ONEHOT_SPLIT, OnehotTruth, generate_onehot
from data.synthetic import GEN_CHUNK, generate, ids_of_ranks, zipf_pmf
from recsys.metrics import auc


def read(path: Path) -> pa.Table:
    files = sorted(path.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).replace_schema_metadata(None)


def ranks_of(field: str, vocab: int, ids: np.ndarray) -> np.ndarray:
    table = ids_of_ranks(field, np.arange(vocab))
    order = np.argsort(table)
    ranks = order[np.clip(np.searchsorted(table[order], ids), 0, vocab - 1)]
    assert (table[ranks] == ids).all()                # every id is one of the field's
    return ranks


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("onehot")
    return out, generate_onehot(out_dir=str(out), seed=5, split=(20_000, 2_000, 8_000))


def test_columns_split_and_p_true(small) -> None:
    out, summary = small
    assert ONEHOT_SPLIT == (50_000, 6_000, 30_000) and len(ONEHOT_FIELDS) == 10
    assert [Path(f).name for f in summary["files"]] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert summary["rows_per_file"] == [20_000, 2_000, 8_000]
    t = read(out)
    assert t.column_names == ["label", *ONEHOT_FIELDS, "row_id", "p_true"]
    assert all(t.schema.field(f).type == pa.int64() and t.column(f).null_count == 0 for f in ONEHOT_FIELDS)
    assert np.array_equal(t.column("row_id").to_numpy(), np.arange(30_000))
    p, y = t.column("p_true").to_numpy(), t.column("label").to_numpy()
    assert ((p > 0) & (p < 1)).all() and set(np.unique(y)) == {0.0, 1.0}
    assert abs(y.mean() - p.mean()) < 4 * math.sqrt(0.25 / len(y))
    assert 0.2 < y.mean() < 0.6
    assert summary["oracle_auc"] == pytest.approx(auc(y, p), abs=1e-3) and summary["oracle_auc"] > 0.9


def test_id_distributions(small) -> None:
    t = pq.read_table(small[0] / "part-00000.parquet")      # 20,000 training rows
    spec = {f.name: f for f in ONEHOT.fields}
    for name in ("user", "item"):
        ranks = ranks_of(name, spec[name].vocab, t.column(name).to_numpy())
        counts = np.bincount(ranks, minlength=spec[name].vocab)
        assert 1000 < (counts > 0).sum() < spec[name].vocab       # a few thousand distinct ids
        assert (counts == 1).sum() > 300                           # a long tail seen once
        assert counts[0] > 20 * np.median(counts[counts > 0])      # and a heavy head (Zipf)
        freq = counts / counts.sum()
        assert np.abs(freq[:20] - zipf_pmf(spec[name].vocab, spec[name].zipf)[:20]).max() < 0.01
    for f in ONEHOT.fields:
        if f.vocab <= 50:
            assert len(np.unique(t.column(f.name).to_numpy())) <= f.vocab
    truth = OnehotTruth(ONEHOT)
    items = ranks_of("item", spec["item"].vocab, t.column("item").to_numpy())
    cats = ranks_of("item_category", 40, t.column("item_category").to_numpy())
    assert np.array_equal(cats, truth.children["item_category"][items])      # the category is the item's


def test_p_true_is_the_documented_model(small) -> None:
    t = pq.read_table(small[0] / "part-00001.parquet")
    truth = OnehotTruth(ONEHOT)
    ranks = {f.name: ranks_of(f.name, f.vocab, t.column(f.name).to_numpy()) for f in ONEHOT.fields}
    logit = np.full(t.num_rows, ONEHOT.bias)
    for f in ONEHOT.fields:
        logit += truth.w[f.name][ranks[f.name]]
    for a, b, s in ONEHOT.pairs:
        logit += s / math.sqrt(ONEHOT.dim) * (truth.v[a][ranks[a]] * truth.v[b][ranks[b]]).sum(1)
    logit = np.clip(logit, -LOGIT_CLIP, LOGIT_CLIP)
    np.testing.assert_allclose(1 / (1 + np.exp(-logit)), t.column("p_true").to_numpy(), rtol=1e-6, atol=1e-7)
    for a, _, _ in ONEHOT.pairs:                                   # interactions have no linear part
        assert np.abs(truth.pmf[a] @ truth.v[a]).max() < 1e-9


def test_deterministic_by_seed_whatever_the_split(tmp_path: Path) -> None:
    n = GEN_CHUNK + 3000                                           # crosses a generation chunk
    generate_onehot(out_dir=str(tmp_path / "a"), seed=1, split=(n - 2000, 1000, 1000))
    generate_onehot(out_dir=str(tmp_path / "b"), seed=1, split=(n,))
    generate(preset="onehot", rows=n, num_files=2, out_dir=str(tmp_path / "c"), seed=1)
    generate_onehot(out_dir=str(tmp_path / "d"), seed=2, split=(n,))
    a = read(tmp_path / "a")
    assert a.equals(read(tmp_path / "b")) and a.equals(read(tmp_path / "c"))
    assert not a.column("user").equals(read(tmp_path / "d").column("user"))


def test_split_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rows_per_file must be 2 counts summing to rows=10"):
        generate(preset="onehot", rows=10, num_files=2, out_dir=str(tmp_path), seed=0, rows_per_file=(5, 4))
    with pytest.raises(ValueError, match=r"rows_per_file must be 2 counts >= 1 summing to rows=5, got \[5, 0\]"):
        generate(preset="longtail", rows=5, num_files=2, out_dir=str(tmp_path), seed=0, rows_per_file=(5, 0))
