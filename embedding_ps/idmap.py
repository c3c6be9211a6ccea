"""A vectorized open-addressing hash map from arbitrary int64 keys to int32 values.

Layout: `keys` int64 [C] and `vals` int32 [C], C a power of two. A bucket is occupied when
`vals >= 0`; `EMPTY` (-1) ends a probe chain and `TOMBSTONE` (-2) marks a deleted bucket that a
probe walks past and an insert may reuse. Occupancy lives in `vals`, never in a sentinel key,
so every 64-bit key (0, negatives, int64 min/max) is storable. 12 bytes per bucket.

Probing is linear (bucket C - 1 wraps to 0) from `home = ((splitmix64(key + GOLDEN) >> 32) * C) >> 32`,
the top bits of a mix different from the shard hash (`shard_of` uses `splitmix64(key)`), so the
ids that one shard holds still spread over all buckets; for C = 2**b it is the mix's top b bits.
C is a power of two as the map grows by itself, or any multiple of 64 after `reserve(n)`.

Every operation takes a whole batch of keys. The map grows (rehashes into twice the buckets) when
live entries plus tombstones pass `max_load`, and rehashes in place when tombstones crowd it.
Probes and inserts are `native.map_find` / `native.map_place` (C, or `embedding_ps.reference`'s numpy).

`BoundedCounter` (at the end) counts sightings of ids that are not admitted yet, with a hard
bound on how many ids it remembers.
"""

from __future__ import annotations

import numpy as np

from embedding_ps import native
from embedding_ps.reference import EMPTY, TOMBSTONE

MAX_LOAD = 0.95
"""Highest `max_load` an IdMap accepts (linear probing's chains grow like 1 / (1 - load)**2 past it)."""


