"""`recsys init-config --data FILES... --label COL [--out X.toml]`: a job config written from the data.

Reads the files' schema and, over up to `sample_rows` rows, each column's distinct values (pyarrow),
classifies the columns and writes a commented config that trains as written:

    label       the --label column
    dense       float columns, and integer ones named like Criteo's counts (I1, I2, ...) or given by --dense;
                `dense_log1p` on when they are counts or long-tailed (skewness > 2) and none is negative
    id          integer columns (every other one), strings and binaries (hashed to 64-bit ids)
    multi-hot   lists of integers or strings
    left out    `p_true` and `row_id` (kept as passthrough columns), and --ignore

Tables are one per id column (`[ps.table_defaults]` makes them) with the recipe of README's "Getting
good results" (DeepFM, Adam, L2, batch norm, early stopping): `placement = "auto"` trains a column of
at most 10,000 distinct ids as a dense parameter on the trainers and bigger ones on the PS; a column
whose ids are mostly seen once gets admission (`min_count = 2`) and a capacity hint; the dim grows
with the largest vocabulary (8 up to 10k ids, 16 up to 1M, 32 beyond). Train / validation / test
files: `split_files`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.parquet import _is_id, _is_list, _is_number, resolve_paths   # the reader's own type rules
from data.remote import parquet_file
from embedding_ps.wire.config import PSConfig
from recsys.config_toml import toml_value

PASSTHROUGH = ("p_true", "row_id")
DENSE_NAME = re.compile(r"I\d+")
SKEWED = 2.0
"""Sample skewness above which a non-negative dense column counts as long-tailed (a lognormal price:
tens; a uniform or a normal: about 0)."""
REPLICATE_MAX = PSConfig().replicate_max_rows
"""What `placement = "auto"` replicates at most (the default ps.replicate_max_rows)."""


class InitConfigError(ValueError):
    """The data cannot make a config: the message names the file or column."""


@dataclass
class Column:
    name: str
    kind: str                # "label" | "dense" | "id" | "multi-hot" | "passthrough" | "ignored"
    type: str
    distinct: int = 0
    singletons: float = 0.0  # share of distinct ids seen once in the sample
    note: str = ""
    negative: bool = False   # dense: some sampled value < 0
    skewed: bool = False     # dense: sampled values >= 0 with a long right tail (skewness > SKEWED)


def classify(files: list[str], label: str, dense: tuple[str, ...] = (), ignore: tuple[str, ...] = (),
             sample_rows: int = 1_000_000) -> tuple[list[Column], int]:
    """(columns in file order, rows sampled) of the first file's schema, counted over the files' first
    `sample_rows` rows. InitConfigError naming the file when the schemas differ or the label is missing."""
    schema = _open(files[0]).schema_arrow
    kept = [n for n in schema.names if n not in ignore]       # --ignore: not read, not compared
    for f in files[1:]:
        other = [n for n in _open(f).schema_arrow.names if n not in ignore]
        if other != kept:
            extra = sorted(set(other) ^ set(kept))
            raise InitConfigError(f"{f}: its columns {other} differ from {files[0]}'s {kept}"
                                  + (f" (pass --ignore {' '.join(extra)} to leave out the columns only some files have,"
                                     f" or give files of one schema)" if extra else " (in another order)"))
    if label not in schema.names:
        raise InitConfigError(f"--label {label!r}: not a column of {files[0]} (columns: {', '.join(schema.names)})")
    tables, rows = [], 0
    for f in files:
        pf = _open(f)
        for g in range(pf.num_row_groups):
            if rows >= sample_rows:
                break
            t = pf.read_row_group(g, columns=kept)
            tables.append(t)
            rows += t.num_rows
    data = pa.concat_tables(tables) if tables else schema.empty_table().select(kept)
    cols = []
    for field in schema:
        n, t = field.name, field.type
        if n == label:
            cols.append(Column(n, "label", str(t)))
        elif n in ignore:
            cols.append(Column(n, "ignored", str(t), note="--ignore"))
        elif n in PASSTHROUGH:
            cols.append(Column(n, "passthrough", str(t), note="bookkeeping of generated data: carried to predictions"))
        elif n in dense or pa.types.is_floating(t) or pa.types.is_boolean(t) or (pa.types.is_integer(t)
                                                                                 and DENSE_NAME.fullmatch(n)):
            if not _is_number(t):
                raise InitConfigError(f"--dense {n}: column of type {t}, not a number")
            cols.append(_dense_column(n, t, data.column(n)))
        elif _is_id(t) or (_is_list(t) and _is_id(t.value_type)):
            values = data.column(n)
            if _is_list(t):
                values = pc.list_flatten(values)
            c = pc.value_counts(pc.drop_null(values)).field("counts").to_numpy(zero_copy_only=False)
            cols.append(Column(n, "multi-hot" if _is_list(t) else "id", str(t), distinct=len(c),
                               singletons=float(np.mean(c == 1)) if len(c) else 0.0))
        else:
            cols.append(Column(n, "ignored", str(t), note=f"type {t}: neither a number nor ids"))
    return cols, rows


def _dense_column(name: str, t: pa.DataType, values: pa.ChunkedArray) -> Column:
    """A dense column with what decides its transform: negative values, a long right tail, nulls."""
    x = pc.drop_null(values).to_numpy(zero_copy_only=False).astype(np.float64) if len(values) else np.zeros(0)
    x = x[np.isfinite(x)]
    nulls = values.null_count / len(values) if len(values) else 0.0
    negative = bool(x.size and x.min() < 0)
    skewed = bool(x.size > 1 and not negative and x.std() > 0 and np.mean(((x - x.mean()) / x.std()) ** 3) > SKEWED)
    notes = [f"{nulls:.0%} null (dense_fill)" if nulls else "", "long right tail" if skewed else "",
             "negative values" if negative else ""]
    return Column(name, "dense", str(t), note="; ".join(n for n in notes if n), negative=negative, skewed=skewed)


def _log1p_line(dense: list[Column]) -> str | None:
    """The dense_log1p line: on when the dense columns are counts (integers) or long-tailed and none is
    negative (log(1 + max(x, 0)) would clip a negative value to 0); a comment saying why when off."""
    counts = [c.name for c in dense if not c.type.startswith(("float", "double", "bool"))]
    tails = [c.name for c in dense if c.skewed]
    negative = [c.name for c in dense if c.negative]
    if not (counts or tails):
        return None
    if negative:
        return (f"# dense_log1p stays off: {', '.join(negative)} holds negative values, which log(1 + max(x, 0)) "
                f"would clip to 0; long-tailed {', '.join(counts + tails)} would want it (transform them "
                f"in the data)")
    why = "integer counts" if not tails else "long right tails" if not counts else "counts and long right tails"
    return f"dense_log1p = true           # {why} ({', '.join(counts + tails)}): log(1 + x), the Criteo convention"


def _open(path: str):  # noqa: ANN202 (a pyarrow ParquetFile)
    """The Parquet file at `path`; InitConfigError naming it when it is not one (as `recsys train` says)."""
    try:
        return parquet_file(path)
    except Exception as e:                       # pyarrow raises ArrowInvalid, OSError, ...
        raise InitConfigError(f"{path}: unreadable Parquet file ({type(e).__name__}: {e}); pass only Parquet "
                              f"files (or a directory holding only them) to --data") from e


_VAL = re.compile(r"(^|[^a-z])(val|valid|validation|eval|dev)([^a-z]|$)")
_TEST = re.compile(r"(^|[^a-z])test([^a-z]|$)")


def split_files(files: list[str]) -> tuple[list[str], list[str], list[str], str]:
    """(train, validation, test, how it was decided). By name when any file's path names a role
    ("val" / "valid" / "validation" / "eval" / "dev", "test"; the rest train); else by order, the last two
    of three or more files validation and test (`resolve_paths` sorts a directory's files by name)."""
    names = {f: f"{Path(f).parent.name}/{Path(f).stem}".lower() for f in files}   # '/' bounds a word
    role = {f: "test" if _TEST.search(n) else "val" if _VAL.search(n) else "train" for f, n in names.items()}
    if "train" in role.values() and len(set(role.values())) > 1:
        return (*([f for f in files if role[f] == r] for r in ("train", "val", "test")), "by file name")
    if len(files) >= 3:
        return files[:-2], [files[-2]], [files[-1]], "by order: the last two by name (no file is named val / test)"
    return files, [], [], "all files train (fewer than 3, none named val / test)"


def render(files: list[str], label: str, cols: list[Column], sample: int, run_dir: str) -> str:
    """The config text (TOML with comments)."""
    dense = [c.name for c in cols if c.kind == "dense"]
    ids = [c for c in cols if c.kind in ("id", "multi-hot")]
    if not ids:
        raise InitConfigError(f"{files[0]}: no id columns (integers, strings or lists of them) to embed")
    passthrough = [c.name for c in cols if c.kind == "passthrough"]
    train, val, test, how = split_files(files)
    vocab = max(c.distinct for c in ids)
    dim = 8 if vocab <= 10_000 else 16 if vocab <= 1_000_000 else 32
    lines = [
        f"# Written by `recsys init-config` from {len(files)} file(s) ({sample:,} rows sampled). Check the column",
        "# classes below, then: recsys train --config THIS_FILE   (recsys print-config --config THIS_FILE shows it",
        "# resolved; recsys print-config --explain KEY says what a key means).",
        f"# train / validation / test files: {len(train)} / {len(val)} / {len(test)}, {how}: check [data] below.",
        "#",
        "# columns:",
    ]
    for c in cols:
        extra = f", {c.distinct:,} distinct ids ({c.singletons:.0%} seen once)" if c.kind in ("id", "multi-hot") else ""
        lines.append(f"#   {c.name:<20} {c.type:<24} {c.kind}{extra}{'; ' + c.note if c.note else ''}")
    lines += ["", "[data]", f"train_paths = {toml_value(train)}"]
    if val:
        lines.append(f"eval_paths = {toml_value(val)}            # validation: picks the epoch (early stopping)")
    if test:
        lines.append(f"test_paths = {toml_value(test)}            # scored once at the end, with the best model")
    lines += [f"label_column = {toml_value(label)}",
              f"dense_columns = {toml_value(dense)}",
              f"sparse_columns = {toml_value([c.name for c in ids])}"]
    if log1p := _log1p_line([c for c in cols if c.kind == "dense"]):
        lines.append(log1p)
    if passthrough:
        lines.append(f"passthrough_columns = {toml_value(passthrough)}")
    lines += ["batch_size = 256", "drop_last = true             # batch norm: no last batch of a few rows", "",
              "[ps]", "num_shards = 1", 'mode = "sync"', "",
              "[ps.table_defaults]          # every table: one per id column, plus the dim-1 linear ones",
              f"dim = {dim}                      # from the largest vocabulary ({vocab:,} ids)",
              f'placement = "auto"           # <= {REPLICATE_MAX:,} ids: a dense parameter on the trainers; '
              'more: the PS',
              'optimizer = { name = "adam", lr = 0.001, weight_decay = 0.0002 }   # weight_decay = 2 x an L2 penalty',
              'init = "normal"', "init_scale = 0.01",
              'unadmitted = "zeros"         # ids the training data never had add nothing at eval / serving time']
    for c in ids:
        if c.distinct > REPLICATE_MAX and c.singletons > 0.5:
            lines += ["", f"# {c.name}: {c.distinct:,} ids, {c.singletons:.0%} seen once: admit an id at its 2nd "
                          "sighting, and size the table",
                      "[[ps.tables]]", f"name = {toml_value(c.name)}", f"dim = {dim}", 'placement = "ps"',
                      "min_count = 2",
                      f"capacity = {int(math.ceil(c.distinct * 1.2))}",
                      "# ttl_steps = 0             # set for ids that stop appearing (daily data): rows unseen this "
                      "many steps are dropped"]
    lines += ["", "[model]", 'arch = "deepfm"', "linear_tables = true         # FM first-order terms: a dim-1 "
              "table per column", "top_mlp = [64, 32]", 'norm = "batch"', "dropout = 0.2", "",
              "[train]", "num_trainers = 1", "epochs = 15" if val else "epochs = 2", "dense_lr = 0.001",
              "log_every = 50"]
    if val:
        lines += ['validate_every = "epoch"', 'early_stop_metric = "logloss"', "early_stop_patience = 2",
                  "keep_best = true"]
    lines.append(f"run_dir = {toml_value(run_dir)}")
    return "\n".join(lines) + "\n"


def init_config(data: list[str], label: str, out: str | None = None, dense: tuple[str, ...] = (),
                ignore: tuple[str, ...] = (), sample_rows: int = 1_000_000, run_dir: str = "") -> str:
    """The config text for `data` (written to `out` when given; an existing `out` is refused)."""
    files = resolve_paths(list(data))
    if not files:
        raise InitConfigError(f"--data {' '.join(data)}: no Parquet files there")
    cols, sample = classify(files, label, tuple(dense), tuple(ignore), sample_rows)
    text = render(files, label, cols, sample, run_dir or f"runs/{Path(out).stem if out else 'my-model'}")
    if out:
        if Path(out).exists():
            raise InitConfigError(f"--out {out}: exists (pick another name, or remove it)")
        Path(out).write_text(text)
    return text
