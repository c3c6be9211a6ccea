"""The dense side of a trainer: DDP wrapping, comm hooks, optimizer and LR schedule."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from recsys import eager_optim
from recsys.config import TrainConfig

logger = logging.getLogger(__name__)


def _bf16_hook(state, bucket):  # no annotations: DDP rejects the string form `from __future__` makes
    """Cast a bucket (dist.GradBucket) to bf16, allreduce over the default group (`state` is None),
    cast back and average; returns a Future.

    torch's stock bf16_compress_hook refuses gloo (it needs NCCL); this one works on both.
    """
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(decompress)


def wrap_ddp(model: nn.Module, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """DDP over the default process group with the configured comm hook (no-op for 1 process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return model
    # PowerSGD deadlocks on gloo when gradients span several buckets (PLATFORM-NOTES): one bucket.
    bucket_cap_mb = 1 << 14 if cfg.comm_hook == "powersgd" and dist.get_backend() == "gloo" else 25
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=bucket_cap_mb, broadcast_buffers=has_state_buffers(model))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

    if cfg.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif cfg.comm_hook == "bf16":
        ddp.register_comm_hook(None, _bf16_hook)
    elif cfg.comm_hook == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2, random_seed=cfg.seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return ddp


def has_state_buffers(model: nn.Module) -> bool:
    """Whether the model has persistent buffers (state such as two_tower's frequency counts, which DDP
    then broadcasts from rank 0 before every forward, as by default). Non-persistent buffers are
    derived from the config (DLRM's triu indices, DIN's kept features), equal on every rank: with only
    those, DDP skips that broadcast, one collective and one sync point of the ranks a step (TorchRec's
    DMP wraps its dense part with broadcast_buffers=False too)."""
    persistent = model.state_dict().keys()
    return any(name in persistent for name, _ in model.named_buffers())


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The model's parameters as optimizer groups: weight matrices decayed by `weight_decay`, the 1-D
    parameters (Linear biases, norm gains and shifts, the linear terms' bias) not decayed.

    Shrinking a bias or a norm's gain towards 0 only shifts or rescales a layer's output, which the
    next layer undoes; the usual choice (BERT, nanoGPT) is to decay the weights that mix features.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The dense optimizer of `model` (`train.dense_optimizer`, `dense_lr`, `dense_weight_decay`: how each
    optimizer decays, docs/config.md): torch's classes, without the torch._dynamo import of their first
    use (`recsys.eager_optim`). Without weight decay one group of every parameter (the optimizer state
    layout of the checkpoints of runs without the option, which therefore load); with it, `param_groups`.
    """
    wd = cfg.dense_weight_decay
    params = param_groups(model, wd) if wd > 0 else list(model.parameters())
    if cfg.dense_optimizer == "adam":
        return eager_optim.AdamW(params, lr=cfg.dense_lr) if wd > 0 else eager_optim.Adam(params, lr=cfg.dense_lr)
    if cfg.dense_optimizer == "adagrad":
        return eager_optim.Adagrad(params, lr=cfg.dense_lr)
    return eager_optim.SGD(params, lr=cfg.dense_lr)


def lr_factor(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Multiplier of dense_lr at optimizer step `step`: linear warmup, then none/linear/cosine/step decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_decay == "step":          # gamma^k during the k-th lr_step_size steps after warmup
        return cfg.lr_gamma ** ((step - cfg.warmup_steps) // cfg.lr_step_size)
    if cfg.lr_decay == "none" or total_steps <= cfg.warmup_steps:
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.lr_decay == "linear":
        return 1.0 - frac
    return 0.5 * (1.0 + math.cos(math.pi * frac))


def build_scheduler(opt: torch.optim.Optimizer, cfg: TrainConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, total_steps))
