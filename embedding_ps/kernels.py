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

`MEASURED` is the table of BENCHMARKS.md, section "Update kernels: fbgemm vs native C vs torch"
(`python benchmarks/ps_table.py --kernels --clock cpu`, the medians of three runs, taken after the
native update started grouping rows by slot before updating them): the setup, the figures, what
auto picks from them and the caveats (load changes the verdict for row-wise Adagrad on fp32 d64
rows) are there. In short, with the C library loaded fbgemm wins for row-wise Adagrad on fp32 d64
rows without decay or with l2 and on fp16 d64 tables without decoupled decay except l2 Adagrad;
native keeps everything else (d16 rows, Adagrad, SGD, decoupled decay, where fbgemm pays passes
around the op). Measure again when the native path changes: the table, not the code, decides.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from embedding_ps.config import TableConfig

FBGEMM_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
"""The optimizers fbgemm's CPU TBE backward updates (no Adam, LAMB or FTRL on CPU)."""

# (optimizer, weight decay: "none" | "l2" | "decoupled", row dtype, dim) -> push M rows/s of
# (fbgemm, native C, fbgemm without the C library, torch without it): medians of three runs of
# `python benchmarks/ps_table.py --kernels --clock cpu`: BENCHMARKS.md, "Update kernels: fbgemm vs native C vs torch".
MEASURED: dict[tuple[str, str, str, int], tuple[float, float, float, float]] = {
    ("sgd", "none", "fp32", 64): (5.81, 9.26, 5.04, 5.91),
    ("sgd", "l2", "fp32", 64): (4.28, 8.38, 3.90, 4.33),
    ("sgd", "decoupled", "fp32", 64): (2.37, 8.41, 2.13, 2.59),
    ("adagrad", "none", "fp32", 64): (1.87, 3.47, 1.77, 1.99),
    ("adagrad", "l2", "fp32", 64): (1.82, 3.51, 1.73, 1.78),
    ("adagrad", "decoupled", "fp32", 64): (1.19, 3.39, 1.16, 1.43),
    ("rowwise_adagrad", "none", "fp32", 64): (8.71, 7.55, 7.17, 5.04),
    ("rowwise_adagrad", "l2", "fp32", 64): (5.64, 5.04, 4.92, 3.72),
    ("rowwise_adagrad", "decoupled", "fp32", 64): (2.40, 4.82, 2.31, 2.38),
    ("sgd", "none", "fp32", 16): (8.85, 16.45, 7.49, 7.82),
    ("sgd", "l2", "fp32", 16): (7.16, 15.55, 6.03, 6.14),
    ("sgd", "decoupled", "fp32", 16): (5.39, 15.74, 4.74, 6.69),
    ("adagrad", "none", "fp32", 16): (3.71, 10.11, 3.39, 5.10),
    ("adagrad", "l2", "fp32", 16): (3.49, 9.80, 3.22, 4.67),
    ("adagrad", "decoupled", "fp32", 16): (3.10, 10.31, 2.87, 5.11),
    ("rowwise_adagrad", "none", "fp32", 16): (11.67, 14.24, 8.78, 6.94),
    ("rowwise_adagrad", "l2", "fp32", 16): (9.21, 12.99, 7.23, 6.05),
    ("rowwise_adagrad", "decoupled", "fp32", 16): (6.96, 13.12, 5.81, 6.35),
    ("sgd", "none", "fp16", 64): (2.67, 1.81, 2.47, 2.82),
    ("sgd", "l2", "fp16", 64): (2.02, 1.65, 2.10, 1.93),
    ("sgd", "decoupled", "fp16", 64): (1.61, 1.79, 1.54, 2.83),
    ("adagrad", "none", "fp16", 64): (1.91, 1.66, 1.85, 1.97),
    ("adagrad", "l2", "fp16", 64): (1.50, 1.60, 1.62, 1.38),
    ("adagrad", "decoupled", "fp16", 64): (1.42, 1.89, 1.40, 1.95),
    ("rowwise_adagrad", "none", "fp16", 64): (2.60, 1.97, 2.47, 3.46),
    ("rowwise_adagrad", "l2", "fp16", 64): (1.98, 1.67, 2.12, 2.10),
    ("rowwise_adagrad", "decoupled", "fp16", 64): (1.71, 1.97, 1.66, 2.82),
    ("sgd", "none", "fp16", 16): (4.59, 6.59, 4.13, 7.96),
    ("sgd", "l2", "fp16", 16): (4.37, 6.01, 4.03, 6.78),
    ("sgd", "decoupled", "fp16", 16): (3.71, 6.45, 3.42, 8.12),
    ("adagrad", "none", "fp16", 16): (3.50, 6.06, 3.21, 5.45),
    ("adagrad", "l2", "fp16", 16): (3.21, 5.57, 2.97, 4.92),
    ("adagrad", "decoupled", "fp16", 16): (2.88, 5.82, 2.70, 5.48),
    ("rowwise_adagrad", "none", "fp16", 16): (4.71, 6.11, 4.23, 7.54),
    ("rowwise_adagrad", "l2", "fp16", 16): (4.27, 5.13, 3.85, 6.41),
    ("rowwise_adagrad", "decoupled", "fp16", 16): (3.78, 5.98, 3.46, 7.46),
}
MEASURED_DIMS = (16, 64)
AUTO_MARGIN = 1.05
"""auto takes fbgemm only where it measured at least this many times the other path's rate
(a tie stays native: no second code path and no fbgemm import for nothing)."""

