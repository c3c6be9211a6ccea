"""Job configuration: `JobConfig` and `load_config(path, overrides)`.

A job config is a TOML file with one section per package (the fields of `JobConfig`; every key:
docs/config.md), each a frozen dataclass. The loader checks names, types and `Literal` choices itself
and turns the dataclasses' own `__post_init__` range checks into `ConfigError`s naming the file.
`--set section.key=value` overrides are parsed as TOML values and go through the same code. Then the
date placeholders of the paths are filled in with data.date (`--date`, `fill_dates`; docs/daily.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from data.config import DataConfig
from data.paths import fill_date, parse_date
from embedding_ps.wire.config import OPTIMIZER_KEYS, PSConfig, TableConfig, at_least
from recsys.config_cluster import ClusterConfig
from recsys.config_model import ModelConfig, sequence_feature_tables
from recsys.config_retrieval import EvalConfig, check_two_tower
from recsys.config_toml import to_toml

logger = logging.getLogger(__name__)

MAX_LOCAL_TRAINERS = 1024
"""Most trainer processes the local launcher starts."""


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the file, the dotted key and the value."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """How the job trains: processes, steps, dense optimizer, logging, run directory."""

    num_trainers: int = 1
    """Trainer processes started by the local launcher."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the dense part runs (NCCL on cuda, gloo on cpu)."""
    epochs: int = 1
    """Passes over the training data."""
    max_steps: int = 0
    """Stop after this many steps (0: run the epochs out)."""
    dense_optimizer: Literal["adam", "adagrad", "sgd"] = "adam"
    """Optimizer of the dense (DDP) parameters."""
    dense_lr: float = 1e-3
    """Dense learning rate."""
    warmup_steps: int = 0
    """Linear LR warmup steps."""
    lr_decay: Literal["none", "linear", "cosine", "step"] = "none"
    """LR decay after warmup: "linear" / "cosine" to zero at the last optimizer step (max_steps /
    grad_accum_steps, or with max_steps = 0 epochs x the data's batches per epoch / grad_accum_steps,
    counted from the files' row counts at start); "step": times `lr_gamma` every `lr_step_size`
    optimizer steps after warmup."""
    grad_accum_steps: int = 1
    """Micro-batches per dense optimizer step."""
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """DDP gradient compression hook."""
    autocast: bool = False
    """bf16 autocast on CPU / AMP on GPU for the dense part."""
    seed: int = 0
    """Seed of the dense model init."""
    log_every: int = 50
    """Steps between metric lines."""
    run_dir: str = "runs/default"
    """Where the resolved config, processes.json, metrics and the final model go."""
    run_id: str = ""
    """The run's id: random, set when a run starts ("" in a config you write), kept by `--resume`; where
    it is written and what it guards: docs/operations.md ("The run directory")."""
    init_from: str = ""
    """Warm start (`recsys train --init-from`): a run directory (its best model if it kept one, else
    its last), a checkpoint directory or a local path or URI of either; what the new run takes from it:
    docs/daily.md ("Warm start"). Ignored by --resume (a resumed run continues its own checkpoint)."""
    init_step: int = 0
    """The step train.init_from's model had reached (set by `recsys train`): this run's step counter
    starts there, and it ends at init_step + train.max_steps."""
    lineage: tuple[str, ...] = ()
    """Run ids this run was warm-started from, oldest first (set by `recsys train --init-from`):
    a delta of this run applies to an export of any of them (export-apply, Predictor)."""
    save_program: bool = False
    """Also save the served dense program (`model/dense.pt2`, torch.export) with the run's model, which an
    export then copies instead of importing torch.export and tracing again (the trainer has it loaded;
    figures: benchmarks/history/figures-from-the-code.md). `recsys daily` sets it."""
    scratch_dir: str = ""
    """When `run_dir` is a URI: the local directory for what only this machine's processes need (docs/storage.md,
    "What goes where"); "": <system temp>/recsys-scratch/<name>-<hash of run_dir>. Unused for a local run_dir."""
    num_threads: int = 0
    """torch intra-op threads per process (0: cores / processes)."""
    eval_auc: Literal["exact", "streaming"] = "exact"
    """Eval AUC from every (label, score) pair, or from a bucketed histogram (bounded memory)."""
    checkpoint_every: int = 0
    """Steps between checkpoints in `run_dir/checkpoints` (0: none by step count)."""
    checkpoint_every_s: float = 0.0
    """Seconds between checkpoints (0: none by time; checked every `log_every` steps)."""
    keep_checkpoints: int = 3
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    checkpoint_background: bool = True
    """Shards snapshot in memory and write while training goes on (False: training waits for the write)."""
    max_restarts: int = 3
    """The local launcher restarts the job from the latest checkpoint this many times after a PS shard or
    a trainer is killed (exit by a signal: kill -9, OOM); an error raised by the job itself is not retried."""
    trace_column: str = ""
    """Debugging: write the values of this passthrough column for every trained example to
    `run_dir/trace/` (one .npy per rank and attempt), to check the data order."""
    validate_every: int | Literal["epoch"] = 0
    """Steps between validation passes over data.eval_paths, or "epoch" (after each epoch); 0: none
    (the eval data is scored once, at the end). Each pass logs `val/*` metrics."""
    dense_weight_decay: float = 0.0
    """Weight decay of the dense optimizer, on weight matrices only (biases and norm gains/shifts, the
    1-D parameters, are exempt). adam: decoupled (AdamW); sgd: torch's weight_decay (the same as a
    decoupled shrink by dense_lr * decay); adagrad: torch's L2 term added to the gradient."""
    lr_step_size: int = 0
    """lr_decay = "step": optimizer steps between two LR drops (required, >= 1, with "step")."""
    lr_gamma: float = 0.1
    """lr_decay = "step": factor applied to the LR at each drop, in (0, 1]."""
    early_stop_metric: Literal["logloss", "auc"] = "logloss"
    """The validation metric that picks the best model and drives early stopping."""
    early_stop_patience: int = 0
    """Stop after this many validation passes in a row without a new best (0: never stop early)."""
    keep_best: bool = True
    """With validation: keep the best pass's model as a checkpoint in `run_dir/best/`, which
    `recsys eval`, `predict` and `export` of the run use by default, and which scores data.test_paths."""
    pull_ahead_batches: int = 1
    """Async mode: the rows of this many next batches are pulled while the current batch computes
    (at most ps.max_staleness: a row pulled K batches ahead misses K steps of updates). Sync mode
    pulls nothing ahead (a step's rows exist only after the previous step's barrier): 0 or 1 there."""

    def __post_init__(self) -> None:
        at_least("train", self, 1, "num_trainers", "epochs", "grad_accum_steps", "log_every", "keep_checkpoints")
        if self.num_trainers > MAX_LOCAL_TRAINERS:
            raise ValueError(f"train.num_trainers must be <= {MAX_LOCAL_TRAINERS} (processes started on this "
                             f"machine; more trainers: torchrun on several hosts), got {self.num_trainers}")
        at_least("train", self, 0, "max_steps", "warmup_steps", "num_threads", "checkpoint_every", "max_restarts",
                 "init_step", "checkpoint_every_s", "early_stop_patience", "dense_weight_decay", "lr_step_size",
                 "pull_ahead_batches")
        if self.dense_lr <= 0:
            raise ValueError(f"train.dense_lr must be > 0, got {self.dense_lr}")
        if any(not r or not all(c in "0123456789abcdef" for c in r) for r in self.lineage):
            raise ValueError(f"train.lineage must list run ids (lowercase hex), got {list(self.lineage)}")
        if self.run_id and not all(c in "0123456789abcdef" for c in self.run_id):
            raise ValueError(f"train.run_id must be lowercase hex (set by `recsys train`), got {self.run_id!r}")
        if isinstance(self.validate_every, int) and self.validate_every < 0:
            raise ValueError(f"train.validate_every must be >= 0 or 'epoch', got {self.validate_every}")
        if self.early_stop_patience and self.validate_every == 0:
            raise ValueError("train.early_stop_patience needs validation passes: set train.validate_every "
                             "(steps, or 'epoch')")
        if self.lr_decay == "step" and self.lr_step_size == 0:
            raise ValueError("train.lr_decay = 'step' needs train.lr_step_size >= 1 (optimizer steps per drop)")
        if not 0.0 < self.lr_gamma <= 1.0:
            raise ValueError(f"train.lr_gamma must be in (0, 1], got {self.lr_gamma}")


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """A whole job: one section per package."""

    data: DataConfig = field(default_factory=DataConfig)
    """Input pipeline."""
    ps: PSConfig = field(default_factory=PSConfig)
    """Parameter-server shards and tables."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """CTR model."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop and launcher."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Offline evaluation (retrieval metrics)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Which engine places the processes: the local launcher or a Ray cluster."""

    def __post_init__(self) -> None:
        tables = {t.name: t for t in self.ps.tables}
        for key in ("feature_tables", "linear_feature_tables"):
            for feature, table in getattr(self.model, key).items():
                if tables and table not in tables:
                    raise ValueError(f"model.{key}.{feature} = {table!r} is not a table in ps.tables "
                                     f"({sorted(tables)})")
                if key == "linear_feature_tables" and table in tables and tables[table].dim != 1:
                    raise ValueError(f"model.linear_feature_tables.{feature}: table {table!r} must have "
                                     f"dim 1, got {tables[table].dim}")
        dims = {tables[t].dim for f in self.data.sparse_columns
                if (t := self.model.feature_tables.get(f, f)) in tables}
        if len(dims) > 1:
            raise ValueError(f"the tables read by data.sparse_columns must share one dim, got {sorted(dims)}")
        if (self.model.arch == "dlrm" and dims and self.data.dense_columns and self.model.bottom_mlp
                and self.model.bottom_mlp[-1] != next(iter(dims))):         # empty: derived from the dim
            raise ValueError(f"model.bottom_mlp must end in the tables' dim {next(iter(dims))} for dlrm, "
                             f"got {list(self.model.bottom_mlp)}")
        if self.model.linear_feature_tables and self.model.arch not in ("deepfm", "wide_deep"):
            raise ValueError(f"model.linear_feature_tables is only used by deepfm and wide_deep, "
                             f"not {self.model.arch!r}")
        if self.model.norm == "batch" and not self.data.drop_last:
            raise ValueError("model.norm = 'batch' needs data.drop_last = true (a short last batch, down to one row, "
                             "would be normalized by its own few rows; one row fails in training)")
        if self.train.validate_every != 0 and not self.data.eval_paths:
            raise ValueError("train.validate_every needs validation data: set data.eval_paths")
        if self.ps.mode == "async" and self.ps.max_staleness < 1:
            raise ValueError("ps.max_staleness must be >= 1 in async mode (a trainer pulls step t+1's rows "
                             f"while step t computes), got {self.ps.max_staleness}")
        if self.train.trace_column and self.train.trace_column not in self.data.passthrough_columns:
            raise ValueError(f"train.trace_column = {self.train.trace_column!r} must be one of "
                             f"data.passthrough_columns {list(self.data.passthrough_columns)}")
        for seq, cand in self.model.sequence_features.items():
            for col in (seq, cand):
                if col not in self.data.sparse_columns:
                    raise ValueError(f"model.sequence_features.{seq}: {col!r} is not in data.sparse_columns "
                                     f"{list(self.data.sparse_columns)}")
            own = self.model.feature_tables.get(seq)
            if own is not None and own != self.model.feature_tables.get(cand, cand):
                raise ValueError(f"model.feature_tables.{seq} = {self.model.feature_tables[seq]!r}: a sequence "
                                 f"feature reads the table of its candidate {cand!r} (model.sequence_features); "
                                 f"leave it out of model.feature_tables")
            if seq in self.data.weight_columns:
                raise ValueError(f"data.weight_columns.{seq}: a sequence feature (model.sequence_features) "
                                 f"takes no per-id weights")
        for column in self.data.weight_columns:
            table = self.model.feature_tables.get(column, column)
            if self.model.table_pooling.get(table, "sum") != "sum":
                raise ValueError(f"data.weight_columns.{column}: per-id weights need sum pooling, but "
                                 f"model.table_pooling.{table} = {self.model.table_pooling[table]!r}")
        check_two_tower(self.model, self.data, self.train)
        self._check_cache_and_prefetch()
        if self.cluster.use_gpu != (self.train.device == "cuda") and self.cluster.engine == "ray":
            raise ValueError(f"cluster.use_gpu = {str(self.cluster.use_gpu).lower()} needs train.device = "
                             f"{'cuda' if self.cluster.use_gpu else 'cpu'}, got {self.train.device!r}")

    def _check_cache_and_prefetch(self) -> None:
        """The trainer-side row cache and prefetch depth against ps.mode and ps.max_staleness."""
        ps, k = self.ps, self.train.pull_ahead_batches
        if ps.mode == "sync":
            for t in ps.tables:
                if t.cache_rows > 0:
                    raise ValueError(f"ps.tables[{t.name}].cache_rows = {t.cache_rows} needs ps.mode = 'async': "
                                     f"sync mode applies every step before the next pull, which cached rows "
                                     f"would not see (set cache_rows = 0, or ps.mode = 'async')")
            if k > 1:
                raise ValueError(f"train.pull_ahead_batches = {k} needs ps.mode = 'async' (sync mode cannot pull "
                                 f"a step's rows before the previous step's barrier)")
        elif k > ps.max_staleness:
            raise ValueError(f"train.pull_ahead_batches = {k} must be <= ps.max_staleness ({ps.max_staleness}): "
                             f"rows pulled {k} batches ahead miss {k} steps of updates")


# ---------------------------------------------------------------------------------------------
# Loading


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The parsed TOML file `path` (the one place recsys reads a config or search space file);
    ConfigError naming it. A local path or a storage URI (a saved run's config.toml)."""
    try:
        if "://" in str(path):               # storage (pyarrow) only for a URI: print-config stays quick
            from recsys import storage

            return tomllib.loads(storage.read_text(path))
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read `path` (TOML; None: all defaults), apply `section.key=value` overrides, validate."""
    return _load(path, overrides, JobConfig, "")


def load_ps_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> PSConfig:
    """PSConfig from the `[ps]` section of TOML file `path` (other sections are not read or checked),
    with `ps.key=value` overrides: what a shard needs of a job config."""
    return _load(path, overrides, PSConfig, "ps")


def _load(path: str | Path | None, overrides: typing.Sequence[str], cls: type, section: str) -> Any:
    """The one pipeline of load_config and load_ps_config: `cls` from the whole file or from `section`."""
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    for item in overrides:
        _apply_override(raw, item)
    try:
        fill_dates(raw, source)             # train.run_dir may be dated (runs/ctr/{date})
        rename_keys(raw, source)
        group_optimizers(raw, source)
        expand_tables(raw, source)          # reads [data] and [model] only for the tables they imply
        cfg = build(cls, raw.get(section, {}) if section else raw, source=source, prefix=section and f"{section}.")
    except ConfigError as e:                # an error of a `--set` override names it, not the file it went into
        rest = str(e).removeprefix(f"{source}: ")
        for item in overrides:
            key = item.partition("=")[0].strip()
            if rest != str(e) and (rest.startswith(key) or f"'{key}'" in rest):
                raise ConfigError(f"--set {item}: {rest}") from None
        raise
    if cls is PSConfig and not cfg.storage_root:    # a shard (`recsys ps`) is confined to the job's run directory
        run_dir = raw["train"].get("run_dir") if isinstance(raw.get("train"), dict) else None
        cfg = dataclasses.replace(cfg, storage_root=run_dir if isinstance(run_dir, str) else TrainConfig().run_dir)
    return cfg


RENAMED_KEYS = {("train", "prefetch_batches"): "pull_ahead_batches"}
"""Old key -> its new name in the same section: the old one still loads, with a one-line note
(train.prefetch_batches shared its name with data.prefetch_batches, which means decoding ahead)."""


def rename_keys(raw: dict[str, Any], source: str) -> None:
    """Old key names (RENAMED_KEYS) to the new ones, in place, with a one-line note each; ConfigError
    when a section sets both."""
    for (section, old), new in RENAMED_KEYS.items():
        table = raw.get(section)
        if not isinstance(table, dict) or old not in table:
            continue
        if new in table:
            raise ConfigError(f"{source}: {section}.{old} and {section}.{new} are both set: {old} is the old "
                              f"name of {new}; keep {new}")
        table[new] = table.pop(old)
        logger.warning("%s: %s.%s is now %s.%s (the old name still loads; print-config shows the new one)",
                       source, section, old, section, new)


def group_optimizers(raw: dict[str, Any], source: str) -> None:
    """A table's `optimizer = { name = "adam", lr = 0.01, beta1 = 0.9 }` (in `[[ps.tables]]` or
    `[ps.table_defaults]`) into the flat keys TableConfig holds, in place; ConfigError naming the key
    when `name` is missing, a key does not apply to that optimizer, or a flat key says otherwise.
    The flat form (`optimizer = "adam"`, `lr = 0.01` beside it) loads too."""
    ps = raw.get("ps")
    if not isinstance(ps, dict):
        return
    tables = ps.get("tables") if isinstance(ps.get("tables"), list) else []
    places = [(f"ps.tables[{i}]", t) for i, t in enumerate(tables) if isinstance(t, dict)]
    if isinstance(ps.get("table_defaults"), dict):
        places.append(("ps.table_defaults", ps["table_defaults"]))
    for where, table in places:
        grouped = table.get("optimizer")
        if not isinstance(grouped, dict):
            continue
        key = f"{where}.optimizer"
        name = grouped.pop("name", None)         # `grouped` is replaced by `name` below
        if name not in OPTIMIZER_KEYS:
            raise ConfigError(f"{source}: {key}.name must be one of {', '.join(map(repr, OPTIMIZER_KEYS))}, "
                              f"got {name!r}")
        for k, v in grouped.items():
            if k not in OPTIMIZER_KEYS[name]:
                raise ConfigError(f"{source}: {key}.{k} does not apply to optimizer {name!r} (it takes "
                                  f"{', '.join(OPTIMIZER_KEYS[name])})")
            if k in table and table[k] != v:
                raise ConfigError(f"{source}: {where}: {k} is set twice, {table[k]!r} and {key}.{k} = {v!r}")
            table[k] = v
        table["optimizer"] = name


def expand_tables(raw: dict[str, Any], source: str) -> None:
    """Apply `[ps.table_defaults]` and `model.linear_tables` to the raw config, in place: a default applies
    to every table that does not set its own value; a `data.sparse_columns` column whose table
    (`model.feature_tables`, else its own name) is not in `ps.tables` gets one made from the defaults, and with
    `model.linear_tables` one without a `model.linear_feature_tables` entry a dim-1 `<column>_linear` (its
    embedding table's pooling). New tables follow the given ones, in column order, so the expanded config
    (`print-config`) loads back to the same tables. A default that no table takes is a warning."""
    ps, model, data = raw.get("ps", {}), raw.get("model", {}), raw.get("data", {})
    if not all(isinstance(x, dict) for x in (ps, model, data)):
        return                                   # `build` names the section that is not a table
    linear = model.get("linear_tables", False) is True
    if "table_defaults" not in ps and not linear:
        return
    defaults = ps.pop("table_defaults", {})
    if not isinstance(defaults, dict):
        raise ConfigError(f"{source}: ps.table_defaults must be a table, got {defaults!r}")
    fields_ = [f.name for f in dataclasses.fields(TableConfig) if f.name != "name"]
    if unknown := [key for key in defaults if key not in fields_]:
        raise ConfigError(f"{source}: unknown key 'ps.table_defaults.{unknown[0]}'; valid: {', '.join(fields_)}")
    tables = ps.setdefault("tables", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        return
    setters = {key: [t.get("name") for t in tables if key in t] for key in defaults}   # the tables' own values
    tables[:] = [{**defaults, **t} for t in tables]             # a table's own value wins
    given = len(tables)
    names = {t.get("name") for t in tables}
    columns = data.get("sparse_columns", [])
    columns = [c for c in columns if isinstance(c, str)] if isinstance(columns, list) else []
    feature_tables, sequences = model.get("feature_tables", {}), model.get("sequence_features", {})
    feature_tables = sequence_feature_tables(feature_tables if isinstance(feature_tables, dict) else {},
                                             sequences if isinstance(sequences, dict) else {})
    for column in columns:
        name = feature_tables.get(column, column)
        if name in names:
            continue
        if "dim" not in defaults:
            raise ConfigError(f"{source}: data.sparse_columns: column {column!r} reads table {name!r}, which is "
                              f"not in ps.tables, and ps.table_defaults has no dim to make it (set "
                              f"ps.table_defaults.dim, or add a table named {name!r})")
        tables.append({"name": name, **defaults})
        names.add(name)
    if linear:
        linear_map = model.setdefault("linear_feature_tables", {})
        pooling = model.setdefault("table_pooling", {})
        if not isinstance(linear_map, dict) or not isinstance(pooling, dict):
            return
        for column in (c for c in columns if c not in linear_map):
            name = f"{column}_linear"
            if name not in names:
                tables.append({"name": name, **defaults, "dim": 1})
                names.add(name)
            linear_map[column] = name
            if (own := feature_tables.get(column, column)) in pooling:      # the pooling of its embedding table
                pooling.setdefault(name, pooling[own])
    for key, value in defaults.items():     # a default no table takes (a _linear table takes every one but dim)
        if given and len(setters[key]) == given and not any(key != "dim" or t["dim"] == value for t in tables[given:]):
            logger.warning("%s: ps.table_defaults.%s = %r applies to no table: every table of ps.tables sets "
                           "its own %s (%s); set it there (ps.tables[i].%s), or drop the tables' own value",
                           source, key, value, key, ", ".join(map(str, setters[key])), key)


DATED_KEYS = (("data", "train_paths"), ("data", "eval_paths"), ("data", "test_paths"), ("data", "item_paths"),
              ("train", "run_dir"), ("train", "scratch_dir"), ("train", "init_from"))


def fill_dates(raw: dict[str, Any], source: str) -> None:
    """Fill in the `{date}`, `{date-N}`, `{date+N}` placeholders (data/paths.py) of DATED_KEYS with data.date,
    in place; ConfigError naming the key."""
    data = raw.get("data", {})
    date = data.get("date", "") if isinstance(data, dict) else ""
    if isinstance(date, datetime.date) and not isinstance(date, datetime.datetime):
        date = data["date"] = date.isoformat()        # TOML's own date: date = 2026-11-26, --set data.date=2026-11-26
    if not isinstance(date, str):
        return                                        # `build` names the wrong type
    if date:
        try:
            parse_date(date)
        except ValueError as e:
            raise ConfigError(f"{source}: data.date (--date): {e}") from None
    for section, key in DATED_KEYS:
        table = raw.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        items = value if isinstance(value, list) else [value]
        for i, v in enumerate(items):
            if not isinstance(v, str):
                continue
            try:
                items[i] = fill_date(v, date)
            except ValueError as e:
                name = f"{section}.{key}" + (f"[{i}]" if isinstance(value, list) else "")
                hint = "" if date else "; pass --date YYYY-MM-DD or set data.date"
                raise ConfigError(f"{source}: {name} = {v!r}: {e}{hint}") from None
        if isinstance(value, str):
            table[key] = items[0]


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # a bare word is a string: --set model.arch=dcn
    *sections, name = key.split(".")
    node = raw
    for part in sections:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{part}' is not a section")
    node[name] = value


def build(cls: type, raw: Any, *, source: str, prefix: str) -> Any:
    """Make dataclass `cls` from the mapping `raw`, checking every key and value."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: '{where}' must be a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if unknown := sorted(set(raw) - set(fields)):
        raise ConfigError(f"{source}: unknown key '{prefix}{unknown[0]}'; valid: {', '.join(fields)}")
    kwargs = {name: _convert(hints[name], value, source=source, key=f"{prefix}{name}")
              for name, value in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{source}: {where}: {e}") from None
    except ValueError as e:   # a __post_init__ check (the fields were converted above)
        raise ConfigError(f"{source}: {e}") from None


_SCALARS = {bool: (bool, "true or false"), int: (int, "an integer"), float: ((int, float), "a number"),
            str: (str, "a string")}
"""A scalar config type: (the TOML values it takes, what an error says it must be)."""


def _convert(tp: Any, value: Any, *, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{source}: {key} must be {expected}, got {value!r}")

    if dataclasses.is_dataclass(tp):
        return build(tp, value, source=source, prefix=f"{key}.")
    if origin is Literal:
        if value not in args:
            raise bad(f"one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arg in args:
            try:
                return _convert(arg, value, source=source, key=key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin is tuple:                     # a config's tuples are all tuple[X, ...]
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        return tuple(_convert(args[0], v, source=source, key=f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad("a table")
        return {str(k): _convert(args[1], v, source=source, key=f"{key}.{k}") for k, v in value.items()}
    if tp in _SCALARS:
        kinds, expected = _SCALARS[tp]
        if not isinstance(value, kinds) or (isinstance(value, bool) and tp is not bool):   # a bool is an int
            raise bad(expected)
        if tp is float and not math.isfinite(value):          # TOML has nan and inf; no setting takes them
            raise bad("a finite number")
        return float(value) if tp is float else value
    raise ConfigError(f"{source}: {key}: unsupported config type {tp!r}")


__all__ = ["ConfigError", "JobConfig", "ModelConfig", "TrainConfig", "DataConfig", "PSConfig", "EvalConfig",
           "TableConfig", "expand_tables", "fill_dates", "load_config", "load_ps_config", "to_toml"]
