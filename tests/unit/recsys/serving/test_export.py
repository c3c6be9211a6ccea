"""Export for serving: formats, integrity, and Predictor scores against the trained model's own eval."""

from __future__ import annotations

import dataclasses
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from data.loader import ParquetLoader
from embedding_ps import native as ps_native
from embedding_ps.wire.config import TableConfig
from embedding_ps.local import LocalStore
from recsys.metrics import CTRMetrics
from recsys.serving import Predictor
from recsys.serving.dense_export import check_no_pickle, load_dense
from recsys.serving.export import export_model, read_manifest, read_tensors
from recsys.serving.quantize import dequantize
from recsys.serving.source import resolve_source
from recsys.training.evaluate import open_run
from recsys.serving.errors import ExportError

# hashed rows, ids not admitted yet that pull zeros, and the default init rows of unseen ids all
# reach the scores
TABLES = {"C3": {"kind": "hashed", "num_embeddings": 97}, "C2": {"min_count": 3, "unadmitted": "zeros"}}


@pytest.fixture(scope="module")
def run(tmp_path_factory, export_data, tiny_config, train_run) -> Path:
    root = tmp_path_factory.mktemp("export-run")
    return train_run(root, tiny_config(export_data, root / "run", TABLES))[0]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, run) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    source = resolve_source(run=run)
    for p in ("fp32", "fp16", "int8", "int4"):
        export_model(source, root / p, p)
    return {p: root / p for p in ("fp32", "fp16", "int8", "int4")}


