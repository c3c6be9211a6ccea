"""The one "reduce over the ranks, or do nothing in one process" helper of recsys.

    total = all_reduce(torch.tensor([x]))                       # sum over every rank (float64 [1])
    fewest = all_reduce(torch.tensor([n]), dist.ReduceOp.MIN)   # the smallest n of any rank

Without an initialized process group (or with one rank) the result is a copy of the input, so
callers need no `if distributed:` of their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed(group: dist.ProcessGroup | None = None) -> bool:
    """Whether a process group of more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """NCCL only reduces CUDA tensors; gloo reduces CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, *,
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`t` reduced element-wise over the ranks of `group` with `op` (a new CPU tensor; `t` is left as it is)."""
    if not is_distributed(group):
        return t.detach().to("cpu", copy=True)
    buf = t.to(collective_device(group), copy=True)
    dist.all_reduce(buf, op=op, group=group)
    return buf.cpu()


__all__ = ["all_reduce", "collective_device", "is_distributed"]
