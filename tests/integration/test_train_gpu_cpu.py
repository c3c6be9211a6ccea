"""The GPU device check (`benchmarks/train_gpu.py --quick`, issue #32) run as CI can run it: with
--device cpu (our trainer through the real launcher on the CPU, every table on the PS and auto
placement; no NVML, no TorchRec GPU baseline), small sizes. Checks the JSON line's keys, that the
GPU-only ones are null rather than made up, that the host CPU per step is measured per role (the
zygote's forks named), and the profile file written to --out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def test_the_device_check_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_gpu.py"), "--device", "cpu", "--quick", "--json",
           "--rows", "12000", "--steps", "10", "--log-every", "5", "--batch-size", "256", "--dim", "8",
           "--shards", "1", "--threads", "1", "--profile-steps", "4", "--out", str(out)]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["device"] == "cpu" and r["repeats"] == 1
    assert r["ours_gpu"] > 0 and r["ours_gpu_auto"] > 0                  # samples/s of both placements
    assert r["torchrec_gpu"] is None and r["ours_gpu_cache"] is None       # --quick's configs; no GPU baseline
    for key in ("ratio_vs_torchrec_gpu", "ratio_vs_torchrec_gpu_auto", "gpu_busy_pct"):
        assert r[key] is None, key                                          # not measured: null, not a number
    assert r["meets_targets"] == {"ratio_vs_torchrec_gpu": None, "ratio_vs_torchrec_gpu_auto": None}
    assert any("no GPU baseline" in n for n in r["notes"])
    assert "test_cuda" not in r                                             # a GPU's check only
    cpu = r["detail"]["ours_gpu"]["cpu_ms_per_step"]
    assert cpu["trainer"] > 0 and cpu["ps"] > 0                             # the forks told apart by name
    assert r["host_cpu_ms_per_step"] == pytest.approx(sum(cpu.values()), abs=0.05)
    profile = Path(r["profile"])
    assert profile.parent == out and "Self CPU" in profile.read_text() and "aten::" in profile.read_text()
