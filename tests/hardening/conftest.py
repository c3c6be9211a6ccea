"""Helpers of the hardening suite: one `recsys ps` shard process on 127.0.0.1 (`shard_process`)."""

from __future__ import annotations

import dataclasses

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from embedding_ps.wire.config import PSConfig
from recsys.config import JobConfig, to_toml

READY_TIMEOUT_S = 60.0


def child_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")


class Shard:
    """`recsys ps --shard 0` of `config` (storage root: `workdir`), its address once it serves."""

    def __init__(self, config: PSConfig, workdir: Path, *extra: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "ps.toml"
        if config.auth == "auto":        # a shard started by hand needs it said (clients read "auto" as "none")
            config = dataclasses.replace(config, auth="none")
        self.config_path.write_text(to_toml(JobConfig(ps=config)))
        self.log_path, ready = workdir / "ps.log", workdir / "ps.ready"
        ready.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "recsys.cli", "ps", "--config", str(self.config_path),
                                          "--shard", "0", "--port", "0", "--ready-file", str(ready), *extra],
                                         env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"shard did not start ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.02)
        self.address = ready.read_text().strip()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def shard_process(tmp_path: Path) -> Iterator:
    """Factory: `shard_process(config, *extra_args)` -> a started Shard, killed after the test."""
    started: list[Shard] = []

    def start(config: PSConfig, *extra: str) -> Shard:
        shard = Shard(config if config.storage_root else _with_root(config, tmp_path), tmp_path / f"ps{len(started)}",
                      *extra)
        started.append(shard)
        return shard

    try:
        yield start
    finally:
        for s in started:
            s.close()


def _with_root(config: PSConfig, root: Path) -> PSConfig:
    import dataclasses

    return dataclasses.replace(config, storage_root=str(root))


def file_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` by relative path: what a refused command must leave unchanged."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    """The single `error:` line a refused command printed on stderr (asserts there is exactly one)."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]
