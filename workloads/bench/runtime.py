"""Process-group setup, device choice, OOM detection and memory release shared by the benchmarks."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=4)
"""An out-of-memory on some ranks only leaves the others waiting in a collective; this bounds the
wait so the run fails well inside a 10-minute command instead of hanging to its end."""


@dataclass(frozen=True, kw_only=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    """This rank's CUDA device, or the CPU when no GPU is visible (gloo)."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def init_runtime() -> Runtime:
    """Join the process group torchrun describes (env://), or a one-rank group without torchrun."""
    # NVLink multicast (NVLS) stays off unless the caller sets it: the recorded figures are
    # measured without it, so that runs compare.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "RANK" in os.environ:
            # No device_id, as Ray Train creates its group: NCCL starts at the first collective.
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT
            )
    return Runtime(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device=device,
    )


def nccl_version() -> str | None:
    """The NCCL version torch was built with, as "2.27.5", or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def is_out_of_memory(error: BaseException) -> bool:
    """True when the error, or one it was raised from, is a device out-of-memory.

    torch.compile and NCCL wrap the allocator's OutOfMemoryError in their own exception types,
    so the whole cause/context chain is searched, by type and then by the allocator's message.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError) or "CUDA out of memory" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def release_memory(device: torch.device) -> None:
    """Drop everything a finished (or failed) run left behind before the next one starts."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def any_rank(flag: bool, *, device: torch.device) -> bool:
    """True on every rank when `flag` is true on at least one rank."""
    value = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def max_over_ranks(value: float, *, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def mean_over_ranks(values: torch.Tensor) -> list[float]:
    """Element-wise mean over ranks, read back to the host (gloo has no AVG reduction)."""
    total = values.detach().to(torch.float64).flatten().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total / dist.get_world_size()).tolist()