@pytest.fixture(scope="module")
def offline_of(export_data):
    def scores_of(run: Path) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [N], scores [N]) of a trained run on the eval file, through the training code path."""
        _, trainer = open_run(run)
        try:
            labels, scores, _ = trainer.predict((str(export_data / "part-00001.parquet"),))
        finally:
            trainer.close()
        return labels, scores

    return scores_of


@pytest.fixture(scope="module")
def offline(run, offline_of):
    return offline_of(run)


def auc(labels: torch.Tensor, scores: np.ndarray) -> float:
    m = CTRMetrics(exact_auc=True)
    m.update(labels, torch.from_numpy(scores).double())
    return m.compute()["auc"]


def test_fp32_predictor_equals_trained_model_eval(exports, offline, export_data) -> None:
    labels, scores = offline
    predictor = Predictor(exports["fp32"])
    got = predictor.predict(pq.read_table(export_data / "part-00001.parquet"))
    assert got.shape == scores.shape
    np.testing.assert_allclose(got, scores.numpy(), atol=1e-5, rtol=0)
    # a Batch straight from the training loader scores the same
    cfg = dataclasses.replace(predictor.config.data, shuffle=False)
    with ParquetLoader(cfg, (str(export_data / "part-00001.parquet"),)) as loader:
        batch = next(iter(loader))
    np.testing.assert_allclose(predictor.predict(batch), scores[:batch.batch_size].numpy(), atol=1e-5, rtol=0)


def test_lookup_matches_ps_pull_for_known_and_unknown_ids(run, exports) -> None:
    predictor = Predictor(exports["fp32"])
    cfg = predictor.config
    store = LocalStore.from_dir(cfg.ps, run / "model" / "ps")
    for t, table in enumerate(cfg.ps.tables):
        known = torch.from_numpy(np.array(predictor.tables[t].ids[:50]))
        unknown = torch.tensor([12345678901, 3, 2**62 + 7], dtype=torch.int64)
        ids = torch.cat([unknown, known]) if table.kind == "dynamic" else torch.arange(-5, 300)
        torch.testing.assert_close(predictor.lookup(table.name, ids), store.pull(t, ids), atol=0, rtol=0,
                                   msg=f"table {table.name}")


def test_quantized_auc_close_to_fp32(exports, offline, export_data) -> None:
    labels, _ = offline
    table = pq.read_table(export_data / "part-00001.parquet")
    got = {p: auc(labels, Predictor(exports[p]).predict(table)) for p in ("fp32", "int8", "int4")}
    assert got["fp32"] > 0.6, got
    assert abs(got["int8"] - got["fp32"]) <= 0.001, got
    assert abs(got["int4"] - got["fp32"]) <= 0.005, got


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_parquet_reads_back_with_plain_pyarrow(exports, precision) -> None:
    root = exports[precision]
    manifest = read_manifest(root)
    for entry in manifest["tables"]:
        tensors, meta = read_tensors(root / entry["files"]["safetensors"])
        assert meta["precision"] == precision and int(meta["dim"]) == entry["dim"]
        t = pq.read_table(root / entry["files"]["parquet"])
        ids = t.column("id").to_numpy()
        vec = t.column("vector").combine_chunks()
        values = vec.values.to_numpy(zero_copy_only=False).reshape(len(t), -1)
        np.testing.assert_array_equal(ids, tensors["ids"])
        assert (np.diff(ids) > 0).all() and len(ids) == entry["rows"]
        if precision in ("fp32", "fp16"):
            np.testing.assert_array_equal(values, tensors["weight"])
        else:
            scale, bias = t.column("scale").to_numpy(), t.column("bias").to_numpy()
            want = dequantize(tensors["weight"], precision, entry["dim"]).numpy()
            if precision == "int8":
                got = values * scale[:, None] + bias[:, None]
            else:    # two codes per byte, low nibble first; padding columns past D
                codes = np.stack([values & 0xF, values >> 4], axis=2).reshape(len(t), -1)[:, :entry["dim"]]
                got = codes * scale[:, None] + bias[:, None]
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_manifest_describes_the_export(exports, run) -> None:
    m = read_manifest(exports["int8"])
    assert m["kind"] == "full" and m["precision"] == "int8" and m["step"] > 0
    assert [t["name"] for t in m["tables"]] == ["C1", "C2", "C3", "C4", "M1"]
    c3 = m["tables"][2]
    assert c3["kind"] == "hashed" and c3["num_embeddings"] == 97 and c3["rows"] <= 97
    assert m["tables"][1]["default"]["unadmitted"] == "zeros"
    assert [f["feature"] for f in m["features"]["pooled"]] == ["C1", "C2", "C3", "C4", "M1"]
    assert m["features"]["pooled"][4]["pooling"] == "mean"
    assert m["dense"]["columns"] == ["I1", "I2"] and [i["name"] for i in m["dense"]["inputs"]] == ["dense", "pooled"]
    assert set(m["files"]) >= {"dense.pt2", "config.toml", "tables/C1.safetensors", "tables/C1.parquet"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in m["files"].values())


@pytest.mark.parametrize("victim, damage", [
    ("tables/C4.safetensors", "flip"), ("tables/C4.safetensors", "truncate"), ("tables/C4.safetensors", "header"),
    ("tables/C1.parquet", "flip"), ("dense.pt2", "truncate"), ("config.toml", "flip")])
def test_corrupted_file_is_detected_and_named(exports, tmp_path, victim, damage) -> None:
    root = tmp_path / "copy"
    shutil.copytree(exports["fp32"], root)
    path = root / victim
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[:-7]
    else:
        data[10] = ord("{")
    path.write_bytes(bytes(data))
    name = victim.rsplit("/", 1)[-1]
    with pytest.raises(ExportError, match=name):
        read_manifest(root)
    with pytest.raises(ExportError, match=name):
        Predictor(root)
    if victim.endswith(".safetensors") and damage == "truncate":
        with pytest.raises(ExportError, match="C4.safetensors.*truncated"):
            read_tensors(path)


def test_dense_program_batch_1_and_no_pickle(exports, tmp_path) -> None:
    path = exports["fp32"] / "dense.pt2"
    scorer = load_dense(path)
    for B in (1, 7):
        out = scorer(torch.rand(B, 2), torch.rand(B, 5, 8))
        assert out.shape == (B,) and out.dtype == torch.float32
    with zipfile.ZipFile(path) as z:
        assert all(i.file_size == 0 for i in z.infolist() if "sample_inputs" in i.filename)
    # an archive carrying a pickled payload is refused before torch sees it
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(bad, "w") as dst:
        for i in src.infolist():
            body = src.read(i)
            if "sample_inputs" in i.filename:
                body = b"\x80\x04K\x01."          # a pickle
            dst.writestr(i, body)
    with pytest.raises(ExportError, match="pickle"):
        check_no_pickle(bad)


def test_export_refuses_to_replace_a_directory_that_is_not_an_export(run, tmp_path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(ExportError, match="not an export"):
        export_model(resolve_source(run=run), out, "fp16")
    assert (out / "notes.txt").read_text() == "keep"
    assert not list(tmp_path.glob(".precious.tmp-*"))


def test_deepfm_with_linear_tables(tmp_path, export_data, tiny_config, train_run, offline_of) -> None:
    """A model with first-order (dim-1) tables: the dense program takes the linear terms too."""
    cfg = tiny_config(export_data, tmp_path / "run", max_steps=20)
    lin = {"C1": "C1_lin", "C2": "C2_lin", "M1": "M1_lin"}
    tables = cfg.ps.tables + tuple(TableConfig(name=t, dim=1, lr=0.05) for t in lin.values())
    cfg = dataclasses.replace(
        cfg, ps=dataclasses.replace(cfg.ps, tables=tables),
        model=dataclasses.replace(cfg.model, arch="deepfm", linear_feature_tables=lin,
                                  table_pooling={"M1": "mean", "M1_lin": "mean"}))
    run = train_run(tmp_path, cfg)[0]
    labels, scores = offline_of(run)
    table = pq.read_table(export_data / "part-00001.parquet")
    for precision in ("fp32", "int4"):
        m = export_model(resolve_source(run=run), tmp_path / precision, precision)
        assert [i["name"] for i in m["dense"]["inputs"]] == ["dense", "pooled", "linear"]
        assert [f["table"] for f in m["features"]["linear"]] == ["C1_lin", "C2_lin", "M1_lin"]
        got = Predictor(tmp_path / precision).predict(table)
        if precision == "fp32":
            np.testing.assert_allclose(got, scores.numpy(), atol=1e-5, rtol=0)
        else:
            assert abs(auc(labels, got) - auc(labels, scores.numpy())) <= 0.005


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_fused_lookup_scores_equal_per_table_path(exports, export_data, precision: str) -> None:
    """Predictor's native pooling (recsys/serving/native_fused.py) against its per-table path, bit for
    bit; without the kernel (no compiler) the Predictor opens on the per-table path."""
    predictor, reference = Predictor(exports[precision]), Predictor(exports[precision], fused=False)
    assert reference.native is None
    prev = ps_native.set_enabled(False)
    try:
        assert Predictor(exports[precision]).native is None
    finally:
        ps_native.set_enabled(prev)
    table = pq.read_table(export_data / "part-00001.parquet").slice(0, 3000)
    fused = predictor.predict(table)
    per_table = reference.predict(table)
    assert fused.shape == (3000,)
    np.testing.assert_array_equal(fused, per_table)
    for B in (1, 2, 17):                       # small requests too
        one = predictor.predict(table.slice(5, B))
        np.testing.assert_array_equal(one, reference.predict(table.slice(5, B)))


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2 + 5 * 8, 1)

    def forward(self, dense, pooled, linear=None):
        return self.lin(torch.cat([dense, pooled.flatten(1)], dim=1)).squeeze(1)


@pytest.mark.parametrize("autocast", [False, True])
def test_fast_scorer_equals_exported_module(exports, tmp_path, autocast: bool) -> None:
    """load_dense's FastScorer (the lifted graph, called directly) against ExportedProgram.module()."""
    from recsys.serving.dense_export import MAX_BATCH, FastScorer, Scorer
    if autocast:                                   # a program with an enabled bf16 autocast region
        path = tmp_path / "tiny.pt2"
        B = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        program = torch.export.export(Scorer(_Tiny().eval(), True).eval(), (torch.zeros(2, 2), torch.zeros(2, 5, 8)),
                                      dynamic_shapes=({0: B}, {0: B}))
        program._example_inputs = None
        torch.export.save(program, path)
    else:
        path = exports["fp32"] / "dense.pt2"
    fast, module = load_dense(path), load_dense(path, fast=False)
    assert isinstance(fast, FastScorer)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for B in (1, 3, 64):
            args = (torch.rand(B, 2, generator=g), torch.rand(B, 5, 8, generator=g))
            assert torch.equal(fast(*args), module(*args))
    with pytest.raises(ValueError, match="dense program inputs"):
        fast(torch.rand(2, 3), torch.rand(2, 5, 8))
    with pytest.raises(ValueError, match="dense program inputs"):
        fast(torch.rand(2, 2), torch.rand(3, 5, 8))
