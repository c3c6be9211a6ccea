"""The benchmark scripts' reporting: train_distributed's ratios and missing baseline, plots.py's inputs.

The timed parts need processes and minutes (they are run by hand, see BENCHMARKS.md); what is
tested here is the arithmetic and the refusal paths, on hand-made results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def td():
    return _load("train_distributed")


@pytest.fixture(scope="module")
def plots():
    return _load("plots")


def _args() -> argparse.Namespace:
    return argparse.Namespace(rows=1000, steps=10, log_every=5, repeats=3, global_batch=4096, dim=64, threads=1,
                              cap=100, ps_kernel="auto")


def _runs(*rates: float) -> list[dict]:
    return [{"samples_per_s": r, "windows": [r]} for r in rates]


def test_ratio_is_of_medians_and_pairs_per_repeat(td):
    results = {"ours_sync_2t2s": _runs(100, 300, 200), "ours_async_2t2s": _runs(90, 150, 120),
               "torchrec_dmp_tw": _runs(200, 100, 400)}
    r = td.summarize(_args(), results, [], 0.0)
    assert r["ours_sync_2t2s"] == 200 and r["torchrec_dmp_tw"] == 200
    assert r["ratio_vs_torchrec_dmp"] == 1.0
    assert r["ratio_async_vs_torchrec_dmp"] == 0.6
    assert r["ratios_per_repeat"]["ratio_vs_torchrec_dmp"] == [0.5, 3.0, 0.5]
    assert r["meets_target"] is True
    assert r["torchrec_dmp_planner"] is None and r["ratio_vs_torchrec_dmp_planner"] is None


def test_missing_baseline_gives_null_ratios(td):
    r = td.summarize(_args(), {"ours_sync_2t2s": _runs(100)}, ["torchrec not importable"], 0.0)
    assert r["torchrec_dmp_tw"] is None
    assert r["ratio_vs_torchrec_dmp"] is None and r["meets_target"] is None
    assert r["notes"] == ["torchrec not importable"]


def test_scaling_ratios(td):
    results = {"ours_sync_2t2s": _runs(300), "ours_sync_1t2s": _runs(200), "ours_sync_2t1s": _runs(150)}
    r = td.summarize(_args(), results, [], 0.0)
    assert r["scaling_sync_2t2s_vs_1t2s"] == 1.5 and r["scaling_sync_2t2s_vs_2t1s"] == 2.0


def test_job_config_splits_the_global_batch(td, tmp_path):
    args = _args()
    two = td.job_config(args, str(tmp_path), str(tmp_path / "run"), "sync", 2, 2)
    one = td.job_config(args, str(tmp_path), str(tmp_path / "run"), "async", 1, 1)
    assert two.data.batch_size == 2048 and two.train.num_trainers == 2 and two.ps.num_shards == 2
    assert one.data.batch_size == 4096 and one.ps.mode == "async"
    assert {t.optimizer for t in two.ps.tables} == {"rowwise_adagrad"} and len(two.ps.tables) == 26


def test_read_json_takes_the_last_json_line_of_a_log(plots, tmp_path):
    log = tmp_path / "log.txt"
    log.write_text('INFO starting\n{"a": 1}\nINFO more\n{"a": 2}\n')
    assert plots.read_json(str(log)) == {"a": 2}
    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"b": [1, 2]}, indent=1))
    assert plots.read_json(str(whole)) == {"b": [1, 2]}
    bad = tmp_path / "bad.txt"
    bad.write_text("no json here\n")
    with pytest.raises(ValueError, match="no JSON object"):
        plots.read_json(str(bad))


def test_latency_lists_found_nested(plots):
    found = plots._latency_lists({"p50_ms_b1": 0.2, "detail": {"fp32": {"latency_ms_b1": [0.1, 0.3]},
                                                                 "int8": {"latency_ms_b1": "n/a"}}})
    assert found == {"detail.fp32.latency_ms_b1": [0.1, 0.3]}


def test_plots_refuse_inputs_without_figures(plots, tmp_path):
    with pytest.raises(ValueError, match="no ours_"):
        plots.plot_train_distributed({"torchrec_dmp_tw": 5}, tmp_path)
    with pytest.raises(ValueError, match="mix embedding dims"):
        plots.plot_memory([{"rss_rows": 10, "rss_bytes_per_row_d16": 90.0}],
                          {"sizes": [{"rows": 10, "bytes": 2800, "dim": 64}]}, tmp_path)
    assert plots.plot_serving({"p50_ms_b1": 0.2}, tmp_path) is None


def test_train_distributed_plot_written(plots, tmp_path):
    r = {"ours_sync_2t2s": 100, "ours_async_1t2s": 80, "torchrec_dmp_tw": 90, "ratio_vs_torchrec_dmp": 1.11,
         "dim": 64, "global_batch": 4096, "cpus": 2, "date": "2026-11-25T10:00:00Z"}
    path = plots.plot_train_distributed(r, tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_plot_reads_scale_points(plots, tmp_path):
    scale = {"rows": 100, "bytes_per_row_ratio": 1.3,
             "points": [{"rows": 10, "dim": 16, "bytes_per_row": 170.0}, {"rows": 100, "dim": 16, "bytes_per_row": 83.0}]}
    path = plots.plot_memory([], None, tmp_path, scale)
    assert path.name == "memory_per_row.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="lacks points"):
        plots.plot_memory([], None, tmp_path, {"rows": 100})
    with pytest.raises(ValueError, match="mix embedding dims"):          # scale.py is D=16, ps_table here D=64
        plots.plot_memory([{"rss_rows": 10, "rss_bytes_per_row_d64": 290.0}], None, tmp_path, scale)


def test_scale_zipf_batches_are_unique_ids_in_range():
    scale = _load("scale")
    a = argparse.Namespace(batch=64, features=4, zipf=1.05)
    batches = scale.zipf_batches(a, rows=1000, n=3)
    for b in batches:
        assert b.dtype.is_floating_point is False and b.min() >= 0 and b.max() < 1000
        assert b.unique().shape[0] == b.shape[0] <= 256
    assert (batches[0] < 10).sum() >= 3            # Zipf: the first ids are the hot ones


def test_cpu_between_interpolates_and_sums_per_role():
    ct = _load("cpu_time")
    s = ct.ProcessCpuSampler()
    s.series = {1: [(10.0, 1.0), (11.0, 1.5), (12.0, 2.5)],      # 0.5 s CPU / s, then 1.0
                2: [(10.0, 0.0), (12.0, 0.2)],
                3: [(11.5, 0.4), (12.0, 0.6)]}                    # started inside the window
    s.roles = {1: "trainer", 2: "ps", 3: "trainer"}
    got = s.cpu_between(10.5, 12.0)
    assert got["trainer"] == pytest.approx((2.5 - 1.25) + 0.6)
    assert got["ps"] == pytest.approx(0.2 * 1.5 / 2)
    assert s.cpu_between(0.0, 100.0) == pytest.approx({"trainer": 2.5 + 0.6, "ps": 0.2})


def test_train_gpu_summary_ratios_targets_and_partial_runs():
    """benchmarks/train_gpu.py's summary: medians over runs, ratios of medians (#32's: every table on
    the PS, and auto placement, against TorchRec), targets judged, host CPU per step, and a summary of
    partial results (a configuration with no run yet: null, no error)."""
    tg = _load("train_gpu")
    args = argparse.Namespace(rows=1000, steps=10, log_every=5, repeats=3, batch_size=4096, dim=64, threads=4,
                              shards=4, cap=100, cache_frac=0.05, cache_staleness=8)
    run = lambda rate, busy, **kw: {"samples_per_s": rate, "gpu_busy_pct": busy, **kw}   # noqa: E731
    results = {"ours_gpu_cache": [run(100.0, 4.0, cache_hit_rate=0.2), run(120.0, 6.0, cache_hit_rate=0.3),
                                  run(90.0, 5.0, cache_hit_rate=0.4)],
               "ours_gpu": [run(80.0, 3.0, host_cpu_ms_per_step=30.0), run(100.0, 4.0, host_cpu_ms_per_step=20.0)],
               "ours_gpu_auto": [run(400.0, 30.0)],
               "torchrec_gpu": [run(400.0, 20.0), run(500.0, 10.0), run(450.0, 15.0)],
               "plain_gpu": []}
    r = tg.summarize(args, results, [], 1.0, {"test_cuda": {"rc": 0, "summary": "5 passed"}})
    assert r["ours_gpu_cache"] == 100 and r["ours_gpu"] == 90 and r["torchrec_gpu"] == 450 and r["plain_gpu"] is None
    assert r["ratio_vs_torchrec_gpu"] == round(90 / 450, 3)
    assert r["ratio_vs_torchrec_gpu_auto"] == round(400 / 450, 3)
    assert r["ratio_cache_vs_torchrec_gpu"] == round(100 / 450, 3)
    assert r["ratio_cache_vs_nocache"] == round(100 / 90, 3)
    assert r["ratio_vs_plain_gpu"] is None
    assert r["gpu_busy_pct"] == 3.5 and r["gpu_busy_pct_torchrec_gpu"] == 15.0
    assert r["host_cpu_ms_per_step"] == 25.0
    assert r["cache_hit_rate"] == 0.3
    assert r["meets_targets"] == {"ratio_vs_torchrec_gpu": False, "ratio_vs_torchrec_gpu_auto": True}
    assert r["test_cuda"]["rc"] == 0
    json.dumps(r)
    # only the auto run so far (a cut --partial run): its busy % and CPU stand for ours, the PS ratio is null
    r = tg.summarize(args, {"ours_gpu_auto": [run(400.0, 30.0, host_cpu_ms_per_step=7.0)]}, [], 1.0)
    assert r["gpu_busy_pct"] == 30.0 and r["host_cpu_ms_per_step"] == 7.0
    assert r["ratio_vs_torchrec_gpu"] is None and r["meets_targets"]["ratio_vs_torchrec_gpu"] is None


def test_serving_latency_histogram_written(plots, tmp_path):
    """serving.py --latencies FILE's shape: one series per precision and side, every call in ms."""
    calls = {p: {"predict_latency_ms_b1": [0.1 + 0.001 * i for i in range(300)],
                 "baseline_latency_ms_b1": [0.2 + 0.001 * i for i in range(300)]} for p in ("fp32", "int8")}
    path = plots.plot_serving({"p50_ms_b1": 0.25, "p99_ms_b1": 0.4, "calls": calls}, tmp_path)
    assert path == tmp_path / "serving_latency.png" and path.stat().st_size > 1000
