"""Which shard owns an id: the one function shared by client, server, re-sharding and export.

`shard_of(keys, S) = splitmix64(keys as uint64) % S`, where `splitmix64` (`splitmix64_np`) is the
finalizer of Steele et al.'s SplitMix64 generator (the same 64-bit mix as `java.util.SplittableRandom`).
Tables of kind `hashed` first map a raw id to a row index `splitmix64(id) % num_embeddings`
(`hashed_row`); the row index is the key the shard stores and the key that is routed, so every
id that shares a row lands on the shard that holds that row (`keys_of` / `route`). A client
must route ids with `route(ids, table, num_shards)`, never with `shard_of` on raw ids of a
hashed table.

numpy's uint64 arithmetic wraps (array ops raise no overflow warnings), so the mix is exact and
takes about 2 ns per id; `torch` has no unsigned 64-bit multiply on every op.
"""

from __future__ import annotations

import numpy as np
import torch

from embedding_ps.wire.config import TableConfig

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


GOLDEN = 0x9E3779B97F4A7C15
"""SplitMix64's increment: the generator's n-th output is the finalizer of n * GOLDEN."""


def splitmix64_np(keys: np.ndarray, *, copy: bool = True) -> np.ndarray:
    """uint64 [N] -> uint64 [N]: the SplitMix64 finalizer (the one Python copy in embedding_ps;
    `csrc/native.h` has the C one, pinned by tests/unit/test_splitmix64.py). `keys` may be int64 or
    uint64 and is not modified, unless `copy=False` and it is a uint64 array: then it is mixed in place."""
    z = keys.astype(np.uint64, copy=copy)      # int64 -> uint64: the same bits (a new array)
    z ^= z >> _S30
    z *= _C1
    z ^= z >> _S27
    z *= _C2
    z ^= z >> _S31
    return z


def shard_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """int64 [N] -> int64 [N] in [0, num_shards): `splitmix64(uint64(id)) % num_shards`."""
    return _mix_mod(ids, num_shards, "shard_of: num_shards")


def hashed_row(ids: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """int64 [N] -> int64 [N] in [0, num_embeddings): the row of a `hashed` table that an id shares."""
    return _mix_mod(ids, num_embeddings, "hashed_row: num_embeddings")


def _mix_mod(ids: torch.Tensor, n: int, what: str) -> torch.Tensor:
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    if ids.dtype != torch.int64:
        raise TypeError(f"ids must be int64, got {ids.dtype}")
    z = splitmix64_np(ids.detach().cpu().contiguous().numpy())
    return torch.from_numpy((z % np.uint64(n)).astype(np.int64))


def keys_of(ids: torch.Tensor, table: TableConfig) -> torch.Tensor:
    """int64 [N] -> int64 [N]: the key a shard stores for each id (the id itself, or its hashed row)."""
    return hashed_row(ids, table.num_embeddings) if table.kind == "hashed" else ids


def route(ids: torch.Tensor, table: TableConfig, num_shards: int) -> torch.Tensor:
    """int64 [N] -> int64 [N]: the shard that owns each raw id of `table` (`shard_of(keys_of(ids))`)."""
    return shard_of(keys_of(ids, table), num_shards)
