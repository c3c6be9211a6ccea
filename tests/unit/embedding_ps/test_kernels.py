"""The update kernel of a table: `native` (the default; "auto" and "torch", older names, load as it) or
`fbgemm` when a table asks for it. Resolved once per table; a table runs the path it names (its rows
equal those of the same table on the other path, which the optimizer tests compare with the reference).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from embedding_ps import native

from embedding_ps.shard import kernels
from embedding_ps.wire.config import PSConfig, TableConfig
from embedding_ps.shard.state import ShardState


def test_native_is_the_default_and_the_old_names_load_as_it() -> None:
    cfg = TableConfig(name="t", dim=8)
    assert cfg.kernel == "native"
    for name in ("native", "auto", "torch"):
        out, why = kernels.resolve(dataclasses.replace(cfg, kernel=name), True)
        assert out.kernel == "native" and why.startswith("native"), why
        assert ("old name" in why) == (name != "native")
    out, why = kernels.resolve(dataclasses.replace(cfg, kernel="fbgemm"), True)
    assert out.kernel == "fbgemm" and why == "fbgemm (configured)"
    TableConfig(name="a", dim=8, optimizer="adam", kernel="auto")   # the old default loads for any optimizer
    TableConfig(name="f", dim=8, optimizer="ftrl", kernel="native")


def test_the_line_says_which_native_body_runs() -> None:
    sgd, adam = TableConfig(name="t", dim=8, optimizer="sgd"), TableConfig(name="a", dim=8, optimizer="adam")
    assert kernels.resolve(sgd, True)[1] == "native (C)"
    assert kernels.resolve(sgd, False)[1] == "native (vectorized torch: C library not loaded)"
    assert kernels.resolve(adam, True)[1] == "native (vectorized torch: no C adam update)"


def test_shard_resolves_once_per_table_and_names_the_kernel(monkeypatch, caplog) -> None:
    calls = []
    real = kernels.resolve
    monkeypatch.setattr(kernels, "resolve", lambda cfg, loaded: calls.append(cfg.name) or real(cfg, loaded))
    tables = (TableConfig(name="fast", dim=16, optimizer="rowwise_adagrad", kernel="fbgemm"),
              TableConfig(name="slow", dim=16, optimizer="adagrad"),
              TableConfig(name="adam", dim=16, optimizer="adam"))
    with caplog.at_level(logging.DEBUG, logger="embedding_ps.shard.table"):
        state = ShardState(PSConfig(tables=tables), 0)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        for t in range(3):
            ids = torch.randint(0, 50, (40,), generator=g)
            state.push(t, ids, torch.randn(40, 16, generator=g), step)
    assert sorted(calls) == ["adam", "fast", "slow"]                    # once per table, not per push
    stats = state.stats()
    assert [stats[f"{t.name}/kernel"] for t in tables] == ["fbgemm", "native", "native"]
    assert [t.cfg.kernel for t in state.tables] == ["fbgemm", "native", "native"]  # what the push path sees
    lines = {r.getMessage().split(": update kernel ")[-1]: r.levelno for r in caplog.records}
    assert lines["fbgemm (configured)"] == logging.INFO                   # a choice worth a line
    assert lines["native (vectorized torch: no C adam update)"] == logging.DEBUG   # the default: quiet


@pytest.mark.parametrize("kernel", ["fbgemm", "native"])
def test_a_table_runs_the_path_it_names(monkeypatch, kernel: str) -> None:
    """fbgemm's fused update runs only for a table configured with it, and gives the native path's rows."""
    if not native.available():
        pytest.skip("native library unavailable (no C compiler?)")
    fused = []
    real = kernels.fbgemm_update
    monkeypatch.setattr(kernels, "fbgemm_update", lambda cfg, *a: fused.append(cfg.kernel) or real(cfg, *a))
    base = TableConfig(name="t", dim=16, optimizer="sgd", lr=0.1, init="normal", init_scale=0.5,
                       weight_decay=0.1, weight_decay_mode="l2")
    dumps = []
    for k in ("auto", kernel):
        state = ShardState(PSConfig(tables=(dataclasses.replace(base, kernel=k),)), 0)
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            ids = torch.randint(0, 30, (40,), generator=g)               # duplicates summed
            state.push(0, ids, torch.randn(40, 16, generator=g), step)
        dumps.append(state.dump_table(0)[1])
    assert len(fused) == (4 if kernel == "fbgemm" else 0)              # 4 pushes of the fbgemm table
    torch.testing.assert_close(dumps[0], dumps[1], atol=1e-6, rtol=0)


def test_a_loaded_table_keeps_its_kernel(tmp_path, caplog) -> None:
    """load() re-initialises each table from the save: same kernel, no second log line."""
    cfg = PSConfig(tables=(TableConfig(name="t", dim=16, optimizer="rowwise_adagrad", kernel="fbgemm"),))
    with caplog.at_level(logging.INFO, logger="embedding_ps.shard.table"):
        state = ShardState(cfg, 0)
        state.push(0, torch.arange(10), torch.ones(10, 16), 0)
        state.save(str(tmp_path / "s"))
        state.load(str(tmp_path / "s"))
        state.push(0, torch.arange(10), torch.ones(10, 16), 1)
    assert state.stats()["t/kernel"] == "fbgemm" and state.tables[0].cfg.kernel == "fbgemm"
    assert sum("update kernel" in r.getMessage() for r in caplog.records) == 1
