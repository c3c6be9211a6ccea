"""Re-sharding N -> M: a checkpoint's shards restore into any number of shards by re-hashing ids.

Every old shard directory is read by every new shard, which keeps the rows whose id hashes to it
(`embedding_ps.wire.sharding.shard_of`): rows, optimizer state, counts and last-seen steps move.
Admission counts of ids still waiting and eviction logs stay behind (they are per old shard).

- at resume: each new shard process loads its own part at start-up (`restore_shard`), in parallel;
- offline: `recsys reshard CKPT --shards M --out DIR` writes a checkpoint with M shards, one new
  shard in memory at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from embedding_ps.wire.config import PSConfig
from embedding_ps.shard.state import ShardState
from embedding_ps.shard.snapshot import SavedShard, saved_num_shards, saved_shard_dirs, shard_dir
from recsys import storage
from recsys.config import load_config, to_toml
from recsys.training.checkpoint import verify_checkpoint, write_manifest
from recsys.training.warm_start import export_rows, resolve_init

logger = logging.getLogger(__name__)


def restore_shard(config: PSConfig, shard_index: int, ps_dir: str | Path) -> ShardState:
    """Shard `shard_index` of `config` holding its part of the PS saved under `ps_dir` (any shard
    count; a URI too: with the same count the shard downloads only its own part)."""
    state = ShardState(config, shard_index)
    if storage.is_uri(str(ps_dir)):
        own = shard_dir(str(ps_dir), shard_index)
        try:
            same = saved_num_shards(own) == config.num_shards
        except FileNotFoundError:
            same = False
        if same:
            state.load(own)                      # embedding_ps.remote fetches shard_index's files
            return state
    with storage.local_copy(str(ps_dir)) as local:      # a URI: downloaded first
        old = saved_shard_dirs(local)
        if len(old) == config.num_shards:
            state.load(old[shard_index])
        else:
            rows = state.load_resharded(old)
            logger.info("shard %d/%d: took %d rows from %d old shards", shard_index, config.num_shards, rows, len(old))
    return state


def init_shard(config: PSConfig, shard_index: int, ps_dir: str | Path) -> ShardState:
    """A warm start's shard (train.init_from): shard `shard_index` of `config` holding the rows, optimizer
    state and counters of the source's saved shards under `ps_dir` (any shard count) for every table of
    `config` the source has, matched by name; tables only in `config` start empty, tables only in the
    source are left behind. (The launcher checked that the kept tables' layout and optimizer match.)"""
    state = ShardState(config, shard_index)
    index = {t.name: i for i, t in enumerate(config.tables) if t.placement != "replicated"}   # the PS's tables
    taken = 0
    with storage.local_copy(str(ps_dir)) as local:      # a URI: downloaded first
        if (local / "tables").is_dir():                  # an fp32 export: rows without optimizer state
            source = resolve_init(local, verify=False)
            for t in source.config.ps.tables:
                if t.name in index and (got := export_rows(local, source.manifest, t.name)) is not None:
                    taken += state.load_dump(index[t.name], got[0], got[1], {}, step=source.step)
            what = "(no optimizer state) from the export"
        else:
            for directory in saved_shard_dirs(local):
                saved = SavedShard(str(directory))
                for i in range(saved.num_tables):
                    name = saved.layout(i).get("name")
                    if name in index:
                        taken += state.load_dump(index[name], *saved.dump_table(i))
            what = "from"
    logger.info("shard %d/%d: warm start took %d rows %s %s", shard_index, config.num_shards, taken, what, ps_dir)
    return state


def shard_factory(restore: str | Path | None, init_from: str | Path | None = None) -> Callable | None:
    """`serve`'s state_factory: each shard's part of checkpoint PS directory `restore` (`restore_shard`),
    else of warm-start source `init_from` (`init_shard`); None (empty shards) without either."""
    if not (restore or init_from):
        return None
    return functools.partial(restore_shard if restore else init_shard, ps_dir=restore or init_from)


def reshard_checkpoint(checkpoint: str | Path, num_shards: int, out: str | Path) -> Path:
    """Write checkpoint `checkpoint` re-sharded into `num_shards` shards at `out` (a new checkpoint).

    Dense model, trainer state and data positions are copied; the config says ps.num_shards = M.
    """
    src, out = Path(checkpoint), Path(out)
    if num_shards < 1:
        raise ValueError(f"--shards must be >= 1, got {num_shards}")
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new directory")
    manifest = verify_checkpoint(src)
    cfg = load_config(src / "config.toml")
    cfg = dataclasses.replace(cfg, ps=dataclasses.replace(cfg.ps, num_shards=num_shards))
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=lambda d, names: [n for n in names if Path(d) == src / "model" and n == "ps"
                                                        or Path(d) == src and n == "manifest.json"])
    old = saved_shard_dirs(src / "model" / "ps")
    total = 0
    for i in range(num_shards):       # one new shard in memory at a time
        state = ShardState(cfg.ps, i)
        total += state.load_resharded(old)
        state.save(shard_dir(tmp / "model" / "ps", i))
        del state
    (tmp / "config.toml").write_text(to_toml(cfg))
    info = {k: v for k, v in manifest.items() if k not in ("files", "format", "version")}
    info.update(num_shards=num_shards, resharded_from=len(old))
    write_manifest(tmp, info)
    tmp.rename(out)
    logger.info("re-sharded %s (%d shards) into %s (%d shards, %d rows)", src, len(old), out, num_shards, total)
    return out

