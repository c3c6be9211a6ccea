"""A delta export of a table with global weight decay holds every row: each one decays every step,
touched or not (`embedding_ps.shard.decay`); a table with touched-rows decay keeps only the rows pushed since."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import ShardState
from embedding_ps.shard.snapshot import shard_dir
from recsys.serving.source import SavedShards


def test_delta_of_a_global_decay_table_holds_every_row(tmp_path) -> None:
    base = TableConfig(name="g", dim=4, optimizer="sgd", lr=0.1, weight_decay=0.5, weight_decay_mode="global",
                       init="normal")
    config = PSConfig(tables=(base, dataclasses.replace(base, name="d", weight_decay_mode="decoupled")))
    state = ShardState(config, 0)
    a, b, one = torch.tensor([1]), torch.tensor([2]), torch.ones(1, 4)
    for t in range(2):
        state.push(t, a, one, 0)                 # a: step 0 only
    for step in range(6):
        for t in range(2):
            state.push(t, b, one, step)          # b: every step
    state.save(shard_dir(tmp_path / "ps", 0), step=6)
    shards = SavedShards(SimpleNamespace(config=SimpleNamespace(ps=config), model_dir=tmp_path))
    full, delta = shards.read_table(0), shards.read_table(0, since=3)
    assert full.ids.tolist() == delta.ids.tolist() == [1, 2]
    torch.testing.assert_close(delta.rows, full.rows)
    torch.testing.assert_close(full.rows, state.pull(0, torch.tensor([1, 2]), 6))     # a decayed through step 5
    assert shards.read_table(1, since=3).ids.tolist() == [2]
