"""Pod sizes for the Ray head and workers, from the instance-type table.

A Ray worker takes a whole GPU node: every GPU and EFA interface, and the CPU and memory the kubelet
leaves allocatable minus a budget for the DaemonSets (VPC CNI, kube-proxy, device plugins, Pod
Identity agent). Requests equal limits (Guaranteed QoS), so a pod that asks for more than the node
can give stays Pending: these numbers err on the small side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.instance_types import InstanceType

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

# The kernel and firmware keep a few percent of the nominal instance memory from the kubelet.
_UNREPORTED_MEMORY_FRACTION = 0.04
_EVICTION_THRESHOLD_GIB = 100 / 1024
_DAEMONSET_CPU = 1.0
_DAEMONSET_MEMORY_GIB = 2.0


@dataclass(frozen=True, kw_only=True)
class PodSize:
    cpu: int
    """Whole CPUs: Ray rounds a fractional CPU limit down anyway."""
    memory_gib: int
    gpus: int = 0
    efa_interfaces: int = 0

    def resources(self) -> dict[str, str]:
        """The Kubernetes quantities, used for both requests and limits."""
        quantities = {"cpu": str(self.cpu), "memory": f"{self.memory_gib}Gi"}
        if self.gpus:
            quantities[GPU_RESOURCE] = str(self.gpus)
        if self.efa_interfaces:
            quantities[EFA_RESOURCE] = str(self.efa_interfaces)
        return quantities


def max_pods(instance: InstanceType) -> int:
    """The pods-per-node cap EKS recommends (110 below 30 vCPUs, else 250): an upper bound for
    the memory the kubelet reserves."""
    return 110 if instance.vcpus < 30 else 250


def kube_reserved_cpu(instance: InstanceType) -> float:
    """CPU the EKS AMI reserves for the kubelet and runtime: 6% of the first core, 1% of the
    second, 0.5% of the next two and 0.25% of the rest."""
    v = instance.vcpus
    return (0.06 * min(v, 1) + 0.01 * min(max(v - 1, 0), 1) + 0.005 * min(max(v - 2, 0), 2)
            + 0.0025 * max(v - 4, 0))


def kube_reserved_memory_gib(instance: InstanceType) -> float:
    """Memory the EKS AMI reserves for the kubelet and runtime: 255 MiB + 11 MiB per pod."""
    return (255 + 11 * max_pods(instance)) / 1024


def allocatable(instance: InstanceType) -> tuple[float, float]:
    """(CPUs, GiB) the kubelet offers to pods on one node of this type."""
    cpu = instance.vcpus - kube_reserved_cpu(instance)
    memory = (instance.memory_gib * (1 - _UNREPORTED_MEMORY_FRACTION)
              - kube_reserved_memory_gib(instance) - _EVICTION_THRESHOLD_GIB)
    return cpu, memory


def worker_pod_size(instance: InstanceType) -> PodSize:
    """One Ray worker per GPU node, taking the whole node."""
    assert instance.gpus and instance.efa_interfaces, f"{instance.name} is not an EFA GPU type"
    cpu, memory = allocatable(instance)
    return PodSize(cpu=math.floor(cpu - _DAEMONSET_CPU),
                   memory_gib=math.floor(memory - _DAEMONSET_MEMORY_GIB),
                   gpus=instance.gpus, efa_interfaces=instance.efa_interfaces)


def head_pod_size(instance: InstanceType) -> PodSize:
    """The Ray head takes half the system node; the other half runs the KubeRay operator,
    CoreDNS and the DaemonSets."""
    return PodSize(cpu=max(1, instance.vcpus // 2), memory_gib=max(2, instance.memory_gib // 2))
