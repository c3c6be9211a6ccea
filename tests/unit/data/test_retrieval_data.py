"""The `retrieval` preset: deterministic rows and the item corpus, with the planted affinity."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from data import retrieval as R
from data.synthetic import generate


def test_rows_corpus_and_planted_affinity(tmp_path: Path) -> None:
    a = generate(preset="retrieval", rows=6000, num_files=2, out_dir=str(tmp_path / "a"), seed=3)
    b = generate(preset="retrieval", rows=6000, num_files=3, out_dir=str(tmp_path / "b"), seed=3)
    ta = pq.read_table(a["files"])
    tb = pq.read_table(b["files"])
    assert ta.equals(tb.cast(ta.schema))                # same rows whatever the number of files
    assert a["rows_per_file"] == [3000, 3000]
    items = pq.read_table(a["item_files"])
    assert items.num_rows == R.NUM_ITEMS
    assert len(set(items.column("item_id").to_pylist())) == R.NUM_ITEMS
    world = R.RetrievalWorld(0)
    user = ta.column("user_id").to_numpy() - R.USER_BASE
    cat = ta.column("item_cat").to_numpy()
    same = float(np.mean(world.user_cluster[user] == cat))
    # AFFINITY of the rows from the own cluster, plus 1/NUM_CLUSTERS of the popularity draws
    expected = R.AFFINITY + (1 - R.AFFINITY) / R.NUM_CLUSTERS
    assert abs(same - expected) < 0.03, (same, expected)
    item = ta.column("item_id").to_numpy() - R.ITEM_BASE
    np.testing.assert_array_equal(world.item_cluster[item], cat)         # item_cat is the item's cluster
    assert set(ta.column("label").to_pylist()) == {1.0}
