"""The stack configuration's schema: `StackConfig`, its keys in a stack file, and the capacity
reservation it may target."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timezone

from infra.instance_types import INSTANCE_TYPES

PROJECT = "ray-eks"
"""The Pulumi project name (Pulumi.yaml `name`): the namespace of this program's config keys."""

REGION_KEY = "aws:region"
DEFAULT_RAY_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    """What one region's stack deploys. Field names map to camelCase keys under `ray-eks:`."""

    region: str
    """AWS region of the stack (`aws:region`); the stack is usually named after it."""
    gpu_availability_zone: str
    """AZ name of the GPU node group and its cluster placement group (written by the probe)."""
    gpu_availability_zone_id: str
    """AZ ID of the same zone (e.g. usw2-az1): stable across accounts, unlike the name."""
    gpu_instance_type: str = "g6.12xlarge"
    """GPU node instance type; must be in infra/instance_types.py and support EFA."""
    gpu_node_count: int = 2
    """GPU nodes, also the Ray worker replicas (desired = min = max)."""
    gpu_capacity_type: str = "on-demand"
    """`on-demand` (the default) or `spot`: the GPU managed node group's capacity type. Spot nodes
    cost a fraction of On-Demand but EC2 may reclaim them on a two-minute notice; the Ray workers
    then get a grace period that fits a checkpoint inside it (infra/spot.py). Spot has no
    capacity reservation. Written by `python -m capacity probe --capacity-type spot`."""
    gpu_spot_price_usd_per_hour: str = ""
    """The Spot price of one GPU node (USD/hour, e.g. "1.7412") that the probe read in the chosen
    AZ (DescribeSpotPriceHistory): the cost estimate's GPU price on Spot. Empty: not read; the
    estimate then counts On-Demand list prices, an upper bound."""
    system_instance_type: str = "m7i.xlarge"
    """Instance type of the system nodes (KubeRay operator, Ray head, CoreDNS); no GPU."""
    system_node_count: int = 2
    """System nodes. With one, losing it stops CoreDNS, the KubeRay operator and the Ray head
    together (the running job dies and nothing reschedules the head until a node returns)."""
    kubernetes_version: str = "1.34"
    """EKS Kubernetes minor version, in standard support."""
    ray_image: str = DEFAULT_RAY_IMAGE
    """Ray Train image for head and workers, pinned by a version tag or a digest (`repo:tag@sha256:...`,
    which `python -m infra lock-images` writes). `pulumi up` deploys it only by digest, unless
    `allowUnpinnedImages`."""
    allow_unpinned_images: bool = False
    """Let `pulumi up` deploy an image pinned by tag only. Off (the default), `pulumi up` refuses one, and
    `pulumi preview` warns, naming `python -m infra lock-images --stack <stack>`, which pins the stack's
    images by digest: a tag, even a version tag, is a pointer its registry's owner can move."""
    ray_version: str = "2.58.0"
    """Ray version inside `ray_image` (RayCluster `rayVersion`); the client pins the same."""
    nvidia_device_plugin_chart_version: str = "0.20.0"
    """Helm chart version of nvidia-device-plugin."""
    efa_device_plugin_chart_version: str = "v0.5.30"
    """Helm chart version of aws-efa-k8s-device-plugin."""
    pod_identity_agent_version: str = "v1.3.10-eksbuild.2"
    """Version of the EKS Pod Identity agent add-on (`aws eks describe-addon-versions
    --addon-name eks-pod-identity-agent --kubernetes-version <minor>` lists them)."""
    vpc_cni_version: str = "v1.22.3-eksbuild.1"
    """Version of the VPC CNI add-on (`aws eks describe-addon-versions --addon-name vpc-cni
    --kubernetes-version <minor>` lists them); v1.14 or later, the first that enforces network
    policies."""
    node_monitoring_agent_version: str = "v1.4.0-eksbuild.2"
    """Version of the EKS node monitoring agent add-on (infra/health.py); v1.3.0 or later, the first
    whose configuration takes the `dcgmAgent` tolerations (`aws eks describe-addon-versions
    --addon-name eks-node-monitoring-agent --kubernetes-version <minor>` lists them)."""
    node_termination_handler_chart_version: str = "0.27.6"
    """Helm chart version of aws-node-termination-handler (installed on Spot stacks only: it drains a
    Spot GPU node on EC2's interruption notice, infra/spot.py)."""
    kuberay_operator_chart_version: str = "1.7.0"
    """Helm chart version of kuberay-operator (must match the CRD the RayCluster is built for)."""
    api_access_cidrs: tuple[str, ...] = ()
    """CIDRs allowed to reach the public EKS API endpoint (IAM authentication still applies), e.g.
    your own address as a /32. Empty (the default): no public endpoint; the API answers inside the
    VPC only, so `pulumi up` and `submit` must run from a machine that reaches the VPC
    (docs/SECURITY.md says how). IPv4 only (EKS takes IPv6 CIDRs on IPv6 clusters only); together at most
    a /8's worth of addresses (infra/config/open_addresses.py says why), more only with
    `apiOpenToInternet`."""
    api_open_to_internet: bool = False
    """Say that `apiAccessCidrs` may open the EKS API to the internet (0.0.0.0/0, or any list wider than a
    /8's worth of addresses): refused otherwise, by config validation and by the policy pack (the
    cluster then carries a tag that says it was meant)."""
    admin_principal_arns: tuple[str, ...] = ()
    """IAM roles/users given cluster-admin through EKS access entries. Leave out the identity
    running `pulumi up`: it already is admin as the cluster's creator."""
    checkpoint_bucket_prefix: str = "ray-checkpoints"
    """Name prefix of the checkpoint bucket; Pulumi appends a random suffix."""
    retain_checkpoints_on_destroy: bool = True
    """Keep the checkpoint bucket (and its data) on `pulumi destroy`."""
    checkpoint_noncurrent_version_days: int = 7
    """Days an overwritten or deleted checkpoint object stays as a noncurrent version before S3
    expires it (0 keeps every version forever)."""
    checkpoint_incomplete_upload_days: int = 1
    """Days before S3 aborts an unfinished multipart upload (a checkpoint write that died)."""
    ray_namespace: str = "ray"
    """Kubernetes namespace of the RayCluster and its service account."""
    gpu_root_volume_gib: int = 200
    """Root volume of GPU nodes: the DLC image is tens of GB, unpacked."""
    gpu_huge_pages_mib: int = 0
    """2 MiB huge pages (in MiB, even) each Ray worker requests as `hugepages-2Mi`, for libfabric's
    EFA buffers. 0 (the default): the AL2023 NVIDIA AMI installs EFA without the package that
    reserves huge pages, so its nodes may offer none, and a worker asking for more than its node
    offers is never scheduled; the workers then run with FI_EFA_USE_HUGE_PAGE=0 (regular pages).
    Set it to what the GPU nodes report (`kubectl get nodes -l role=gpu -o
    custom-columns=NAME:.metadata.name,HUGEPAGES:.status.allocatable.hugepages-2Mi`), at most what
    a full EFA installation reserves (infra/sizing.py)."""
    gpu_idle_minutes: int = 0
    """Scale the GPU nodes to zero once no job has used them for this many minutes; 0 (the
    default) is off: the GPU nodes run, and bill, from `pulumi up` to `pulumi destroy`. On, Ray's
    autoscaler removes a worker pod idle this long, the Cluster Autoscaler then removes its empty
    node (about 2 minutes later), and the next submitted job brings them back, which costs that job
    the node launch and the image pull (minutes; docs/INFRA.md). A targeted capacity reservation
    keeps billing while the nodes are gone: an On-Demand Capacity Reservation by the hour, a
    Capacity Block up front."""
    cluster_autoscaler_chart_version: str = "9.59.0"
    """Helm chart version of cluster-autoscaler (installed with gpuIdleMinutes only); its image is
    the release of the cluster's Kubernetes minor (infra/scale_to_zero.py)."""
    workers_ready_timeout_minutes: int = 30
    """How long `pulumi up` waits for every Ray worker pod to be Ready (GPU nodes joining and the
    image pull take most of it) before failing with why they are not; 0 does not wait."""
    eks_image_registry_account: str = "602401143452"
    """AWS account of the regional ECR registry that serves EKS add-on images (the EFA device
    plugin). Most regions use the default; opt-in regions have their own account, listed in the
    EKS user guide under "Amazon container image registries"."""
    gpu_reservation_id: str = ""
    """Capacity reservation the GPU launch template targets (cr-...): an On-Demand Capacity
    Reservation kept by `python -m capacity probe --hold`, or a Capacity Block bought by
    `python -m capacity blocks`. Empty: plain On-Demand capacity in a cluster placement group."""
    gpu_reservation_type: str = ""
    """`on-demand` (an ODCR) or `capacity-block` (launched with market type capacity-block)."""
    gpu_reservation_instance_type: str = ""
    """Instance type the reservation is for, as EC2 reported it; must equal gpuInstanceType."""
    gpu_reservation_availability_zone: str = ""
    """AZ name the reservation is in, as EC2 reported it; must equal gpuAvailabilityZone."""
    gpu_reservation_instance_count: int = 0
    """Instances the reservation holds; gpuNodeCount may not exceed it."""
    gpu_reservation_start: str = ""
    """When the reservation starts (ISO 8601, UTC). A Capacity Block not started yet gets a node
    group of 0 nodes until then."""
    gpu_reservation_end: str = ""
    """When the reservation ends (ISO 8601, UTC). EC2 reclaims a Capacity Block's instances from
    30 minutes before this."""
    mlflow: bool = False
    """A SageMaker managed MLflow tracking server for the runs (infra/tracking.py): its artifact
    store under the checkpoint bucket's prefix, the Ray pods allowed to log to it and nothing more,
    its ARN and UI URL exported. `python -m workloads submit --stack` then tracks every run there. It
    is billed by the hour while it exists (the cost estimate counts it)."""
    mlflow_size: str = "Small"
    """The tracking server's size: Small (AWS suggests it for up to 25 users), Medium or Large."""

    @property
    def gpu_instance(self):
        return INSTANCE_TYPES[self.gpu_instance_type]

    @property
    def is_spot(self) -> bool:
        return self.gpu_capacity_type == "spot"

    @property
    def gpu_reservation(self) -> GpuReservation | None:
        """The targeted capacity reservation, None without one."""
        if not self.gpu_reservation_id:
            return None
        return GpuReservation(
            reservation_id=self.gpu_reservation_id, kind=self.gpu_reservation_type,
            instance_type=self.gpu_reservation_instance_type,
            availability_zone=self.gpu_reservation_availability_zone,
            instance_count=self.gpu_reservation_instance_count,
            start=parse_utc(self.gpu_reservation_start), end=parse_utc(self.gpu_reservation_end))

    @property
    def system_instance(self):
        return INSTANCE_TYPES[self.system_instance_type]


