"""Synthetic retrieval data with planted user-item affinity (`recsys gen-data --preset retrieval`).

The world (a function of `model_seed` only, so train and eval sets of different seeds share it)::

    NUM_CLUSTERS latent clusters; item i: cluster c_i (uniform), popularity w_i ~ Zipf(ITEM_ZIPF)
    over a random permutation of the items; user u: cluster c_u (uniform)
    a positive row:  user u ~ uniform
                     item ~ w restricted to cluster c_u     with prob. AFFINITY
                          ~ w over all items                otherwise (popularity)

Columns of `out_dir/part-%05d.parquet` (every row a positive, label 1.0): `label`, `user_id`,
`user_region` (c_u, replaced by a random cluster with prob. REGION_NOISE), `user_age` (float,
noise), `item_id`, `item_cat` (c_i), `item_price` (float, log-normal), `row_id`.
The item corpus `out_dir/items/part-00000.parquet`: one row per item: `item_id`, `item_cat`,
`item_price` (and a constant `label`, which the Parquet reader requires). Ids: user u -> USER_BASE + u, item i ->
ITEM_BASE + i (int64).

A model that finds the structure ranks a user's cluster's popular items first; the most-popular
baseline ranks the global popular items, of which only ~1/NUM_CLUSTERS are in the user's cluster.
Determinism as in `data.synthetic` (chunks of GEN_CHUNK rows, each from an RNG seeded by (seed, chunk)).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from data.genbase import GEN_CHUNK, iter_chunks, write_parts

NUM_USERS = 2000
NUM_ITEMS = 4000
NUM_CLUSTERS = 20
AFFINITY = 0.85
"""Share of positives drawn from the user's own cluster."""
ITEM_ZIPF = 0.8
REGION_NOISE = 0.2
USER_BASE = 1 << 40
ITEM_BASE = 1 << 41


class RetrievalWorld:
    """Users, items and their clusters (from `model_seed`), and the positive-row sampler."""

    def __init__(self, model_seed: int = 0) -> None:
        rng = np.random.default_rng([model_seed, 0x7E7])
        self.item_cluster = rng.integers(0, NUM_CLUSTERS, NUM_ITEMS)                   # [I]
        rank = rng.permutation(NUM_ITEMS)                                               # popularity rank
        self.item_weight = 1.0 / (1.0 + rank) ** ITEM_ZIPF                               # [I]
        self.item_price = np.exp(rng.normal(3.0, 1.0, NUM_ITEMS)).astype(np.float32)    # [I]
        self.user_cluster = rng.integers(0, NUM_CLUSTERS, NUM_USERS)                    # [U]
        self.user_age = rng.normal(35.0, 10.0, NUM_USERS).astype(np.float32)           # [U]
        noisy = rng.random(NUM_USERS) < REGION_NOISE
        self.user_region = np.where(noisy, rng.integers(0, NUM_CLUSTERS, NUM_USERS), self.user_cluster)
        self.global_cdf = np.cumsum(self.item_weight) / self.item_weight.sum()          # [I]
        # per cluster: its items and the cdf of their weights
        self.cluster_items = [np.flatnonzero(self.item_cluster == c) for c in range(NUM_CLUSTERS)]
        self.cluster_cdf = [np.cumsum(self.item_weight[ix]) / self.item_weight[ix].sum()
                            for ix in self.cluster_items]

    def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n positive (user index [n], item index [n]) pairs."""
        users = rng.integers(0, NUM_USERS, n)
        items = np.minimum(np.searchsorted(self.global_cdf, rng.random(n)), NUM_ITEMS - 1)
        own = rng.random(n) < AFFINITY
        u_rand = rng.random(n)
        for c in range(NUM_CLUSTERS):
            sel = own & (self.user_cluster[users] == c)
            pick = np.minimum(np.searchsorted(self.cluster_cdf[c], u_rand[sel]), len(self.cluster_items[c]) - 1)
            items[sel] = self.cluster_items[c][pick]
        return users, items

    def rows(self, users: np.ndarray, items: np.ndarray, row_start: int) -> pa.Table:
        n = users.size
        return pa.table({
            "label": pa.array(np.ones(n, np.float32)),
            "user_id": pa.array(USER_BASE + users),
            "user_region": pa.array(self.user_region[users].astype(np.int64)),
            "user_age": pa.array(self.user_age[users]),
            "item_id": pa.array(ITEM_BASE + items),
            "item_cat": pa.array(self.item_cluster[items].astype(np.int64)),
            "item_price": pa.array(self.item_price[items]),
            "row_id": pa.array(np.arange(row_start, row_start + n, dtype=np.int64)),
        })

    def corpus(self) -> pa.Table:
        """One row per item: label (1.0), item_id, item_cat, item_price."""
        return pa.table({"label": pa.array(np.ones(NUM_ITEMS, np.float32)),    # the loader needs one
                         "item_id": pa.array(ITEM_BASE + np.arange(NUM_ITEMS)),
                         "item_cat": pa.array(self.item_cluster.astype(np.int64)),
                         "item_price": pa.array(self.item_price)})


def generate_retrieval(*, rows: int, num_files: int, out_dir: str, seed: int, row_group_rows: int = 65536,
                       compression: str = "zstd", model_seed: int = 0) -> dict:
    """Write `rows` positive rows into `num_files` files `out_dir/part-%05d.parquet` (file i holds
    rows [i * rows // num_files, (i + 1) * rows // num_files)) and the corpus into `out_dir/items/`."""
    t0 = time.perf_counter()
    world = RetrievalWorld(model_seed)

    def chunk(c: int) -> pa.Table:
        users, items = world.sample(np.random.default_rng([seed, c, 0x5EED]), GEN_CHUNK)
        return world.rows(users, items, c * GEN_CHUNK)

    schema = world.rows(np.zeros(0, np.int64), np.zeros(0, np.int64), 0).schema
    summary = write_parts("retrieval", schema, lambda: iter_chunks(chunk, rows), rows=rows, num_files=num_files,
                          out_dir=out_dir, seed=seed, row_group_rows=row_group_rows, compression=compression,
                          model_seed=model_seed)
    corpus = world.corpus()
    items = write_parts("retrieval", corpus.schema, lambda: iter([corpus]), rows=NUM_ITEMS, num_files=1,
                        out_dir=str(Path(out_dir) / "items"), seed=seed, row_group_rows=row_group_rows,
                        compression=compression, model_seed=model_seed)
    summary.update(item_files=items["files"], users=NUM_USERS, items=NUM_ITEMS, clusters=NUM_CLUSTERS,
                   seconds=round(time.perf_counter() - t0, 3))
    return summary


__all__ = ["RetrievalWorld", "generate_retrieval", "NUM_USERS", "NUM_ITEMS", "NUM_CLUSTERS"]
