"""Typed configuration of the Parquet input pipeline (the `[data]` section of a job config)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from data.paths import has_date, parse_date


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where the examples are and how a row of Parquet becomes part of a `Batch`."""

    date: str = ""
    """The day this job is for, `YYYY-MM-DD` (`recsys train --date`): the `{date}`, `{date-N}`, `{date+N}`
    placeholders of the `*_paths` below (and of train.run_dir / train.init_from / train.scratch_dir) are
    filled in with it when the config is loaded (see data/paths.py). "": no date; a placeholder is then
    an error."""
    train_paths: tuple[str, ...] = ()
    """Parquet files, directories (hive partitions `day=.../` included) or glob patterns, local or URIs,
    for training; may hold date placeholders (`s3://bucket/ctr/day={date-1}/`)."""
    eval_paths: tuple[str, ...] = ()
    """Parquet files, directories or glob patterns for evaluation (validation, with train.validate_every)."""
    test_paths: tuple[str, ...] = ()
    """Held-out Parquet data scored once at the end of training, with the best model (metrics.json "test")."""
    batch_size: int = 4096
    """Examples per batch B, per rank."""
    label_column: str = "label"
    """Column holding the 0/1 label."""
    dense_columns: tuple[str, ...] = ()
    """Float or integer columns that make up `Batch.dense` [B, Dn], in this order."""
    dense_fill: float = 0.0
    """Value a null dense entry becomes."""
    dense_log1p: bool = False
    """Apply log(1 + max(x, 0)) to dense values (the Criteo convention)."""
    sparse_columns: tuple[str, ...] = ()
    """Id columns: int64 scalars (one id), list<int64> (multi-hot) or strings (hashed to int64)."""
    weight_columns: dict[str, str] = field(default_factory=dict)
    """Sparse column -> list<float> column of per-id weights, same lengths as the ids."""
    id_types: dict[str, str] = field(default_factory=dict)
    """Sparse column -> "integer" or "string": the type of its ids (in a list column, of the list's
    values; binary counts as string). A file whose column holds the other type is refused naming it:
    the id 123 and the string "123" are different rows. `recsys train` fills in the columns left out
    from the first training file (or from the run it warm-starts from), so checkpoints and exports
    carry them: eval, predict and `recsys serve` then refuse ids of the wrong type."""
    example_weight_column: str = ""
    """Column of a per-row loss weight (a number >= 0, finite), carried into `Batch.example_weights`
    [B]; "" for none. Not `weight_columns` (per-id pooling weights). Training weighs each row's loss
    by it; eval metrics are weighted by it (docs/models.md, "Example weights and negative downsampling")."""
    negative_sampling_rate: float = 1.0
    """r in (0, 1]: the training data's negatives (label 0) were kept with probability r. 1.0: not
    downsampled. How it is corrected: `negative_sampling_correction`."""
    negative_sampling_correction: Literal["calibrate", "weight"] = "calibrate"
    """With negative_sampling_rate r < 1: "calibrate" trains on the rows as they are and reports
    p' = p / (p + (1 - p) / r) (eval, predict, export, serving); "weight" weighs the negatives'
    loss by 1 / r, so the model's own sigmoid is already calibrated and scores are not changed.
    Each alone corrects the downsampling (both together would correct it twice)."""
    max_ids_per_row: int = 1024
    """A list column longer than this in one row is bad input."""
    on_bad_rows: Literal["error", "skip"] = "error"
    """`error` raises naming file, row group and column; `skip` drops the row and counts it."""
    shuffle: bool = True
    """Shuffle the (file, row group) order per epoch and the rows inside windows of
    `shuffle_buffer_rows` (see data/sharding.py); the order is a function of (seed, epoch, rank)."""
    shuffle_buffer_rows: int = 65536
    """Rows of a shuffle window: at most this many, made of whole row groups where they fit (a larger
    row group is cut). 0 shuffles only the row-group order."""
    seed: int = 0
    """Base seed of the shuffle; epoch e uses a seed derived from (seed, e)."""
    prefetch_batches: int = 2
    """Batches decoded ahead by a background thread; 0 decodes on the caller's thread."""
    drop_last: bool = False
    """Drop the final partial batch of a rank's epoch."""
    passthrough_columns: tuple[str, ...] = ()
    """Columns carried unchanged into `Batch.extras` (numpy [B]), e.g. copied next to the scores by
    `recsys predict`."""
    validate_batches: bool = False
    """Run `validate_batch()` on every batch the loader yields (the data-boundary check)."""
    pin_memory: bool = False
    """Put batches in page-locked memory in the prefetch thread (only when CUDA is available)."""
    item_paths: tuple[str, ...] = ()
    """Retrieval (two-tower) runs: the item corpus, one row per item with the item tower's columns;
    `recsys eval` ranks all of them for every user, `recsys export` writes their vectors."""

    def with_passthrough(self, columns: tuple[str, ...]) -> DataConfig:
        """This config with `columns` added to passthrough_columns (kept in order, once each)."""
        return replace(self, passthrough_columns=tuple(dict.fromkeys((*self.passthrough_columns, *columns))))

    def __post_init__(self) -> None:
        if self.date:
            try:
                parse_date(self.date)
            except ValueError as e:
                raise ValueError(f"data.date: {e}") from None
        for key in ("train_paths", "eval_paths", "test_paths", "item_paths"):
            left = [p for p in getattr(self, key) if has_date(p)]
            if left:      # the loader fills them in (load_config); a config built in code must too
                raise ValueError(f"data.{key}: {left[0]!r} holds a date placeholder: fill it in first "
                                 f"(data.paths.fill_date, done by load_config with data.date)")
        for key, low in ("batch_size", 1), ("max_ids_per_row", 1), ("shuffle_buffer_rows", 0), ("prefetch_batches", 0):
            if getattr(self, key) < low:
                raise ValueError(f"data.{key} must be >= {low}, got {getattr(self, key)}")
        if self.batch_size > 1 << 24:
            raise ValueError(f"data.batch_size must be in 1..{1 << 24} (rows per rank per step), got {self.batch_size}")
        for key in ("dense_columns", "sparse_columns", "passthrough_columns"):
            cols = getattr(self, key)
            if len(set(cols)) != len(cols):
                dup = sorted({c for c in cols if cols.count(c) > 1})
                raise ValueError(f"data.{key} names {dup} more than once")
        r = self.negative_sampling_rate
        if not (0.0 < r <= 1.0):          # also NaN
            raise ValueError(f"data.negative_sampling_rate must be in (0, 1], got {r}")
        if self.example_weight_column and self.example_weight_column == self.label_column:
            raise ValueError(f"data.example_weight_column = {self.example_weight_column!r} is the label column")
        for col, kind in self.id_types.items():
            if col not in self.sparse_columns or kind not in ("integer", "string"):
                raise ValueError(f"data.id_types.{col} = {kind!r}: " + (
                    "not a column of data.sparse_columns" if col not in self.sparse_columns
                    else 'expected "integer" or "string"'))
        for col in self.weight_columns:
            if col not in self.sparse_columns:
                raise ValueError(f"data.weight_columns names '{col}', which is not in data.sparse_columns")
