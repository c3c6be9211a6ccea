"""What every synthetic generator shares (data.synthetic, data.onehot, data.sequence): the splitmix64
hashing of ranks to ids and weights, Zipf sampling, the per-chunk RNG, the columns and label draw of a
planted click model (`planted_table`) and `write_parts`, which writes a generator's tables into Parquet
parts and summarizes them (CTR, oracle AUC). `data.synthetic` re-exports these names."""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from data.hashing import GOLDEN, MASK63, splitmix64_finalize
from data.sharding import epoch_seed as _rng  # noqa: F401  (the generators' RNG: _rng(seed, chunk, column))
from data.writer import PartWriter

logger = logging.getLogger("data.synthetic")

GEN_CHUNK = 32768
"""Rows per generation chunk; fixed, so the rows do not depend on how they are written."""
MASK64 = (1 << 64) - 1
_AUC_BINS = 1 << 20


# ---------------------------------------------------------------------------------------------
# hashing
# ---------------------------------------------------------------------------------------------
def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 generator's output for state x: the finalizer (`data.hashing`) of x + GOLDEN,
    elementwise on uint64 [N] (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        return splitmix64_finalize(x.astype(np.uint64) + np.uint64(GOLDEN))


def _mix_scalar(*parts: int) -> int:
    """A uint64 salt made of several ints (scalar splitmix64 chain)."""
    s = 0
    for p in parts:
        s = int(splitmix64(np.array([s ^ (p & MASK64)], dtype=np.uint64))[0])
    return s


def _name_salt(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def ids_of_ranks(feature: str, ranks: np.ndarray) -> np.ndarray:
    """int64 [N] non-negative ids of 0-based ranks [N] of `feature` (same for every seed)."""
    h = splitmix64(ranks.astype(np.uint64) ^ np.uint64(_name_salt(feature)))
    return (h & MASK63).astype(np.int64)


def _hash_normals(ranks: np.ndarray, salt: int) -> np.ndarray:
    """float64 [N] standard normals, a function of (salt, rank) only (Box-Muller on one hash)."""
    h = splitmix64(ranks.astype(np.uint64) ^ np.uint64(salt))
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0**-32
    u2 = (h & np.uint64(0xFFFFFFFF)).astype(np.float64) * 2.0**-32
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


# ---------------------------------------------------------------------------------------------
# Zipf sampling
# ---------------------------------------------------------------------------------------------
def zipf_ranks(u: np.ndarray, vocab: int, s: float) -> np.ndarray:
    """0-based ranks int64 [N] of uniforms u [N]: x = inverse CDF of a power law x^-s on [1, V+1)."""
    if abs(s - 1.0) < 1e-9:
        x = np.exp(u * math.log(vocab + 1.0))
    else:
        a = (vocab + 1.0) ** (1.0 - s) - 1.0
        x = (1.0 + u * a) ** (1.0 / (1.0 - s))
    return np.clip(x.astype(np.int64) - 1, 0, vocab - 1)


def zipf_pmf(vocab: int, s: float) -> np.ndarray:
    """float64 [V]: the exact probability `zipf_ranks` gives each rank."""
    x = np.arange(1, vocab + 2, dtype=np.float64)
    if abs(s - 1.0) < 1e-9:
        cdf = np.log(x) / math.log(vocab + 1.0)
    else:
        cdf = (x ** (1.0 - s) - 1.0) / ((vocab + 1.0) ** (1.0 - s) - 1.0)
    return np.diff(cdf)


# ---------------------------------------------------------------------------------------------
# chunks and parts
# ---------------------------------------------------------------------------------------------
def iter_chunks(chunk: Callable[[int], pa.Table], rows: int) -> Iterator[pa.Table]:
    """chunk(0), chunk(1), ... (GEN_CHUNK rows each), the last cut to end at row `rows`: tables of at
    most GEN_CHUNK rows, rows 0..rows-1 in order. Memory: one chunk."""
    for c in range(-(-rows // GEN_CHUNK)):
        yield chunk(c).slice(0, min(GEN_CHUNK, rows - c * GEN_CHUNK))


def planted_schema(*fields: pa.Field) -> pa.Schema:
    """label f32, `fields`, row_id int64, p_true f32: the columns of a preset with a planted click model."""
    return pa.schema([pa.field("label", pa.float32(), nullable=False), *fields,
                      pa.field("row_id", pa.int64(), nullable=False), pa.field("p_true", pa.float32(), nullable=False)])


def planted_table(schema: pa.Schema, chunk: int, cols: dict[str, pa.Array], logit: np.ndarray,
                  rng: np.random.Generator) -> pa.Table:
    """Chunk `chunk` of `planted_schema` columns: `cols`, p_true = sigmoid(logit) (float32), label ~
    Bernoulli(p_true) drawn with `rng`, and row_id, the rows' global numbers."""
    n = len(logit)
    p_true = (1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    label = (rng.random(n) < p_true.astype(np.float64)).astype(np.float32)
    row_id = pa.array(np.arange(chunk * GEN_CHUNK, chunk * GEN_CHUNK + n, dtype=np.int64))
    return pa.table({"label": pa.array(label), **cols, "row_id": row_id, "p_true": pa.array(p_true)}, schema=schema)


def file_rows(rows: int, num_files: int, rows_per_file: Sequence[int] | None = None) -> tuple[int, ...]:
    """Rows of each of `num_files` files: rows_per_file when given (counts >= 1 summing to `rows`),
    else an equal share (file i: rows [i * rows // num_files, (i + 1) * rows // num_files))."""
    if rows_per_file is None:
        if rows < 1 or num_files < 1 or num_files > rows:
            raise ValueError(f"need 1 <= num_files <= rows, got rows={rows}, num_files={num_files}")
        return tuple((i + 1) * rows // num_files - i * rows // num_files for i in range(num_files))
    if len(rows_per_file) != num_files or sum(rows_per_file) != rows or min(rows_per_file, default=0) < 1:
        counts = "counts >= 1" if len(rows_per_file) == num_files and sum(rows_per_file) == rows else "counts"
        raise ValueError(f"rows_per_file must be {num_files} {counts} summing to rows={rows}, "
                         f"got {list(rows_per_file)}")
    return tuple(rows_per_file)


def write_parts(preset: str, schema: pa.Schema, tables: Callable[[], Iterator[pa.Table]], *, rows: int,
                num_files: int, out_dir: str, seed: int, row_group_rows: int, compression: str,
                model_seed: int, rows_per_file: Sequence[int] | None = None) -> dict:
    """Writes the generator's tables (rows 0..rows-1, each with `label`) into `num_files` files of
    `out_dir` (`file_rows`) and returns generate()'s summary, shared by every preset (the oracle AUC
    and mean p_true of presets with a `p_true` column)."""
    counts = file_rows(rows, num_files, rows_per_file)
    t0 = time.perf_counter()
    schema = schema.with_metadata(
        {"recsys.synthetic.preset": preset, "recsys.synthetic.seed": str(seed),
         "recsys.synthetic.model_seed": str(model_seed)})
    writer = PartWriter(out_dir, schema, lambda i: counts[i],
                        row_group_rows=row_group_rows, compression=compression)
    hist = np.zeros((2, _AUC_BINS), np.int64)                      # rows per p_true bin: [negatives, positives]
    p_sum = 0.0
    oracle = "p_true" in schema.names
    try:
        for t in tables():
            writer.write(t)
            if not oracle:
                continue
            label = t.column("label").to_numpy() > 0.5
            p_true = t.column("p_true").to_numpy()
            p_sum += float(p_true.sum(dtype=np.float64))
            b = np.minimum((p_true * _AUC_BINS).astype(np.int64), _AUC_BINS - 1)
            hist += np.bincount(b + label * _AUC_BINS, minlength=2 * _AUC_BINS).reshape(2, _AUC_BINS)
    finally:
        files = writer.close()
    secs = time.perf_counter() - t0
    summary = {"preset": preset, "rows": rows, "seed": seed, "model_seed": model_seed,
               "files": [f for f, _ in files], "rows_per_file": [r for _, r in files], "seconds": round(secs, 3)}
    if oracle:
        neg, pos = hist                                  # the AUC of the bins: ties within a bin count half
        pairs = float(pos.sum()) * float(neg.sum())
        auc = float(((pos * (np.cumsum(neg) - neg)).sum() + 0.5 * (pos * neg).sum()) / pairs) if pairs else float("nan")
        summary.update(ctr=float(pos.sum() / rows), mean_p_true=p_sum / rows, oracle_auc=auc)
    logger.info("gen-data %s: %d rows in %d files%s, %.0f rows/s", preset, rows, num_files,
                f", ctr {summary['ctr']:.4f}, oracle AUC {summary['oracle_auc']:.4f}" if oracle else "",
                rows / max(secs, 1e-9))
    return summary
