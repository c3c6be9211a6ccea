"""Auth: refusal to bind beyond loopback without auth; token and CURVE on 127.0.0.1 (auth forced on)."""

import dataclasses
import shutil
import subprocess
import sys

import pytest
import torch

from embedding_ps.wire.auth import create_curve_keys
from embedding_ps.client.client import PSClient, PSRequestError, ShardUnavailableError
from embedding_ps.wire.config import PSConfig, TableConfig

from .conftest import child_env, ps_toml

pytestmark = pytest.mark.integration

TABLES = (TableConfig(name="t", dim=4),)


def test_non_loopback_bind_without_auth_refuses_to_start(tmp_path):
    """The check runs before anything is bound: no socket is opened on 0.0.0.0."""
    path = tmp_path / "job.toml"
    path.write_text(ps_toml(PSConfig(tables=TABLES)))
    ready = tmp_path / "ready"
    out = subprocess.run([sys.executable, "-m", "recsys.cli", "ps", "--config", str(path), "--shard", "0",
                          "--bind", "0.0.0.0", "--ready-file", str(ready)],
                         env=child_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "refusing to bind '0.0.0.0' without authentication" in out.stderr
    assert not ready.exists()


def test_token_auth(shard_processes, tmp_path):
    (tmp_path / "token").write_text("correct-horse-battery-staple\n")
    (tmp_path / "other").write_text("incorrect-horse-battery-staple\n")
    (tmp_path / "token").chmod(0o600)            # a token readable by others is refused
    (tmp_path / "other").chmod(0o600)
    cfg = PSConfig(num_shards=2, auth="token", token_file=str(tmp_path / "token"), timeout_s=20.0,
                   retries=0, tables=TABLES)
    shards = shard_processes(cfg)
    ids = torch.arange(50)
    with PSClient(cfg, shards.addresses) as good:
        rows = good.pull(0, ids)
    bad_cfg = dataclasses.replace(cfg, token_file=str(tmp_path / "other"))
    with PSClient(bad_cfg, shards.addresses) as bad:
        with pytest.raises(PSRequestError, match=r"ps shard \d at tcp://127.0.0.1:\d+ failed \(UNAUTHORIZED\)"):
            bad.pull(0, ids)
        with pytest.raises(PSRequestError, match="UNAUTHORIZED"):
            bad.push(0, ids, torch.ones(50, 4))
    with PSClient(cfg, shards.addresses) as good:
        assert torch.equal(good.pull(0, ids), rows)          # the refused push changed nothing


def test_curve_auth(shard_processes, tmp_path):
    keys = create_curve_keys(tmp_path / "keys")
    stranger = create_curve_keys(tmp_path / "stranger")       # a client key pair the shard never saw
    shutil.copy(keys / "server.key", stranger / "server.key")
    cfg = PSConfig(num_shards=1, auth="curve", curve_keys_dir=str(keys), timeout_s=20.0, retries=0,
                   tables=TABLES)
    shards = shard_processes(cfg)
    with PSClient(cfg, shards.addresses) as good:
        assert good.pull(0, torch.arange(10)).shape == (10, 4)
    short = dict(timeout_s=5.0, retries=0)
    with PSClient(dataclasses.replace(cfg, curve_keys_dir=str(stranger), **short), shards.addresses) as bad:
        # the handshake is refused: said at once, not a timeout
        with pytest.raises(PSRequestError, match=f"ps shard 0 at {shards.addresses[0]} failed .UNAUTHORIZED.: "
                                                 f"it refused this client's credentials"):
            bad.pull(0, torch.arange(10))
    with PSClient(dataclasses.replace(cfg, auth="none", curve_keys_dir="", **short), shards.addresses) as bad:
        # refused at once when the client sees the mechanism mismatch (ZMTP error), else the timeout says
        # what the failed handshake suggests (the shard may close first: which one is a race)
        with pytest.raises((PSRequestError, ShardUnavailableError),
                           match=f"ps shard 0 at {shards.addresses[0]}.*(the shard and this client disagree on "
                                 f"ps.auth .this client: 'none'.|its last handshake failed: does it require ps.auth)"):
            bad.pull(0, torch.arange(10))
    with PSClient(cfg, shards.addresses) as good:      # the shard still serves good clients
        assert good.health()[0]["ok"] is True