class IdMap:
    """int64 key -> int32 value (>= 0), for batches of keys.

    Example::

        m = IdMap()
        m.insert(np.array([7, -1, 2**63 - 1]), np.array([0, 1, 2], dtype=np.int32))
        m.lookup(np.array([-1, 5]))   # -> array([1, -1], dtype=int32)
    """

    def __init__(self, capacity: int = 0, max_load: float = 0.7, threads: int = 1) -> None:
        if not 0.1 <= max_load <= MAX_LOAD:
            raise ValueError(f"IdMap.max_load must be in [0.1, {MAX_LOAD}], got {max_load}")
        self.max_load = max_load
        self.threads = threads  # C threads of a native lookup (reads only); inserts run on one thread
        self._size = 0
        self._reserved = 0  # buckets that `reserve` asked for: rehashes of up to max_load of them keep them
        self._alloc(self._buckets_for(capacity))

    # ------------------------------------------------------------------ public API
    def __len__(self) -> int:
        return self._size

    @property
    def num_buckets(self) -> int:
        return self._vals.shape[0]

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """int64 [N] -> int32 [N]: the value of each key, -1 where absent. Duplicates are fine."""
        return native.map_find(self._keys, self._vals, np.ascontiguousarray(keys, dtype=np.int64), "val", self.threads)

    def insert(self, keys: np.ndarray, vals: np.ndarray) -> None:
        """Insert keys int64 [N] -> vals int32 [N] (>= 0).

        The keys must be distinct and absent from the map (the caller looked them up first with
        `lookup`). Growth happens here, before probing.
        """
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        vals = np.ascontiguousarray(vals, dtype=np.int32)
        if keys.shape != vals.shape:
            raise ValueError(f"IdMap.insert: {keys.shape[0]} keys but {vals.shape[0]} values")
        n = keys.shape[0]
        if n == 0:
            return
        if self._size + self._tombs + n > self.max_load * self.num_buckets:
            self._rehash(self._size + n)
        self._tombs -= native.map_place(self._keys, self._vals, keys, vals)   # takes free buckets, tombstones too
        self._size += n

    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Remove keys int64 [N]; returns int32 [N]: the removed value, -1 where a key was absent."""
        pos = native.map_find(self._keys, self._vals, np.ascontiguousarray(keys, dtype=np.int64), "pos", self.threads)
        hit = pos >= 0
        out = np.where(hit, self._vals[pos], EMPTY)       # int32 [N]
        p = np.unique(pos[hit])  # duplicate keys in one call delete once
        self._vals[p] = TOMBSTONE
        self._size -= p.shape[0]
        self._tombs += p.shape[0]
        if self._tombs > self.max_load * self.num_buckets / 2:
            self._rehash(self._size)
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All (keys int64 [R], vals int32 [R]), in bucket order (new arrays)."""
        live = self._vals >= 0
        return self._keys[live], self._vals[live]   # boolean indexing copies

    def reserve(self, n: int) -> None:
        """Room for `n` entries in all (live + tombstones) without a rehash, in the fewest buckets:
        ceil(n / max_load) rounded up to a multiple of 64 (not a power of two: a table with a capacity hint
        costs 12 / max_load bytes per entry). Never shrinks."""
        buckets = -(-max(int(np.ceil(n / self.max_load)), 64) // 64) * 64
        self._reserved = max(self._reserved, buckets)
        if buckets > self.num_buckets:
            self._rehash(self._size)

    def clear(self) -> None:
        self._size = 0
        self._alloc(max(self._buckets_for(0), self._reserved))

    # ------------------------------------------------------------------ internals
    def _buckets_for(self, n: int) -> int:
        """Power of two (>= 64) that holds n entries at a load between 3/8 and 3/4 of max_load."""
        b = 1 << max(6, (int(np.ceil(n / self.max_load)) - 1).bit_length())
        return 2 * b if n > 0.75 * self.max_load * b else b

    def _alloc(self, buckets: int) -> None:
        # np.full, not np.zeros: the key pages are written now, not faulted in one by one by random inserts
        # (slower: benchmarks/history/figures-from-the-code.md); a map at load >= 3/8 touches every page anyway
        self._keys = np.full(buckets, 0, dtype=np.int64)
        self._vals = np.full(buckets, EMPTY, dtype=np.int32)
        self._tombs = 0

    def _rehash(self, n: int) -> None:
        """Rebuild without tombstones in buckets for n entries (the reserved ones while n fits them)."""
        keys, vals = self.items()
        fits = self._reserved > 0 and n <= self.max_load * self._reserved
        self._alloc(self._reserved if fits else self._buckets_for(n))
        native.map_place(self._keys, self._vals, keys, vals)


class BoundedCounter:
    """Sighting counts (int32) and last-seen steps of at most `max_entries` int64 keys.

    Used for ids that are not admitted yet: a flood of new ids cannot grow it past the bound
    (beyond one batch, transiently). When an `add` leaves more than `max_entries` keys, the
    entries with the lowest (count, last seen, key) are dropped until a quarter of the bound is
    free again, so their counts start over when they come back.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"BoundedCounter.max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.map = IdMap()
        self.count = np.zeros(0, dtype=np.int32)
        self.last_seen = np.zeros(0, dtype=np.int32)
        self._free: list[np.ndarray] = []
        self._hwm = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.map)

    @property
    def nbytes(self) -> int:
        return self.map.nbytes + self.count.nbytes + self.last_seen.nbytes

    def add(self, keys: np.ndarray, step: int) -> np.ndarray:
        """Count one sighting of each distinct key int64 [N] at `step`; returns the counts int32 [N]."""
        slots = self.map.lookup(keys)
        new = slots < 0
        n_new = int(np.count_nonzero(new))
        if n_new:
            slots[new] = self._alloc(n_new)
            self.map.insert(keys[new], slots[new])
            self.count[slots[new]] = 0
        self.count[slots] += 1
        self.last_seen[slots] = step
        out = self.count[slots].copy()
        if len(self.map) > self.max_entries:          # shrink to 3/4 of the bound (the class docstring)
            keys, slots = self.map.items()
            drop = keys.shape[0] - self.max_entries * 3 // 4
            prio = (self.count[slots].astype(np.int64) << 32) | self.last_seen[slots].astype(np.int64)
            self.remove(keys[np.lexsort((keys, prio))[:drop]])
            self.dropped += drop
        return out

    def remove(self, keys: np.ndarray) -> None:
        """Forget keys int64 [N] (admitted ones, or ones dropped by a sweep); absent keys are fine."""
        slots = self.map.delete(keys)
        slots = slots[slots >= 0]
        if slots.shape[0]:
            self._free.append(slots.astype(np.int64))

    def older_than(self, step: int) -> np.ndarray:
        """Keys int64 [K] whose last sighting is at or before `step`."""
        keys, slots = self.map.items()
        return keys[self.last_seen[slots] <= step]

    def state(self) -> dict[str, np.ndarray]:
        keys, slots = self.map.items()
        return {"keys": keys, "count": self.count[slots].copy(), "last_seen": self.last_seen[slots].copy()}

    def set_state(self, keys: np.ndarray, count: np.ndarray, last_seen: np.ndarray) -> None:
        self.__init__(self.max_entries)
        slots = self._alloc(keys.shape[0])
        self.map.insert(keys, slots)
        self.count[slots], self.last_seen[slots] = count, last_seen

    def _alloc(self, n: int) -> np.ndarray:
        free = np.concatenate(self._free) if self._free else np.zeros(0, dtype=np.int64)
        take, rest = free[:n], free[n:]
        self._free = [rest] if rest.shape[0] else []
        k = n - take.shape[0]
        if self._hwm + k > self.count.shape[0]:
            cap = max(2 * self.count.shape[0], self._hwm + k, 1024)
            self.count, self.last_seen = (np.concatenate([a[:self._hwm], np.empty(cap - self._hwm, a.dtype)])
                                          for a in (self.count, self.last_seen))
        out = np.concatenate([take, np.arange(self._hwm, self._hwm + k)]).astype(np.int32)
        self._hwm += k
        return out
