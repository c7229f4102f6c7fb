"""Pod sizes for the Ray head and workers, from the instance-type table and a model of what the
kubelet on an EKS AMI node offers to pods.

A Ray worker takes a whole GPU node: every GPU and EFA interface, the 2 MiB huge pages the stack
asks for (`gpuHugePagesMib`, 0 by default, below), and the CPU and memory the node has allocatable
less what the DaemonSets on it request. Requests equal limits
(Guaranteed QoS), so a pod that asks for more than the node can give stays Pending forever: these
numbers err on the small side.

Node allocatable, as the kubelet computes it from the EKS AMI's settings:

    allocatable = capacity - kube-reserved - eviction threshold - huge pages

- capacity: what the kernel reports as MemTotal, a few percent below the instance's nominal
  memory (firmware, the kernel's page tables); KERNEL_RESERVED_FRACTION is fitted to real nodes.
- kube-reserved: 255 MiB + 11 MiB per pod the node may run, and a CPU share that shrinks with
  each core (6% of the first, 1% of the second, 0.5% of the next two, 0.25% of the rest).
- eviction threshold: `memory.available<100Mi`.
- huge pages: a full EFA installation (its efa-config package) reserves 2 MiB pages at boot for
  libfabric (110 per vCPU, plus one), which leave the kubelet's memory and appear as
  `hugepages-2Mi` instead. The AL2023 NVIDIA AMI installs EFA with `--minimal` (kernel module and
  rdma-core only), so its nodes may reserve none: the model counts the full reservation against
  memory (the worker errs small), and its page count is the most a worker may ask for.

What is evidence and what is modelled is in docs/INFRA.md ("Node allocatable and worker size").
tests/test_infra_sizing.py checks the model against two published `kubectl describe node` outputs
(a p4de.24xlarge and a p5.48xlarge) and every GPU type of the table against its workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from infra.instance_types import InstanceType

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"

HUGE_PAGE_MIB = 2
KERNEL_RESERVED_FRACTION = 0.031
"""Share of the nominal memory that never reaches MemTotal. A published p4de.24xlarge node shows
3.08% and a p5.48xlarge 2.27%; the larger is used, so the model errs on the small side."""
EVICTION_HARD_MIB = 100
"""The EKS AMI's kubelet `evictionHard: memory.available<100Mi`."""
EFA_HUGE_PAGES_PER_VCPU = 110
"""2 MiB pages a full EFA installation reserves per vCPU at boot (plus one page), for libfabric's
buffers (both published EFA nodes show exactly this)."""
WORKER_MEMORY_HEADROOM_FRACTION = 0.01
"""Memory a worker leaves unasked: the allocatable model is checked to within 1% of real nodes,
so a worker sized to the model's last byte could miss by that much."""


@dataclass(frozen=True, kw_only=True)
class DaemonSetRequests:
    """What one DaemonSet's pod requests on every GPU node (the scheduler counts requests)."""

    name: str
    cpu_millicores: int
    memory_mib: int
    source: str
    """Where the numbers come from."""


EKS_ADDON_ALLOWANCE = "allowance per EKS add-on whose DaemonSet manifest is not in this repository"
GPU_NODE_DAEMONSETS = (
    DaemonSetRequests(name="aws-node", cpu_millicores=100, memory_mib=128,
                      source=EKS_ADDON_ALLOWANCE),
    DaemonSetRequests(name="kube-proxy", cpu_millicores=100, memory_mib=128,
                      source=EKS_ADDON_ALLOWANCE),
    DaemonSetRequests(name="eks-pod-identity-agent", cpu_millicores=100, memory_mib=128,
                      source=EKS_ADDON_ALLOWANCE),
    DaemonSetRequests(name="aws-efa-k8s-device-plugin", cpu_millicores=10, memory_mib=20,
                      source="the chart's default resources.requests"),
    DaemonSetRequests(name="nvidia-device-plugin", cpu_millicores=0, memory_mib=0,
                      source="the chart sets no requests"),
    DaemonSetRequests(name="eks-node-monitoring-agent", cpu_millicores=10, memory_mib=30,
                      source="the add-on's chart (aws/eks-node-monitoring-agent, "
                             "charts/eks-node-monitoring-agent/values.yaml): "
                             "nodeAgent.resources.requests"),
    DaemonSetRequests(name="dcgm-server", cpu_millicores=0, memory_mib=0,
                      source="the same chart: dcgmAgent.resources is empty, so no requests "
                             "(infra/health.py lets it onto the GPU nodes)"),
    DaemonSetRequests(name="aws-node-termination-handler", cpu_millicores=50, memory_mib=64,
                      source="infra/spot.py NODE_TERMINATION_HANDLER_RESOURCES (Spot stacks only, "
                             "counted on every stack: the worker errs small)"),
)
"""Every DaemonSet that runs on the GPU nodes (they tolerate the GPU taint or every taint)."""


@dataclass(frozen=True, kw_only=True)
class NodeAllocatable:
    """What the kubelet offers to pods on one node (its `status.allocatable`)."""

    cpu_millicores: int
    memory_kib: int
    hugepages_2mi: int
    """Number of 2 MiB huge pages (the node shows `hugepages-2Mi: <2 x this>Mi`)."""
    gpus: int = 0
    efa_interfaces: int = 0


