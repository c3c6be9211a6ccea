"""The `daily` synthetic preset: N day partitions of CTR data whose ids live and die over the days.

    recsys gen-data --preset daily --days 3 --rows 30000 --out runs/daily-data --start 2026-11-25
    # runs/daily-data/day=2026-11-25/part-00000.parquet, day=2026-11-26/..., day=2026-11-27/...

Each day has `rows` rows (hive-style partitions `day=YYYY-MM-DD/`): columns `label` (0/1), `p_true`
(the click probability the label was drawn from), dense `I1`, `I2` and one-id columns `user`,
`item`, `item_cat`, `ctx`:
- users: a fixed population, Zipf-distributed activity; their affinities for item categories are
  fixed (a pairwise user x category effect a model can learn and carry from day to day);
- items: each lives for a few days (born on a day, gone after it: ids that stop appearing), new ones
  are born every day (new ids); the day's active items are drawn Zipf over a popularity order that
  drifts (each item's popularity moves day to day); each item has a fixed quality and category;
- the label: Bernoulli(sigmoid(bias + quality[item] + bias[user] + affinity[user, cat] + ctx effect +
  a dense term)).

Deterministic in (seed, day): a day's file does not depend on how many days are generated.
"""

from __future__ import annotations

import datetime as dt
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NUM_USERS = 3000
NUM_CATS = 20
NUM_CTX = 8
ITEMS_PER_DAY = 600          # items born each day
ITEM_LIFE = (2, 5)           # days an item lives (inclusive range)


MAX_DAYS = 1000
"""Days the preset's item population covers (each day's file is the same whatever --days asks for)."""


def _world(seed: int) -> dict[str, np.ndarray]:
    """The fixed parts: user effects and affinities, every item's birth, life, quality and category
    (items of all MAX_DAYS days, so that nothing depends on how many days are written)."""
    rng = np.random.default_rng(seed)
    n_items = ITEMS_PER_DAY * (MAX_DAYS + ITEM_LIFE[1])
    index = np.arange(n_items, dtype=np.int64)
    return {
        "user_bias": rng.normal(0.0, 0.5, NUM_USERS),
        "affinity": rng.normal(0.0, 1.0, (NUM_USERS, NUM_CATS)),
        "ctx": rng.normal(0.0, 0.4, NUM_CTX),
        "born": index // ITEMS_PER_DAY - ITEM_LIFE[1],                                   # day of birth
        "life": rng.integers(ITEM_LIFE[0], ITEM_LIFE[1] + 1, n_items),
        "quality": rng.normal(0.0, 0.8, n_items),
        "cat": rng.integers(0, NUM_CATS, n_items),
        "drift": rng.normal(0.0, 1.0, n_items),
        # distinct ids that do not reveal the birth order: an odd multiplier is a bijection mod 2^32
        "item_id": 10_000 + (index * 2654435761) % (1 << 32),
    }


def _zipf_pick(rng: np.random.Generator, n: int, size: int, s: float = 1.1) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=p / p.sum())


def day_table(world: dict[str, np.ndarray], day: int, rows: int, seed: int) -> pa.Table:
    """Day `day`'s rows (0-based day index)."""
    rng = np.random.default_rng([seed, day])
    alive = np.flatnonzero((world["born"] <= day) & (day < world["born"] + world["life"]))
    # popularity drifts: each live item's score moves a little further every day
    score = (world["quality"][alive] + world["drift"][alive] * 0.3 * (day - world["born"][alive])
             + rng.normal(0, 0.5, alive.size))
    order = alive[np.argsort(-score)]
    items = order[_zipf_pick(rng, order.size, rows)]
    users = _zipf_pick(np.random.default_rng([seed, day, 1]), NUM_USERS, rows, 1.05)
    ctx = rng.integers(0, NUM_CTX, rows)
    dense = rng.normal(0.0, 1.0, (rows, 2)).astype(np.float32)
    cat = world["cat"][items]
    logit = (-2.3 + world["quality"][items] + world["user_bias"][users] + world["affinity"][users, cat]
             + world["ctx"][ctx] + 0.3 * dense[:, 0])
    p = 1.0 / (1.0 + np.exp(-logit))
    label = (rng.random(rows) < p).astype(np.float32)
    return pa.table({
        "label": label, "p_true": p.astype(np.float32), "I1": dense[:, 0], "I2": dense[:, 1],
        "user": users.astype(np.int64) + 1, "item": world["item_id"][items].astype(np.int64),
        "item_cat": cat.astype(np.int64) + 100, "ctx": ctx.astype(np.int64) + 200,
    })


def generate_daily(*, days: int, rows: int, out_dir: str, seed: int = 0, start: str = "2026-11-25",
                   row_group_rows: int = 65536) -> dict:
    """Write `days` partitions OUT/day=YYYY-MM-DD/part-00000.parquet of `rows` rows each; returns a summary."""
    if not 1 <= days <= MAX_DAYS or rows < 1:
        raise ValueError(f"need 1 <= days <= {MAX_DAYS} and rows >= 1, got days={days}, rows={rows}")
    first = dt.date.fromisoformat(start)
    world = _world(seed)
    out = {"days": [], "rows_per_day": rows}
    for d in range(days):
        date = (first + dt.timedelta(days=d)).isoformat()
        path = os.path.join(out_dir, f"day={date}")
        os.makedirs(path, exist_ok=True)
        table = day_table(world, d, rows, seed)
        pq.write_table(table, os.path.join(path, "part-00000.parquet"), row_group_size=row_group_rows,
                       compression="zstd")
        out["days"].append({"date": date, "ctr": float(np.mean(table.column("label").to_numpy())),
                            "items": int(np.unique(table.column("item").to_numpy()).size)})
    return out
