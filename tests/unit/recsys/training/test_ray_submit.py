"""`recsys ray-submit`: what is submitted for a config (no cluster here; see
tests/integration/test_ray_submit.py for a real submission)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recsys.cli import build_parser
from recsys.config import ConfigError, load_config
from recsys.training.ray_submit import JOB_CONFIG_NAME, build_submission, relative_paths, working_dir

ROOT = Path(__file__).resolve().parents[4]
TINY = ROOT / "configs" / "tiny.toml"


def absolute(tmp: Path) -> list[str]:
    """Overrides that make every path of configs/tiny.toml absolute."""
    return [f"data.train_paths=['{tmp}/data/part-00000.parquet']",
            f"data.eval_paths=['{tmp}/data/part-00001.parquet']", f"train.run_dir='{tmp}/run'"]


def test_train_submission_ships_the_resolved_config(tmp_path: Path) -> None:
    overrides = absolute(tmp_path) + ["ps.num_shards=2", "train.max_steps=7"]
    sub = build_submission(TINY, overrides)
    assert sub.entrypoint == f"recsys train --config {JOB_CONFIG_NAME}"
    assert sub.metadata == {"recsys_command": "train", "recsys_config": str(TINY)}
    assert sub.submission_id is None
    shipped = tmp_path / "shipped.toml"
    shipped.write_text(sub.config_text)
    got = load_config(shipped)                  # what the cluster reads: the overrides are in it
    assert got == load_config(TINY, overrides)
    assert (got.ps.num_shards, got.train.max_steps, got.train.run_dir) == (2, 7, f"{tmp_path}/run")


def test_check_submits_print_config(tmp_path: Path) -> None:
    sub = build_submission(TINY, absolute(tmp_path), check=True, submission_id="job-1")
    assert sub.entrypoint == f"recsys print-config --config {JOB_CONFIG_NAME}"
    assert sub.metadata["recsys_command"] == "print-config"
    assert sub.submission_id == "job-1"


def test_relative_paths_are_refused_by_key() -> None:
    with pytest.raises(ConfigError, match=r"data.train_paths = 'runs/tiny-data/part-00000.parquet'.*"
                                          r"train.run_dir = 'runs/tiny'.*absolute paths or URIs"):
        build_submission(TINY)


def test_uris_and_absolute_paths_pass(tmp_path: Path) -> None:
    cfg = load_config(TINY, ["data.train_paths=['s3://bucket/train/part-0.parquet']",
                             f"data.eval_paths=['{tmp_path}/eval.parquet']", "train.run_dir='gs://bucket/run'",
                             "ps.storage_root='relative/root'"])
    assert relative_paths(cfg) == ["ps.storage_root = 'relative/root'"]


def test_bad_config_fails_before_any_submission() -> None:
    with pytest.raises(ConfigError, match="ps.num_shards must be >= 1, got 0"):
        build_submission(TINY, ["ps.num_shards=0"])


def test_working_dir_holds_only_the_config(tmp_path: Path) -> None:
    sub = build_submission(TINY, absolute(tmp_path))
    with working_dir(sub) as wd:
        assert os.listdir(wd) == [JOB_CONFIG_NAME]
        assert (Path(wd) / JOB_CONFIG_NAME).read_text() == sub.config_text
    assert not os.path.exists(wd)


def test_cli_arguments() -> None:
    parser = build_parser()
    args = parser.parse_args(["ray-submit", "--config", "x.toml", "--address", "http://h:8265"])
    assert (args.config, args.address, args.wait, args.check, args.submission_id) == (
        "x.toml", "http://h:8265", True, False, None)
    args = parser.parse_args(["ray-submit", "--config", "x.toml", "--address", "http://h:8265", "--no-wait",
                              "--check", "--set", "train.max_steps=3", "--submission-id", "a"])
    assert (args.wait, args.check, args.overrides, args.submission_id) == (False, True, ["train.max_steps=3"], "a")
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["ray-submit", "--config", "x.toml", "--address", "a", "--wait", "--no-wait"])
    assert e.value.code == 2


def test_cli_import_does_not_import_ray() -> None:
    code = "import sys, recsys.cli; print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_cluster_with_token_auth_and_no_token_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """#28 item 5: Ray's AuthenticationError (token auth on, no or a wrong token) was a raw traceback
    (exit 1); now one ConfigError saying how to pass the token."""
    from recsys.training import ray_submit

    class AuthenticationError(Exception):        # what ray.exceptions raises
        pass

    def refused(address):
        raise AuthenticationError("Token authentication is enabled but no authentication token was found")

    monkeypatch.setattr(ray_submit, "_client", refused)
    sub = build_submission(ROOT / "configs" / "tiny.toml", absolute(tmp_path))
    with pytest.raises(ConfigError, match=r"the Ray cluster at http://h:8265 uses token authentication and refused "
                                          r"this client \(Token authentication is enabled but no authentication "
                                          r"token was found\): set RAY_AUTH_MODE=token and give its token"):
        ray_submit.submit(sub, "http://h:8265")


def test_the_ray_engine_refuses_a_warm_start_also_under_resume(tmp_path: Path, monkeypatch) -> None:
    """train.init_from on the Ray engine is refused before any Ray call: without --resume at once, and
    with `--resume latest` of a run that has no checkpoint yet (where the warm start would apply) once
    the run is prepared; a resume that finds a checkpoint goes on (the warm start does not apply)."""
    import contextlib
    import dataclasses

    pytest.importorskip("ray")
    from recsys.training import ray_launch

    cfg = load_config(None, absolute(tmp_path))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(tmp_path / "day1")))
    init = []

    @contextlib.contextmanager
    def prepared(cfg, resume, overwrite):
        yield cfg, tmp_path, tmp_path / "config.toml", None, init[0]

    class Connected(Exception):
        pass

    def connect(cfg):
        raise Connected

    monkeypatch.setattr(ray_launch, "prepared_run", prepared)
    monkeypatch.setattr(ray_launch, "connect", connect)
    with pytest.raises(ConfigError, match="train.init_from: a warm start runs with cluster.engine = 'local'"):
        ray_launch.launch_train_ray(cfg)
    init.append(object())                                    # --resume latest, no checkpoint: a warm start
    with pytest.raises(ConfigError, match="train.init_from: a warm start runs with cluster.engine = 'local'"):
        ray_launch.launch_train_ray(cfg, resume="latest")
    init[0] = None                                           # a checkpoint to resume: no warm start
    with pytest.raises(Connected):
        ray_launch.launch_train_ray(cfg, resume="latest")
