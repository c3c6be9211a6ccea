"""Data files on a pyarrow filesystem URI (`s3://bucket/data/`, `gs://...`, `hdfs://...`, `file:///...`).

`data.*_paths` entries that are URIs are listed here by the rules of local paths (a file, a directory
or a glob: `data.parquet.resolve_paths`), and each file is opened through its filesystem. A file's
URI keeps the query of the path it came from (`?endpoint_override=...&scheme=http`), so it can be
opened again on its own. Endpoint and credentials: docs/storage.md.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from data.paths import HIDDEN, glob_match

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+://")
_MAGIC = re.compile(r"[*?[]")
_FILESYSTEMS: dict[tuple[str, str, str], tuple[pafs.FileSystem, str]] = {}


def is_uri(path: str) -> bool:
    """Whether `path` is a filesystem URI (`scheme://...`) rather than a local path."""
    return isinstance(path, str) and _URI.match(path) is not None


def _resolve(uri: str) -> tuple[pafs.FileSystem, str, str, str]:
    """(filesystem, path inside it, URI prefix that path is appended to, query suffix)."""
    s = urlsplit(uri)
    key = (s.scheme.lower(), s.netloc, s.query)
    if key not in _FILESYSTEMS:
        fs, _ = pafs.FileSystem.from_uri(uri)
        object_store = key[0] not in ("file", "hdfs", "viewfs", "mock")
        _FILESYSTEMS[key] = fs, (f"{s.scheme}://" if object_store else f"{s.scheme}://{s.netloc}")
    fs, prefix = _FILESYSTEMS[key]
    path = unquote(s.path) if not prefix.endswith("://") else s.netloc + unquote(s.path)
    return fs, path, prefix, f"?{s.query}" if s.query else ""


def _visible(rel: str) -> bool:
    return not any(part.startswith(HIDDEN) for part in rel.split("/") if part)


def list_files(uri: str) -> list[str]:
    """File URIs named by `uri` (a file, a directory or a glob), sorted; FileNotFoundError if it
    does not exist, OSError naming `uri` when listing fails (missing bucket, permission)."""
    try:
        fs, path, prefix, query = _resolve(uri)
        magic = _MAGIC.search(path)
        if magic is None:
            info = fs.get_file_info(path.rstrip("/") or path)     # `.../day=2026-11-26/`: the directory
            if info.type == pafs.FileType.File:
                return [uri]
            if info.type == pafs.FileType.NotFound:
                raise FileNotFoundError(f"data path '{uri}' does not exist")
            base, pattern = path.rstrip("/"), None
        else:
            base, pattern = path[: magic.start()].rsplit("/", 1)[0], path
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise OSError(f"data path '{uri}': listing failed ({e})") from e
    return sorted(f"{prefix}{i.path}{query}" for i in infos if i.type == pafs.FileType.File
                  and (_visible(i.path[len(base):]) if pattern is None else _glob_names(pattern, i.path, base)))


def _glob_names(pattern: str, path: str, base: str) -> bool:
    """Whether glob `pattern` names file `path`: the file itself, or a directory between `base` and
    it whose visible files the glob means (as a local glob of a directory), name by name."""
    if glob_match(pattern, path):
        return True
    parts = path[len(base):].strip("/").split("/")
    return any(glob_match(pattern, f"{base}/{'/'.join(parts[:k])}") and _visible("/".join(parts[k:]))
               for k in range(1, len(parts)))


def parquet_file(path: str, metadata: pq.FileMetaData | None = None) -> pq.ParquetFile:
    """A ParquetFile of a local path or a file URI (opened through its pyarrow filesystem)."""
    if not is_uri(path):
        return pq.ParquetFile(path, metadata=metadata)
    fs, p, _, _ = _resolve(path)
    return pq.ParquetFile(p, metadata=metadata, filesystem=fs)


__all__ = ["is_uri", "list_files", "parquet_file"]
