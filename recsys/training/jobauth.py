"""Every job's shards authenticated: the per-job token of `recsys train` and the checks of `ps.auth`.

`ps.auth = "auto"` (the default) makes the launcher (`job_auth`) create a random token for the job
and hand its shards and trainers the overrides `ps.auth='token'` and `ps.token_file=<path>`,
where the path names an in-memory file (memfd, mode 600) of the launcher's, `/proc/<pid>/fd/<n>`:
the token is never on argv or on a disk, only processes of this user can open it, and it vanishes
with the launcher, even after kill -9. Where there is no memfd, a mode-600 file in the run
directory, removed at exit. A shard started by hand (`recsys ps`) and a trainer of such shards
(`python -m recsys.train`) need the auth said outright (`require_explicit`).
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from embedding_ps.wire.config import PSConfig
from recsys.config import ConfigError

logger = logging.getLogger(__name__)

NONE_WARNING = ("ps.auth = 'none': the shards take requests from any process on this host; another local "
                "user can stop them, load or save checkpoints and change rows (leave ps.auth unset, or 'auto', "
                "for a per-job token)")


def memory_file(name: str, text: str, self_path: bool = True) -> tuple[int, Path]:
    """`text` in an anonymous in-memory file (memfd, mode 600, not inherited by children) and the path
    to open it by (this process's `/proc/self/fd/N`, or with self_path=False `/proc/<pid>/fd/N`, which
    this user's other processes open too): nothing on disk, and it vanishes with the process."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.fchmod(fd, 0o600)
    data = text.encode()
    while data:
        data = data[os.write(fd, data):]
    return fd, Path(f"/proc/{'self' if self_path else os.getpid()}/fd/{fd}")


@contextmanager
def job_auth(ps: PSConfig, run_dir: Path) -> Iterator[list[str]]:
    """The `--set` overrides that give this job's shards and trainers their authentication: a new token
    for ps.auth = "auto", nothing for an explicit choice (a warning for "none")."""
    if ps.auth != "auto":
        if ps.auth == "none":
            logger.warning("%s", NONE_WARNING)
        yield []
        return
    token = secrets.token_hex(32)
    if hasattr(os, "memfd_create") and Path(f"/proc/{os.getpid()}/fd").is_dir():
        fd, path = memory_file("recsys-ps-token", token, self_path=False)
        try:
            yield ["ps.auth='token'", f"ps.token_file='{path}'"]
        finally:
            os.close(fd)
        return
    fd, name = tempfile.mkstemp(prefix=".ps-token-", dir=run_dir)       # mode 600
    try:
        os.write(fd, token.encode())
        os.close(fd)
        yield ["ps.auth='token'", f"ps.token_file='{name}'"]
    finally:
        Path(name).unlink(missing_ok=True)


def require_explicit(ps: PSConfig, who: str) -> None:
    """`who` (a shard or trainer started by hand) has no launcher to make a token: ps.auth must be said."""
    if ps.auth == "auto":
        raise ConfigError(f"{who}: ps.auth = 'auto' makes a per-job token only under `recsys train`; shards "
                          f"started by hand and their trainers need ps.auth = 'token' with ps.token_file (the "
                          f"same on both), or 'curve', or explicitly 'none' (loopback only; anyone on this "
                          f"host can then stop the shards or change rows)")
    if ps.auth == "none":
        logger.warning("%s", NONE_WARNING)


__all__ = ["NONE_WARNING", "job_auth", "memory_file", "require_explicit"]
