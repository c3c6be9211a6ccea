"""Where run directories, checkpoints and exports live: a local path or any pyarrow filesystem URI
(`s3://bucket/prefix`, `gs://...`, `hdfs://host:port/...`, `file:///abs/path`; which paths, endpoint,
credentials, and why a remote directory is complete once its `manifest.json` is written: docs/storage.md).
Data paths are read by `data/`, a shard's own save by `embedding_ps.remote`, whose `is_uri` / `join` are
used here so both name directories the same way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs

from embedding_ps import remote
from embedding_ps.remote import is_uri, join

class StorageError(OSError):
    """A storage operation failed; the message names the URI, the operation and why (a missing file is a
    FileNotFoundError naming the URI)."""


def _explain(detail: str) -> str:
    text = detail.upper()
    if "NO_SUCH_BUCKET" in text or "NOSUCHBUCKET" in text or "BUCKET DOES NOT EXIST" in text:
        return "the bucket does not exist"
    if "ACCESS_DENIED" in text or "ACCESSDENIED" in text or "FORBIDDEN" in text or "PERMISSION" in text:
        return "permission denied (check the credentials: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ...)"
    if "CONNECT" in text or "RESOLVE" in text or "TIMEOUT" in text or "NETWORK" in text:
        return "cannot reach the storage endpoint (check endpoint_override / AWS_ENDPOINT_URL)"
    return "error"


@contextlib.contextmanager
def _errors(path: str | os.PathLike, op: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: not found ({op})") from e
    except StorageError:
        raise
    except OSError as e:
        raise StorageError(f"{path}: {op} failed: {_explain(str(e))} ({e})") from e
    except Exception as e:             # pyarrow's ArrowInvalid for a bad URI, unknown scheme, ...
        if type(e).__module__.startswith("pyarrow"):
            raise StorageError(f"{path}: {op} failed: {e}") from e
        raise


def resolve(path: str | os.PathLike) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) of a local path or a URI."""
    if is_uri(path):
        with _errors(path, "resolving the filesystem"):
            return remote.resolve(str(path))
    return pafs.LocalFileSystem(), os.path.abspath(os.fspath(path))


def _info(path: str | os.PathLike) -> pafs.FileInfo:
    fs, p = resolve(path)
    with _errors(path, "stat"):
        return fs.get_file_info(p)


def exists(path: str | os.PathLike) -> bool:
    return _info(path).type != pafs.FileType.NotFound


def is_file(path: str | os.PathLike) -> bool:
    return _info(path).type == pafs.FileType.File


def read_bytes(path: str | os.PathLike) -> bytes:
    fs, p = resolve(path)
    with _errors(path, "read"):
        with fs.open_input_stream(p) as f:
            return f.read()


def read_text(path: str | os.PathLike) -> str:
    return read_bytes(path).decode()


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write a whole file atomically: locally a temporary file renamed into place, remotely one object."""
    if not is_uri(path):
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)
        return
    fs, p = resolve(path)
    with _errors(path, "write"):
        if isinstance(fs, pafs.LocalFileSystem):          # file://: no implicit parents (object stores have none)
            fs.create_dir(p.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(p) as f:
            f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    write_bytes(path, text.encode())


def list_dir(path: str | os.PathLike) -> list[str]:
    """Names of the entries directly under `path`, sorted; [] if it does not exist."""
    fs, p = resolve(path)
    with _errors(path, "list"):
        infos = fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))
    return sorted(i.base_name for i in infos)


def list_files(path: str | os.PathLike) -> dict[str, int]:
    """{relative path: size} of every file under `path` (recursively); {} if it does not exist."""
    fs, p = resolve(path)
    with _errors(path, "list"):
        infos = fs.get_file_info(pafs.FileSelector(p, recursive=True, allow_not_found=True))
    root = p.rstrip("/") + "/"
    return {i.path[len(root):]: i.size for i in infos if i.type == pafs.FileType.File}


def delete_tree(path: str | os.PathLike) -> None:
    """Delete `path` and everything under it (its manifest.json first); missing: nothing to do."""
    if not is_uri(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    with _errors(path, "delete"):
        remote.delete_tree(str(path))


def basename(path: str | os.PathLike) -> str:
    """The last name of a path or URI (its query and trailing slashes left out)."""
    return str(path).partition("?")[0].rstrip("/").rsplit("/", 1)[-1]


def upload_dir(local: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put local directory `local` at `path` (replacing what is there), its manifest.json written last."""
    if not is_uri(path):
        dst = Path(path)
        tmp = dst.with_name(f".tmp-{dst.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(local, tmp)
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(tmp, dst)
        return
    with _errors(path, "upload"):
        remote.upload_dir(os.fspath(local), str(path), last="manifest.json")


def download_dir(path: str | os.PathLike, local: str | os.PathLike) -> None:
    """Copy everything under `path` into local directory `local`."""
    if not is_uri(path):
        shutil.copytree(path, local, dirs_exist_ok=True)
        return
    with _errors(path, "download"):
        remote.download_dir(str(path), os.fspath(local))


@contextlib.contextmanager
def local_copy(path: str | os.PathLike) -> Iterator[Path]:
    """A local directory holding `path`'s files: `path` itself when local, else a downloaded
    temporary copy removed on exit."""
    if not is_uri(path):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="recsys-fetch-", ignore_cleanup_errors=True) as tmp:
        download_dir(path, Path(tmp) / "d")
        yield Path(tmp) / "d"


@contextlib.contextmanager
def local_output(path: str | os.PathLike, directory: bool = True) -> Iterator[str]:
    """Where a command writes output `path`: `path` itself when local; for a URI a local temporary
    path, uploaded to `path` when the block ends without an error (a directory: its manifest.json
    last; a file: one object)."""
    if not is_uri(path):
        yield os.fspath(path)
        return
    with tempfile.TemporaryDirectory(prefix="recsys-out-", ignore_cleanup_errors=True) as tmp:
        local = Path(tmp) / (basename(path) or "out")
        yield str(local)
        if directory:
            upload_dir(local, path)
        else:
            write_bytes(path, local.read_bytes())


__all__ = ["StorageError", "delete_tree", "download_dir", "exists", "is_file", "is_uri", "join", "list_dir",
           "list_files", "local_copy", "local_output", "read_bytes", "read_text", "resolve", "upload_dir",
           "write_bytes", "write_text"]