_IMPORT: dict[str, Exception | None] = {}  # "error": None once fbgemm_gpu imported; absent: not tried yet

_HOST = 3  # fbgemm_gpu.split_table_batched_embeddings_ops_common.EmbeddingLocation.HOST
_SUM = 0  # PoolingMode.SUM


def fbgemm_error() -> Exception | None:
    """None if fbgemm_gpu imports (imported on first call, only where a table uses it), else the error."""
    if "error" not in _IMPORT:
        try:
            import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

            _IMPORT["error"] = None
        except Exception as e:  # pragma: no cover - depends on the install
            _IMPORT["error"] = e
    return _IMPORT["error"]


def fbgemm_available() -> bool:
    return fbgemm_error() is None


def measured_rates(cfg: TableConfig) -> tuple[int, tuple[float, float, float, float]] | None:
    """(the measured dim nearest cfg.dim, push M rows/s of (fbgemm, native C, fbgemm without C,
    torch)) for this table's optimizer, weight decay and row dtype; None if fbgemm has no CPU
    update for its optimizer."""
    if cfg.optimizer not in FBGEMM_OPTIMIZERS:
        return None
    decay = cfg.weight_decay_mode if cfg.weight_decay else "none"
    dim = min(MEASURED_DIMS, key=lambda d: abs(math.log(cfg.dim / d)))  # nearest on a log scale
    return dim, MEASURED[(cfg.optimizer, decay, cfg.dtype, dim)]


def auto_kernel(cfg: TableConfig, native_loaded: bool) -> tuple[str, str]:
    """("fbgemm" or "native", why) for a table with kernel "auto"; `native_loaded`: the C library is."""
    found = measured_rates(cfg)
    if found is None:
        return "native", f"fbgemm has no CPU {cfg.optimizer} update"
    dim, (fbgemm, native_c, fbgemm_pure, plain) = found
    if native_loaded:
        other, rate = "native C", native_c
    else:  # without the C library both run the numpy id map: the figures measured that way
        other, rate, fbgemm = "torch", plain, fbgemm_pure
    decay = cfg.weight_decay_mode if cfg.weight_decay else "no"
    why = (f"{cfg.optimizer}, {decay} weight decay, {cfg.dtype} d{dim}: fbgemm {fbgemm:.2f}M vs {other} "
           f"{rate:.2f}M rows/s")
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
