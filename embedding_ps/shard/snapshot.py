"""The one owner of a saved shard on disk: its name, its writer, its verified readers.

Shard `i` of a save under `root` is `root/shard{i}` (`shard_dir`, the only maker of such paths;
`saved_shard_dirs(root)` lists them back), one directory (format 2)::

    manifest.json        {"format_version": 2, "shard_index": i, "num_shards": n,
                          "tables": [{"layout": {...}, "meta": {...}, "arrays": [names]}, ...],
                          "files": {"table0/weights.npy": {"size": bytes, "sha256": hex}, ...}}
    table<t>/<name>.npy  one plain .npy file per array of `TableShard.to_arrays` and `slot_tensors`
                         (no pickle)

Every data file is listed under "files" with its size and SHA-256, computed while it is written
(never by reading it back). Readers check both before using a file and raise CorruptShardError
naming the file. Format 1 saves (no "files") still load, unchecked.

Writing: a save is atomic: everything is written (and fsynced) into `<dir>.tmp-<pid>`, which is
renamed into place; an older save at `<dir>` is replaced only then. A failed write removes its tmp dir.
A `ShardSnapshot` (`ShardState.snapshot()`, copy-on-write) is written without the shard's lock, e.g. on
a background thread while the shard serves, into the same bytes as a blocking save.

Reading: every reader of a save (restore, re-sharding, export) goes through `SavedShard`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from embedding_ps import remote
from embedding_ps.wire.config import TableConfig
from embedding_ps.shard.npyfile import (CorruptShardError, fsync_dir, parse_npy, read_checked, write_array,
                                        write_streamed)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"

LAYOUT_FIELDS = ("name", "dim", "kind", "num_embeddings", "dtype", "optimizer", "seed", "init", "init_scale")
"""TableConfig fields saved as a table's "layout": a config loading the save must match them."""
_SHARD = "shard"
LOW32 = 0xFFFFFFFF
"""The low half of a row's saved `meta` (`count << 32 | last_seen`): its last_seen step."""
CHUNK_ROWS = 1 << 16
"""Rows per chunk a blocking save writes (`LiveRows`; the copy-on-write save sizes its own chunks)."""


# ---------------------------------------------------------------------------------------------
# naming


def shard_dir(root: str | os.PathLike, shard_index: int) -> str:
    """Where shard `shard_index` keeps its part of a save under `root` (`root/shard{i}`; `root`
    may be a URI, see `embedding_ps.remote`)."""
    return remote.join(root, f"{_SHARD}{shard_index}")


def _shard_indices(root: str) -> list[int]:
    """Indices i of the `shard{i}` directories under `root`, sorted (tmp / old dirs are not); none if
    `root` does not exist."""
    names = os.listdir(root) if os.path.exists(root) else []
    return sorted(int(n[len(_SHARD):]) for n in names
                  if n.startswith(_SHARD) and n[len(_SHARD):].isdigit() and os.path.isdir(os.path.join(root, n)))


def saved_shard_dirs(root: str | os.PathLike) -> list[str]:
    """The shard directories of a save under `root` (`root/shard{i}`), in shard order.

    The count is the `num_shards` of the lowest one's manifest; FileNotFoundError if `root` holds
    no saved shard or one of them is missing, CorruptShardError if that manifest is unreadable.
    """
    root = os.fspath(root)
    found = _shard_indices(root)
    if not found:
        why = f"{_SHARD}0, {_SHARD}1, ..." if os.path.exists(root) else "the directory does not exist"
        raise FileNotFoundError(f"{root}: no saved shards ({why})")
    n = int(read_manifest(shard_dir(root, found[0]))["num_shards"])
    dirs = [shard_dir(root, i) for i in range(n)]
    missing = [d for d in dirs if not os.path.isdir(d)]
    if missing:
        raise FileNotFoundError(f"{root}: saved with {n} shards but {', '.join(missing)} missing")
    return dirs


def saved_file_checksums(root: str | os.PathLike) -> dict[str, dict]:
    """{"shard{i}/table{t}/<name>.npy": {"size", "sha256"}} of every shard saved under `root`, as
    their manifests list them (a checkpoint's manifest reuses them instead of hashing every row
    again). Best effort: a shard whose manifest is missing or unreadable is left out."""
    root = os.fspath(root)
    out: dict[str, dict] = {}
    for i in _shard_indices(root):
        try:
            files = read_manifest(shard_dir(root, i)).get("files", {})
        except (OSError, ValueError):
            continue
        for rel, entry in files.items():
            if isinstance(entry, dict) and "sha256" in entry and "size" in entry:
                out[f"{_SHARD}{i}/{rel}"] = entry
    return out


