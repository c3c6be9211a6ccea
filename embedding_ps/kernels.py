"""The shard's update kernels: `TableConfig.kernel` resolved per table, and fbgemm's fused CPU update.

Kernels (`TableConfig.kernel`):

    native   the shard's own update: `_native.c`'s ps_update (sgd, adagrad, rowwise_adagrad) when
             the C library is loaded, else the vectorized torch of `optim.py` (always for adam, ftrl)
    torch    the old name of `native` (existing configs keep working)
    fbgemm   fbgemm's fused CPU TBE backward (sgd, adagrad, rowwise_adagrad), `fbgemm_update` below
    auto     (default) per table, the fastest of those by the measurement in `MEASURED`

`resolve` turns a table's config into a concrete one once, when the table is made
(`TableShard.__init__`): kernel "torch" (the native path) or "fbgemm", so the push path only
sees those two. "auto" takes fbgemm only for fp32 rows of sgd / adagrad / rowwise_adagrad, only
if its measured push rate beats the other path's by `AUTO_MARGIN`, and only if fbgemm_gpu
imports; the other path is native C when the library is loaded, else torch.

`fbgemm_update` calls the CPU backward op of fbgemm's table-batched embedding (TBE) directly,
with one table whose rows are our slot-major `weights` [C, D] and one bag per unique slot (SUM
pooling, bag size 1), so the op's fused EXACT_SGD / EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD
update writes our rows and optimizer state in place. The plain-torch equivalents are
`optim._sgd` / `_adagrad` / `_rowwise_adagrad` (and the one-row `optim.reference_update`); tests
check that every path agrees with them. This is the only module of the package that imports
fbgemm_gpu, and only when a table uses it.

Measured (2026-11-25, `python benchmarks/ps_table.py --kernels`, three runs; `MEASURED` holds the
medians of the three): a push of 100k unique rows into a 2M-row fp32 table through
`ShardState.push` (id map, duplicate check, update, counters), fresh random ids each push, the
three paths alternated, 1 thread, median of 15 per run, on the 2-core machine shared with other
jobs. The native C path is the fastest in every case: fbgemm reaches 0.24-0.96x of it
(row-wise Adagrad d64 without weight decay is closest: fbgemm 9.90M rows/s vs native 10.33M,
run ratios 0.76-0.96; with weight decay fbgemm pays passes around the op: 0.40-0.80x). Against
the vectorized torch path fbgemm wins for row-wise Adagrad (1.05-1.67x) and SGD at d16 without
decay or with l2 (1.18x, 1.43x), ties SGD at d64 (1.00-1.02x) and loses for Adagrad (0.55-0.78x)
and decoupled SGD (0.71-0.87x). So with the C library loaded auto runs native for every table;
without it (no compiler, EMBEDDING_PS_NATIVE=0) auto runs fbgemm for row-wise Adagrad (except
decoupled d16: 1.049x, inside the margin) and d16 SGD without decoupled decay. The issue's
figure (row-wise Adagrad, fbgemm 4.3-4.7M vs 3.1-3.8M rows/s for the default path) is not
reproduced against the C path; its ratio is near what fbgemm reaches here against the torch
path. Measure again when the native path changes (e.g. a multi-threaded update): the table, not
the code, decides.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from embedding_ps.config import TableConfig

FBGEMM_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
"""The optimizers fbgemm's CPU TBE backward updates (no Adam, LAMB or FTRL on CPU)."""

