"""data.synthetic: hashing, Zipf sampling, AUC, the hidden model, determinism, files, realism."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data.config import DataConfig
from recsys.metrics import auc
from data.synthetic import (
    GEN_CHUNK,
    PRESETS,
    GroundTruth,
    data_config_kwargs,
    generate,
    ids_of_ranks,
    preset_schema,
    splitmix64,
    zipf_pmf,
    zipf_ranks,
)


def read_dir(path: Path) -> pa.Table:
    files = sorted(path.glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).replace_schema_metadata(None)


# --------------------------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------------------------
def test_splitmix64_known_values() -> None:
    # The first two outputs of the reference splitmix64 generator seeded with 0.
    x = np.array([0, 0x9E3779B97F4A7C15], dtype=np.uint64)
    assert splitmix64(x).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_ids_are_non_negative_distinct_and_seed_free() -> None:
    ids = ids_of_ranks("C3", np.arange(200_000))
    assert ids.dtype == np.int64 and (ids >= 0).all()
    assert len(np.unique(ids)) == len(ids)
    assert not np.array_equal(ids[:100], ids_of_ranks("C4", np.arange(100)))
    assert ids.max() > 2**62  # 64-bit looking, not small integers


def test_roc_auc_hand_computed() -> None:
    # the one exact AUC is recsys.metrics.auc(labels, scores) (data/ keeps only the generator's
    # histogram AUC of its oracle figure)
    # pos {0.35, 0.8} vs neg {0.1, 0.4}: 0.35>0.1, 0.35<0.4, 0.8>both -> 3/4
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    # ties: pos {0.5, 0.9} vs neg {0.5, 0.2}: 0.5=0.5 counts 1/2 -> (0.5 + 1 + 1 + 1) / 4
    assert auc(np.array([1, 0, 0, 1]), np.array([0.5, 0.5, 0.2, 0.9])) == 0.875
    assert auc(np.array([1, 0, 1]), np.array([3.0, 3.0, 3.0])) == 0.5
    assert math.isnan(auc(np.array([1, 1]), np.array([0.1, 0.2])))      # one class: undefined


def test_roc_auc_matches_pairwise_count() -> None:
    rng = np.random.default_rng(0)
    s = rng.integers(0, 20, 300).astype(float)  # many ties
    y = rng.random(300) < 0.3
    pos, neg = s[y], s[~y]
    ref = ((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()) / (
        len(pos) * len(neg))
    assert auc(y, s) == pytest.approx(ref, abs=1e-12)


def test_zipf_pmf_is_the_sampler_distribution() -> None:
    for vocab, s in [(10, 1.0), (105, 1.1), (1000, 1.3)]:
        pmf = zipf_pmf(vocab, s)
        assert pmf.sum() == pytest.approx(1.0) and (np.diff(pmf) <= 1e-15).all()
        u = np.random.default_rng(1).random(400_000)
        freq = np.bincount(zipf_ranks(u, vocab, s), minlength=vocab) / len(u)
        assert np.abs(freq - pmf).max() < 3e-3


def test_interactions_have_no_linear_part() -> None:
    gt = GroundTruth(PRESETS["criteo-like"])
    for a, b, _ in PRESETS["criteo-like"].pairs:
        spec = next(f for f in PRESETS["criteo-like"].sparse if f.name == b)
        _, v = gt.effects(b, np.arange(spec.vocab))
        assert np.abs(zipf_pmf(spec.vocab, spec.zipf) @ v).max() < 1e-9  # E[v_b] = 0


# --------------------------------------------------------------------------------------------
# the files
# --------------------------------------------------------------------------------------------
def test_schema_and_content(tmp_path: Path) -> None:
    n = 50_000
    summary = generate(preset="criteo-like", rows=n, num_files=2, out_dir=str(tmp_path), seed=3)
    t = read_dir(tmp_path)
    names = preset_schema("criteo-like")
    assert names["dense"] == tuple(f"I{i}" for i in range(1, 14))
    assert names["sparse"] == tuple(f"C{i}" for i in range(1, 27))
    assert names["list"] == ("M1", "M2")
    assert t.column_names == ["label", *names["dense"], *names["sparse"], *names["list"], "row_id", "p_true"]
    assert t.schema.field("label").type == pa.float32() and t.schema.field("C3").type == pa.int64()
    assert t.schema.field("M1").type == pa.list_(pa.int64())
    assert np.array_equal(t.column("row_id").to_numpy(), np.arange(n))
    label = t.column("label").to_numpy()
    assert set(np.unique(label)) == {0.0, 1.0}
    assert summary["ctr"] == pytest.approx(label.mean())
    p = t.column("p_true").to_numpy()
    assert ((p > 0) & (p < 1)).all()
    assert abs(label.mean() - p.mean()) < 4 * math.sqrt(p.mean() / n)
    assert summary["oracle_auc"] == pytest.approx(auc(label, p), abs=1e-3)
    for c in names["sparse"]:
        ids = t.column(c).drop_null().to_numpy()
        assert (ids >= 0).all()
    assert len(np.unique(t.column("C6").drop_null().to_numpy())) <= 24
    assert len(np.unique(t.column("C3").drop_null().to_numpy())) > 5000  # huge vocabulary
    assert 0.4 < t.column("C22").null_count / n < 0.6 and t.column("C1").null_count == 0
    assert 0.7 < t.column("I12").null_count / n < 0.8
    i5 = t.column("I5").drop_null().to_numpy()
    assert i5.min() >= 0 and i5.max() > 100 * np.median(i5)  # heavy tail
    for c, lo, hi in [("M1", 5.5, 6.5), ("M2", 8.5, 9.5)]:
        lengths = pa.compute.list_value_length(t.column(c)).to_numpy()
        assert lo < lengths.mean() < hi and (lengths == 0).sum() > 0


def test_files_row_groups_and_determinism(tmp_path: Path) -> None:
    n = GEN_CHUNK + 5000  # crosses a generation chunk
    a = generate(preset="tiny", rows=n, num_files=3, out_dir=str(tmp_path / "a"), seed=7,
                 row_group_rows=4000)
    assert [Path(f).name for f in a["files"]] == [f"part-0000{i}.parquet" for i in range(3)]
    bounds = [i * n // 3 for i in range(4)]
    assert a["rows_per_file"] == [bounds[i + 1] - bounds[i] for i in range(3)]
    for f, rows in zip(a["files"], a["rows_per_file"]):
        md = pq.ParquetFile(f).metadata
        groups = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        assert sum(groups) == rows and all(g == 4000 for g in groups[:-1]) and 0 < groups[-1] <= 4000
        assert md.row_group(0).column(0).compression == "ZSTD"
    assert not list(tmp_path.glob("a/*.tmp"))
    same = generate(preset="tiny", rows=n, num_files=3, out_dir=str(tmp_path / "b"), seed=7,
                    row_group_rows=4000)
    other_layout = generate(preset="tiny", rows=n, num_files=1, out_dir=str(tmp_path / "c"), seed=7,
                            row_group_rows=1000, compression="none")
    md = pq.ParquetFile(other_layout["files"][0]).metadata
    assert md.row_group(0).column(0).compression == "UNCOMPRESSED"
    generate(preset="tiny", rows=1234, num_files=1, out_dir=str(tmp_path / "d"), seed=7)
    other_seed = generate(preset="tiny", rows=n, num_files=1, out_dir=str(tmp_path / "e"), seed=8)
    ta = read_dir(tmp_path / "a")
    assert ta.equals(read_dir(tmp_path / "b"))
    assert ta.equals(read_dir(tmp_path / "c"))
    assert ta.slice(0, 1234).equals(read_dir(tmp_path / "d"))
    te = read_dir(tmp_path / "e")
    assert not ta.column("C3").equals(te.column("C3"))
    assert same["oracle_auc"] == a["oracle_auc"] and other_seed["rows"] == n


def test_p_true_is_the_documented_model(tmp_path: Path) -> None:
    """Recompute the logit from the written columns with the module docstring's formula."""
    p = PRESETS["tiny"]
    generate(preset="tiny", rows=20_000, num_files=1, out_dir=str(tmp_path), seed=11)
    t = read_dir(tmp_path)
    n = t.num_rows
    gt = GroundTruth(p)
    logit = np.full(n, p.bias)
    for d in p.dense:
        logit += d.beta * np.log1p(t.column(d.name).fill_null(0).to_numpy())
    vecs = {}
    for f in (*p.sparse, *p.lists):
        col = t.column(f.name).combine_chunks()
        is_list = pa.types.is_list(col.type)
        ids = col.values.to_numpy() if is_list else col.fill_null(-1).to_numpy()
        table = ids_of_ranks(f.name, np.arange(f.vocab))
        order = np.argsort(table)
        pos = np.clip(np.searchsorted(table[order], ids), 0, f.vocab - 1)
        ranks = order[pos]
        w, v = gt.effects(f.name, ranks)
        if is_list:
            lengths = np.diff(col.offsets.to_numpy())
            assert (table[ranks] == ids).all()
            row = np.repeat(np.arange(n), lengths)
            den = np.maximum(lengths, 1)
            logit += np.bincount(row, w, minlength=n) / den
            if v is not None:
                pooled = [np.bincount(row, v[:, j], minlength=n) for j in range(p.dim)]
                vecs[f.name] = np.stack(pooled, 1) / den[:, None]
        else:
            known = ids >= 0
            assert (table[ranks][known] == ids[known]).all()
            logit += np.where(known, w, 0.0)
            if v is not None:
                vecs[f.name] = np.where(known[:, None], v, 0.0)
    for a, b, s in p.pairs:
        logit += s / math.sqrt(p.dim) * (vecs[a] * vecs[b]).sum(1)
    np.testing.assert_allclose(1 / (1 + np.exp(-logit)), t.column("p_true").to_numpy(), rtol=1e-6, atol=1e-7)


