"""The dense bf16 matmul rate this device reaches, measured in the same run as the training
benchmark: MFU against it separates "the GPU is slower than its datasheet" from "the loop is slow"."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class MatmulRate:
    size: int
    """n of the n x n x n product."""
    dtype: str
    repeats: int
    median_s: float
    """Median seconds of one product."""
    flops: float
    """2 n^3 / median_s: floating-point operations per second."""


def measure_matmul(
    *, device: torch.device, size: int = 8192, dtype: torch.dtype = torch.bfloat16,
    warmup: int = 5, repeats: int = 20,
) -> MatmulRate:
    """Time `repeats` products one by one (CUDA events on the GPU) after `warmup` untimed ones."""
    if size < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"matmul size and repeats must be >= 1 and warmup >= 0, got {size}, {repeats}, {warmup}")
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    out = torch.empty(size, size, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    seconds = _time_cuda(a, b, out, repeats) if device.type == "cuda" else _time_host(a, b, out, repeats)
    median_s = statistics.median(seconds)
    return MatmulRate(
        size=size, dtype=str(dtype).removeprefix("torch."), repeats=repeats,
        median_s=median_s, flops=2 * size**3 / median_s,
    )


def _time_cuda(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, repeats: int) -> list[float]:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    events[0].record()
    for end in events[1:]:
        torch.matmul(a, b, out=out)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1000.0 for start, end in zip(events, events[1:])]


def _time_host(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        seconds.append(time.perf_counter() - start)
    return seconds
