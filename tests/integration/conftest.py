"""Helpers to run PS shard processes on 127.0.0.1 for the integration tests.

`ShardProcesses(config, tmp_path)` starts `recsys ps` (`python -m recsys.cli ps`) once per shard (ports
chosen by the shard: `--port 0`, read back from its ready file), restarts a shard on its old port
(so connected clients reconnect by themselves) and kills everything in `close()`.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from embedding_ps.wire.config import PSConfig
from embedding_ps.local import LocalStore
from recsys.config import JobConfig, load_config, to_toml

READY_TIMEOUT_S = 60.0


def ps_toml(config: PSConfig) -> str:
    """A job config holding `config` as its `[ps]` section, which `recsys ps` reads back. ps.auth "auto"
    becomes "none" (a shard started by hand needs it said; the library's clients read "auto" as "none")."""
    if config.auth == "auto":
        config = dataclasses.replace(config, auth="none")
    return to_toml(JobConfig(ps=config))


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", MKL_NUM_THREADS="1")
    return env


class ShardProcesses:
    """`config.num_shards` shard processes of `config`; use as a context manager."""

    def __init__(self, config: PSConfig, workdir: Path, name: str = "ps") -> None:
        self.config, self.workdir, self.name = config, Path(workdir), name
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not config.storage_root:      # the shards save and load under the test's directory
            config = dataclasses.replace(config, storage_root=str(self.workdir))
        self.config, self.config_path = config, self.workdir / f"{name}.toml"
        self.config_path.write_text(ps_toml(config))
        self.procs: list[subprocess.Popen | None] = [None] * config.num_shards
        self.addresses: list[str] = [""] * config.num_shards

    def __enter__(self) -> "ShardProcesses":
        try:
            self.start(range(self.config.num_shards))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ready(self, shard: int) -> Path:
        return self.workdir / f"{self.name}-{shard}.ready"

    def log(self, shard: int) -> str:
        path = self.workdir / f"{self.name}-{shard}.log"
        return path.read_text() if path.exists() else ""

    def start(self, shards, port_of_old_address: bool = False) -> None:
        """Start `shards` (all at once), wait until each serves; reuse old ports if asked."""
        shards = list(shards)
        for s in shards:
            self._ready(s).unlink(missing_ok=True)
            port = self.addresses[s].rsplit(":", 1)[1] if port_of_old_address and self.addresses[s] else "0"
            cmd = [sys.executable, "-m", "recsys.cli", "ps", "--config", str(self.config_path),
                   "--shard", str(s), "--port", port, "--ready-file", str(self._ready(s))]
            with open(self.workdir / f"{self.name}-{s}.log", "ab") as log:
                self.procs[s] = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        for s in shards:
            while not self._ready(s).exists():
                if self.procs[s].poll() is not None:
                    raise RuntimeError(f"shard {s} exited with {self.procs[s].returncode}:\n{self.log(s)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shard {s} not ready in {READY_TIMEOUT_S} s:\n{self.log(s)}")
                time.sleep(0.02)
            self.addresses[s] = self._ready(s).read_text().strip()

    def kill(self, shard: int) -> None:
        proc = self.procs[shard]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def restart(self, shard: int) -> None:
        """Kill shard `shard` (no save) and start a fresh process on the same port."""
        self.kill(shard)
        self.start([shard], port_of_old_address=True)

    def wait_exit(self, timeout_s: float = 10.0) -> list[int]:
        """Exit codes of every shard after they stop by themselves (e.g. after SHUTDOWN)."""
        return [p.wait(timeout=timeout_s) for p in self.procs if p is not None]

    def close(self) -> None:
        """Kill what still runs (graceful exits are tested where they matter: SHUTDOWN, SIGTERM)."""
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
        for p in self.procs:
            if p is not None:
                p.wait(timeout=10)


@pytest.fixture
def shard_processes(tmp_path):
    """Factory: `shard_processes(config)` -> a started ShardProcesses, closed after the test."""
    started: list[ShardProcesses] = []

    def start(config: PSConfig, name: str = "ps") -> ShardProcesses:
        procs = ShardProcesses(config, tmp_path, name)
        started.append(procs)
        return procs.__enter__()

    try:
        yield start
    finally:
        for procs in started:
            procs.close()


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie counts as dead: it only waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def final_model(run: Path) -> tuple[dict[str, torch.Tensor], dict[tuple[int, int], torch.Tensor]]:
    """A finished run's dense weights and every row by (table, id), read from run/model."""
    cfg = load_config(run / "config.toml")
    dense = torch.load(run / "model" / "dense.pt", weights_only=True)
    store = LocalStore.from_dir(cfg.ps, run / "model" / "ps")
    rows = {}
    for t in range(len(cfg.ps.tables)):
        for state in store.states:
            keys, values, _ = state.dump_table(t)
            rows.update({(t, k): v for k, v in zip(keys.tolist(), values)})
    return dense, rows


def assert_same_model(a: Path, b: Path, atol: float = 1e-6) -> None:
    """Runs a and b ended with the same dense weights and the same (non-empty) rows, to `atol`."""
    (da, ra), (db, rb) = final_model(a), final_model(b)
    for name in da:
        torch.testing.assert_close(da[name], db[name], atol=atol, rtol=0, msg=name)
    assert ra.keys() == rb.keys() and ra
    keys = sorted(ra)
    torch.testing.assert_close(torch.stack([ra[k] for k in keys]), torch.stack([rb[k] for k in keys]),
                               atol=atol, rtol=0)