def saved_files(root: str, num_shards: int) -> dict[str, dict]:
    """{"shard{i}/manifest.json": {"size", "sha256"}, "shard{i}/<file>": {"size", "sha256"}} of the
    `num_shards` shards saved under `root` (a URI too), as their manifests list their files: what a
    checkpoint's manifest records of them without reading a row. FileNotFoundError naming a shard
    whose manifest is not there."""
    out: dict[str, dict] = {}
    for i in range(num_shards):
        raw = remote.read_bytes(remote.join(shard_dir(root, i), MANIFEST))
        out[f"{_SHARD}{i}/{MANIFEST}"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        for rel, entry in json.loads(raw).get("files", {}).items():
            out[f"{_SHARD}{i}/{rel}"] = entry
    return out


def saved_num_shards(directory: str) -> int:
    """The shard count a saved shard's manifest records (`directory` a URI too); FileNotFoundError if
    there is no manifest."""
    return int(json.loads(remote.read_bytes(remote.join(directory, MANIFEST)))["num_shards"])


def table_layout(cfg: TableConfig) -> dict:
    """The "layout" a save records for a table: its `LAYOUT_FIELDS`."""
    return {f: getattr(cfg, f) for f in LAYOUT_FIELDS}


def unpack_meta(meta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(count, last_seen), int64 each, of saved `meta` int64 [R] (`count << 32 | last_seen`, as
    `embedding_ps.shard.table` packs its counters)."""
    return meta >> 32, meta & LOW32


@dataclass
class TableSnapshot:
    """One table: its layout fields (checked on load), arrays and scalar meta, as `to_arrays` gives them.

    `rows`: its slot-major arrays (`TableShard.saved_rows`), an object with `specs` {name: (shape,
    dtype)} and `chunks()` yielding {name: ndarray [n, ...]} for consecutive row ranges (`LiveRows`,
    `embedding_ps.shard.cow.RowStream`, `embedding_ps.shard.decay.CaughtUpRows`).
    """

    layout: dict
    arrays: dict[str, np.ndarray]
    meta: dict
    rows: Any = None


class LiveRows:
    """A blocking save's `TableSnapshot.rows`: the live slot-major arrays {name: ndarray [hwm, ...]}
    in chunks of CHUNK_ROWS rows, views except those named in `copied` (copies a reader may change)."""

    def __init__(self, arrays: dict[str, np.ndarray], copied: Sequence[str] = ()) -> None:
        self.arrays, self.copied = arrays, copied
        self.specs = {n: (a.shape, a.dtype) for n, a in arrays.items()}

    def chunks(self) -> Iterator[dict[str, np.ndarray]]:
        rows = next(iter(self.arrays.values())).shape[0]
        for lo in range(0, rows, CHUNK_ROWS):
            yield {n: a[lo : lo + CHUNK_ROWS].copy() if n in self.copied else a[lo : lo + CHUNK_ROWS]
                   for n, a in self.arrays.items()}


@dataclass
class ShardSnapshot:
    """Every table of one shard, frozen: written by `write` once (it then calls `close`)."""

    shard_index: int
    num_shards: int
    tables: list[TableSnapshot]
    snapshot_s: float = 0.0
    """Seconds the snapshot took under the shard's lock (the shard's pause)."""
    on_close: Callable[[], None] | None = None
    """Ends the copy-on-write save (called once, by `close`)."""
    stats: Callable[[], dict] = field(default=dict)
    """The copy-on-write save's figures (`CowSave.stats`: extra_bytes_peak, push_wait_s, ...)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays the files hold (the streamed slot-major ones included)."""
        streamed = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                       for t in self.tables for shape, dtype in t.rows.specs.values())
        return streamed + sum(a.nbytes for t in self.tables for a in t.arrays.values())

    def close(self) -> None:
        """End the snapshot: the shard stops keeping pre-images for it. Idempotent."""
        fn, self.on_close = self.on_close, None
        if fn is not None:
            fn()

    def write(self, directory: str) -> dict:
        """Write to `directory` atomically (see the module docstring), then close the snapshot, also when
        the write fails (the error is raised). Returns {"directory", "bytes" (data files), "write_s"}. A
        URI `directory`: written locally, then uploaded with the manifest last (`embedding_ps.remote`)."""
        try:
            if remote.is_uri(directory):
                return remote.write_via_local(directory, self._write)
            return self._write(directory)
        finally:
            self.close()

    def _write(self, directory: str) -> dict:
        t0 = time.perf_counter()
        parent = os.path.dirname(os.path.abspath(directory))
        tmp = f"{directory}.tmp-{os.getpid()}"
        try:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            manifest: dict = {"format_version": FORMAT_VERSION, "shard_index": self.shard_index,
                              "num_shards": self.num_shards, "tables": [], "files": {}}
            for i, t in enumerate(self.tables):
                table_dir = os.path.join(tmp, f"table{i}")
                os.makedirs(table_dir)
                files = write_streamed(table_dir, t.rows)
                for name in sorted(t.arrays):
                    files[name] = write_array(os.path.join(table_dir, f"{name}.npy"), t.arrays[name])
                names = sorted(files)
                manifest["files"].update({f"table{i}/{name}.npy": files[name] for name in names})
                fsync_dir(table_dir)
                manifest["tables"].append({"layout": t.layout, "meta": t.meta, "arrays": names})
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            old = f"{directory}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            if os.path.exists(directory):
                os.rename(directory, old)
            os.rename(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
        size = sum(f["size"] for f in manifest["files"].values())
        write_s = time.perf_counter() - t0
        logger.info("shard %d: wrote %s (%.1f MB in %.2f s)", self.shard_index, directory, size / 1e6, write_s)
        return {"directory": directory, "bytes": size, "write_s": write_s}


# ---------------------------------------------------------------------------------------------
# reading


def read_manifest(directory: str) -> dict:
    """The parsed manifest of a saved shard.

    FileNotFoundError if `directory` does not exist; CorruptShardError if its manifest.json is
    missing, not JSON, or of an unknown format version.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no saved shard at {directory} (missing {path})")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError:
        raise CorruptShardError(f"{path}: missing (the directory holds no finished save)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptShardError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("tables"), list):
        raise CorruptShardError(f"{path}: not a shard manifest (no 'tables' list)")
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise CorruptShardError(f"{path}: format_version {version!r}, this code reads {READABLE_VERSIONS}")
    if version >= 2 and not isinstance(manifest.get("files"), dict):
        raise CorruptShardError(f"{path}: format_version {version} without a 'files' table")
    for i, entry in enumerate(manifest["tables"]):
        if not isinstance(entry, dict) or not {"layout", "meta", "arrays"} <= entry.keys():
            raise CorruptShardError(f"{path}: table {i} entry lacks layout/meta/arrays")
        for name in entry["arrays"] if version >= 2 else ():
            if f"table{i}/{name}.npy" not in manifest["files"]:
                raise CorruptShardError(f"{path}: table{i}/{name}.npy is not listed under 'files'")
    return manifest


class SavedShard:
    """One saved shard, opened for reading: the manifest is read and checked once, and every array
    read through it is checked against the manifest's size and SHA-256 first (CorruptShardError).

        saved = SavedShard(shard_dir(root, 0))
        saved.check(config.tables)                 # the layout this config expects
        w = saved.array(t, "weights", mmap=True)   # verified, memory-mapped
        keys, rows, state = saved.dump_table(t)    # what `TableShard.dump` gives, from the files

    FileNotFoundError if `directory` does not exist.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        # a URI: read from a local copy, removed with this object (embedding_ps.remote)
        self._fetched = remote.fetch(directory) if remote.is_uri(directory) else None
        self.directory = self._fetched.name if self._fetched else os.fspath(directory)
        self.manifest = read_manifest(self.directory)

    @property
    def shard_index(self) -> int:
        return int(self.manifest["shard_index"])

    @property
    def num_shards(self) -> int:
        return int(self.manifest["num_shards"])

    @property
    def num_tables(self) -> int:
        return len(self.manifest["tables"])

    def layout(self, table: int) -> dict:
        """The saved `LAYOUT_FIELDS` of table `table`."""
        return self.manifest["tables"][table]["layout"]

    def meta(self, table: int) -> dict:
        """The saved scalar meta of table `table` (hwm, capacity, evlog_lost_through, totals...)."""
        return self.manifest["tables"][table]["meta"]

    def array_names(self, table: int) -> list[str]:
        return list(self.manifest["tables"][table]["arrays"])

    def array(self, table: int, name: str, mmap: bool = False) -> np.ndarray:
        """Array `name` of table `table`, after checking its size and SHA-256 against the manifest.

        mmap=False: the file is read once into memory; the checksum is taken over those bytes and the
        array is a view of them. mmap=True: the file is memory-mapped read-only and hashed through the
        mapping once (one sequential read of the file, at SHA-256 speed); its pages then sit in the OS
        page cache, not in this process's own memory, and the array is a view of the mapping, so
        gathering a few rows of it later reads no more. Format 1 (no checksums): np.load, unchecked.
        """
        if name not in self.manifest["tables"][table]["arrays"]:
            raise CorruptShardError(f"{self.directory}/table{table}/{name}.npy: not in the saved shard's manifest")
        rel = f"table{table}/{name}.npy"
        path = os.path.join(self.directory, rel)
        if self.manifest["format_version"] < 2:
            try:
                return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
            except FileNotFoundError:
                raise CorruptShardError(f"{path}: missing") from None
            except (ValueError, EOFError, OSError) as e:
                raise CorruptShardError(f"{path}: unreadable ({e})") from None
        return parse_npy(path, read_checked(path, self.manifest["files"][rel], mmap))

    def table_arrays(self, table: int, mmap: bool = False) -> dict[str, np.ndarray]:
        """{name: verified array} of every array of table `table`."""
        return {n: self.array(table, n, mmap) for n in self.array_names(table)}

    def check(self, tables: Sequence[TableConfig], shard_index: int | None = None, num_shards: int | None = None,
              fields: Sequence[str] = LAYOUT_FIELDS) -> None:
        """ValueError naming the field unless this save holds `tables` with the same `fields` (and,
        where given, is shard `shard_index` of `num_shards`)."""
        where = os.path.join(self.directory, MANIFEST)
        for key, mine in (("shard_index", shard_index), ("num_shards", num_shards)):
            if mine is not None and self.manifest[key] != mine:
                raise ValueError(f"{where}: saved {key}={self.manifest[key]} but this shard has {key}={mine}")
        if self.num_tables != len(tables):
            raise ValueError(f"{where}: {self.num_tables} tables saved, config has {len(tables)}")
        for i, cfg in enumerate(tables):
            saved = self.layout(i)
            for name in fields:
                if saved.get(name) != getattr(cfg, name):
                    raise ValueError(f"{where}: table {i} saved with {name}={saved.get(name)!r}, "
                                     f"config has {name}={getattr(cfg, name)!r}")

    def live_slots(self, table: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys int64 [R], slots int64 [R]) of the rows table `table` holds: key k's row is
        `weights[slot]` (and its counters `meta[slot]`)."""
        keys = self.array(table, "map_keys").astype(np.int64, copy=False)
        return keys, self.array(table, "map_slots").astype(np.int64)

    def dump_table(self, table: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """What `TableShard.dump` returns, from the files: (keys int64 [R], rows float32 [R, D],
        {optimizer state name: [R] or [R, D], "count": int32 [R], "last_seen": int32 [R]}); no count /
        last_seen for a table saved without row counters; "decay_step" int32 [R] for one saved with
        global weight decay."""
        keys, slots = self.live_slots(table)
        # memory-mapped: only the gathered live rows become resident (re-sharding reads every old shard)
        rows = torch.from_numpy(self.array(table, "weights", mmap=True)[slots]).float()
        state = {n[len("state."):]: torch.from_numpy(self.array(table, n, mmap=True)[slots])
                 for n in self.array_names(table) if n.startswith("state.")}
        if "meta" in self.array_names(table):   # absent: a table saved with row_counters = false
            count, last_seen = unpack_meta(self.array(table, "meta", mmap=True)[slots])
            state["count"] = torch.from_numpy(count).to(torch.int32)
            state["last_seen"] = torch.from_numpy(last_seen).to(torch.int32)
        if "decay_step" in self.array_names(table):     # global weight decay: the step the rows are decayed through
            state["decay_step"] = torch.from_numpy(self.array(table, "decay_step", mmap=True)[slots].astype(np.int32))
        return torch.from_numpy(keys), rows, state


def verify_shard(directory: str) -> None:
    """Check every file of a saved shard against its manifest (size, SHA-256) without loading it.

    Raises FileNotFoundError (no such directory) or CorruptShardError naming the bad file. A
    format 1 save has no checksums: only that its files exist is checked (and a warning logged).
    """
    manifest = read_manifest(directory)
    if manifest["format_version"] < 2:
        logger.warning("%s: format_version %d has no checksums; only checking that files exist",
                       directory, manifest["format_version"])
        for i, entry in enumerate(manifest["tables"]):
            for name in entry["arrays"]:
                path = os.path.join(directory, f"table{i}", f"{name}.npy")
                if not os.path.isfile(path):
                    raise CorruptShardError(f"{path}: missing")
        return
    for rel, expect in sorted(manifest["files"].items()):
        read_checked(os.path.join(directory, rel), expect, mmap=True)      # hashed through a mapping: no copy


__all__ = ["FORMAT_VERSION", "LAYOUT_FIELDS", "LOW32", "CorruptShardError", "LiveRows", "SavedShard", "ShardSnapshot",
           "TableSnapshot", "read_manifest", "saved_file_checksums", "saved_shard_dirs", "shard_dir", "table_layout",
           "unpack_meta", "verify_shard", "write_array"]
