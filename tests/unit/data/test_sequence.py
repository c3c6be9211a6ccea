"""The `sequence` preset (data/sequence.py) and list order through the loader (DIN reads it as time order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig
from data.loader import ParquetLoader
from data.sequence import SEQUENCE, SequenceTruth, generate_sequence, iter_sequence_rows
from data.synthetic import ids_of_ranks


def _rows(path: Path) -> pa.Table:
    return pq.read_table(path)


def test_same_rows_whatever_the_files_and_a_planted_affinity(tmp_path: Path) -> None:
    a = generate_sequence(rows=3000, num_files=1, out_dir=str(tmp_path / "a"), seed=4)
    generate_sequence(rows=3000, num_files=3, out_dir=str(tmp_path / "b"), seed=4, row_group_rows=500)
    one = _rows(tmp_path / "a" / "part-00000.parquet")
    three = pa.concat_tables([_rows(tmp_path / "b" / f"part-0000{i}.parquet") for i in range(3)])
    assert one.equals(three)
    assert 0.7 < a["oracle_auc"] < 0.95 and 0.2 < a["ctr"] < 0.7
    hist = one.column("hist").to_pylist()
    lens = np.array([len(h) for h in hist])
    assert lens.min() == 0 and lens.max() <= SEQUENCE.max_hist
    # candidate and list ids are item ids; the click probability rises with the recent matches
    truth = SequenceTruth(SEQUENCE)
    index = {int(i): k for k, i in enumerate(ids_of_ranks("item", np.arange(SEQUENCE.num_items)))}
    cat = truth.category
    items = one.column("item").to_numpy()
    m = np.array([sum(cat[index[x]] == cat[index[int(c)]] for x in h[-SEQUENCE.window:])
                  for h, c in zip(hist, items)])
    p = one.column("p_true").to_numpy()
    assert p[m >= 4].mean() > p[m == 0].mean() + 0.3
    # only the last `window` behaviors count: older matches do not raise it
    old = np.array([sum(cat[index[x]] == cat[index[int(c)]] for x in h[:-SEQUENCE.window])
                    for h, c in zip(hist, items)])
    sel = m == 0
    assert abs(p[sel & (old >= 2)].mean() - p[sel & (old == 0)].mean()) < 0.05


@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_keeps_each_lists_order(tmp_path: Path, shuffle: bool) -> None:
    generate_sequence(rows=2000, num_files=2, out_dir=str(tmp_path), seed=1, row_group_rows=300)
    files = sorted(str(p) for p in tmp_path.glob("part-*.parquet"))
    truth = {r["row_id"]: r["hist"] for f in files for r in _rows(Path(f)).select(["row_id", "hist"]).to_pylist()}
    cfg = DataConfig(batch_size=128, dense_columns=("I1",), sparse_columns=("ctx", "item", "hist"),
                     passthrough_columns=("row_id",), shuffle=shuffle, shuffle_buffer_rows=512, seed=3)
    seen = 0
    with ParquetLoader(cfg, files) as loader:
        for batch in loader:
            j = batch.sparse["hist"]
            off = j.offsets().tolist()
            for b, row in enumerate(batch.extras["row_id"].tolist()):
                assert j.values[off[b]:off[b + 1]].tolist() == truth[row]    # same ids, same order
                seen += 1
    assert seen == len(truth) == 2000


def test_rows_are_a_function_of_the_seed() -> None:
    a = next(iter_sequence_rows(100, seed=1))
    b = next(iter_sequence_rows(100, seed=1))
    c = next(iter_sequence_rows(100, seed=2))
    assert a.equals(b) and not a.equals(c)
