"""The [cluster] section: parsing, validation (one error per rule, naming the dotted key), resources,
the preflight's Ray check, and Ray staying unimported unless engine = "ray"."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recsys.config import ConfigError, load_config, to_toml
from recsys.config_cluster import parse_bytes
from recsys.preflight import PreflightError, check_cluster

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "configs" / "tiny.toml"


def cfg(*overrides: str):
    return load_config(TINY, list(overrides))


def test_defaults_run_locally() -> None:
    c = cfg().cluster
    assert c.engine == "local" and c.address == "" and c.placement == "spread" and not c.use_gpu
    assert c.ps_bundle() == {"CPU": 1.0} and c.trainer_bundle() == {"CPU": 1.0}


@pytest.mark.parametrize("text, expected", [
    ("32GiB", 32 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5GiB", 3 * 2**29),
    ("100KB", 100_000), ("7", 7), ("64 kib", 64 * 1024)])
def test_memory_sizes_parse_to_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text, "k") == expected
    assert parse_bytes(4096, "k") == 4096


def test_resource_tables_become_ray_numbers() -> None:
    c = cfg("cluster.engine='ray'", "cluster.ps_resources={CPU=4, memory='32GiB', ps=1}",
            "cluster.trainer_resources={CPU=0.5, trainer=1}").cluster
    assert c.ps_bundle() == {"CPU": 4.0, "memory": float(32 * 2**30), "ps": 1.0}
    assert c.trainer_bundle() == {"CPU": 0.5, "trainer": 1.0}
    gpu = cfg("cluster.engine='ray'", "cluster.use_gpu=true", "train.device='cuda'").cluster
    assert gpu.trainer_bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert load_config(None, []).cluster == load_config(None, []).cluster


def test_round_trip_through_toml(tmp_path: Path) -> None:
    c = cfg("cluster.engine='ray'", "cluster.address='auto'", "cluster.ps_resources={CPU=2, memory='1GiB'}",
            "cluster.placement='pack'", "cluster.start_timeout_s=5")
    path = tmp_path / "c.toml"
    path.write_text(to_toml(c))
    assert load_config(path) == c


@pytest.mark.parametrize("override, match", [
    ("cluster.engine='k8s'", r"cluster.engine must be one of 'local', 'ray', got 'k8s'"),
    ("cluster.placement='strict'", r"cluster.placement must be one of"),
    ("cluster.address='http://x'", r"cluster.address must be '', 'auto', 'ray://HOST:PORT' or 'HOST:PORT', got 'http://x'"),
    ("cluster.ps_resources={memory='lots'}", r"cluster.ps_resources.memory must be a byte count .* got 'lots'"),
    ("cluster.ps_resources={memory='3XB'}", r"cluster.ps_resources.memory must be a byte count"),
    ("cluster.trainer_resources={CPU=-1}", r"cluster.trainer_resources.CPU must be >= 0, got -1"),
    ("cluster.trainer_resources={CPU='four'}", r"cluster.trainer_resources.CPU must be a number .* got 'four'"),
    ("cluster.start_timeout_s=0", r"cluster.start_timeout_s must be > 0, got 0"),
    ("cluster.unknown=1", r"unknown key 'cluster.unknown'"),
])
def test_each_rule_names_the_key_and_value(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        cfg(override)


def test_use_gpu_needs_cuda_on_ray() -> None:
    with pytest.raises(ConfigError, match=r"cluster.use_gpu = true needs train.device = cuda, got 'cpu'"):
        cfg("cluster.engine='ray'", "cluster.use_gpu=true")


def test_preflight_names_the_install_line_when_ray_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    check_cluster(cfg())                       # local: nothing to check
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("ray") else real(name, *a))
    with pytest.raises(PreflightError, match=r"cluster.engine = 'ray': Ray is not installed .*pip install -e '.\[ray\]'"):
        check_cluster(cfg("cluster.engine='ray'"))


def test_ray_is_not_imported_unless_the_engine_is_ray() -> None:
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        import recsys.cli, recsys.training.launch
        from recsys.config import load_config
        from recsys.preflight import check_cluster
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            recsys.cli.main(["train", "--help"])
        check_cluster(load_config({str(TINY)!r}, ["cluster.engine='ray'"]))
        print(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray.")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
