"""Every benchmark script runs to its report at its smallest size.

A benchmark imports product internals (a snapshot's fields, a client's switches, a predictor's
paths), so a rename in the product can break it without any other test failing; the figures
themselves are measured by hand (BENCHMARKS.md). Each case runs the script as BENCHMARKS.md does,
with tiny sizes and `--allow-missing-baseline` where it has one (TorchRec is not a test dependency),
and checks that the JSON report holds our own figures as positive numbers. No timing is asserted.
`train_gpu.py` has its own test (test_train_gpu_cpu.py); `plots.py` and the figure arithmetic are
tested on hand-made inputs (tests/unit/test_benchmark_reports.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

NO_BASE = "--allow-missing-baseline"
TRAIN = ["--rows", "4000", "--steps", "3", "--log-every", "2", "--repeats", "1", "--dim", "8"]
PS = ["--batch", "256", "--pool", "2000"]

# script -> (arguments, keys of the report that hold positive numbers; "a.b" looks inside "a")
CASES: dict[str, tuple[list[str], list[str]]] = {
    "checkpoint": (["--rows", "1000", "--dim", "8", "--repeats", "1", "--push-rows", "100", NO_BASE],
                   ["blocking_save_s"]),
    "daily": (["--rows", "2000", "--repeats", "1"], ["train_s_warm", "delta_bytes", "next_day_auc_warm"]),
    "data_pipeline": (["--rows", "2000", "--reps", "1", "--files", "2", "--batch-size", "256",
                       "--row-group-rows", "500", NO_BASE], ["rows_per_s", "rows_per_s_inline"]),
    "placement": (["--batch", "64", "--dim", "8", "--steps", "3", "--rows", "1000"], ["results"]),
    "preflight": (["--repeats", "1"], ["seconds"]),
    "ps_shm_push": ([*PS, "--rounds", "2"], ["copy_first_pull_ms", "late_notify_push_ms"]),
    "ps_table": (["--rows", "2000", "--batch", "256", "--repeats", "1", "--skip-rss"],
                 ["pull_d64_rows_per_s", "push_d64_rows_per_s"]),
    "ps_throughput": ([*PS, "--repeats", "1", "--shards", "1", "--clients", "1", "--skip-core"],
                      ["rows_per_s", "ratio_vs_inprocess_zipf"]),
    "ps_transport": ([*PS, "--rounds", "2"], ["socket_pull_median_ms", "shm_push_median_ms"]),
    "quality": (["--quick", "--seeds", "0", "--max-epochs", "1"], ["onehot", "longtail"]),
    "ray_overhead": (["--repeats", "1", "--steps", "3"], ["local_samples_per_s", "ray_samples_per_s"]),
    "retrieval": (["--items", "2000", "--dim", "8", "--batch", "16", "--k", "5", "--repeats", "1"], ["data"]),
    "row_cache": (["--vocab", "2000", "--steps", "5", "--warmup", "1", "--batch", "256", "--dim", "8"],
                  ["results"]),
    "scale": (["--rows", "2000", "--dim", "8", "--shards", "1", "--points", "", "--steps", "3",
               "--batch", "256", "--features", "2"], ["fill_rows_per_s", "bytes_per_row"]),
    "serve": (["--clients", "1", "--duration", "1", "--warmup", "0.5", "--repeats", "1", "--rows", "2000",
               "--steps", "3"], ["predictions_per_s_1", "inprocess_predictions_per_s"]),
    "serving": (["--rows", "8192", "--extra-rows", "1000", "--steps", "3", "--requests", "20",
                 "--timed-s", "0.01", "--workdir", "w", NO_BASE], ["p50_ms_b1", "p99_ms_b1"]),
    "shard_ops": (["--rows", "1000", "--dim", "8", "--calls", "2", "--tables", "2", "--batch", "256"],
                  ["init_c_ms", "merge_c_ms"]),
    "shm_segments": ([*PS, "--blocks", "1", "--block", "3"], ["uniform_settle_pull_ms", "zipf_settle_push_ms"]),
    "sparse_step_cpu": (["--steps", "3", "--rows", "2000", "--batches", "2", "--batch-size", "256", "--dim", "8",
                         NO_BASE], ["ours_trainer_ms"]),
    "startup": (["--repeats", "1"], ["train_first_step_s", "eval_s"]),
    "stop_check": (["--ranks", "2", "--iters", "3"], ["step_us"]),
    "train_throughput": ([*TRAIN, "--batch-size", "256", "--configs", "ours_sync", "ours_async", "ours_local",
                          NO_BASE], ["ours_sync", "ours_async", "ours_local"]),
    "train_distributed": ([*TRAIN, "--global-batch", "512", "--configs", "ours_sync_2t2s", "--no-warmup", NO_BASE],
                          ["ours_sync_2t2s"]),
}


def _report(stdout: str) -> dict:
    """The script's JSON report: its last line, or (indented reports) everything from the first '{' line."""
    lines = stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        first = next(i for i, line in enumerate(lines) if line.startswith("{"))
        return json.loads("\n".join(lines[first:]))


def _positive(value) -> bool:
    if isinstance(value, dict | list):
        return len(value) > 0
    return isinstance(value, int | float) and value > 0


def test_every_script_has_a_case() -> None:
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    not_run = {"cpu_time", "quality_reference", "plots", "train_gpu"}      # modules, or tested elsewhere
    assert scripts - not_run == set(CASES)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_to_its_report(script: str, tmp_path: Path) -> None:
    args, keys = CASES[script]
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--json", *args]
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)})
    try:
        out, err = p.communicate(timeout=360)
    finally:
        with contextlib.suppress(ProcessLookupError):       # the script's own processes (shards, trainers, Ray) too
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert p.returncode == 0, err[-3000:]
    report = _report(out)
    assert isinstance(report, dict) and report
    for key in keys:
        assert _positive(report.get(key)), (key, report.get(key))
