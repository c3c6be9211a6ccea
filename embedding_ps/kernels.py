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
(`python benchmarks/ps_table.py --kernels --clock cpu`, the medians of three runs) on the newest
machine measured, `MEASURED_EARLIER` those of the machines before it. The winner depends on the
CPU: fbgemm-gpu-cpu 1.8.0's row-wise Adagrad beat the native update on the 2026-11-25 machine and
lost to it by several times on the 2026-11-27 one (BENCHMARKS.md, section "Update kernels: fbgemm
vs native C vs torch, a second machine"), so auto takes fbgemm only where it won on every
machine measured: today the fp16 d64 tables of SGD, Adagrad and row-wise Adagrad without decay;
native keeps everything else. Measure again when the native path changes or on a new kind of CPU:
the tables, not the code, decide.
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
# One table per machine the benchmark ran on; `MEASURED` is the newest, `MEASURED_EARLIER` the rest.
Figures = dict[tuple[str, str, str, int], tuple[float, float, float, float]]
_MEASURED_2026_11_27: Figures = {
    ("sgd", "none", "fp32", 64): (4.34, 6.34, 3.77, 3.77),
    ("sgd", "l2", "fp32", 64): (3.12, 5.72, 2.67, 2.65),
    ("sgd", "decoupled", "fp32", 64): (2.15, 5.93, 1.97, 2.21),
    ("adagrad", "none", "fp32", 64): (1.55, 3.09, 1.47, 1.64),
    ("adagrad", "l2", "fp32", 64): (1.29, 2.93, 1.23, 1.37),
    ("adagrad", "decoupled", "fp32", 64): (1.13, 3.10, 1.08, 1.30),
    ("rowwise_adagrad", "none", "fp32", 64): (1.52, 5.30, 1.38, 3.04),
    ("rowwise_adagrad", "l2", "fp32", 64): (1.32, 4.59, 1.18, 2.33),
    ("rowwise_adagrad", "decoupled", "fp32", 64): (1.10, 5.14, 1.03, 1.97),
    ("sgd", "none", "fp32", 16): (8.13, 14.97, 6.33, 5.88),
    ("sgd", "l2", "fp32", 16): (6.29, 13.15, 5.09, 4.87),
    ("sgd", "decoupled", "fp32", 16): (4.67, 13.23, 3.97, 5.05),
    ("adagrad", "none", "fp32", 16): (3.16, 8.75, 2.85, 3.81),
    ("adagrad", "l2", "fp32", 16): (2.87, 8.17, 2.57, 3.29),
    ("adagrad", "decoupled", "fp32", 16): (2.47, 8.54, 2.26, 3.33),
    ("rowwise_adagrad", "none", "fp32", 16): (1.79, 10.31, 1.67, 4.68),
    ("rowwise_adagrad", "l2", "fp32", 16): (1.65, 9.41, 1.55, 4.09),
    ("rowwise_adagrad", "decoupled", "fp32", 16): (1.55, 9.01, 1.47, 3.90),
    ("sgd", "none", "fp16", 64): (2.20, 1.74, 1.96, 2.40),
    ("sgd", "l2", "fp16", 64): (1.51, 1.41, 1.48, 1.55),
    ("sgd", "decoupled", "fp16", 64): (1.36, 1.61, 1.25, 2.22),
    ("adagrad", "none", "fp16", 64): (1.45, 1.38, 1.34, 1.33),
    ("adagrad", "l2", "fp16", 64): (1.17, 1.37, 1.19, 1.06),
    ("adagrad", "decoupled", "fp16", 64): (1.09, 1.50, 1.02, 1.32),
    ("rowwise_adagrad", "none", "fp16", 64): (1.78, 1.69, 1.67, 2.10),
    ("rowwise_adagrad", "l2", "fp16", 64): (1.45, 1.48, 1.55, 1.58),
    ("rowwise_adagrad", "decoupled", "fp16", 64): (1.31, 1.75, 1.25, 2.19),
    ("sgd", "none", "fp16", 16): (3.20, 5.11, 3.06, 4.70),
    ("sgd", "l2", "fp16", 16): (3.40, 4.65, 2.93, 4.03),
    ("sgd", "decoupled", "fp16", 16): (2.50, 4.98, 2.34, 4.55),
    ("adagrad", "none", "fp16", 16): (2.61, 4.25, 2.44, 3.26),
    ("adagrad", "l2", "fp16", 16): (2.55, 4.17, 2.35, 2.90),
    ("adagrad", "decoupled", "fp16", 16): (2.10, 4.27, 1.94, 3.24),
    ("rowwise_adagrad", "none", "fp16", 16): (3.58, 4.62, 3.19, 4.05),
    ("rowwise_adagrad", "l2", "fp16", 16): (3.34, 4.09, 2.92, 3.54),
    ("rowwise_adagrad", "decoupled", "fp16", 16): (2.71, 4.66, 2.51, 4.08),
}
_MEASURED_2026_11_25: Figures = {
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
MEASURED: Figures = _MEASURED_2026_11_27
"""The newest machine's figures (2026-11-27: a 2-core Xeon VM with AVX-512 FP16 / AMX, 480 MB L3)."""
MEASURED_EARLIER: tuple[tuple[str, Figures], ...] = (
    ("2026-11-25", _MEASURED_2026_11_25),
)
"""(date, figures) of the machines measured before `MEASURED`: auto takes fbgemm only where it won
on every one of them too, since which path wins depends on the CPU (compare the two tables)."""
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


def measured_rates(cfg: TableConfig, figures: Figures | None = None
                   ) -> tuple[int, tuple[float, float, float, float]] | None:
    """(the measured dim nearest cfg.dim, push M rows/s of (fbgemm, native C, fbgemm without C,
    torch)) for this table's optimizer, weight decay and row dtype in `figures` (default `MEASURED`);
    None if fbgemm has no CPU update for its optimizer."""
    if cfg.optimizer not in FBGEMM_OPTIMIZERS:
        return None
    # global decay: the kernel updates without decay (`embedding_ps.decay` catches rows up before it, the
    # same pass whichever kernel follows), so the figures without decay compare the two
    decay = cfg.weight_decay_mode if cfg.weight_decay and cfg.weight_decay_mode != "global" else "none"
    dim = min(MEASURED_DIMS, key=lambda d: abs(math.log(cfg.dim / d)))  # nearest on a log scale
    return dim, (MEASURED if figures is None else figures)[(cfg.optimizer, decay, cfg.dtype, dim)]


def _rivals(rates: tuple[float, float, float, float], native_loaded: bool) -> tuple[float, str, float]:
    """(fbgemm's rate, the other path's name, its rate) of one measurement."""
    fbgemm, native_c, fbgemm_pure, plain = rates
    if native_loaded:
        return fbgemm, "native C", native_c
    return fbgemm_pure, "torch", plain   # without the C library both run the numpy id map


def auto_kernel(cfg: TableConfig, native_loaded: bool) -> tuple[str, str]:
    """("fbgemm" or "native", why) for a table with kernel "auto"; `native_loaded`: the C library is.
    fbgemm only where it measured >= AUTO_MARGIN x the other path on every machine measured."""
    found = measured_rates(cfg)
    if found is None:
        return "native", f"fbgemm has no CPU {cfg.optimizer} update"
    dim, rates = found
    fbgemm, other, rate = _rivals(rates, native_loaded)
    decay = cfg.weight_decay_mode if cfg.weight_decay else "no"
    why = (f"{cfg.optimizer}, {decay} weight decay, {cfg.dtype} d{dim}: fbgemm {fbgemm:.2f}M vs {other} "
           f"{rate:.2f}M rows/s")
    if fbgemm < AUTO_MARGIN * rate:
        return "native", why
    for date, figures in MEASURED_EARLIER:
        fb, _, r = _rivals(measured_rates(cfg, figures)[1], native_loaded)
        if fb < AUTO_MARGIN * r:
            return "native", f"{why}, but {fb:.2f}M vs {r:.2f}M on the {date} machine"
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