def test_data_config_kwargs_build_a_config() -> None:
    for preset in PRESETS:
        cfg = DataConfig(train_paths=("x",), **data_config_kwargs(preset))
        s = preset_schema(preset)
        assert cfg.sparse_columns == (*s["sparse"], *s["list"]) and cfg.dense_columns == s["dense"]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown synthetic preset 'nope'; valid: criteo-like, longtail, tiny"):
        generate(preset="nope", rows=10, num_files=1, out_dir=str(tmp_path), seed=0)
    with pytest.raises(ValueError, match="num_files <= rows"):
        generate(preset="tiny", rows=3, num_files=4, out_dir=str(tmp_path), seed=0)
    generate(preset="tiny", rows=10, num_files=1, out_dir=str(tmp_path), seed=0)
    with pytest.raises(FileExistsError, match="part-00000.parquet"):
        generate(preset="tiny", rows=10, num_files=1, out_dir=str(tmp_path), seed=0)


# --------------------------------------------------------------------------------------------
# realism: CTR, oracle AUC, and a linear model that falls short of the oracle
# --------------------------------------------------------------------------------------------
def _id_bags(t: pa.Table, columns: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """One bag per row over all (feature, id) pairs: (indices, per-id weights, offsets [N+1], size).

    A scalar column gives one index per row (null is its own id); a list column gives its items
    with weight 1/len (the mean). Indices of different features never collide.
    """
    n = t.num_rows
    rows, idx, wts, base = [], [], [], 0
    for c in columns:
        col = t.column(c).combine_chunks()
        if pa.types.is_list(col.type):
            lengths = np.diff(col.offsets.to_numpy())
            ids, r = col.values.to_numpy(), np.repeat(np.arange(n), lengths)
            w = 1.0 / lengths[r]
        else:
            ids, r, w = col.fill_null(-1).to_numpy(), np.arange(n), np.ones(n)
        uniq, inv = np.unique(ids, return_inverse=True)
        rows.append(r), idx.append(inv + base), wts.append(w)
        base += len(uniq)
    r = np.concatenate(rows)
    order = np.argsort(r, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=n))])
    return np.concatenate(idx)[order], np.concatenate(wts)[order].astype(np.float32), offsets, base


