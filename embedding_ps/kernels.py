"""fbgemm's fused CPU embedding update, behind `TableConfig.kernel = "fbgemm"`.

The only module of the package that imports fbgemm_gpu. It calls the CPU backward op of
fbgemm's table-batched embedding (TBE) directly, with one table whose rows are our slot-major
`weights` [C, D] and one bag per unique slot (SUM pooling, bag size 1), so the op's fused
EXACT_SGD / EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD update writes our rows and optimizer state in
place. The plain-torch equivalents are `optim._sgd` / `_adagrad` / `_rowwise_adagrad` (and the
one-row `optim.reference_update`); tests check the two paths agree.

Measured (`benchmarks/ps_table.py --kernels`: push of 100k unique rows of d64 into a 2M-row
table, 1 thread, median): SGD torch 4.5M rows/s vs fbgemm 3.1M; row-wise Adagrad torch 3.2M vs
fbgemm 1.4M (a standalone call of the op alone: ~55-65 ms vs ~17-20 ms for the torch update).
The op sorts and transposes indices for general pooled bags, work a shard's unique-row update
does not need. So torch is the default and this is the option, tested equal.
"""

from __future__ import annotations

import math

import torch

from embedding_ps.config import TableConfig

try:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    _IMPORT_ERROR: Exception | None = None
except Exception as e:  # pragma: no cover - depends on the install
    _IMPORT_ERROR = e

_HOST = 3  # fbgemm_gpu.split_table_batched_embeddings_ops_common.EmbeddingLocation.HOST
_SUM = 0  # PoolingMode.SUM


def fbgemm_available() -> bool:
    return _IMPORT_ERROR is None


def fbgemm_update(
    cfg: TableConfig, weights: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor, grads: torch.Tensor
) -> None:
    """The fused update of rows `slots` (int64 [U], unique) of weights [C, D] from grads float32 [U, D]."""
    if _IMPORT_ERROR is not None:
        raise RuntimeError(f"table {cfg.name!r}: kernel='fbgemm' but fbgemm_gpu failed to import: {_IMPORT_ERROR}")
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
