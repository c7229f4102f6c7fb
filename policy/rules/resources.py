"""How the rules see resources: type tokens, the UNKNOWN of preview, a stack's resources with their
dependencies, and the helpers that read properties and follow references between resources."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, NamedTuple, Sequence


class _Unknown:
    """A property value not known during preview."""

    _instance: _Unknown | None = None

    def __new__(cls) -> _Unknown:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unknown during preview>"


UNKNOWN = _Unknown()


# Resource type tokens, as the engine names them (pulumi-aws 7.x, pulumi-kubernetes 4.x).
EKS_CLUSTER = "aws:eks/cluster:Cluster"
NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
PLACEMENT_GROUP = "aws:ec2/placementGroup:PlacementGroup"
SUBNET = "aws:ec2/subnet:Subnet"
CAPACITY_RESERVATION = "aws:ec2/capacityReservation:CapacityReservation"
CAPACITY_BLOCK = "aws:ec2/capacityBlockReservation:CapacityBlockReservation"
RAY_CLUSTER = "kubernetes:ray.io/v1:RayCluster"
SERVICE = "kubernetes:core/v1:Service"
NAMESPACE = "kubernetes:core/v1:Namespace"
NETWORK_POLICY = "kubernetes:networking.k8s.io/v1:NetworkPolicy"
INGRESS = "kubernetes:networking.k8s.io/v1:Ingress"
HELM_RELEASE = "kubernetes:helm.sh/v3:Release"
HELM_CHART = "kubernetes:helm.sh/v4:Chart"
BUCKETS = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
BUCKET_POLICY = "aws:s3/bucketPolicy:BucketPolicy"
ENCRYPTION_CONFIGS = (
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2",
)
# Where each Kubernetes workload keeps its pod spec.
POD_SPEC_PATHS: dict[str, tuple[str, ...]] = {
    "kubernetes:core/v1:Pod": ("spec",),
    "kubernetes:apps/v1:Deployment": ("spec", "template", "spec"),
    "kubernetes:apps/v1:DaemonSet": ("spec", "template", "spec"),
    "kubernetes:apps/v1:StatefulSet": ("spec", "template", "spec"),
    "kubernetes:apps/v1:ReplicaSet": ("spec", "template", "spec"),
    "kubernetes:batch/v1:Job": ("spec", "template", "spec"),
    "kubernetes:batch/v1:CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}


class StackViolation(NamedTuple):
    urn: str
    message: str


@dataclass(frozen=True, kw_only=True)
class StackResource:
    """One resource of the stack as a stack rule sees it."""

    urn: str
    """The resource's URN; violations are reported against it."""
    type: str
    """The type token, e.g. aws:eks/nodeGroup:NodeGroup."""
    props: Mapping[str, Any]
    """The resource's properties (its planned outputs during preview)."""
    dependencies: tuple[str, ...] = ()
    """URNs this resource depends on."""
    property_dependencies: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """For each property, the URNs of the resources whose outputs it was computed from."""


def value_at(obj: Any, *path: str | int) -> Any:
    """The value at `path`, or None where the path is missing (UNKNOWN where it is not known)."""
    for key in path:
        if obj is UNKNOWN:
            return UNKNOWN
        if isinstance(key, int):
            if not isinstance(obj, Sequence) or isinstance(obj, str) or key >= len(obj):
                return None
            obj = obj[key]
        else:
            if not isinstance(obj, Mapping):
                return None
            obj = obj.get(key)
    return obj


def as_list(value: Any) -> list[Any]:
    """A list property as a list; missing or unknown is empty."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return []


def referenced(by: StackResource, prop: str, candidates: Sequence[StackResource],
                match_keys: Sequence[str]) -> list[StackResource]:
    """The candidates that `by.props[prop]` refers to: through the property's dependencies, else
    through a known value equal to one of the candidate's `match_keys` properties, else through
    the resource's dependencies."""
    urns = set(by.property_dependencies.get(prop, ()))
    found = [c for c in candidates if c.urn in urns]
    if found:
        return found
    value = by.props.get(prop)
    values = {v for v in (value, value_at(value, "id"), value_at(value, "name"), value_at(value, "groupName"))
              if isinstance(v, str) and v}
    found = [c for c in candidates
             if any(isinstance(c.props.get(k), str) and c.props.get(k) in values
                    for k in match_keys)]
    return found or [c for c in candidates if c.urn in by.dependencies]


def referenced_all(by: StackResource, prop: str,
                    candidates: Sequence[StackResource]) -> list[StackResource]:
    """The candidates a list property (e.g. subnetIds) refers to: through the property's
    dependencies, else by known IDs."""
    urns = set(by.property_dependencies.get(prop, ()))
    found = [c for c in candidates if c.urn in urns]
    ids = {v for v in as_list(by.props.get(prop)) if isinstance(v, str)}
    return found or [c for c in candidates if c.props.get("id") in ids]


def pod_containers(pod_spec: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key in ("initContainers", "containers"):
        for i, c in enumerate(as_list(value_at(pod_spec, key))):
            if isinstance(c, Mapping):
                name = c.get("name") if isinstance(c.get("name"), str) else f"{key}[{i}]"
                yield name, c