def _logistic_regression_auc(t: pa.Table, n_train: int, epochs: int = 2, batch: int = 1024) -> float:
    """Bias + one weight per (feature, id) + a weight per log1p dense column; Adagrad; best epoch."""
    torch.manual_seed(0)
    s = preset_schema("criteo-like")
    idx, wts, offsets, size = _id_bags(t, (*s["sparse"], *s["list"]))
    dense = np.stack([np.log1p(t.column(c).fill_null(0).to_numpy().clip(0)) for c in s["dense"]], 1)
    dense = torch.from_numpy(((dense - dense.mean(0)) / dense.std(0)).astype(np.float32))
    label = torch.from_numpy(t.column("label").to_numpy())
    emb = torch.nn.EmbeddingBag(size, 1, mode="sum", sparse=True)
    torch.nn.init.zeros_(emb.weight)
    lin = torch.nn.Linear(dense.shape[1], 1)
    opt_s = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    opt_d = torch.optim.Adagrad(lin.parameters(), lr=0.1)
    idx_t, wts_t, off_t = torch.from_numpy(idx), torch.from_numpy(wts), torch.from_numpy(offsets)

    def logits(lo: int, hi: int) -> torch.Tensor:
        a, b = offsets[lo], offsets[hi]
        bag = emb(idx_t[a:b], off_t[lo:hi] - a, per_sample_weights=wts_t[a:b])
        return bag.squeeze(1) + lin(dense[lo:hi]).squeeze(1)

    best = 0.0
    for _ in range(epochs):
        for lo in range(0, n_train, batch):  # rows are iid: no shuffle needed
            hi = min(lo + batch, n_train)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(lo, hi), label[lo:hi])
            opt_s.zero_grad(), opt_d.zero_grad()
            loss.backward()
            opt_s.step(), opt_d.step()
        with torch.no_grad():
            score = logits(n_train, t.num_rows).numpy()
        best = max(best, auc(label[n_train:].numpy(), score))
    return best


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_task_is_realistic(tmp_path: Path) -> None:
    """Base CTR in [0.02, 0.30], oracle AUC in [0.75, 0.85], and a logistic regression on the raw
    ids (plus the dense columns) at least 0.03 AUC below the oracle on held-out rows."""
    n, n_train = 200_000, 150_000
    generate(preset="criteo-like", rows=n, num_files=2, out_dir=str(tmp_path), seed=0)
    t = read_dir(tmp_path)
    label, p_true = t.column("label").to_numpy(), t.column("p_true").to_numpy()
    ctr = label.mean()
    oracle = auc(label[n_train:], p_true[n_train:])
    lr_auc = _logistic_regression_auc(t, n_train)
    assert 0.02 <= ctr <= 0.30, ctr
    assert 0.75 <= oracle <= 0.85, oracle
    assert oracle - lr_auc >= 0.03, (oracle, lr_auc)
    assert lr_auc > 0.65, lr_auc  # the linear model does learn something
