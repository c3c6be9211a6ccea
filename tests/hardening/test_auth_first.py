"""#28, item 1-2: nothing before authentication, and every `recsys train` shard authenticated.

- A shard with token auth never reads a request of a peer without the token: three 900 MB requests
  with a wrong token (and the same without any) leave its peak RSS within +64 MiB, and it still
  serves its own clients. (Before: it read each whole message, then refused it: 262 MB -> 2.5 GB.)
- `recsys train` with the default ps.auth ("auto") gives its shards a per-job token that is on no
  command line, in no file of the run directory, and that a client without it cannot use.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch
import zmq

from embedding_ps.client.client import PSClient, PSRequestError
from embedding_ps.wire import protocol as P
from embedding_ps.wire.auth import PLAIN_USER
from embedding_ps.wire.config import PSConfig, TableConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TABLES = (TableConfig(name="t", dim=8),)
MIB = 1 << 20


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def test_requests_without_the_token_are_never_read(shard_process, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("correct-horse-battery-staple")
    token.chmod(0o600)
    cfg = PSConfig(auth="token", token_file=str(token), tables=TABLES, timeout_s=10.0, retries=0)
    shard = shard_process(cfg)
    with PSClient(cfg, [shard.address]) as good:                  # warm: the shard's tables exist
        good.push(0, torch.arange(100), torch.ones(100, 8))
        rows = good.pull(0, torch.arange(100))
    before = _status_kib(shard.proc.pid, "VmHWM")
    body = bytearray(900 * MIB)                                   # one buffer, sent three times
    header = P.Header(op=P.Op.PUSH, dtype=P.DType.FP32, count=1, dim=8, client=1, request=1).pack()
    ctx = zmq.Context()
    try:
        socks = []
        for password in (b"incorrect-horse-battery-staple", None):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if password is not None:
                sock.plain_username, sock.plain_password = PLAIN_USER, password
            sock.connect(shard.address)
            socks.append(sock)
        sent = 0
        deadline = time.monotonic() + 3.0                          # what the shard would need to read 2.7 GB
        while time.monotonic() < deadline:                         # the peers keep trying, 3 requests each
            for sock in socks:
                try:
                    if sent < 6:
                        sock.send_multipart([header, b"x" * 32, memoryview(body)], flags=zmq.NOBLOCK, copy=False)
                        sent += 1
                except zmq.Again:                                  # no handshake completed: nowhere to queue
                    pass
            time.sleep(0.05)
        grown_mib = (_status_kib(shard.proc.pid, "VmHWM") - before) / 1024
        assert grown_mib <= 64, f"the shard's peak RSS grew {grown_mib:.0f} MiB under unauthenticated requests"
        for sock in socks:
            sock.close(linger=0)
    finally:
        ctx.term()
    assert shard.proc.poll() is None
    with PSClient(cfg, [shard.address]) as good:                  # it still serves, nothing was applied
        torch.testing.assert_close(good.pull(0, torch.arange(100)), rows, atol=0, rtol=0)
    assert "refused a client with a wrong or missing ps token" in shard.log()


def test_launcher_shards_get_a_per_job_token(tmp_path: Path, tiny_dataset, monkeypatch) -> None:
    """The default ps.auth: the launcher's shards take requests only with the job's token, which is
    nowhere an unprivileged user could read it (argv, the run directory); a client without it is refused."""
    from recsys.config import load_config
    from recsys.training.launch import launch_train

    data = tiny_dataset(rows=2000, files=1, seed=3)
    run = tmp_path / "run"
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        f"data.train_paths=['{data}/part-00000.parquet']", "data.eval_paths=[]", "train.max_steps=6",
        "train.checkpoint_every=0", f"train.run_dir='{run}'"])
    assert cfg.ps.auth == "auto"
    seen: dict = {}

    import recsys.training.launch as launch

    spawn = launch.spawn_shards

    def spy(*args, **kwargs):                                      # the shard's command line, and a stranger
        procs, ready = spawn(*args, **kwargs)
        seen["argv"] = [" ".join(p.args) for p in procs]           # forked: its argv goes through a pipe
        seen["cmdline"] = [open(f"/proc/{p.pid}/cmdline", "rb").read().decode() for p in procs]
        seen["ready"] = ready
        return procs, ready

    monkeypatch.setattr(launch, "spawn_shards", spy)
    launch_train(cfg)
    argv = " ".join(seen["argv"])
    assert "ps.auth='token'" in argv
    token_path = argv.split("ps.token_file='")[1].split("'")[0]
    assert token_path.startswith(f"/proc/{os.getpid()}/fd/")           # the launcher's memfd: no file, no argv
    assert not any("ps.auth" in c or "/fd/" in c for c in seen["cmdline"])   # nor in what `ps` shows
    assert "/proc/" not in (run / "config.toml").read_text()           # the run dir's config stays the user's
    assert "auth 'token'" in (run / "ps-0.log").read_text() or "auth token" in (run / "ps-0.log").read_text()
    assert json.loads((run / "metrics.json").read_text())["steps"] == 6


def test_a_stranger_cannot_talk_to_a_jobs_shards(tmp_path: Path, shard_process) -> None:
    """What the launcher's token buys: a client of the right address but without the token is refused
    at once (one line), whatever it asks (SHUTDOWN, LOAD, SAVE)."""
    token = tmp_path / "job-token"
    token.write_text(os.urandom(32).hex())
    token.chmod(0o600)
    cfg = PSConfig(auth="token", token_file=str(token), tables=TABLES, timeout_s=10.0, retries=0)
    shard = shard_process(cfg)
    stranger = dataclasses.replace(cfg, auth="auto", token_file="")
    with PSClient(stranger, [shard.address]) as c:
        for call in (lambda: c.pull(0, torch.arange(3)), lambda: c.save(str(tmp_path / "x")), c.shutdown):
            with pytest.raises((PSRequestError, ConnectionError)):
                call()
    assert shard.proc.poll() is None                                  # SHUTDOWN did not reach it
    assert not (tmp_path / "x").exists()
