"""shard_of / splitmix64 pinned to known values; hashed-table routing keeps shared rows together."""

import pytest
import torch

from embedding_ps.wire.config import TableConfig
from embedding_ps.wire.sharding import (
    hashed_row,
    keys_of,
    route,
    shard_of,
    splitmix64_np,
)
from tests.init_reference import splitmix64_reference

GOLDEN = 0x9E3779B97F4A7C15
EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 12345678901234, -987654321]


def test_reference_matches_published_splitmix64_outputs() -> None:
    # SplitMix64 seeded with 0 outputs finalizer(k * GOLDEN): e220a8397b1dcdaf, 6e789e6aa1b965f4, ...
    assert splitmix64_reference(GOLDEN) == 0xE220A8397B1DCDAF
    assert splitmix64_reference(2 * GOLDEN) == 0x6E789E6AA1B965F4


def test_splitmix64_known_values() -> None:
    ids = torch.tensor(EXTREMES, dtype=torch.int64)
    got = splitmix64_np(ids.numpy()).tolist()
    assert got == [splitmix64_reference(x) for x in EXTREMES]
    assert got[:3] == [0, 0x5692161D100B05E5, 0xB4D055FCF2CBBD7B]
    assert got[3] == 0x5A682AFE7965DEBD and got[4] == 0x25C26EA579CEA98A


def test_shard_of_known_values() -> None:
    ids = torch.tensor(EXTREMES, dtype=torch.int64)
    assert shard_of(ids, 3).tolist() == [0, 1, 0, 1, 0, 1, splitmix64_reference(-987654321) % 3]
    assert shard_of(ids, 7).tolist()[:6] == [0, 6, 0, 3, 0, 6]
    assert shard_of(ids, 1000).tolist()[:6] == [0, 789, 67, 533, 50, 611]
    assert shard_of(ids, 1).tolist() == [0] * len(EXTREMES)


def test_shard_of_matches_reference_on_random_ids() -> None:
    ids = torch.randint(-(2**63), 2**63 - 1, (2000,), generator=torch.Generator().manual_seed(0))
    for n in (2, 5, 16, 1_000_003):
        assert shard_of(ids, n).tolist() == [splitmix64_reference(x) % n for x in ids.tolist()]


def test_shard_of_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        shard_of(torch.tensor([1]), 0)
    with pytest.raises(TypeError, match="int64"):
        shard_of(torch.tensor([1], dtype=torch.int32), 2)


def test_hashed_rows_route_with_their_row() -> None:
    table = TableConfig(name="h", dim=4, kind="hashed", num_embeddings=50)
    ids = torch.arange(-500, 500)
    rows = hashed_row(ids, 50)
    assert rows.min() >= 0 and rows.max() < 50
    assert rows.tolist() == [splitmix64_reference(x) % 50 for x in ids.tolist()]
    assert torch.equal(keys_of(ids, table), rows)
    shards = route(ids, table, 4)
    assert torch.equal(shards, shard_of(rows, 4))
    for r in rows.unique().tolist():  # every id of one row goes to one shard
        assert shards[rows == r].unique().numel() == 1
    dyn = TableConfig(name="d", dim=4)
    assert torch.equal(route(ids, dyn, 4), shard_of(ids, 4))
