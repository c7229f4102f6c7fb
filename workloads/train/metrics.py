"""Throughput accounting: FLOPs per token, MFU, tokens/s, peak memory."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

from workloads.gpus import peak_bf16_flops

H100_BF16_DENSE_FLOPS = 989e12


def flops_per_token(*, n_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int,
                    frozen_params: int = 0) -> float:
    """Training FLOPs per token: 6N for the matmuls with the weights (forward 2N; backward 2N for
    the inputs' gradients and 2N for the weights', N counting the tied embedding once), less 2 per
    frozen weight, whose gradient is never formed (LoRA's base), plus 12 * L * H * Q * T for
    attention scores and values (H heads of dimension Q over a context of T). Recomputation under
    activation checkpointing is not model work and is not counted."""
    return 6.0 * n_params - 2.0 * frozen_params + 12.0 * n_layers * n_heads * head_dim * seq_len


def mfu(*, tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization of one device: achieved model FLOP/s over its peak."""
    return tokens_per_s * flops_per_token / peak_flops


def device_peak_flops(device: torch.device, *, configured: Optional[float] = None) -> Optional[float]:
    """The dense bf16 peak MFU is reported against: `configured` (TrainConfig.peak_flops) when set,
    else the CUDA device's own by its name (workloads/gpus.py); None on CPU and on a GPU the table
    does not know."""
    if device.type != "cuda":
        return None
    return configured or peak_bf16_flops(torch.cuda.get_device_name(device))


def device_mfu(
    device: torch.device, *, tokens_per_s: float, flops_per_token: float, peak_flops: Optional[float]
) -> float | None:
    """MFU rounded for reporting on CUDA; None on CPU, which has no meaningful bf16 peak, and
    without a peak (a GPU workloads/gpus.py does not know)."""
    if device.type != "cuda" or peak_flops is None:
        return None
    return round(mfu(tokens_per_s=tokens_per_s, flops_per_token=flops_per_token, peak_flops=peak_flops), 4)


def tokens_per_s(*, tokens: float, seconds: float) -> float:
    """Tokens one device processed per second."""
    return tokens / seconds if seconds > 0 else 0.0


def peak_host_memory_gib() -> float:
    """The process's peak resident set so far."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def memory_in_use_gib(device: torch.device) -> float:
    """Memory allocated by tensors on a CUDA device now; on CPU the process's resident set now (what
    a stability check follows step over step: a peak only rises)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return peak_host_memory_gib()
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory allocated by tensors on a CUDA device; on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_host_memory_gib()