@dataclass(frozen=True, kw_only=True)
class GpuReservation:
    """The capacity reservation the GPU node group launches into (validated config)."""

    reservation_id: str
    """cr-... identifier."""
    kind: str
    """`on-demand` or `capacity-block`."""
    instance_type: str
    """Instance type EC2 reserved."""
    availability_zone: str
    """AZ name of the reservation."""
    instance_count: int
    """Instances reserved."""
    start: datetime
    """Start, UTC."""
    end: datetime
    """End, UTC."""

    @property
    def is_capacity_block(self) -> bool:
        return self.kind == "capacity-block"


def parse_utc(text: str) -> datetime:
    """An ISO 8601 time with a UTC offset (`2026-12-03T11:30:00Z`), as an aware datetime in UTC;
    ValueError otherwise."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if value.tzinfo is None:
        raise ValueError(f"{text!r} has no UTC offset")
    return value.astimezone(timezone.utc)


def format_utc(value: datetime) -> str:
    """The stack file's spelling of a time: ISO 8601 in UTC, seconds, `Z`."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def config_key(field_name: str) -> str:
    """The stack-file key of a StackConfig field: `region` -> `aws:region`, others camelCase."""
    if field_name == "region":
        return REGION_KEY
    head, *rest = field_name.split("_")
    return f"{PROJECT}:{head}{''.join(p.capitalize() for p in rest)}"


