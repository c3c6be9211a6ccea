"""docs/config.md is generated from the config dataclasses and current; `print-config --explain`."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from recsys import config_doc
from recsys.config import JobConfig

ROOT = Path(__file__).resolve().parents[3]


def test_docs_config_md_is_current() -> None:
    want = config_doc.markdown()
    got = (ROOT / "docs" / "config.md").read_text()
    assert got == want, "docs/config.md is stale: python -m recsys.config_doc > docs/config.md"


def test_every_key_of_every_section_is_documented() -> None:
    sections = {name for name, _, _ in config_doc.SECTIONS}
    assert {f.name for f in dataclasses.fields(JobConfig)} <= sections          # every [section] of a job
    keys = config_doc.keys()
    assert len(keys) > 100
    undocumented = [k.dotted for k in keys if not k.doc]
    assert not undocumented, f"config fields without a docstring: {undocumented}"
    by_name = {k.dotted: k for k in keys}
    lr = by_name["ps.tables.lr"]
    assert lr.type == "float" and lr.default == repr(config_doc.TableConfig(name="t", dim=4).lr)
    assert "Literal" in by_name["ps.mode"].type and "'sync'" in by_name["ps.mode"].type   # valid values shown


def test_explain_a_key_a_section_and_a_typo() -> None:
    text = config_doc.explain("ps.table_defaults.optimizer")
    assert text.startswith("ps.table_defaults.optimizer: ") and "adagrad" in text
    assert "train.max_steps" in config_doc.section("train")
    with pytest.raises(ValueError, match="did you mean ps.tables.lr"):
        config_doc.explain("ps.tables.lrr")


def test_print_config_explain_cli() -> None:
    run = subprocess.run([sys.executable, "-m", "recsys.cli", "print-config", "--explain", "data.batch_size"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("data.batch_size: int = 4096")
    bad = subprocess.run([sys.executable, "-m", "recsys.cli", "print-config", "--explain", "data.batchsize"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "did you mean data.batch_size" in bad.stderr