# (optimizer, weight decay: "none" | "l2" | "decoupled", dim) -> push M rows/s of (fbgemm, native C, torch),
# medians of three runs of `benchmarks/ps_table.py --kernels` (2026-11-25; see the module docstring).
MEASURED: dict[tuple[str, str, int], tuple[float, float, float]] = {
    ("sgd", "none", 64): (6.79, 14.73, 6.82),
    ("sgd", "l2", 64): (5.10, 12.20, 5.02),
    ("sgd", "decoupled", 64): (3.71, 12.46, 4.26),
    ("adagrad", "none", 64): (2.18, 4.15, 2.96),
    ("adagrad", "l2", 64): (2.01, 4.33, 2.59),
    ("adagrad", "decoupled", 64): (1.70, 4.31, 2.39),
    ("rowwise_adagrad", "none", 64): (9.90, 10.33, 5.93),
    ("rowwise_adagrad", "l2", 64): (6.47, 8.09, 4.44),
    ("rowwise_adagrad", "decoupled", 64): (4.02, 10.13, 3.69),
    ("sgd", "none", 16): (10.02, 24.13, 8.48),
    ("sgd", "l2", 16): (8.56, 22.62, 5.97),
    ("sgd", "decoupled", 16): (5.87, 22.97, 8.31),
    ("adagrad", "none", 16): (3.31, 12.18, 5.04),
    ("adagrad", "l2", 16): (2.45, 9.93, 3.76),
    ("adagrad", "decoupled", 16): (2.92, 12.15, 5.32),
    ("rowwise_adagrad", "none", 16): (8.56, 13.22, 5.52),
    ("rowwise_adagrad", "l2", 16): (8.48, 17.49, 6.01),
    ("rowwise_adagrad", "decoupled", 16): (8.30, 19.62, 7.91),
}
MEASURED_DIMS = (16, 64)
AUTO_MARGIN = 1.05
"""auto takes fbgemm only where it measured at least this many times the other path's rate
(a tie stays native: no second code path and no fbgemm import for nothing)."""

_IMPORT: dict[str, Exception | None] = {}  # "error": None once fbgemm_gpu imported; absent: not tried yet

_HOST = 3  # fbgemm_gpu.split_table_batched_embeddings_ops_common.EmbeddingLocation.HOST
_SUM = 0  # PoolingMode.SUM


def fbgemm_error() -> Exception | None:
    """None if fbgemm_gpu imports (imported on first call: ~1 s, only where a table uses it), else the error."""
    if "error" not in _IMPORT:
        try:
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

            _IMPORT["error"] = None
        except Exception as e:  # pragma: no cover - depends on the install
            _IMPORT["error"] = e
    return _IMPORT["error"]


def fbgemm_available() -> bool:
    return fbgemm_error() is None


def measured_rates(cfg: TableConfig) -> tuple[int, tuple[float, float, float]] | None:
    """(the measured dim nearest cfg.dim, push M rows/s of (fbgemm, native C, torch)) for this
    table's optimizer and weight decay; None where fbgemm was not measured (its optimizer has no
    fbgemm CPU update, or the rows are fp16)."""
    if cfg.optimizer not in FBGEMM_OPTIMIZERS or cfg.dtype != "fp32":
        return None
    decay = cfg.weight_decay_mode if cfg.weight_decay else "none"
    dim = min(MEASURED_DIMS, key=lambda d: abs(math.log(cfg.dim / d)))  # nearest on a log scale
    return dim, MEASURED[(cfg.optimizer, decay, dim)]


def auto_kernel(cfg: TableConfig, native_loaded: bool) -> tuple[str, str]:
    """("fbgemm" or "native", why) for a table with kernel "auto"; `native_loaded`: the C library is."""
    found = measured_rates(cfg)
    if found is None:
        why = (f"fbgemm has no CPU {cfg.optimizer} update" if cfg.optimizer not in FBGEMM_OPTIMIZERS
               else f"fbgemm not measured on {cfg.dtype} rows")
        return "native", why
    dim, (fbgemm, native_c, plain) = found
    other, rate = ("native C", native_c) if native_loaded else ("torch", plain)
    decay = cfg.weight_decay_mode if cfg.weight_decay else "no"
    why = f"{cfg.optimizer}, {decay} weight decay, d{dim}: fbgemm {fbgemm:.2f}M vs {other} {rate:.2f}M rows/s"
    if fbgemm < AUTO_MARGIN * rate:
        return "native", why
    if fbgemm_error() is not None:
        return "native", f"{why}, but fbgemm_gpu does not import: {fbgemm_error()}"
    return "fbgemm", why


