"""The trainer with a row cache (ps.tables[*].cache_rows) and a prefetch depth (train.pull_ahead_batches),
in one process on LocalStores: exact where it must be, metrics keys, config rules."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from embedding_ps.client.cache import CachingStore
from embedding_ps.local import LocalStore
from recsys.config import ConfigError, JobConfig, load_config
from recsys.metrics import MemoryMetricLogger
from recsys.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[4]
B = 64


@pytest.fixture(scope="module")
def data_dir(tiny_dataset) -> Path:
    return tiny_dataset(rows=24 * B, files=1, seed=3)


def job(run: Path, data: Path, cache_rows: int, *extra: str) -> JobConfig:
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}']", "data.eval_paths=[]", f"data.batch_size={B}", "data.shuffle=false",
        "ps.num_shards=2", "ps.mode='async'", "train.num_threads=1", "train.log_every=4",
        f"train.run_dir='{run}'", *extra])
    tables = tuple(dataclasses.replace(t, cache_rows=cache_rows) for t in cfg.ps.tables)
    return dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, tables=tables))


def train(cfg: JobConfig, store=None) -> tuple[Trainer, LocalStore, list[dict]]:
    torch.manual_seed(0)
    inner = LocalStore.create(cfg.ps)
    sink = MemoryMetricLogger()
    trainer = Trainer(cfg, inner if store is None else store(inner), metric_logger=sink)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer, inner, sink.lines


def rows(store: LocalStore) -> dict[tuple[int, int], torch.Tensor]:
    """{(table, id): row} over every shard."""
    out = {}
    for t in range(len(store.config.tables)):
        for state in store.states:
            keys, values, _ = state.dump_table(t)
            out.update({(t, k): v for k, v in zip(keys.tolist(), values)})
    return out


def test_cache_that_may_not_serve_older_rows_trains_exactly_as_without(tmp_path: Path, data_dir: Path) -> None:
    """ps.max_staleness = 1 with one batch prefetched: max_age 0, a cached row only serves the step
    it was pulled for, so every step pulls what the uncached run pulls: equal losses and rows."""
    plain_t, plain, plain_lines = train(job(tmp_path / "a", data_dir, 0))
    cached_t, cached, cached_lines = train(job(tmp_path / "b", data_dir, 40))
    assert isinstance(cached_t.store, CachingStore) and not isinstance(plain_t.store, CachingStore)
    assert cached_t.step == plain_t.step == 24
    assert [x["loss/train"] for x in cached_lines] == [x["loss/train"] for x in plain_lines]
    a, b = rows(plain), rows(cached)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert all(x["cache/hit_rate"] == 0.0 and x["cache/C1/hit_rate"] == 0.0 for x in cached_lines)
    assert "cache/hit_rate" not in plain_lines[0]


def test_cache_hits_within_the_staleness_bound_and_logs_per_table_rates(tmp_path: Path, data_dir: Path) -> None:
    trainer, _, lines = train(job(tmp_path / "c", data_dir, 200, "ps.max_staleness=4"))
    assert isinstance(trainer.store, CachingStore) and trainer.store.max_age == 3
    for x in lines:
        assert {f"cache/{t}/hit_rate" for t in ("C1", "C2", "C3", "C4", "M1")} <= x.keys()
        assert x["time/data_wait_ms"] >= 0 and x["time/ps_wait_ms"] >= 0
    # C1 (a few hundred ids, Zipf) is mostly hits once warm; every loss is finite
    assert lines[-1]["cache/C1/hit_rate"] > 0.5 and 0 < lines[-1]["cache/hit_rate"] < 1
    # the sparse arch passes each id's occurrences: hot ids repeat in a batch, so per lookup the
    # rate is higher than per distinct id; refreshes ahead are a share of the distinct ids
    last = lines[-1]
    assert last["cache/hit_rate"] < last["cache/hit_rate_per_lookup"] < 1 and 0 < last["cache/refresh_rate"] < 1
    assert all(torch.isfinite(torch.tensor(x["loss/train"])) for x in lines)


class Recorder:
    """Wraps a store; records ("pull" | "push" | "barrier", step) in call order."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.events = inner, []

    @property
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    def pull_many_async(self, tables, ids, step=None):
        self.events.append(("pull", self.inner.step if step is None else step))
        return self.inner.pull_many_async(tables, ids, step)

    def push_many_async(self, tables, ids, grads, step=None):
        self.events.append(("push", self.inner.step if step is None else step))
        return self.inner.push_many_async(tables, ids, grads, step)

    def barrier(self, step):
        self.events.append(("barrier", step))
        return self.inner.barrier(step)

    def barrier_async(self, step):
        self.events.append(("barrier", step))
        return self.inner.barrier_async(step)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def first_pull_before_push(events: list[tuple[str, int]]) -> dict[int, int]:
    """{t: the last step whose push came before step t's first pull}."""
    out, pushed = {}, -1
    for kind, step in events:
        if kind == "push":
            pushed = max(pushed, step)
        elif kind == "pull" and step not in out:
            out[step] = pushed
    return out


@pytest.mark.parametrize("mode, k, staleness", [("async", 0, 1), ("async", 1, 1), ("async", 3, 3),
                                                ("sync", 1, 1)])
def test_prefetch_depth_issues_each_steps_pulls_k_steps_ahead(tmp_path: Path, data_dir: Path, mode: str, k: int,
                                                              staleness: int) -> None:
    """Step t's rows are pulled once step t - K - 1 has pushed and before step t - K pushes (sync:
    K = 0, after the barrier of step t - 1); nothing is pulled for a step past max_steps."""
    rec: list[Recorder] = []

    def wrap(inner):
        rec.append(Recorder(inner))
        return rec[0]

    cfg = job(tmp_path / f"{mode}{k}", data_dir, 0, f"ps.mode='{mode}'", f"train.pull_ahead_batches={k}",
              f"ps.max_staleness={staleness}", "train.max_steps=10")
    train(cfg, store=wrap)
    want_k = k if mode == "async" else 0
    seen = first_pull_before_push(rec[0].events)
    assert sorted(seen) == list(range(10))
    assert seen == {t: max(t - want_k - 1, -1) for t in range(10)}
    if mode == "sync":
        ev = rec[0].events
        for t in range(1, 10):
            assert ev.index(("barrier", t - 1)) < ev.index(("pull", t))


def test_sync_mode_refuses_a_row_cache() -> None:
    with pytest.raises(ConfigError, match=r"ps\.tables\[C1\]\.cache_rows = 10 needs ps\.mode = 'async'"):
        load_config(ROOT / "configs" / "tiny.toml", ["ps.mode='sync'", "ps.table_defaults.cache_rows=10"])


@pytest.mark.parametrize("overrides, message", [
    (["ps.mode='async'", "train.pull_ahead_batches=2"], r"train\.pull_ahead_batches = 2 must be <= ps\.max_staleness \(1\)"),
    (["ps.mode='sync'", "train.pull_ahead_batches=2"], r"train\.pull_ahead_batches = 2 needs ps\.mode = 'async'"),
    (["train.pull_ahead_batches=-1"], r"train\.pull_ahead_batches must be >= 0, got -1"),
    (["ps.table_defaults.cache_rows=-2"], r"cache_rows must be >= 0, got -2"),
])
def test_prefetch_and_cache_config_rules(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs" / "tiny.toml", overrides)


def test_table_defaults_carry_cache_rows() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["ps.mode='async'", "ps.table_defaults.cache_rows=128"])
    assert [t.cache_rows for t in cfg.ps.tables] == [128] * len(cfg.ps.tables)
    assert cfg.train.pull_ahead_batches == 1