@dataclass(frozen=True, kw_only=True)
class PodSize:
    cpu: int
    """Whole CPUs: Ray rounds a fractional CPU limit down anyway."""
    memory_gib: int
    gpus: int = 0
    efa_interfaces: int = 0
    hugepages_2mi: int = 0
    """2 MiB huge pages: libfabric's EFA provider allocates its buffers from them, and a container
    gets none unless it requests them."""

    def resources(self) -> dict[str, str]:
        """The Kubernetes quantities, used for both requests and limits."""
        quantities = {"cpu": str(self.cpu), "memory": f"{self.memory_gib}Gi"}
        if self.gpus:
            quantities[GPU_RESOURCE] = str(self.gpus)
        if self.efa_interfaces:
            quantities[EFA_RESOURCE] = str(self.efa_interfaces)
        if self.hugepages_2mi:
            quantities[HUGEPAGES_RESOURCE] = f"{self.hugepages_2mi * HUGE_PAGE_MIB}Mi"
        return quantities


def max_pods(instance: InstanceType) -> int:
    """The pods-per-node cap EKS managed node groups set: 110 below 30 vCPUs, else 250. Where the
    instance's network interfaces hold fewer addresses EKS sets less and the kubelet reserves
    less memory, so this is an upper bound for the reservation."""
    return 110 if instance.vcpus < 30 else 250


def kube_reserved_cpu(instance: InstanceType) -> float:
    """CPU the EKS AMI reserves for the kubelet and runtime: 6% of the first core, 1% of the
    second, 0.5% of the next two and 0.25% of the rest."""
    v = instance.vcpus
    return (0.06 * min(v, 1) + 0.01 * min(max(v - 1, 0), 1) + 0.005 * min(max(v - 2, 0), 2)
            + 0.0025 * max(v - 4, 0))


def kube_reserved_memory_mib(instance: InstanceType) -> int:
    """Memory the EKS AMI reserves for the kubelet and runtime: 255 MiB + 11 MiB per pod."""
    return 255 + 11 * max_pods(instance)


def efa_huge_pages(instance: InstanceType) -> int:
    """2 MiB huge pages a full EFA installation reserves at boot on a node with EFA interfaces (0
    without EFA): the most a node of this type offers, by the model."""
    return EFA_HUGE_PAGES_PER_VCPU * instance.vcpus + 1 if instance.efa_interfaces else 0


def max_huge_pages_mib(instance: InstanceType) -> int:
    """The largest `gpuHugePagesMib` a node of this type can give, by the model."""
    return efa_huge_pages(instance) * HUGE_PAGE_MIB


def memory_capacity_kib(instance: InstanceType) -> int:
    """The node's memory capacity (MemTotal) as the kubelet reports it."""
    return math.floor(instance.memory_gib * 2**20 * (1 - KERNEL_RESERVED_FRACTION))


def node_allocatable(instance: InstanceType) -> NodeAllocatable:
    """`status.allocatable` of one node of this type on the EKS AMI."""
    pages = efa_huge_pages(instance)
    reserved_mib = kube_reserved_memory_mib(instance) + EVICTION_HARD_MIB + pages * HUGE_PAGE_MIB
    return NodeAllocatable(
        cpu_millicores=instance.vcpus * 1000 - round(kube_reserved_cpu(instance) * 1000),
        memory_kib=memory_capacity_kib(instance) - reserved_mib * 1024,
        hugepages_2mi=pages, gpus=instance.gpus, efa_interfaces=instance.efa_interfaces)


def daemonset_requests() -> tuple[int, int]:
    """(millicores, MiB) all GPU_NODE_DAEMONSETS request together on one GPU node."""
    return (sum(d.cpu_millicores for d in GPU_NODE_DAEMONSETS),
            sum(d.memory_mib for d in GPU_NODE_DAEMONSETS))


def worker_pod_size(instance: InstanceType, *, hugepages_mib: int) -> PodSize:
    """One Ray worker per GPU node, taking what the node has left after its DaemonSets, and
    `hugepages_mib` of 2 MiB huge pages (validated config: even, at most max_huge_pages_mib)."""
    assert instance.gpus and instance.efa_interfaces, f"{instance.name} is not an EFA GPU type"
    assert 0 <= hugepages_mib <= max_huge_pages_mib(instance) and hugepages_mib % HUGE_PAGE_MIB == 0
    node = node_allocatable(instance)
    ds_cpu, ds_mib = daemonset_requests()
    headroom_kib = memory_capacity_kib(instance) * WORKER_MEMORY_HEADROOM_FRACTION
    memory_kib = node.memory_kib - ds_mib * 1024 - headroom_kib
    return PodSize(cpu=(node.cpu_millicores - ds_cpu) // 1000,
                   memory_gib=math.floor(memory_kib / 2**20),
                   gpus=instance.gpus, efa_interfaces=instance.efa_interfaces,
                   hugepages_2mi=hugepages_mib // HUGE_PAGE_MIB)


def head_pod_size(instance: InstanceType) -> PodSize:
    """The Ray head takes half a system node; the other half runs the KubeRay operator,
    CoreDNS and the DaemonSets."""
    return PodSize(cpu=max(1, instance.vcpus // 2), memory_gib=max(2, instance.memory_gib // 2))
