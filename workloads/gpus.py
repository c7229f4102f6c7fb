"""The GPUs the stack's instance types carry: memory, dense bf16 peak and GPU-to-GPU bandwidth.

One table for the plan, the memory model and the MFU a run reports. It lives in the `workloads`
package because that package is what a job uploads: the training loop finds its own GPU here by
the device name CUDA reports, and infra/instance_types.py names each instance type's GPU by its
key. A GPU not in this table (or one without a published peak) reports no MFU rather than one
computed against another GPU's peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """What the memory model, the step-time model, the plan and the loop's MFU need of one GPU."""

    model: str
    """The name EC2's DescribeInstanceTypes gives it (GpuInfo.Gpus[].Name)."""
    memory_mib: int
    """Total memory as `nvidia-smi --query-gpu=memory.total` reports it (the CUDA context comes out
    of it): a little under the datasheet's GB for GDDR cards, exactly its GiB for HBM ones."""
    peak_bf16_flops: Optional[float]
    """Dense bf16 tensor FLOP/s by the datasheet (half the "with sparsity" figure); None where
    NVIDIA publishes none (A10G, AWS's own variant of the A10)."""
    link_gbps: float
    """GPU-to-GPU bandwidth inside a node, per direction, GB/s: PCIe Gen4 x16 (32) for the g
    families, NVLink for the p families (A100 600 GB/s, H100 and H200 900 GB/s, B200 1.8 TB/s,
    each both ways)."""
    device_names: tuple[str, ...]
    """What `torch.cuda.get_device_name()` (nvidia-smi's name) says on the AWS part: matched
    exactly, so that a PCIe or NVL variant with another peak is not taken for it."""


GPUS: dict[str, Gpu] = {
    g.model: g
    for g in (
        Gpu(model="L4", memory_mib=23034, peak_bf16_flops=121e12, link_gbps=32.0,
            device_names=("NVIDIA L4",)),
        Gpu(model="A10G", memory_mib=23028, peak_bf16_flops=None, link_gbps=32.0,
            device_names=("NVIDIA A10G",)),
        Gpu(model="L40S", memory_mib=46068, peak_bf16_flops=362e12, link_gbps=32.0,
            device_names=("NVIDIA L40S",)),
        Gpu(model="A100", memory_mib=40960, peak_bf16_flops=312e12, link_gbps=300.0,
            device_names=("NVIDIA A100-SXM4-40GB",)),
        Gpu(model="H100", memory_mib=81559, peak_bf16_flops=989e12, link_gbps=450.0,
            device_names=("NVIDIA H100 80GB HBM3",)),
        Gpu(model="H200", memory_mib=143771, peak_bf16_flops=989e12, link_gbps=450.0,
            device_names=("NVIDIA H200",)),
        Gpu(model="B200", memory_mib=183359, peak_bf16_flops=2250e12, link_gbps=900.0,
            device_names=("NVIDIA B200",)),
    )
}
"""H200 and B200 memory as nvidia-smi reports it on this project's H200 (docs/gpu) and on B200
hosts; their dense bf16 peaks from NVIDIA's H200 and HGX B200 datasheets (the H200 has the H100
SXM's tensor cores)."""


def gpu_named(device_name: str) -> Optional[Gpu]:
    """The table's GPU whose CUDA device name this is, None for a device it does not know."""
    return next((g for g in GPUS.values() if device_name.strip() in g.device_names), None)


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of the GPU with this device name: None when the table does not know the
    GPU or NVIDIA publishes no peak for it."""
    gpu = gpu_named(device_name)
    return None if gpu is None else gpu.peak_bf16_flops