FIELDS = {config_key(f.name): f for f in fields(StackConfig)}
KNOWN_KEYS = tuple(FIELDS)
"""Every key of this program in a stack file; FIELDS maps each to its StackConfig field."""


PLACEMENT_FIELDS = ("region", "gpu_availability_zone", "gpu_availability_zone_id",
                    "gpu_instance_type", "gpu_node_count")
"""What `python -m capacity probe` writes into a stack file; it keeps every other key."""


SPOT_FIELDS = ("gpu_capacity_type", "gpu_spot_price_usd_per_hour")
"""What `probe --capacity-type spot` writes beside the placement; a probe for On-Demand removes
them (the default capacity type is on-demand)."""

CAPACITY_TYPES = ("on-demand", "spot")
"""The values of gpuCapacityType."""


RESERVATION_FIELDS = ("gpu_reservation_id", "gpu_reservation_type", "gpu_reservation_instance_type",
                      "gpu_reservation_availability_zone", "gpu_reservation_instance_count",
                      "gpu_reservation_start", "gpu_reservation_end")
"""What `probe --hold` and `blocks` write beside the placement, and `release` removes."""


RESERVATION_KINDS = ("on-demand", "capacity-block")

MLFLOW_SIZES = ("Small", "Medium", "Large")
"""SageMaker's MLflow tracking server sizes, spelt as its API takes them."""
