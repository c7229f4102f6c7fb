"""Facts about the EC2 instance types the stack can run on.

The RayCluster builder sizes pods from this table, so nothing instance-specific lives in the builder.
The GPU counts, GPU memory, EFA interfaces and network cards are EC2's (DescribeInstanceTypes, the
"Accelerated computing" specifications of the EC2 instance types guide); `python -m capacity probe`
compares them with what EC2 answers and stops on a difference. Each type's GPU is a row of
workloads/gpus.py (its peak FLOP/s, memory and links).
Prices are On-Demand Linux list prices in us-east-1 (USD/hour) as published on 2025-06-05, after
that month's P4/P5/P5en price cut (p6-b200, sold through Capacity Blocks alone at first: its
On-Demand list price since); other regions differ by up to ~30%, so treat them as an estimate.
p5e has none: EC2 sells it through Capacity Blocks, not On-Demand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from workloads.gpus import GPUS, Gpu

PRICE_TABLE_DATE = "2025-06-05"
PRICE_TABLE_REGION = "us-east-1"

EKS_CONTROL_PLANE_USD_PER_HOUR = 0.10
"""An EKS cluster in standard support (extended support is 0.60)."""
NAT_GATEWAY_USD_PER_HOUR = 0.045
"""One NAT gateway, before data processing charges."""
GP3_USD_PER_GIB_MONTH = 0.08
"""gp3 EBS storage, the node root volumes."""
HOURS_PER_MONTH = 730
MLFLOW_TRACKING_SERVER_USD_PER_HOUR = {"Small": 0.60, "Medium": 1.40, "Large": 2.70}
"""A SageMaker managed MLflow tracking server by size (`ray-eks:mlflowSize`), billed while it exists;
its metadata storage (about 0.10 per GB-month) and the S3 artifacts are not included."""


@dataclass(frozen=True, kw_only=True)
class ProvisionLimit:
    """How long a new GPU node of a family may take from its launch to joining the cluster before
    the Cluster Autoscaler gives the launch up and backs off (`max-node-provision-time`)."""

    minutes: int
    source: str
    """Where the figure comes from."""


PROVISION_LIMITS: dict[str, ProvisionLimit] = {
    "g": ProvisionLimit(minutes=15, source=(
        "the Cluster Autoscaler's default max-node-provision-time, the 15 minutes Karpenter also allows "
        "a node to register: a g5, g6 or g6e node (PCIe GPUs, one EFA interface) boots as a "
        "general-purpose instance does")),
    "p": ProvisionLimit(minutes=30, source=(
        "the 1,800 s AWS ParallelCluster allows one of its GPU compute nodes to boot (the default of "
        "DevSettings/Timeouts/ComputeNodeBootstrapTimeout): a P node also brings up its NVSwitch "
        "fabric and up to 32 EFA interfaces, and p6-b200 users report boots of 15 to 25 minutes")),
}
"""By instance family (the letters before the generation): EC2 publishes no launch-to-join times."""


def family_of(instance_type: str) -> str:
    """The family letters of a type's name: `p` for p5en.48xlarge, `g` for g6e.12xlarge."""
    return re.match(r"[a-z]*", instance_type).group(0)


@dataclass(frozen=True, kw_only=True)
class InstanceType:
    name: str
    vcpus: int
    memory_gib: int
    gpus: int = 0
    gpu_model: str = ""
    gpu_memory_gib: int = 0
    """Memory of one GPU as the type is sold (24 GB cards, 80 GiB HBM): `workloads submit` picks its
    default preset by it. EC2 gives it in MiB: GDDR cards' decimal GB, HBM's GiB."""
    efa_interfaces: int = 0
    """Maximum EFA interfaces the type supports (0: no EFA)."""
    network_cards: int = 1
    """Network cards (`MaximumNetworkCards`): a launch template gives each its own EFA interface,
    the first (card 0) also carrying the node's IP address."""
    network_gbps: float = 0.0
    """The instance's network bandwidth in Gbps (EC2's instance type page), what EFA carries between
    nodes."""
    usd_per_hour: Optional[float]
    """On-Demand list price (module docstring); None where EC2 lists none (p5e: Capacity Blocks)."""

    @property
    def gpu(self) -> Optional[Gpu]:
        return GPUS.get(self.gpu_model)

    @property
    def provision_limit(self) -> ProvisionLimit:
        """Its family's; every GPU type of the table has one (tests/test_instance_families.py)."""
        return PROVISION_LIMITS[family_of(self.name)]


INSTANCE_TYPES: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType(name="g6.12xlarge", vcpus=48, memory_gib=192, gpus=4, gpu_model="L4",
                     gpu_memory_gib=24, efa_interfaces=1, network_gbps=40, usd_per_hour=4.6016),
        InstanceType(name="g6e.12xlarge", vcpus=48, memory_gib=384, gpus=4, gpu_model="L40S",
                     gpu_memory_gib=48, efa_interfaces=1, network_gbps=100, usd_per_hour=10.49264),
        InstanceType(name="g5.12xlarge", vcpus=48, memory_gib=192, gpus=4, gpu_model="A10G",
                     gpu_memory_gib=24, efa_interfaces=1, network_gbps=40, usd_per_hour=5.672),
        InstanceType(name="p4d.24xlarge", vcpus=96, memory_gib=1152, gpus=8, gpu_model="A100",
                     gpu_memory_gib=40, efa_interfaces=4, network_cards=4, network_gbps=400,
                     usd_per_hour=21.96),
        InstanceType(name="p5.48xlarge", vcpus=192, memory_gib=2048, gpus=8, gpu_model="H100",
                     gpu_memory_gib=80, efa_interfaces=32, network_cards=32, network_gbps=3200,
                     usd_per_hour=55.04),
        InstanceType(name="p5e.48xlarge", vcpus=192, memory_gib=2048, gpus=8, gpu_model="H200",
                     gpu_memory_gib=141, efa_interfaces=32, network_cards=32, network_gbps=3200,
                     usd_per_hour=None),
        InstanceType(name="p5en.48xlarge", vcpus=192, memory_gib=2048, gpus=8, gpu_model="H200",
                     gpu_memory_gib=141, efa_interfaces=16, network_cards=16, network_gbps=3200,
                     usd_per_hour=63.296),
        InstanceType(name="p6-b200.48xlarge", vcpus=192, memory_gib=2048, gpus=8, gpu_model="B200",
                     gpu_memory_gib=179, efa_interfaces=8, network_cards=8, network_gbps=3200,
                     usd_per_hour=113.9328),
        InstanceType(name="m7i.xlarge", vcpus=4, memory_gib=16, usd_per_hour=0.2016),
        InstanceType(name="m7i.2xlarge", vcpus=8, memory_gib=32, usd_per_hour=0.4032),
    )
}

GPU_INSTANCE_TYPES = tuple(sorted(n for n, t in INSTANCE_TYPES.items() if t.gpus and t.efa_interfaces))
SYSTEM_INSTANCE_TYPES = tuple(sorted(n for n, t in INSTANCE_TYPES.items() if not t.gpus))

CAPACITY_BLOCK_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "p6-b300", "p6e-gb200",
                           "trn1", "trn2")
"""Instance families EC2 sells Capacity Blocks for ML for (EC2 user guide, "Supported instance
types and Regions"); G-family types such as g6 are not among them."""


def sells_capacity_blocks(instance_type: str) -> bool:
    """Whether EC2 sells Capacity Blocks for this instance type."""
    return instance_type.split(".", 1)[0] in CAPACITY_BLOCK_FAMILIES
