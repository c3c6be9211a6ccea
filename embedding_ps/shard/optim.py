"""Sparse optimizers applied on a shard: SGD, Adagrad, row-wise Adagrad, lazy Adam, FTRL-Proximal.

Every optimizer updates only the rows it is given. `apply_update` is the vectorized path: it
receives unique slots [U] with gradients [U, D] that were already summed per id (the update is
non-linear, so duplicate ids must be merged first: `native.merge_rows`). `tests/optim_reference.py`
writes the same math for one row at a time (the tests' oracle).

Math per row (g: the summed gradient [D], w: the row [D]; all in fp32):

    sgd              w -= lr * g
    adagrad          h += g*g;                   w -= lr * g / (sqrt(h) + eps)        (h: [D])
    rowwise_adagrad  h += mean(g*g);             w -= lr * g / (sqrt(h) + eps)        (h: scalar)
    adam (lazy)      t += 1; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g*g
                     w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)      (t: this row's updates)
    ftrl             n' = n + g*g; sigma = (sqrt(n') - sqrt(n)) / lr; z += g - sigma * w; n = n'
                     w = 0 if |z| <= l1 else -(z - sign(z) l1) / ((ftrl_beta + sqrt(n)) / lr + l2)

Weight decay (`weight_decay` wd > 0; sgd, adagrad, rowwise_adagrad, adam; the three modes:
docs/models.md, "Sparse regularization"): `l2` (g = g + wd * w, fbgemm TBE's WeightDecayMode.L2) and
`decoupled` (w = (1 - lr * wd) * w first, WeightDecayMode.DECOUPLED) run here, on the touched rows;
`global` rows are caught up by `embedding_ps.shard.decay` before the update, which then runs with
wd = 0 (`TableShard.ucfg`; the tests' one-row oracle leaves it to its caller too).

The two Adagrads are fbgemm's EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD: the
row-wise accumulator adds the mean over the row of g*g, and eps is added after the sqrt.
FTRL is McMahan et al. 2013 (per coordinate, alpha = lr); it starts from the row's current w,
so a random init is carried into z by the first update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedding_ps.shard import kernels
from embedding_ps.wire.config import TableConfig


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One per-row optimizer state tensor: [C] (`per_coordinate=False`) or [C, D]."""

    name: str
    per_coordinate: bool
    dtype: torch.dtype
    fill: str  # "zero" or "initial_accumulator"


_SPECS: dict[str, tuple[StateSpec, ...]] = {
    "sgd": (),
    "adagrad": (StateSpec("sum_sq", True, torch.float32, "initial_accumulator"),),
    "rowwise_adagrad": (StateSpec("sum_sq", False, torch.float32, "initial_accumulator"),),
    "adam": (
        StateSpec("exp_avg", True, torch.float32, "zero"),
        StateSpec("exp_avg_sq", True, torch.float32, "zero"),
        StateSpec("steps", False, torch.int32, "zero"),
    ),
    "ftrl": (StateSpec("z", True, torch.float32, "zero"), StateSpec("n", True, torch.float32, "zero")),
}


def state_specs(cfg: TableConfig) -> tuple[StateSpec, ...]:
    """The per-row state tensors of this table's optimizer."""
    return _SPECS[cfg.optimizer]


def fill_value(cfg: TableConfig, spec: StateSpec) -> float:
    return cfg.initial_accumulator if spec.fill == "initial_accumulator" else 0.0


