"""All-reduce bus bandwidth, as nccl-tests define it: busbw = algbw * 2(n-1)/n.

algbw is bytes / time. A ring all-reduce moves 2(n-1)/n of the buffer over each rank's slowest
link, so busbw is comparable with the link's hardware bandwidth whatever the rank count. Times are
the slowest rank's (a MAX all-reduce), so every rank returns the same figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class AllReduceBandwidth:
    size_bytes: int
    world_size: int
    seconds: float
    """Mean time of one all-reduce on the slowest rank."""
    algbw_gbps: float
    busbw_gbps: float


def bus_bandwidth_gbps(*, size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) for one all-reduce of `size_bytes` taking `seconds`."""
    if seconds <= 0:
        raise ValueError(f"all-reduce time must be positive, got {seconds}")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def measure_allreduce(
    *,
    device: torch.device,
    message_bytes: int,
    warmup: int = 5,
    iters: int = 20,
    dtype: torch.dtype = torch.float32,
    group: Optional[dist.ProcessGroup] = None,
) -> AllReduceBandwidth:
    """Time `iters` all-reduces of `message_bytes` after `warmup` untimed ones (which also make NCCL
    open its connections). Every rank of `group` must call it with the same arguments."""
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={warmup} iters={iters}")
    element = torch.tensor([], dtype=dtype).element_size()
    numel = max(1, message_bytes // element)
    size = numel * element
    # Zeros: repeated sums of anything else overflow to inf on large worlds.
    buf = torch.zeros(numel, dtype=dtype, device=device)
    world = dist.get_world_size(group)
    for _ in range(warmup):
        dist.all_reduce(buf, group=group)
    seconds = _timed(buf, iters=iters, device=device, group=group) / iters
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    seconds = float(slowest.item())
    algbw, busbw = bus_bandwidth_gbps(size_bytes=size, seconds=seconds, world_size=world)
    return AllReduceBandwidth(size_bytes=size, world_size=world, seconds=seconds, algbw_gbps=algbw, busbw_gbps=busbw)


def _timed(buf: torch.Tensor, *, iters: int, device: torch.device, group: Optional[dist.ProcessGroup]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_reduce(buf, group=group)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    dist.barrier(group=group)
    began = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf, group=group)
    return time.perf_counter() - began


def measure_busbw(*, device: torch.device, message_bytes: int, warmup: int = 5, iters: int = 20) -> float:
    """Bus bandwidth in GB/s of an all-reduce of `message_bytes` over the default process group."""
    return measure_allreduce(device=device, message_bytes=message_bytes, warmup=warmup, iters=iters).busbw_gbps
