"""The shard's update kernels: `TableConfig.kernel` resolved per table, and fbgemm's fused CPU update.

`resolve` turns a table's kernel into "native" (`csrc/ps.c`'s ps_update for sgd, adagrad and
rowwise_adagrad when the C library is loaded, else the vectorized torch of `optim.py`) or "fbgemm"
(`fbgemm_update` below: the same three) once, when the table is made (`TableShard.__init__`), so the
push path only sees those two (which to pick, and the old names "auto" / "torch": docs/performance.md, "The
update kernel of a table"; BENCHMARKS.md, "benchmarks/ps_table.py").

`fbgemm_update` calls the CPU backward op of fbgemm's table-batched embedding (TBE) directly,
with one table whose rows are our slot-major `weights` [C, D] and one bag per unique slot (SUM
pooling, bag size 1), so the op's fused EXACT_SGD / EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD
update writes our rows and optimizer state in place. The plain-torch equivalents are
`optim._sgd` / `_adagrad` / `_rowwise_adagrad` (and the one-row `tests/optim_reference.reference_update`); tests
check that every path agrees with them. This is the only module of the package that imports
fbgemm_gpu, and only when a table uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from embedding_ps import native
from embedding_ps.wire.config import TableConfig

_HOST = 3  # fbgemm_gpu.split_table_batched_embeddings_ops_common.EmbeddingLocation.HOST
_SUM = 0  # PoolingMode.SUM


@functools.cache
def fbgemm_error() -> Exception | None:
    """None if fbgemm_gpu imports (imported on first call, only where a table uses it), else the error."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
    except Exception as e:  # pragma: no cover - depends on the install
        return e
    return None


def fbgemm_available() -> bool:
    return fbgemm_error() is None


def resolve(cfg: TableConfig, native_loaded: bool) -> tuple[TableConfig, str]:
    """(cfg with the concrete kernel "native" or "fbgemm", a line naming the update that runs); a resolved
    config resolves to itself. `native_loaded`: the C library is loaded."""
    if cfg.kernel == "fbgemm":
        return cfg, "fbgemm (configured)"
    if not native_loaded:
        body = "vectorized torch: C library not loaded"
    elif cfg.optimizer not in native.OPTIMIZERS:
        body = f"vectorized torch: no C {cfg.optimizer} update"
    else:
        body = "C"
    if cfg.kernel != "native":
        body += f"; {cfg.kernel!r} is an old name of 'native'"
    return dataclasses.replace(cfg, kernel="native"), f"native ({body})"


def fbgemm_update(cfg: TableConfig, weights: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor,
                  grads: torch.Tensor) -> None:
    """The fused update (without weight decay) of rows `slots` (int64 [U], unique) of weights [C, D] from
    grads float32 [U, D]."""
    if fbgemm_error() is not None:
        raise RuntimeError(f"table {cfg.name!r}: kernel='fbgemm' but fbgemm_gpu failed to import: {fbgemm_error()}")
    c, d = weights.shape
    # weight decay is applied by the caller around the op (`optim.apply_update`): of the CPU ops only
    # rowwise_adagrad takes weight_decay / weight_decay_mode arguments, and fbgemm-gpu-cpu 1.8.0 ignores
    # them (measured: rows equal to weight_decay = 0 in both modes), so none is passed
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
