"""A shard's seam to remote storage: saves to and loads from a pyarrow filesystem URI (docs/storage.md:
the schemes, endpoint and credentials; "Checkpoints": on a multi-host job each shard writes its own part).

A remote save is "write-then-marker" (object stores cannot rename a directory): the shard's files are
written into a local temporary directory as a local save writes them (checksums computed while
writing), then uploaded, `manifest.json` last; a reader treats a shard directory without it as
unfinished (`snapshot.read_manifest`). A load downloads the directory first. This is the only place in
`embedding_ps` that knows about URIs; `recsys.storage` uses its `is_uri` / `join` so both sides name a
shard's directory the same way.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

logger = logging.getLogger(__name__)

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
_FILESYSTEMS: dict[tuple[str, str, str], pafs.FileSystem] = {}


def is_uri(path: str | os.PathLike) -> bool:
    """Whether `path` is a filesystem URI (`scheme://...`) rather than a local path."""
    return isinstance(path, str) and _URI.match(path) is not None


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base`/`parts...`; for a URI the query (`?endpoint_override=...`) stays at the end."""
    if not is_uri(base):
        return os.path.join(os.fspath(base), *parts)
    head, sep, query = base.partition("?")
    for p in parts:
        head = head.rstrip("/") + "/" + p.strip("/")
    return head + sep + query


def within(root: str, path: str) -> bool:
    """Whether URI `path` lies under URI `root` (same scheme, host and query; no `..` part)."""
    if not (is_uri(root) and is_uri(path)):
        return False
    r, p = urlsplit(root), urlsplit(path)
    if (r.scheme.lower(), r.netloc, r.query) != (p.scheme.lower(), p.netloc, p.query):
        return False
    parts = [x for x in p.path.split("/") if x]
    if any(x in (".", "..") for x in parts):
        return False
    base = [x for x in r.path.split("/") if x]
    return parts[: len(base)] == base


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) of a URI; the filesystem of a scheme, host and query is made once."""
    s = urlsplit(uri)
    key = (s.scheme.lower(), s.netloc, s.query)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs, path = pafs.FileSystem.from_uri(uri)
        _FILESYSTEMS[key] = fs
        return fs, path
    if key[0] in ("file", "hdfs", "viewfs", "mock"):
        path = unquote(s.path)
    else:                                    # object stores: the bucket is the first part of the path
        path = s.netloc + unquote(s.path)
    return fs, path.rstrip("/") or "/"


def read_bytes(path: str) -> bytes:
    """A whole file, local or at a URI; FileNotFoundError if it is not there."""
    if not is_uri(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = resolve(path)
    if fs.get_file_info(p).type != pafs.FileType.File:
        raise FileNotFoundError(f"{path}: no such file")
    with fs.open_input_stream(p) as f:
        return f.read()


def upload_dir(local: str, uri: str, last: str) -> None:
    """Copy every file under local directory `local` to `uri`, file `last` (relative name) last.

    Whatever was under `uri` before is deleted first, marker first, so a reader never sees an old
    marker over new files.
    """
    fs, root = resolve(uri)
    delete_tree(uri)
    rels = [os.path.relpath(os.path.join(dirpath, n), local) for dirpath, _, names in os.walk(local) for n in names]
    for rel in sorted(rels, key=lambda r: (r == last, r)):
        _copy(pafs.LocalFileSystem(), os.path.join(local, rel), fs, f"{root}/{rel}")


def download_dir(uri: str, local: str) -> None:
    """Copy every file under `uri` into local directory `local`; FileNotFoundError if there is none."""
    fs, root = resolve(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except OSError as e:
        raise OSError(f"{uri}: listing failed ({e})") from e
    files = [i for i in infos if i.type == pafs.FileType.File]
    if not files:
        raise FileNotFoundError(f"no saved shard at {uri} (nothing stored under it)")
    for info in files:
        rel = info.path[len(root):].lstrip("/")
        _copy(fs, info.path, pafs.LocalFileSystem(), os.path.join(local, rel))


def delete_tree(uri: str) -> None:
    """Delete the file `uri`, or everything under it (a `manifest.json` first); nothing there: nothing to do."""
    fs, root = resolve(uri)
    kind = fs.get_file_info(root).type
    if kind == pafs.FileType.NotFound:
        return
    if kind == pafs.FileType.File:
        fs.delete_file(root)
        return
    marker = f"{root}/manifest.json"
    if fs.get_file_info(marker).type == pafs.FileType.File:
        fs.delete_file(marker)
    if "/" in root.strip("/"):
        fs.delete_dir(root)
    else:                                    # a bucket itself: empty it, never delete it
        fs.delete_dir_contents(root)


def write_via_local(directory: str, write: Callable[[str], dict]) -> dict:
    """A save to URI `directory`: `write(local_tmp_dir)` (the local writer), then upload, manifest last.

    Returns what `write` returned, with "directory" = `directory`. The local copy is removed.
    """
    with tempfile.TemporaryDirectory(prefix="ps-save-", ignore_cleanup_errors=True) as tmp:
        local = os.path.join(tmp, "shard")
        info = dict(write(local))
        try:
            upload_dir(local, directory, last="manifest.json")
        except OSError as e:
            raise OSError(f"saving to {directory} failed: {e}") from e
    info["directory"] = directory
    return info


def fetch(directory: str) -> tempfile.TemporaryDirectory:
    """A local copy of the shard directory at URI `directory`, removed when the object is collected
    (arrays memory-mapped from it stay readable after that on POSIX)."""
    tmp = tempfile.TemporaryDirectory(prefix="ps-load-")
    try:
        download_dir(directory, tmp.name)
    except BaseException:
        tmp.cleanup()
        raise
    return tmp


def _copy(src_fs: pafs.FileSystem, src: str, dst_fs: pafs.FileSystem, dst: str) -> None:
    if isinstance(dst_fs, pafs.LocalFileSystem):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
    pafs.copy_files(src, dst, source_filesystem=src_fs, destination_filesystem=dst_fs)


__all__ = ["delete_tree", "download_dir", "fetch", "is_uri", "join", "resolve", "upload_dir", "within",
           "write_via_local"]
