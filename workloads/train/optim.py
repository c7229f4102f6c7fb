"""AdamW on the fp32 master weights, its learning-rate schedule, and gradient clipping."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from workloads.train.config import TrainConfig


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of 1-based `step`: linear warmup to `peak` over `warmup_steps`, then cosine
    decay to peak * min_lr_ratio at `total_steps`."""
    if step <= warmup_steps:
        return peak * step / warmup_steps
    decay_steps = total_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    floor = peak * min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule(cfg: TrainConfig, step: int) -> float:
    return lr_at(
        step, peak=cfg.lr, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio
    )


def build_optimizer(model: nn.Module, cfg: TrainConfig, *, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices only; fused AdamW on CUDA (one kernel for all parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(
        groups, lr=schedule(cfg, 1), betas=cfg.betas, eps=1e-8, fused=fused, foreach=None if fused else True
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: nn.Module, *, max_norm: float) -> torch.Tensor:
    """The global gradient norm (before clipping) as a device tensor; no host sync.

    Under FSDP2 the gradients are DTensor shards, so the norm is a partial value until reduced
    across ranks by `full_tensor()`.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in model.parameters() if p.grad is not None], max_norm, total, foreach=True
        )
    return total
