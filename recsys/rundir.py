"""The run directory's layout (config.toml, metrics, model/, best/, checkpoints/: docs/operations.md), one
owner for both training (writes it) and serving (reads it). RUN_DIR may be a URI (`recsys.storage`): what
only this machine's processes use then lives in a local scratch directory (`local_run_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from recsys import storage

BEST_DIR = "best"


def run_path(run_dir: str | Path, *parts: str) -> Path | str:
    """RUN_DIR/parts...: a Path for a local run directory, a URI string (query kept last) for a URI."""
    if storage.is_uri(str(run_dir)):
        return storage.join(str(run_dir), *parts)
    return Path(run_dir).joinpath(*parts)


def local_run_dir(run_dir: str | Path, scratch_dir: str = "") -> Path:
    """Where this machine's processes keep pids, ready files, logs and errors: RUN_DIR itself when
    local, else `scratch_dir` (`train.scratch_dir`) if set, else <system temp>/recsys-scratch/<name>-<hash
    of the URI>."""
    if not storage.is_uri(str(run_dir)):
        return Path(run_dir)
    if scratch_dir:
        return Path(scratch_dir)
    digest = hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "recsys-scratch" / f"{storage.basename(run_dir) or 'run'}-{digest}"


def best_dir(run_dir: str | Path) -> Path | str:
    """RUN_DIR/best: the best validation pass's model, as a checkpoint (config.toml, model/, manifest.json)."""
    return run_path(run_dir, BEST_DIR)


def has_best(run_dir: str | Path) -> bool:
    """Whether the run kept a complete best model (its manifest is written last)."""
    return storage.is_file(run_path(best_dir(run_dir), "manifest.json"))


def model_root(run_dir: str | Path, last: bool = False) -> Path | str:
    """The directory holding the model a command on the run uses: RUN_DIR/best when the run kept a
    best model and `last` is not asked for, else RUN_DIR (its last model in RUN_DIR/model)."""
    return best_dir(run_dir) if not last and has_best(run_dir) else run_path(run_dir)


@contextlib.contextmanager
def local_run(run_dir: str | Path, last: bool = False) -> Iterator[Path]:
    """A local directory holding run `run_dir`'s model: the run directory itself when local; for a
    URI a temporary copy of config.toml, metrics.json and the model the commands use (RUN_DIR/best,
    unless `last`, else RUN_DIR/model; never the checkpoints), removed on exit."""
    if not storage.is_uri(str(run_dir)):
        yield Path(run_dir)
        return
    with tempfile.TemporaryDirectory(prefix="recsys-run-", ignore_cleanup_errors=True) as tmp:
        local = Path(tmp) / "run"
        local.mkdir()
        for name in ("config.toml", "metrics.json"):
            if storage.is_file(run_path(run_dir, name)):
                (local / name).write_bytes(storage.read_bytes(run_path(run_dir, name)))
        model = BEST_DIR if not last and has_best(run_dir) else "model"
        storage.download_dir(run_path(run_dir, model), local / model)
        yield local


READY_TIMEOUT_S = 120.0
"""How long a launcher or trainer waits for a shard to serve."""


