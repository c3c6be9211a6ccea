"""The shard optimizers' test oracle: one row at a time in plain torch (`reference_update`) and a
whole table of such rows (`ReferenceTable`), what the vectorized `embedding_ps.shard.optim` updates
and the C `ps_update` are compared with."""

from __future__ import annotations

import torch

from embedding_ps.shard.optim import fill_value, state_specs
from embedding_ps.wire.config import TableConfig


def reference_update(cfg: TableConfig, w: torch.Tensor, state: dict[str, torch.Tensor], g: torch.Tensor) -> None:
    """One row, in place: w float32 [D], state {name: [D] or [] tensor}, g float32 [D] (already summed)."""
    lr, eps = cfg.lr, cfg.eps
    if cfg.weight_decay and cfg.weight_decay_mode == "l2":
        g = g + cfg.weight_decay * w
    elif cfg.weight_decay and cfg.weight_decay_mode == "decoupled":
        w *= 1.0 - lr * cfg.weight_decay
    if cfg.optimizer == "sgd":
        w -= lr * g
    elif cfg.optimizer == "adagrad":
        state["sum_sq"] += g * g
        w -= lr * g / (torch.sqrt(state["sum_sq"]) + eps)
    elif cfg.optimizer == "rowwise_adagrad":
        state["sum_sq"] += (g * g).sum() / g.shape[0]
        w -= lr * g / (torch.sqrt(state["sum_sq"]) + eps)
    elif cfg.optimizer == "adam":
        state["steps"] += 1
        t = int(state["steps"])
        state["exp_avg"] = cfg.beta1 * state["exp_avg"] + (1 - cfg.beta1) * g
        state["exp_avg_sq"] = cfg.beta2 * state["exp_avg_sq"] + (1 - cfg.beta2) * g * g
        m_hat = state["exp_avg"] / (1 - cfg.beta1**t)
        v_hat = state["exp_avg_sq"] / (1 - cfg.beta2**t)
        w -= lr * m_hat / (torch.sqrt(v_hat) + eps)
    elif cfg.optimizer == "ftrl":
        n_new = state["n"] + g * g
        sigma = (torch.sqrt(n_new) - torch.sqrt(state["n"])) / lr
        state["z"] += g - sigma * w
        state["n"] = n_new
        z = state["z"]
        new_w = -(z - torch.sign(z) * cfg.ftrl_l1) / ((cfg.ftrl_beta + torch.sqrt(n_new)) / lr + cfg.ftrl_l2)
        w.copy_(torch.where(z.abs() <= cfg.ftrl_l1, torch.zeros_like(w), new_w))
    else:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


class ReferenceTable:
    """A whole table in plain torch, one row at a time: {key: (row [D], state)}.

    `push` sums duplicate keys' gradients in arrival order, creates missing rows from `init`
    (a function key -> float32 [D]), and applies `reference_update`; no admission or eviction.
    """

    def __init__(self, cfg: TableConfig, init) -> None:
        self.cfg, self.init, self.rows = cfg, init, {}

    def _new_row(self, key: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d = self.cfg.dim
        state = {
            s.name: torch.full((d,) if s.per_coordinate else (), fill_value(self.cfg, s), dtype=s.dtype)
            for s in state_specs(self.cfg)
        }
        return self.init(key).clone().to(torch.float32), state

    def push(self, keys: torch.Tensor, grads: torch.Tensor) -> None:
        summed: dict[int, torch.Tensor] = {}
        for k, g in zip(keys.tolist(), grads):
            summed[k] = summed[k] + g if k in summed else g.clone()
        for k, g in summed.items():
            if k not in self.rows:
                self.rows[k] = self._new_row(k)
            w, state = self.rows[k]
            reference_update(self.cfg, w, state, g)
            if self.cfg.dtype == "fp16":
                w.copy_(w.half().float())

    def pull(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.rows[k][0] if k in self.rows else self.init(k) for k in keys.tolist()])
