"""`kernel = "auto"`: resolved once per table from the measured table in embedding_ps/kernels.py.

The rule is tested on figures set by each test (the measured ones change with every new
measurement); the tables that ship are checked for coverage, and a table resolved to a path must
run that path (its rows equal those of the same table configured with that kernel).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from embedding_ps import kernels, native
from embedding_ps.config import PSConfig, TableConfig
from embedding_ps.shard import ShardState

DECAYS = {"none": {}, "l2": dict(weight_decay=0.1, weight_decay_mode="l2"),
          "decoupled": dict(weight_decay=0.1, weight_decay_mode="decoupled")}


@pytest.fixture
def figures(monkeypatch):
    """Replace every measured figure by (fbgemm, native, fbgemm without C, torch) = (2, 4, 2, 1) M rows/s;
    returns the dict to edit."""
    table = {key: (2.0, 4.0, 2.0, 1.0) for key in kernels.MEASURED}
    monkeypatch.setattr(kernels, "MEASURED", table)
    monkeypatch.setattr(kernels, "MEASURED_EARLIER", ())     # one machine unless a test adds one
    return table


def resolved(cfg: TableConfig, native_loaded: bool = True) -> str:
    return kernels.kernel_name(kernels.resolve(cfg, native_loaded)[0])


def test_measured_table_covers_every_fbgemm_case() -> None:
    want = {(o, d, dt, dim) for o in kernels.FBGEMM_OPTIMIZERS for d in DECAYS for dt in ("fp32", "fp16")
            for dim in kernels.MEASURED_DIMS}
    for figures in (kernels.MEASURED, *(f for _, f in kernels.MEASURED_EARLIER)):
        assert set(figures) == want
        assert all(len(v) == 4 and min(v) > 0 for v in figures.values())


def test_auto_takes_fbgemm_only_where_it_won_on_every_machine(figures, monkeypatch) -> None:
    """The winner depends on the CPU: a path measured slower on any machine is not taken."""
    cfg = TableConfig(name="t", dim=64, optimizer="rowwise_adagrad")
    key = ("rowwise_adagrad", "none", "fp32", 64)
    figures[key] = (8.0, 4.0, 8.0, 4.0)                                    # fbgemm 2x on the newest
    earlier = {k: (9.0, 1.0, 9.0, 1.0) for k in figures}
    monkeypatch.setattr(kernels, "MEASURED_EARLIER", (("2000-01-01", earlier),))
    assert resolved(cfg) == "fbgemm" and resolved(cfg, native_loaded=False) == "fbgemm"
    earlier[key] = (1.0, 4.0, 9.0, 1.0)                                    # native 4x there, with C only
    out, why = kernels.resolve(cfg, True)
    assert out.kernel == "torch" and why.endswith("but 1.00M vs 4.00M on the 2000-01-01 machine)"), why
    assert resolved(cfg, native_loaded=False) == "fbgemm"                 # without C: fbgemm won on both
    figures[key] = (1.0, 4.0, 8.0, 4.0)                                    # the newest says native itself
    assert resolved(cfg) == "native"


def test_auto_is_the_default_and_native_an_alias_of_torch() -> None:
    cfg = TableConfig(name="t", dim=8)
    assert cfg.kernel == "auto"
    for name in ("native", "torch"):
        out, why = kernels.resolve(dataclasses.replace(cfg, kernel=name), True)
        assert out.kernel == "torch" and why.startswith("native (configured")
    out, why = kernels.resolve(dataclasses.replace(cfg, kernel="fbgemm"), True)
    assert out.kernel == "fbgemm" and why == "fbgemm (configured)"
    TableConfig(name="a", dim=8, optimizer="adam", kernel="auto")   # auto is fine for any optimizer
    TableConfig(name="f", dim=8, optimizer="ftrl", kernel="native")


@pytest.mark.parametrize("optimizer", kernels.FBGEMM_OPTIMIZERS)
@pytest.mark.parametrize("decay", sorted(DECAYS))
def test_auto_picks_the_faster_measured_path(figures, optimizer: str, decay: str) -> None:
    cfg = TableConfig(name="t", dim=64, optimizer=optimizer, **DECAYS[decay])
    key = (optimizer, decay, "fp32", 64)
    figures[key] = (2.0, 4.0, 2.0, 1.0)        # native C 2x fbgemm; without C, fbgemm 2x torch
    assert resolved(cfg, native_loaded=True) == "native"
    assert resolved(cfg, native_loaded=False) == "fbgemm"  # without the C library the rival is torch
    figures[key] = (5.0, 4.0, 2.0, 1.0)
    assert resolved(cfg, native_loaded=True) == "fbgemm"
    figures[key] = (4.1, 4.0, 2.0, 1.0)        # within AUTO_MARGIN: stays native
    assert resolved(cfg, native_loaded=True) == "native"
    figures[key] = (9.0, 4.0, 0.5, 1.0)        # without C, fbgemm's figure without C decides
    assert resolved(cfg, native_loaded=False) == "native"
    # only this entry decides: other decay modes and the fp16 rows of the same optimizer do not
    for other in DECAYS:
        figures[(optimizer, other, "fp16", 64)] = (1.0, 9.0, 1.0, 9.0)
        if other != decay:
            figures[(optimizer, other, "fp32", 64)] = (1.0, 9.0, 1.0, 9.0)
    assert resolved(cfg, native_loaded=True) == "fbgemm"
    assert resolved(dataclasses.replace(cfg, dtype="fp16"), native_loaded=True) == "native"


def test_auto_uses_the_nearest_measured_dim(figures) -> None:
    figures[("sgd", "none", "fp32", 16)] = (9.0, 1.0, 9.0, 1.0)   # fbgemm wins at d16 only
    assert [resolved(TableConfig(name="t", dim=d, optimizer="sgd")) for d in (4, 16, 24, 40, 64, 512)] == [
        "fbgemm", "fbgemm", "fbgemm", "native", "native", "native"]


def test_auto_falls_back_where_fbgemm_cannot_or_was_not_measured(figures, monkeypatch) -> None:
    for key in figures:
        figures[key] = (9.0, 1.0, 9.0, 1.0)        # fbgemm would win everywhere it was measured
    assert resolved(TableConfig(name="t", dim=8, optimizer="rowwise_adagrad")) == "fbgemm"
    assert resolved(TableConfig(name="t", dim=8, optimizer="rowwise_adagrad", dtype="fp16")) == "fbgemm"
    for cfg in (TableConfig(name="t", dim=8, optimizer="adam"), TableConfig(name="t", dim=8, optimizer="ftrl")):
        out, why = kernels.resolve(cfg, True)
        assert out.kernel == "torch" and why.startswith(f"native (auto: fbgemm has no CPU {cfg.optimizer}"), why
    monkeypatch.setitem(kernels._IMPORT, "error", ImportError("no fbgemm_gpu here"))
    out, why = kernels.resolve(TableConfig(name="t", dim=8, optimizer="rowwise_adagrad"), True)
    assert out.kernel == "torch" and "fbgemm_gpu does not import: no fbgemm_gpu here" in why


def test_shard_resolves_once_per_table_and_names_the_kernel(figures, monkeypatch, caplog) -> None:
    figures[("rowwise_adagrad", "none", "fp32", 16)] = (9.0, 1.0, 9.0, 1.0)
    calls = []
    real = kernels.auto_kernel
    monkeypatch.setattr(kernels, "auto_kernel", lambda cfg, loaded: calls.append(cfg.name) or real(cfg, loaded))
    tables = (TableConfig(name="fast", dim=16, optimizer="rowwise_adagrad"),
              TableConfig(name="slow", dim=16, optimizer="adagrad"),
              TableConfig(name="adam", dim=16, optimizer="adam"))
    with caplog.at_level(logging.INFO, logger="embedding_ps.table"):
        state = ShardState(PSConfig(tables=tables), 0)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        for t in range(3):
            ids = torch.randint(0, 50, (40,), generator=g)
            state.push(t, ids, torch.randn(40, 16, generator=g), step)
    assert sorted(calls) == ["adam", "fast", "slow"]                    # once per table, not per push
    stats = state.stats()
    assert [stats[f"{t.name}/kernel"] for t in tables] == ["fbgemm", "native", "native"]
    assert [t.cfg.kernel for t in state.tables] == ["fbgemm", "torch", "torch"]  # what the push path sees
    lines = [r.getMessage() for r in caplog.records]
    assert any("'fast'): update kernel fbgemm (auto: rowwise_adagrad, no weight decay, fp32 d16" in m for m in lines)
    assert any("'adam'): update kernel native (auto: fbgemm has no CPU adam update" in m for m in lines)


@pytest.mark.parametrize("winner", ["fbgemm", "native"])
def test_auto_table_runs_the_path_it_names(figures, monkeypatch, winner: str) -> None:
    """A table resolved to a path calls that path, and gives exactly the rows of the table configured with it."""
    if not native.available():
        pytest.skip("native library unavailable (no C compiler?)")
    figures[("sgd", "l2", "fp32", 16)] = (9.0, 1.0, 9.0, 1.0) if winner == "fbgemm" else (1.0, 9.0, 1.0, 9.0)
    fused = []
    real = kernels.fbgemm_update
    monkeypatch.setattr(kernels, "fbgemm_update", lambda cfg, *a: fused.append(cfg.kernel) or real(cfg, *a))
    base = TableConfig(name="t", dim=16, optimizer="sgd", lr=0.1, init="normal", init_scale=0.5, **DECAYS["l2"])
    dumps = []
    for kernel in ("auto", winner):
        state = ShardState(PSConfig(tables=(dataclasses.replace(base, kernel=kernel),)), 0)
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            ids = torch.randint(0, 30, (40,), generator=g)               # duplicates summed
            state.push(0, ids, torch.randn(40, 16, generator=g), step)
        dumps.append(state.dump_table(0)[1])
    assert len(fused) == (8 if winner == "fbgemm" else 0)              # 4 pushes of each table
    assert torch.equal(dumps[0], dumps[1])


def test_a_loaded_table_keeps_its_kernel(figures, tmp_path, caplog) -> None:
    """load() re-initialises each table from the save: same kernel, no second log line."""
    figures[("rowwise_adagrad", "none", "fp32", 16)] = (9.0, 1.0, 9.0, 1.0)
    cfg = PSConfig(tables=(TableConfig(name="t", dim=16, optimizer="rowwise_adagrad"),))
    with caplog.at_level(logging.INFO, logger="embedding_ps.table"):
        state = ShardState(cfg, 0)
        state.push(0, torch.arange(10), torch.ones(10, 16), 0)
        state.save(str(tmp_path / "s"))
        state.load(str(tmp_path / "s"))
        state.push(0, torch.arange(10), torch.ones(10, 16), 1)
    assert state.stats()["t/kernel"] == "fbgemm" and state.tables[0].cfg.kernel == "fbgemm"
    assert sum("update kernel" in r.getMessage() for r in caplog.records) == 1
