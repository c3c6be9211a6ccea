"""Typed configuration of the parameter server (the `[ps]` section of a job config)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

OptimizerName = Literal["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl"]
_DECAY = ("weight_decay", "weight_decay_mode")
OPTIMIZER_KEYS: dict[str, tuple[str, ...]] = {
    "sgd": ("lr", *_DECAY),
    "adagrad": ("lr", "eps", "initial_accumulator", *_DECAY),
    "rowwise_adagrad": ("lr", "eps", "initial_accumulator", *_DECAY),
    "adam": ("lr", "eps", "beta1", "beta2", *_DECAY),
    "ftrl": ("lr", "ftrl_beta", "ftrl_l1", "ftrl_l2"),
}
"""The TableConfig fields each optimizer reads: what a table's grouped form takes,
`optimizer = { name = "adam", lr = 0.01, beta1 = 0.9 }` (`recsys.config` flattens it)."""
FUSED_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
"""The optimizers with a C update (`embedding_ps.native.OPTIMIZERS`, in ps.c's enum order) and an fbgemm one."""

MAX_SHARDS = 4096               # PS shards of a job (each is a process)
MAX_WORKERS = 65536             # trainers pushing to the shards
MAX_DIM = 65536                 # widest embedding row
MAX_THREADS = 64
"""Most worker threads per shard (ps.threads)."""


def at_least(prefix: str, config: object, low: int, *keys: str) -> None:
    """ValueError "{prefix}.{key} must be >= {low}, got ..." for the first of `keys` below `low`."""
    for key in keys:
        if getattr(config, key) < low:
            raise ValueError(f"{prefix}.{key} must be >= {low}, got {getattr(config, key)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TableConfig:
    """One embedding table, sharded by id across every PS shard (`[[ps.tables]]`)."""

    name: str
    """Table name; features refer to tables by this name."""
    dim: int
    """Row width D."""
    kind: Literal["dynamic", "hashed"] = "dynamic"
    """`dynamic`: collisionless id -> row map that grows; `hashed`: ids hashed into `num_embeddings` rows."""
    num_embeddings: int = 0
    """Rows of a `hashed` table (across all shards). Unused for `dynamic`."""
    dtype: Literal["fp32", "fp16"] = "fp32"
    """Storage type of the rows (optimizer state stays fp32)."""
    init: Literal["uniform", "normal", "zeros"] = "uniform"
    """Distribution of a new row, drawn deterministically from (seed, id)."""
    init_scale: float = 0.01
    """Half-width of `uniform`, standard deviation of `normal`."""
    seed: int = 0
    """Table seed for row init."""
    optimizer: OptimizerName = "rowwise_adagrad"
    """Sparse optimizer applied on the shard."""
    lr: float = 0.01
    """Learning rate (FTRL: alpha)."""
    eps: float = 1e-8
    """Adagrad/Adam epsilon."""
    initial_accumulator: float = 0.0
    """Starting value of the Adagrad accumulators."""
    beta1: float = 0.9
    """Adam first moment decay."""
    beta2: float = 0.999
    """Adam second moment decay."""
    ftrl_beta: float = 1.0
    """FTRL-Proximal beta."""
    ftrl_l1: float = 0.0
    """FTRL-Proximal L1 strength."""
    ftrl_l2: float = 0.0
    """FTRL-Proximal L2 strength."""
    min_count: int = 0
    """An id gets a trained row only after this many sightings (0 or 1: at once)."""
    admit_probability: float = 1.0
    """Probability that a sighting of an unadmitted id counts towards admission."""
    unadmitted: Literal["init", "zeros"] = "init"
    """What a pull returns for an id not admitted yet."""
    ttl_steps: int = 0
    """Rows unseen for this many steps are dropped at the next sweep (0: never)."""
    max_rows: int = 0
    """Most rows per table per shard; least-frequently-used rows are evicted past it (0: no bound)."""
    max_pending: int = 1 << 20
    """Most not-yet-admitted ids whose sightings a shard counts per table (lowest counts dropped past it)."""
    eviction_log_max: int = 1 << 22
    """Most (id, step) eviction records kept per table per shard until read and truncated (oldest dropped)."""
    weight_decay: float = 0.0
    """Regularization of the rows a step touches (sgd, adagrad, rowwise_adagrad, adam; FTRL: ftrl_l1/l2)."""
    weight_decay_mode: Literal["l2", "decoupled", "global"] = "l2"
    """`l2`: weight_decay * w is added to a touched row's gradient (fbgemm TBE's L2 mode);
    `decoupled`: a touched row is scaled by (1 - lr * weight_decay) before its update (AdamW-style);
    `global`: every row of the table is scaled by (1 - lr * weight_decay) every step, touched or not,
    then the touched rows get their update from the plain gradient (fbgemm TBE's DECOUPLED_GLOBAL; the
    decay of a whole-table torch optimizer). Applied lazily (`embedding_ps.shard.decay`): a row untouched for k
    steps is scaled by (1 - lr * weight_decay)^k when it is next pulled, pushed, saved or dumped."""
    kernel: Literal["native", "fbgemm", "auto", "torch"] = "native"
    """Optimizer update path. `native`: the shard's own update (C when the library is compiled, else
    vectorized torch); `fbgemm`: fbgemm's fused CPU TBE backward (sgd/adagrad/rowwise_adagrad), for a
    table that measured faster with it on its machine (`benchmarks/ps_table.py --kernels`); `auto` and
    `torch`: older names of `native`, still loaded."""
    placement: Literal["ps", "replicated", "auto"] = "ps"
    """Where the table trains. `ps`: hash-sharded on the PS shards, lazy updates of the rows a step
    touches (the path for big vocabularies). `replicated`: a dense [rows, dim] parameter on every
    trainer (rows: the distinct ids of the training data; an id outside them gets the table's
    `unadmitted` default row, untrained, as a PS pull and an export give it), trained by a torch
    optimizer (the table's optimizer, lr, weight_decay, applied to the whole table every step) with
    its gradient all-reduced by DDP beside the dense model's: no PS traffic. `auto`: replicated
    when the table's distinct ids number at most ps.replicate_max_rows and its bytes fit
    ps.replicate_max_bytes, else ps (the choice per table is logged and written to the run dir)."""
    cache_rows: int = 0
    """Trainer-side hot-row cache: each trainer keeps up to this many of the table's rows in memory
    (on its GPU with train.device = "cuda") and pulls only the misses (`embedding_ps.client.cache`); async
    mode only, a cached row is at most ps.max_staleness steps old. 0: off. The shards ignore it."""

    capacity: int = 0
    """Rows of this table expected across all shards (a hint; 0: none). Each of the ps.num_shards
    shards reserves its share up front, `capacity / num_shards` plus 1% and 1024: the slot arrays
    (rows, optimizer state, counters; virtual memory, resident only as slots are used) and its id
    map, sized to hold that share at load 0.85 (14.1 bytes a row, against 23-46 for a map that grows
    by doubling, at load 0.26-0.53). Up to it nothing doubles or regrows; past it the table grows as without a hint."""
    row_counters: bool = True
    """Keep each row's push count and last-push step (8 bytes a row). TTL (`ttl_steps`), LFU
    eviction (`max_rows`) and delta exports (`recsys export --since`) read them; re-sharding and
    `dump` carry them. false (allowed only with ttl_steps = 0 and max_rows = 0) saves the 8 bytes:
    a delta export of such a table is refused (a full export works)."""

    def __post_init__(self) -> None:
        p = f"ps.tables[{self.name}]"
        if not self.name:
            raise ValueError("ps.tables: every table needs a non-empty name")
        at_least(p, self, 1, "dim", "max_pending", "eviction_log_max")
        if self.dim > MAX_DIM:
            raise ValueError(f"{p}.dim must be <= {MAX_DIM}, got {self.dim}")
        if self.kind == "hashed" and self.num_embeddings < 1:
            raise ValueError(f"{p}.num_embeddings must be >= 1 for kind='hashed', got {self.num_embeddings}")
        if self.lr <= 0:
            raise ValueError(f"{p}.lr must be > 0, got {self.lr}")
        if not 0.0 < self.admit_probability <= 1.0:
            raise ValueError(f"{p}.admit_probability must be in (0, 1], got {self.admit_probability}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise ValueError(f"{p}.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.weight_decay and self.optimizer == "ftrl":
            raise ValueError(f"{p}.weight_decay does not apply to optimizer 'ftrl': use ftrl_l2 (and ftrl_l1)")
        if self.weight_decay_mode in ("decoupled", "global") and not self.lr * self.weight_decay < 1.0:
            raise ValueError(f"{p}: {self.weight_decay_mode} weight decay needs lr * weight_decay < 1 (a row would "
                             f"flip sign or vanish each step), got {self.lr} * {self.weight_decay}")
        if self.kernel == "fbgemm" and self.optimizer not in FUSED_OPTIMIZERS:
            raise ValueError(f"{p}.kernel='fbgemm' supports optimizer {', '.join(FUSED_OPTIMIZERS)}; got "
                             f"{self.optimizer!r}")
        at_least(p, self, 0, "min_count", "ttl_steps", "max_rows", "cache_rows", "capacity")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"{p}.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.placement == "replicated":
            if self.optimizer == "ftrl":
                raise ValueError(f"{p}: placement 'replicated' trains with a torch optimizer (sgd, adagrad, "
                                 f"rowwise_adagrad, adam); optimizer 'ftrl' needs placement = 'ps'")
            if self.kind == "hashed":
                raise ValueError(f"{p}: placement 'replicated' needs kind = 'dynamic' (its rows are the data's ids)")
            if self.cache_rows:
                raise ValueError(f"{p}: cache_rows caches PS rows; a replicated table has no PS rows (set it to 0)")
            if self.ttl_steps or self.max_rows:
                raise ValueError(f"{p}: ttl_steps / max_rows age rows out of a PS table; a replicated table keeps "
                                 f"its vocabulary (set placement = 'ps', or both to 0)")
        if not self.row_counters and (self.ttl_steps or self.max_rows):
            raise ValueError(f"{p}.row_counters = false, but ttl_steps = {self.ttl_steps} and max_rows = "
                             f"{self.max_rows} read them: set both to 0 or row_counters = true")


@dataclass(frozen=True, kw_only=True, slots=True)
class PSConfig:
    """The parameter-server shards and how clients reach them."""

    num_shards: int = 1
    """Shard processes; id -> shard is splitmix64(id) % num_shards."""
    addresses: tuple[str, ...] = ()
    """`tcp://host:port` of every shard in shard order; empty: the local launcher starts them."""
    bind: str = "127.0.0.1"
    """Address a shard binds. Any non-loopback address requires auth."""
    mode: Literal["sync", "async"] = "sync"
    """`sync`: a step's pushes from all workers are summed and applied once; `async`: applied on arrival."""
    num_workers: int = 1
    """Trainers pushing to the shards (sync mode waits for all of them each step)."""
    max_staleness: int = 1
    """Async mode: how many steps a trainer may run ahead of the slowest one."""
    auth: Literal["auto", "none", "token", "curve"] = "auto"
    """Who may talk to a shard. `token`: clients prove the secret of ps.token_file during ZeroMQ's
    handshake (PLAIN via ZAP), so a peer without it never delivers a byte of a request; `curve`:
    CURVE keys of ps.curve_keys_dir (encrypted too). `auto` (default): `recsys train` (local and Ray)
    makes a per-job token its shards and trainers share (never on argv or disk); a shard started by
    hand (`recsys ps`) needs `token` or `curve`. `none`: no authentication, loopback binds only, by
    explicit choice (a warning says so): any local user can then stop the shards or roll rows back."""
    token_file: str = ""
    """File holding the shared token (auth='token')."""
    curve_keys_dir: str = ""
    """Directory with server.key_secret / client.key_secret etc. from zmq.auth (auth='curve')."""
    wire_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """Type of rows and gradients on the wire."""
    timeout_s: float = 60.0
    """Per-request timeout."""
    retries: int = 2
    """Retries of a timed-out request before the error names the shard."""
    max_frame_bytes: int = 1 << 30
    """Largest request frame a shard accepts."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """A PUSH with a NaN or infinite gradient: `error` refuses the whole request (nothing applied,
    the trainer gets the error naming table and rows); `skip` applies the finite rows only and
    counts the dropped ones in the shard's stats (`nonfinite_rows_skipped`)."""
    storage_root: str = ""
    """A shard SAVEs and LOADs only under this directory ('..' and symlinks resolved; anything else
    is refused). `recsys train` and `recsys ps` set it to train.run_dir when it is empty; a PSConfig
    built in code with it empty does not confine (library use, tests)."""
    shared_memory: bool | Literal["auto"] = "auto"
    """PULL / PUSH rows of 1 MB or more between a client and a shard on one host go through
    shared-memory segments in /dev/shm (`embedding_ps.wire.shm`) instead of the socket. "auto"
    (default): with loopback shards; true: with every shard; false: off. Who takes it and the
    fallback to the socket: docs/performance.md, "The native library"."""
    threads: int = 0
    """Worker threads per shard for the native data path (docs/performance.md, "The native library").
    1: one thread; 0: half the CPUs this process may run on, at most 4 (`shard_threads`). Results do not
    depend on it."""
    tables: tuple[TableConfig, ...] = ()
    """Embedding tables; every shard holds its part of each."""
    replicate_max_rows: int = 10_000
    """`placement = "auto"`: a table with at most this many distinct ids in the training data is
    replicated on the trainers (see TableConfig.placement). A replicated table's step costs grow with
    its rows (a dense gradient and an update of every row), a PS table's with the rows a batch
    touches; at B = 4096, D = 64 they cross near 10,000 rows (benchmarks/placement.py)."""
    replicate_max_bytes: int = 256 << 20
    """`placement = "auto"`: replicate only while the replicated tables' weights and optimizer state
    (fp32) fit this many bytes on each trainer, smallest tables first; `replicated` tables count
    too, and an explicit `replicated` table that alone passes it is an error."""
    checkpoint_extra_memory: float = 0.1
    """Most extra memory a shard's background save holds, as a fraction of its rows' bytes (weights,
    optimizer state and counters of every table), in (0, 1]. The save is copy-on-write
    (`embedding_ps.shard.cow`): it copies the id map and the other small arrays (about 12 bytes a row) and
    keeps pre-images of rows updated before the writer reached them in a side buffer sized from
    what is left; when that is full, updates wait for the writer. Larger: fewer waits under heavy
    pushing during a save; smaller: less memory. Rows of fewer than ~130 bytes (e.g. row-wise Adagrad
    below d30 at 0.1) cannot keep the bound (the map copy alone passes it): the side buffer then gets
    2% of the rows' bytes and a warning says so. The files do not depend on it."""

    def __post_init__(self) -> None:
        if self.num_shards > MAX_SHARDS:
            raise ValueError(f"ps.num_shards must be <= {MAX_SHARDS} (each shard is a process), got {self.num_shards}")
        if self.num_workers > MAX_WORKERS:
            raise ValueError(f"ps.num_workers must be <= {MAX_WORKERS}, got {self.num_workers}")
        at_least("ps", self, 1, "num_shards", "num_workers")
        if self.addresses and len(self.addresses) != self.num_shards:
            raise ValueError(f"ps.addresses has {len(self.addresses)} entries but ps.num_shards is {self.num_shards}")
        if not (isinstance(self.shared_memory, bool) or self.shared_memory == "auto"):
            raise ValueError(f"ps.shared_memory must be true, false or 'auto', got {self.shared_memory!r}")
        if not 0 <= self.threads <= MAX_THREADS:
            raise ValueError(f"ps.threads must be in [0, {MAX_THREADS}] (0: what the machine has), got {self.threads}")
        if self.timeout_s <= 0:
            raise ValueError(f"ps.timeout_s must be > 0, got {self.timeout_s}")
        at_least("ps", self, 0, "max_staleness", "retries", "replicate_max_rows", "replicate_max_bytes")
        if not 0.0 < self.checkpoint_extra_memory <= 1.0:
            raise ValueError(f"ps.checkpoint_extra_memory must be in (0, 1] (a fraction of the rows' bytes), "
                             f"got {self.checkpoint_extra_memory}")
        names = [t.name for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"ps.tables: duplicate table names {dup}")
        if self.auth == "token" and not self.token_file:
            raise ValueError("ps.token_file must be set when ps.auth = 'token'")
        if self.auth == "curve" and not self.curve_keys_dir:
            raise ValueError("ps.curve_keys_dir must be set when ps.auth = 'curve'")


DEFAULT_MAX_THREADS = 4     # ps.threads = 0 uses at most this many: beyond, one request's rows are too few to share


def shard_threads(threads: int) -> int:
    """ps.threads resolved: the value itself, or for 0 half the usable CPUs, in [1, DEFAULT_MAX_THREADS].

    Half, because the other half runs trainers, the data pipeline and other shards: a thread of a
    request's fork-join that loses its core makes the whole request wait. On the shared 2-core
    machine 2 threads made the in-process op mix slower (BENCHMARKS.md, "benchmarks/ps_throughput.py"),
    so 0 means 1 there.
    """
    if threads > 0:
        return threads
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(DEFAULT_MAX_THREADS, cpus // 2))
