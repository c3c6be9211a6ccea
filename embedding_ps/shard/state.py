"""`ShardState`: everything one PS shard holds, for every table of `PSConfig.tables`.

The server layer decodes a request and calls one of these methods; the state lives here.
Table `t` is `config.tables[t]`. Ids are raw int64 ids; a `hashed` table maps them to its row
keys here (`sharding.keys_of`), so the client sends raw ids routed by `sharding.route`.

Example::

    state = ShardState(PSConfig(tables=(TableConfig(name="user", dim=16),)), shard_index=0)
    rows = state.pull(0, ids, step=0)              # float32 [N, 16]
    state.push(0, ids, torch.ones(len(ids), 16), step=0)

Every public method takes one lock, so a threaded server may call them from several threads.
Steps are int32 counters on the rows: 0 <= step < 2**31.

Checkpoints: `save` / `load`, or `snapshot` then `ShardSnapshot.write` while the shard serves. The
format, `verify_shard` and `CorruptShardError` live in `embedding_ps.shard.snapshot` (exported here).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import numpy as np
import torch

from embedding_ps.wire.config import PSConfig, shard_threads
from embedding_ps.shard.cow import CowSave
from embedding_ps.wire.sharding import keys_of, shard_of
from embedding_ps.shard.snapshot import (FORMAT_VERSION, CorruptShardError, SavedShard, ShardSnapshot, TableSnapshot,
                                   table_layout, verify_shard)
from embedding_ps.shard.table import TableShard

logger = logging.getLogger(__name__)

MAX_STEP = 2**31 - 1
"""Steps are int32 on the shard (a row's last-seen step)."""
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)     # glibc's (`release_free_heap`), else None


