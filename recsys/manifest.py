"""File manifests of checkpoints and exports: reading, size + sha256 of every file, and their check.
A manifest's `files` maps a path relative to its directory to `{"size": bytes, "sha256": hex}` (the
PS shards' own manifests use the same form), so a truncated or altered file is named, not loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from recsys import storage
from recsys.rundir import run_path


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def write_json_atomic(path: Path, obj: Any) -> None:
    """`obj` as indented JSON at `path`, written to a temporary file, fsynced and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(root: Path, manifest: dict[str, Any], known: dict[str, dict[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """`manifest` with `files` (size and sha256 of every file under `root`: an entry of `known`, by
    relative path, where its size still matches, else hashed here) written to root/manifest.json
    (fsynced); returns it."""
    files = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or (path.parent == root and path.name.startswith("manifest.json")):
            continue
        rel = path.relative_to(root).as_posix()
        entry = (known or {}).get(rel)
        files[rel] = entry if entry is not None and entry["size"] == path.stat().st_size else file_entry(path)
    manifest["files"] = files
    write_json_atomic(root / "manifest.json", manifest)
    return manifest


def read_manifest(root: str | Path, error: type[Exception], *, kind: str, format: str,
                  version: tuple[str, int], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """`root/manifest.json` (a local path or a URI) of a checkpoint or export: a JSON object of `format`
    whose `version[0]` key is `version[1]`, holding the `required` keys and a `files` table. Raises
    `error` naming the file: missing ("not {kind}"), not JSON, of another format or version, or
    without a key. The one reader of recsys' manifests (a saved PS shard's is
    `embedding_ps.shard.snapshot`'s)."""
    path = run_path(root, "manifest.json")
    try:
        data = storage.read_bytes(path)         # bytes: json.loads refuses bad UTF-8 as invalid JSON
    except FileNotFoundError:
        raise error(f"{path}: missing (not {kind})") from None
    try:
        manifest = json.loads(data)
    except ValueError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != format:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise error(f"{path}: not a {format} manifest (format {got!r})")
    key, want = version
    if manifest.get(key) != want:
        raise error(f"{path}: {key} {manifest.get(key)!r}, this build reads {want}")
    missing = [k for k in (*required, "files") if k not in manifest]
    if missing or not isinstance(manifest["files"], dict):
        raise error(f"{path}: corrupt manifest, no {missing or ['files']}")
    return manifest


def check_files(root: Path, files: dict[str, dict[str, Any]], error: type[Exception], *, verify: bool = True) -> None:
    """Raise `error` naming the first file of `files` (under `root`) that is missing, of another size,
    or (with `verify`) of another sha256 than its entry says."""
    for rel, want in files.items():
        path = root / rel
        if not path.is_file():
            raise error(f"{path}: missing (listed in {root / 'manifest.json'})")
        size = path.stat().st_size
        if size != want["size"]:
            raise error(f"{path}: {size} bytes, the manifest says {want['size']} (truncated or changed)")
        if verify:
            digest = sha256_file(path)
            if digest != want["sha256"]:
                raise error(f"{path}: sha256 {digest[:12]}..., the manifest says {want['sha256'][:12]}... "
                            f"(the file was altered)")
