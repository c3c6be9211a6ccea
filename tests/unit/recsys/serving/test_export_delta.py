"""Delta export: base export + delta == full export at the later step, with evictions in between."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from recsys.serving import Predictor
from recsys.serving.delta import apply_delta
from recsys.serving.export import export_model, read_manifest, read_tensors
from recsys.serving.source import resolve_source
from recsys.serving.errors import ExportError

S1, S2 = 30, 59
# C3: LFU eviction past 150 rows per shard on every push; C4: rows unseen for 40 steps dropped at
# the sweeps (every 5 steps), so at S2 it holds rows unchanged since S1 as well; M1: a hashed table
TABLES = {"C3": {"max_rows": 150}, "C4": {"ttl_steps": 40}, "M1": {"kind": "hashed", "num_embeddings": 31}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, export_data, tiny_config, train_run) -> tuple[Path, Path]:
    """(checkpoint at step S1, run at step S2) of one training."""
    root = tmp_path_factory.mktemp("delta-run")
    cfg = tiny_config(export_data, root / "run", TABLES, log_every=5)
    ckpt, run = train_run(root, cfg, steps=(S1, S2), checkpoints=True)
    return ckpt, run


def tables_of(root: Path) -> dict[str, dict[str, np.ndarray]]:
    m = read_manifest(root)
    return {e["name"]: {k: np.array(v) for k, v in read_tensors(root / e["files"]["safetensors"])[0].items()} for e in m["tables"]}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_base_plus_delta_equals_full_export(runs, tmp_path, precision) -> None:
    ckpt, run = runs
    base = export_model(resolve_source(checkpoint=ckpt), tmp_path / "base", precision)
    assert base["step"] == S1
    delta = export_model(resolve_source(run=run), tmp_path / "delta", precision, since=S1)
    full = export_model(resolve_source(run=run), tmp_path / "full", precision)
    assert delta["kind"] == "delta" and delta["since"] == S1 and delta["step"] == full["step"] == S2
    applied = apply_delta(tmp_path / "base", tmp_path / "delta", tmp_path / "applied")
    assert applied["kind"] == "full" and applied["step"] == S2

    b, d, f, a = (tables_of(tmp_path / n) for n in ("base", "delta", "full", "applied"))
    for name in f:
        np.testing.assert_array_equal(a[name]["ids"], f[name]["ids"], err_msg=name)
        np.testing.assert_array_equal(a[name]["weight"], f[name]["weight"], err_msg=name)
        tomb = d[name]["tombstones"]
        assert not np.isin(tomb, f[name]["ids"]).any(), name
        assert np.isin(d[name]["ids"], f[name]["ids"]).all(), name
    # evictions between the steps: ids of the base that are gone at S2 are all tombstoned
    for name in ("C4", "C3"):
        gone = np.setdiff1d(b[name]["ids"], f[name]["ids"])
        assert gone.size > 0, name
        assert np.isin(gone, d[name]["tombstones"]).all(), name
    # rows not updated since S1 are left out of the delta
    assert d["C4"]["ids"].size < f["C4"]["ids"].size
    # the table files are byte for byte those of the full export
    fm, am = read_manifest(tmp_path / "full"), read_manifest(tmp_path / "applied")
    for rel, info in fm["files"].items():
        if rel.startswith("tables/"):
            assert am["files"][rel]["sha256"] == info["sha256"], rel
    # tombstones are also in Parquet
    t = pq.read_table(tmp_path / "delta" / "tables" / "C4.tombstones.parquet")
    np.testing.assert_array_equal(t.column("id").to_numpy(), d["C4"]["tombstones"])


def test_predictor_with_delta_scores_as_full_export(runs, tmp_path, export_data) -> None:
    ckpt, run = runs
    export_model(resolve_source(checkpoint=ckpt), tmp_path / "base", "int4")
    export_model(resolve_source(run=run), tmp_path / "delta", "int4", since=S1)
    export_model(resolve_source(run=run), tmp_path / "full", "int4")
    table = pq.read_table(export_data / "part-00001.parquet").slice(0, 3000)
    want = Predictor(tmp_path / "full").predict(table)
    p = Predictor(tmp_path / "base")
    before = p.predict(table)
    p.apply_delta(tmp_path / "delta")
    assert p.step == S2
    np.testing.assert_array_equal(p.predict(table), want)
    assert not np.array_equal(before, want)
    np.testing.assert_array_equal(Predictor(tmp_path / "base", deltas=[tmp_path / "delta"]).predict(table), want)
    with pytest.raises(ExportError, match="delta"):
        Predictor(tmp_path / "delta")


def test_delta_refuses_a_base_it_does_not_cover(runs, tmp_path) -> None:
    ckpt, run = runs
    export_model(resolve_source(checkpoint=ckpt), tmp_path / "base", "fp32")
    export_model(resolve_source(run=run), tmp_path / "late", "fp32", since=S1 + 5)
    with pytest.raises(ExportError, match="does not apply"):
        apply_delta(tmp_path / "base", tmp_path / "late", tmp_path / "out")
    export_model(resolve_source(run=run), tmp_path / "other", "fp16", since=S1)
    with pytest.raises(ExportError, match="precision"):
        apply_delta(tmp_path / "base", tmp_path / "other", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_delta_needs_the_eviction_log(tmp_path, export_data, tiny_config, train_run) -> None:
    tables = {"C4": {"max_rows": 100, "eviction_log_max": 20}}
    cfg = tiny_config(export_data, tmp_path / "run", tables, max_steps=12)
    run = train_run(tmp_path, cfg, steps=(12,))[0]
    with pytest.raises(ExportError, match="C4.*eviction log no longer covers step 4.*full export"):
        export_model(resolve_source(run=run), tmp_path / "delta", "fp32", since=4)
    export_model(resolve_source(run=run), tmp_path / "full", "fp32")     # a full export needs no log


def test_delta_of_a_table_without_row_counters_is_refused(tmp_path, export_data, tiny_config, train_run) -> None:
    """row_counters = false: no last-seen step a row to select by; a full export still works."""
    cfg = tiny_config(export_data, tmp_path / "run", {"C4": {"row_counters": False}}, max_steps=6)
    run = train_run(tmp_path, cfg, steps=(6,))[0]
    with pytest.raises(ExportError, match="C4.*saved without row counters.*row_counters = false.*full export"):
        export_model(resolve_source(run=run), tmp_path / "delta", "fp32", since=2)
    export_model(resolve_source(run=run), tmp_path / "full", "fp32")