class ShardState:
    """One shard (`shard_index` of `config.num_shards`) of every table in `config.tables`."""

    def __init__(self, config: PSConfig, shard_index: int) -> None:
        if not 0 <= shard_index < config.num_shards:
            raise ValueError(f"shard_index must be in [0, {config.num_shards}), got {shard_index}")
        self.config = config
        self.shard_index = shard_index
        self.threads = shard_threads(config.threads)
        self.tables = [
            TableShard(t, where=f"shard {shard_index} table {i} ({t.name!r})", threads=self.threads,
                       num_shards=config.num_shards)
            for i, t in enumerate(config.tables)
        ]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)     # a background save's writer and waiting updates
        self._cow: CowSave | None = None                 # the running copy-on-write save, if any
        self._hints: dict[int, tuple[torch.Tensor, np.ndarray]] = {}   # table -> (ids, slots): hint_slots

    # ------------------------------------------------------------------ hot path
    def pull(self, table: int, ids: torch.Tensor, step: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows float32 [N, D] of ids int64 [N] (duplicates fine), as `TableShard.pull` says. Read-only:
        changes no row and no last-seen. `out`: a float32 [N, D] contiguous tensor to write the rows into
        and return (the server's reusable reply buffers, `replybuffers`); default a new tensor."""
        t, ids = self._table_ids(table, ids)
        if out is not None and (out.dtype != torch.float32 or tuple(out.shape) != (ids.shape[0], t.cfg.dim)
                                or not out.is_contiguous()):
            raise ValueError(f"shard {self.shard_index} table {table}: out must be contiguous float32 "
                             f"[{ids.shape[0]}, {t.cfg.dim}], got {out.dtype} {list(out.shape)}")
        with self._lock:
            return t.pull(keys_of(ids, t.cfg), step, out)

    def push(self, table: int, ids: torch.Tensor, grads: torch.Tensor, step: int) -> None:
        """Apply gradients float32 [N, D] of ids int64 [N] at `step` (`TableShard.push`: admission,
        optimizer, counters, eviction; the module doc of `embedding_ps.shard.table`). While a background
        save is written, the rows it has not reached keep their pre-images first, or the push waits for
        the writer (`embedding_ps.shard.cow`).
        """
        t, ids = self._table_ids(table, ids)
        self._check_step(step)
        if grads.dim() != 2 or grads.shape[0] != ids.shape[0] or grads.shape[1] != t.cfg.dim:
            raise ValueError(f"shard {self.shard_index} table {table} ({t.cfg.name!r}): grads must be "
                             f"[{ids.shape[0]}, {t.cfg.dim}], got {list(grads.shape)}")
        if ids.shape[0] == 0:
            return
        grads = grads.detach().to(torch.float32).contiguous()
        with self._lock:
            keys = keys_of(ids, t.cfg)
            hint = self._hints.pop(table, None)
            self._before_write(table, t, keys)
            t.push(keys, grads, step, hint[1] if hint is not None and hint[0] is ids else None)

    def _before_write(self, table: int, t: TableShard, keys: torch.Tensor) -> None:
        """Under the lock, before writing rows of `keys` into table `t` while a save streams it: keep
        the pre-images of the slots the write may touch (may wait, lock released, for room in the
        save's side buffer)."""
        if self._cow is not None:
            self._cow.before_write(table, lambda: t.write_slots(keys.numpy()))

    def advance(self, step: int) -> None:
        """Requests of `step` are served from now on (a SAVE of `step`): every table with global
        weight decay owes its rows the decay of the steps through step - 1, which a save or dump then
        writes (`embedding_ps.shard.decay`). Pushes and pulls carry their own step."""
        self._check_step(step)
        with self._lock:
            for t in self.tables:
                t.advance(step)

    def hint_slots(self, table: int, ids: torch.Tensor) -> None:
        """Look up the slots of ids int64 [N] now, for the next `push` of this very tensor to `table`
        (the server, while a client still writes that push's grads: protocol.FLAG_GRADS_LATE). Valid
        while nothing else changes the table's map: the server calls `clear_hints` once it pushed."""
        t, ids = self._table_ids(table, ids)
        with self._lock:
            self._hints[table] = (ids, t.map.lookup(keys_of(ids, t.cfg).numpy()))     # int32 [N], -1: no row

    def clear_hints(self) -> None:
        self._hints.clear()

    def sweep(self, step: int) -> dict[str, int]:
        """TTL eviction in every table; returns {"evicted_ttl": n, "pending_dropped": n, "<name>/evicted_ttl": ...}."""
        self._check_step(step)
        out = {"evicted_ttl": 0, "pending_dropped": 0}
        with self._lock:
            for t in self.tables:
                for key, n in t.sweep(step).items():
                    out[key] += n
                    out[f"{t.cfg.name}/{key}"] = n
            release_free_heap()
        return out

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict[str, int | float]:
        """Flat stats: `<table name>/<key>` for every table, plus totals `rows` and `bytes`."""
        with self._lock:
            per_table = [(t.cfg.name, t.stats()) for t in self.tables]
        out = {total: sum(s[total] for _, s in per_table) for total in ("rows", "bytes")}
        out.update({f"{name}/{k}": v for name, s in per_table for k, v in s.items()})
        return out

    def dump_table(self, table: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """`TableShard.dump` of table `table`: keys (raw ids for `dynamic` tables, hashed row indices for
        `hashed` ones), rows, per-row state."""
        with self._lock:
            return self._table(table).dump()

    def eviction_log(self, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys int64 [E], steps int64 [E]) evicted since the last truncation, oldest first."""
        with self._lock:
            return self._table(table).eviction_log()

    def truncate_eviction_log(self, table: int, through_step: int) -> None:
        """Forget the eviction records of steps <= through_step (after a delta export read them)."""
        with self._lock:
            self._table(table).truncate_eviction_log(through_step)

    def load_dump(self, table: int, keys: torch.Tensor, rows: torch.Tensor, state: dict[str, torch.Tensor],
                  step: int = 0) -> int:
        """Re-sharding: insert the rows of a `dump_table` (of any shard) that this shard owns.

        Keeps the keys with `shard_of(keys, num_shards) == shard_index`, so feeding every old
        shard's dump to every new shard re-shards N -> M. Returns the number of rows taken.
        """
        t = self._table(table)
        mine = shard_of(keys, self.config.num_shards) == self.shard_index
        keys = keys[mine].contiguous()
        with self._lock:
            self._before_write(table, t, keys)
            t.load_rows(keys, rows[mine], {k: v[mine] for k, v in state.items()}, step)
        return int(mine.sum())

    def load_resharded(self, directories: list[str]) -> int:
        """Re-sharding N -> M from disk: take this shard's rows from every `save`d shard of an old layout.

        `directories` are all N old shard directories (any num_shards, same tables). Rows, optimizer
        state, counts and last-seen steps move; admission counts of waiting ids and eviction logs
        stay behind (they are per old shard). Every file read is checked against its checksum
        (CorruptShardError). Returns the number of rows taken.
        """
        taken = 0
        for directory in directories:
            saved = self._open(directory)
            saved.check(self.config.tables)
            for i in range(saved.num_tables):
                taken += self.load_dump(i, *saved.dump_table(i))
        release_free_heap()
        return taken

    # ------------------------------------------------------------------ save / load
    def snapshot(self, step: int | None = None) -> ShardSnapshot:
        """The state now, to be written later by `ShardSnapshot.write(directory)` from any thread.
        `step`: the save's step (`advance(step)` first; global decay: rows written caught up
        through step - 1, else through the latest step seen).

        Under the lock (`snapshot_s`, the only pause) it copies the small arrays and freezes the
        slot-major ones copy-on-write (`embedding_ps.shard.cow`: within `ps.checkpoint_extra_memory`).
        The files equal a blocking `save` taken at the snapshot. One such save at a time; `write` (or
        `close`) ends it.
        """
        t0 = time.perf_counter()
        if step is not None:
            self.advance(step)
        with self._lock:
            if self._cow is not None:
                raise RuntimeError(f"shard {self.shard_index}: a background save is still being written")
            tables = [TableSnapshot(table_layout(t.cfg), *t.to_arrays(copy=True)) for t in self.tables]
            fixed = sum(a.nbytes for s in tables for a in s.arrays.values())
            cow = CowSave(self._cond, [(t.slot_tensors, t.hwm) for t in self.tables], fixed,
                          self.config.checkpoint_extra_memory, where=f"shard {self.shard_index}")
            for snap_table, stream, t in zip(tables, cow.streams, self.tables):
                snap_table.rows = t.saved_rows(stream)     # global decay: caught up, chunk by chunk
            self._cow = cow
        return ShardSnapshot(self.shard_index, self.config.num_shards, tables, time.perf_counter() - t0,
                             on_close=lambda: self._end_save(cow), stats=cow.stats)

    def _end_save(self, cow: CowSave) -> None:
        with self._lock:
            cow.close()
            if self._cow is cow:
                self._cow = None

    def save(self, directory: str, step: int | None = None) -> dict:
        """Write every table's state as checksummed .npy files plus manifest.json; atomic by rename.
        `step`: the save's step, as for `snapshot`.

        The same writer as `snapshot().write(directory)`, but on views of the live arrays with the
        lock held throughout: a blocking save needs no second copy of the shard in memory.
        Returns {"directory", "bytes", "write_s"}.
        """
        if step is not None:
            self.advance(step)
        with self._lock:     # views of the live state, valid while the lock is held
            tables = [TableSnapshot(table_layout(t.cfg), *t.to_arrays(), t.saved_rows()) for t in self.tables]
            return ShardSnapshot(self.shard_index, self.config.num_shards, tables).write(directory)

    def load(self, directory: str) -> None:
        """Replace all state with a `save`d shard; the saved layout must match this config.

        Every file is read and checked (size, sha256) before any state changes: a damaged save
        raises CorruptShardError naming the file and leaves this shard as it was.
        """
        saved = self._open(directory)
        saved.check(self.config.tables, shard_index=self.shard_index, num_shards=self.config.num_shards)
        # memory-mapped (`SavedShard.array`): no second resident copy of the shard beside the table being filled
        tables = [saved.table_arrays(i, mmap=True) for i in range(saved.num_tables)]
        with self._lock:
            if self._cow is not None:
                raise RuntimeError(f"shard {self.shard_index}: cannot load {directory} while a background save "
                                   "is being written")
            for i, (t, arrays) in enumerate(zip(self.tables, tables)):
                t.from_arrays(arrays, saved.meta(i))
            del tables, arrays
            release_free_heap()
        logger.info("shard %d loaded from %s", self.shard_index, directory)

    # ------------------------------------------------------------------ helpers
    def _open(self, directory: str) -> SavedShard:
        try:
            return SavedShard(directory)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"shard {self.shard_index}: {e}") from None

    def _table(self, table: int) -> TableShard:
        if not 0 <= table < len(self.tables):
            raise IndexError(f"shard {self.shard_index}: table {table} out of range [0, {len(self.tables)})")
        return self.tables[table]

    def _table_ids(self, table: int, ids: torch.Tensor) -> tuple[TableShard, torch.Tensor]:
        t = self._table(table)
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"shard {self.shard_index} table {table}: ids must be int64 [N], got {ids.dtype} "
                             f"{list(ids.shape)}")
        return t, ids.contiguous()

    def _check_step(self, step: int) -> None:
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"shard {self.shard_index}: step must be in [0, {MAX_STEP}], got {step}")


def release_free_heap() -> None:
    """Give freed heap pages back to the OS (glibc `malloc_trim`); a no-op elsewhere.

    Large temporaries (a push's [N, D] buffers, a rehash's key arrays) leave free chunks inside
    glibc's heap that still count as resident memory. A shard calls this after sweeps and loads,
    never on the hot path (trimmed pages fault in again, ~several us each on a VM).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


__all__ = ["FORMAT_VERSION", "MAX_STEP", "CorruptShardError", "ShardState", "release_free_heap", "verify_shard"]
