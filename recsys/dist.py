"""The collectives of recsys: reduce or gather over the ranks (on the backend's device), or do nothing in one
process: without an initialized process group (or with one rank) the result is a copy of the input, so
callers need no `if distributed:` of their own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether a process group of more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    """Wait until every rank gets here (nothing in one process)."""
    if is_distributed():
        dist.barrier()


def collective_device() -> torch.device:
    """NCCL only reduces CUDA tensors; gloo reduces CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """`t` reduced element-wise over the ranks with `op` (a new CPU tensor; `t` is left as it is)."""
    if not is_distributed():
        return t.detach().to("cpu", copy=True)
    buf = t.to(collective_device(), copy=True)
    dist.all_reduce(buf, op=op)
    return buf.cpu()


def all_gather_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """1-D tensor `t` of any length from every rank, in rank order, as CPU tensors (no pickling;
    padded to the longest for the collective, on `collective_device`). One process: [t]."""
    if not is_distributed():
        return [t.detach().cpu()]
    device = collective_device()
    n = torch.tensor([t.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    lens = [int(x.item()) for x in sizes]
    padded = torch.zeros(max(lens), dtype=t.dtype, device=device)        # all_gather needs equal sizes
    padded[: t.numel()] = t.to(device)
    parts = [torch.zeros_like(padded) for _ in lens]
    dist.all_gather(parts, padded)
    return [p[:k].cpu() for p, k in zip(parts, lens)]


__all__ = ["all_gather_parts", "all_reduce", "barrier", "collective_device", "is_distributed"]