def resolve(cfg: TableConfig, native_loaded: bool) -> tuple[TableConfig, str]:
    """(cfg with the concrete kernel "torch" (the native path) or "fbgemm", a line naming the kernel and why).

    Called once per table (`TableShard.__init__`); a resolved config resolves to itself.
    """
    if cfg.kernel == "fbgemm":
        return cfg, "fbgemm (configured)"
    if cfg.kernel == "auto":
        name, why = auto_kernel(cfg, native_loaded)
        why = f"auto: {why}"
    else:
        name, why = "native", f"configured {cfg.kernel!r}"
    if name == "native" and not native_loaded:
        why += "; C library not loaded: vectorized torch"
    elif name == "native" and cfg.optimizer not in FBGEMM_OPTIMIZERS:
        why += f"; vectorized torch (no C {cfg.optimizer} update)"
    return dataclasses.replace(cfg, kernel="fbgemm" if name == "fbgemm" else "torch"), f"{name} ({why})"


def kernel_name(cfg: TableConfig) -> str:
    """"fbgemm" or "native": which update a table's resolved config runs."""
    return "fbgemm" if cfg.kernel == "fbgemm" else "native"


def fbgemm_update(
    cfg: TableConfig, weights: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor, grads: torch.Tensor
) -> None:
    """The fused update of rows `slots` (int64 [U], unique) of weights [C, D] from grads float32 [U, D]."""
    if fbgemm_error() is not None:
        raise RuntimeError(f"table {cfg.name!r}: kernel='fbgemm' but fbgemm_gpu failed to import: {fbgemm_error()}")
    c, d = weights.shape
    wd = cfg.weight_decay
    if wd:
        # around the op, the math of optim.py: L2 into the gradient, or the decoupled shrink of the
        # touched rows before the op adds its update. Of the CPU ops only rowwise_adagrad takes
        # weight_decay / weight_decay_mode arguments, and fbgemm-gpu-cpu 1.8.0 ignores them
        # (measured: rows equal to weight_decay = 0 in both modes), so none is passed.
        from embedding_ps.optim import decay_factor, l2_grads

        if cfg.weight_decay_mode == "l2":
            grads = l2_grads(cfg, weights, slots, grads)
        else:
            rows = weights.index_select(0, slots).float().mul_(decay_factor(cfg))
            weights.index_copy_(0, slots, rows.to(weights.dtype))
    common = dict(
        grad_output=grads.contiguous(),
        host_weights=weights.view(-1),
        weights_placements=torch.tensor([_HOST], dtype=torch.int32),
        weights_offsets=torch.zeros(1, dtype=torch.int64),
        D_offsets=torch.tensor([0, d], dtype=torch.int32),
        max_D=d,
        hash_size_cumsum=torch.tensor([0, c], dtype=torch.int64),
        total_hash_size_bits=max(1, math.ceil(math.log2(c + 1))),
        indices=slots,
        offsets=torch.arange(slots.shape[0] + 1, dtype=torch.int64),
        pooling_mode=_SUM,
        indice_weights=torch.empty(0),
        stochastic_rounding=False,
        learning_rate_tensor=torch.tensor(cfg.lr, dtype=torch.float32),
    )
    ops = torch.ops.fbgemm
    if cfg.optimizer == "sgd":
        ops.split_embedding_backward_codegen_sgd_cpu(**common)
        return
    momentum = dict(
        momentum1_host=state["sum_sq"].view(-1),
        momentum1_placements=torch.tensor([_HOST], dtype=torch.int32),
        momentum1_offsets=torch.zeros(1, dtype=torch.int64),
        eps=cfg.eps,
    )
    if cfg.optimizer == "adagrad":
        ops.split_embedding_backward_codegen_adagrad_cpu(**common, **momentum)
    elif cfg.optimizer == "rowwise_adagrad":
        ops.split_embedding_backward_codegen_rowwise_adagrad_cpu(**common, **momentum)
    else:
        raise ValueError(f"table {cfg.name!r}: kernel='fbgemm' has no {cfg.optimizer!r} update")
