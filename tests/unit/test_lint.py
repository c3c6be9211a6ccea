"""ruff over the repository with pyproject.toml's [tool.ruff] (pyflakes, pycodestyle, 120 columns): CI runs
it through the test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: it comes with the [test] extra (make test installs it)")
    r = subprocess.run([ruff, "check", "--no-cache", "recsys", "embedding_ps", "data", "benchmarks", "tests"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