def wait_for_shards(ready_files: list[str] | list[Path], timeout_s: float) -> list[str]:
    """The shards' addresses, read from their ready files (`recsys ps --ready-file`) as they appear: a
    local trainer starts with its shards and waits here (the launcher's `ShardWatchdog` ends the job if
    a shard dies first). Raises TimeoutError naming the shard and its log after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    addresses = []
    for shard, ready in enumerate(map(Path, ready_files)):
        while not ready.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"ps shard {shard} not ready after {timeout_s:.0f} s; "
                                   f"see {ready.parent / f'ps-{shard}.log'}")
            time.sleep(0.02)
        addresses.append(ready.read_text().strip())
    return addresses


__all__ = ["BEST_DIR", "best_dir", "has_best", "local_run", "local_run_dir", "model_root", "run_path",
           "wait_for_shards"]


# ---------------------------------------------------------------------------------------------
# one launcher per run directory, and no run mixed into another


LOCK_FILE = ".lock"
"""RUN_DIR/.lock (the local run directory's, also for a URI run_dir): flock'ed by the launcher."""

RUN_FILES = ("config.toml", "metrics.json", "metrics.jsonl", "model", "checkpoints", BEST_DIR)
"""What makes a run directory hold a run (a new run refuses it without --resume or --overwrite)."""


class RunDirError(ValueError):
    """A run directory held by another launcher, or holding another run; the message names it."""


class RunLock:
    """An exclusive `fcntl.flock` on LOCAL_RUN_DIR/.lock held for the launcher's life (docs/operations.md),
    the file holding {"pid", "host", "run_dir", "since"}. The kernel drops it when the holder dies (kill -9
    too): no stale lock. Not across machines: a URI run_dir is locked in this machine's scratch directory only."""

    def __init__(self, local_dir: Path, run_dir: str) -> None:
        import fcntl

        local_dir.mkdir(parents=True, exist_ok=True)
        path = local_dir / LOCK_FILE
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(self.fd, 4096, 0) or b"{}")
            except ValueError:
                holder = {}
            os.close(self.fd)
            raise RunDirError(
                f"train.run_dir = {run_dir}: in use by another launcher ({_describe(holder)}; lock {path}): wait "
                f"for it, stop it, or choose another train.run_dir") from None
        self.run_dir = str(run_dir)

    def announce(self) -> None:
        """Write who holds the lock (after the launcher's checks: a refused launcher changes nothing)."""
        info = json.dumps({**_holder(), "run_dir": self.run_dir}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, info, 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)          # drops the flock; the file stays (removing it would race a waiter)
            self.fd = -1


def existing_run(run_dir: str | Path) -> list[str]:
    """The names of RUN_FILES that `run_dir` (a path or URI) holds."""
    return [name for name in RUN_FILES if storage.exists(run_path(run_dir, name))]


def move_aside(run_dir: Path) -> Path:
    """Rename a local run directory's run files into RUN_DIR/../NAME.old-YYYYmmdd-HHMMSS; returns it."""
    stamp = f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    old, n = run_dir.with_name(stamp), 0
    while old.exists():                       # a second move within the same second
        n += 1
        old = run_dir.with_name(f"{stamp}-{n}")
    old.mkdir()
    for child in sorted(run_dir.iterdir()):
        if child.name != LOCK_FILE:
            child.rename(old / child.name)
    return old


URI_LOCK = ".lock.json"


class UriLock:
    """The lock object RUN_URI/.lock.json ({"run_id", "pid", "host", "since"}) of a URI run directory,
    written after the launcher's checks (what it refuses: docs/operations.md). Object stores offer no atomic
    create here, so two launchers starting within the same second can both pass: the local flock
    (`RunLock`) covers one machine, this object the others."""

    def __init__(self, run_dir: str) -> None:
        self.path = str(run_path(run_dir, URI_LOCK))
        self.held = False
        if not storage.exists(self.path):
            return
        try:
            holder = json.loads(storage.read_text(self.path))
        except (ValueError, OSError):
            holder = {}
        if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
            return                          # its launcher died on this machine: stale
        raise RunDirError(
            f"train.run_dir = {run_dir}: held by run {holder.get('run_id', '?')} ({_describe(holder)}; lock object "
            f"{self.path}): wait for it, or, if that launcher is gone, delete the lock object")

    def announce(self, run_id: str) -> None:
        storage.write_text(self.path, json.dumps({"run_id": run_id, **_holder()}))
        self.held = True

    def release(self) -> None:
        if self.held:
            with contextlib.suppress(OSError):
                storage.delete_tree(self.path)
            self.held = False


def _holder() -> dict:
    """Who this launcher is, as a lock records it."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('since', '?')}"


def _alive(pid: object) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, TypeError):     # gone, or no pid recorded
        return False
    except PermissionError:     # alive, of another user
        pass
    return True