# ---------------------------------------------------------------------------- vectorized path
def apply_update(cfg: TableConfig, weights: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor,
                 grads: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """Update rows `slots` (int64 [U], unique) of weights [C, D] and state in place from grads float32 [U, D].

    `grads` is only read. `scratch` (float32 [U, D], optional) is a buffer the update may
    overwrite, so a shard can reuse one instead of allocating [U, D] per call.
    """
    if slots.numel() == 0:
        return
    if cfg.weight_decay and cfg.weight_decay_mode == "l2":     # grads + wd * w (a new tensor: `grads` is only read)
        grads = weights.index_select(0, slots).float().mul_(cfg.weight_decay).add_(grads)
    decay = 1.0 - cfg.lr * cfg.weight_decay if cfg.weight_decay_mode == "decoupled" else 1.0   # rows shrink first
    if cfg.kernel == "fbgemm":
        if decay != 1.0:
            _add_rows(weights, slots, None, decay)
        kernels.fbgemm_update(cfg, weights, state, slots, grads)
        return
    if scratch is None:
        scratch = torch.empty_like(grads)
    delta = _UPDATES[cfg.optimizer](cfg, weights, state, slots, grads, scratch)
    if delta is not None:
        _add_rows(weights, slots, delta, decay)


def _add_rows(weights: torch.Tensor, slots: torch.Tensor, delta: torch.Tensor | None, decay: float) -> None:
    """weights[slots] = weights[slots] * decay + delta (float32 [U, D], or None: nothing added); fp16
    rows are updated in fp32 and rounded once."""
    if decay == 1.0 and weights.dtype == torch.float32 and delta is not None:
        weights.index_add_(0, slots, delta)  # pre-scaled delta: index_add_(alpha=) is slow on CPU
        return
    rows = weights.index_select(0, slots).float()
    if decay != 1.0:
        rows.mul_(decay)
    if delta is not None:
        rows.add_(delta)
    weights.index_copy_(0, slots, rows.to(weights.dtype))


# Each update: (cfg, weights [C, D], state, slots int64 [U], g float32 [U, D] read-only, scratch [U, D]) -> the
# rows' delta [U, D] (`apply_update` adds it to the shrunk rows), or None: ftrl writes its rows itself.
def _sgd(cfg: TableConfig, w: torch.Tensor, st: dict, slots: torch.Tensor, g: torch.Tensor,
         tmp: torch.Tensor) -> torch.Tensor:
    return torch.mul(g, -cfg.lr, out=tmp)


def _adagrad(cfg: TableConfig, w: torch.Tensor, st: dict, slots: torch.Tensor, g: torch.Tensor,
             tmp: torch.Tensor) -> torch.Tensor:
    h = torch.index_select(st["sum_sq"], 0, slots, out=tmp).addcmul_(g, g)  # [U, D]
    st["sum_sq"].index_copy_(0, slots, h)
    return torch.div(g, h.sqrt_().add_(cfg.eps), out=tmp).mul_(-cfg.lr)


def _rowwise_adagrad(cfg: TableConfig, w: torch.Tensor, st: dict, slots: torch.Tensor, g: torch.Tensor,
                     tmp: torch.Tensor) -> torch.Tensor:
    # mean of g*g over the row: ||g||^2 / D (vector_norm is one pass, no [U, D] temporary)
    g_sq_mean = torch.linalg.vector_norm(g, dim=1).square_().div_(g.shape[1])  # [U]
    h = st["sum_sq"].index_select(0, slots).add_(g_sq_mean)
    st["sum_sq"].index_copy_(0, slots, h)
    mult = h.sqrt_().add_(cfg.eps).reciprocal_().mul_(-cfg.lr)  # [U]
    return torch.mul(g, mult.unsqueeze(1), out=tmp)


def _adam(cfg: TableConfig, w: torch.Tensor, st: dict, slots: torch.Tensor, g: torch.Tensor,
          tmp: torch.Tensor) -> torch.Tensor:
    b1, b2 = cfg.beta1, cfg.beta2
    t = st["steps"].index_select(0, slots).add_(1)  # int32 [U]
    st["steps"].index_copy_(0, slots, t)
    m = st["exp_avg"].index_select(0, slots).mul_(b1).add_(g, alpha=1.0 - b1)
    v = st["exp_avg_sq"].index_select(0, slots).mul_(b2).addcmul_(g, g, value=1.0 - b2)
    st["exp_avg"].index_copy_(0, slots, m)
    st["exp_avg_sq"].index_copy_(0, slots, v)
    t64 = t.to(torch.float64).unsqueeze(1)
    bc1 = (1.0 - torch.pow(b1, t64)).to(torch.float32)  # [U, 1]
    bc2 = (1.0 - torch.pow(b2, t64)).to(torch.float32)
    denom = v.div_(bc2).sqrt_().add_(cfg.eps)
    return m.div_(bc1).div_(denom).mul_(-cfg.lr)


def _ftrl(cfg: TableConfig, w: torch.Tensor, st: dict, slots: torch.Tensor, g: torch.Tensor, tmp: torch.Tensor) -> None:
    rows = w.index_select(0, slots).float()  # [U, D]
    z = st["z"].index_select(0, slots)
    n = st["n"].index_select(0, slots)
    n_new = torch.addcmul(n, g, g)
    sqrt_n_new = n_new.sqrt()
    sigma = (sqrt_n_new - n.sqrt_()).div_(cfg.lr)
    z.add_(g).sub_(sigma.mul_(rows))
    st["z"].index_copy_(0, slots, z)
    st["n"].index_copy_(0, slots, n_new)
    shrunk = z - torch.sign(z) * cfg.ftrl_l1
    new_w = shrunk.neg_().div_(sqrt_n_new.add_(cfg.ftrl_beta).div_(cfg.lr).add_(cfg.ftrl_l2))
    new_w.masked_fill_(z.abs() <= cfg.ftrl_l1, 0.0)
    w.index_copy_(0, slots, new_w.to(w.dtype))


_UPDATES = {"sgd": _sgd, "adagrad": _adagrad, "rowwise_adagrad": _rowwise_adagrad, "adam": _adam, "ftrl": _ftrl}
