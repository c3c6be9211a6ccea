"""`recsys train` checks the config and the data before it imports torch: a bad input is refused in a
fraction of a second (the zygote that imports torch meanwhile dies with the command)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import json, sys
from recsys import cli
rc = cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
"""


def _train(tmp_path: Path, *sets: str) -> tuple[dict, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, "train", "--config", str(ROOT / "configs" / "tiny.toml"),
                        "--set", f"train.run_dir='{tmp_path / 'run'}'", *[x for s in sets for x in ("--set", s)]],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_missing_data_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    out, err = _train(tmp_path, f"data.train_paths=['{tmp_path}/nope.parquet']")
    assert out == {"rc": 2, "torch": False}
    assert f"data path '{tmp_path}/nope.parquet' does not exist" in err
    assert not (tmp_path / "run").exists()


def test_a_feature_reading_a_missing_table_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    out, err = _train(tmp_path, "model.feature_tables={C1 = 'nope'}")
    assert out == {"rc": 2, "torch": False}
    assert "model.feature_tables.C1 = 'nope' is not a table in ps.tables" in err


def test_the_table_plans_need_no_torch() -> None:
    """What preflight's table check runs (recsys.table_plans), in a fresh interpreter."""
    code = ("import sys; from recsys.config import load_config; from recsys.preflight import check_tables; "
            f"check_tables(load_config({str(ROOT / 'configs' / 'din.toml')!r})); "
            f"check_tables(load_config({str(ROOT / 'configs' / 'tiny.toml')!r})); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
