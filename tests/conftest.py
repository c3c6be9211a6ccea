"""Fixtures every test folder shares.

`tiny_dataset(rows=..., files=..., seed=..., row_group_rows=...)`: a directory of the `tiny`
synthetic preset (`data.synthetic.generate`), built once per test session for each distinct set of
arguments and shared read-only by every test that asks for the same one (tests write their runs
elsewhere: never into the dataset's directory).

`ROOT` (the checkout) and `CONFIGS` (its `configs/`) are importable from here: `from tests.conftest
import ...` does not work under `--import-mode=importlib`, so use the `repo_root` fixture, or
`Path(__file__).resolve().parents[N]` as the tests do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from data.synthetic import generate

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_dataset(rows=8000, files=2, seed=11, row_group_rows=None, preset="tiny") -> Path`."""
    made: dict[tuple, Path] = {}
    lock = threading.Lock()

    def make(rows: int = 8000, files: int = 2, seed: int = 11, row_group_rows: int | None = None,
             preset: str = "tiny") -> Path:
        key = (preset, rows, files, seed, row_group_rows)
        with lock:
            if key not in made:
                out = tmp_path_factory.mktemp(f"{preset}-{rows}x{files}-s{seed}")
                kwargs = {} if row_group_rows is None else {"row_group_rows": row_group_rows}
                generate(preset=preset, rows=rows, num_files=files, out_dir=str(out), seed=seed, **kwargs)
                made[key] = out
            return made[key]

    return make
