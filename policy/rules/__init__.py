"""The stack's invariants as pure functions over resource properties.

Each resource rule takes one resource's properties (plain dicts and lists, camelCase keys as the
Pulumi engine sends them; the image rule also its type) and returns a list of violation messages; an
empty list means compliant.
Each stack rule takes every resource of the stack and returns (urn, message) pairs. Nothing here
imports Pulumi, so the rules are tested as data.

During `pulumi preview` a property that depends on another resource's output is not known yet; the
policy wrappers hand it over as `UNKNOWN`. A rule says nothing about a value it cannot see: the
same rule runs again at `pulumi up`, where every input is known before the resource is created.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
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
HELM_RELEASE = "kubernetes:helm.sh/v3:Release"
HELM_CHART = "kubernetes:helm.sh/v4:Chart"
BUCKETS = ("aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2")
PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
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

GPU_LABEL_KEY = "nvidia.com/gpu.present"
GPU_LABEL_VALUE = "true"
GPU_TAINT_KEY = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
ALLOWED_SERVICE_TYPES = (None, "ClusterIP")
PRIMARY_INTERFACE_TYPES = ("efa", "interface")
"""The primary interface carries the node's IP: EFA with ENA, or plain ENA beside `efa-only`
interfaces (AWS's layout for instances with several network cards)."""
PUBLIC_ACCESS_FLAGS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                       "restrictPublicBuckets")
SSE_ALGORITHMS = ("AES256", "aws:kms", "aws:kms:dsse")

_GPU_AMI_RE = re.compile(r"NVIDIA|GPU", re.IGNORECASE)
_GPU_INSTANCE_RE = re.compile(r"^(g|p)\d")
_DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
# A tag pins a release when it carries a version (v1.1, 2.58.0-py311, train-ml-cuda-v1.1).
_VERSION_IN_TAG_RE = re.compile(r"(?:^|[-_.])v?\d+\.\d+(?:\.\d+)*(?:$|[-_.+])")
_EXACT_CHART_VERSION_RE = re.compile(
    r"^v?\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")
_RAY_POD_LABELS = {("app.kubernetes.io/created-by", "kuberay-operator"),
                   ("app.kubernetes.io/name", "kuberay")}


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


def _get(obj: Any, *path: str | int) -> Any:
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


def _items(value: Any) -> list[Any]:
    """A list property as a list; missing or unknown is empty."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return []


# --- GPU node groups -------------------------------------------------------------------------

def is_gpu_node_group(props: Mapping[str, Any]) -> bool:
    """A node group is a GPU group when its AMI type is a GPU one or an instance type is g*/p*."""
    ami = props.get("amiType")
    if isinstance(ami, str) and _GPU_AMI_RE.search(ami):
        return True
    return any(isinstance(t, str) and _GPU_INSTANCE_RE.match(t)
               for t in _items(props.get("instanceTypes")))


def gpu_node_group_violations(props: Mapping[str, Any]) -> list[str]:
    """The GPU label, the GPU taint and a launch template on a GPU managed node group."""
    if not is_gpu_node_group(props):
        return []
    out: list[str] = []
    labels = props.get("labels")
    if labels is not UNKNOWN:
        value = _get(labels, GPU_LABEL_KEY)
        if value is not UNKNOWN and value != GPU_LABEL_VALUE:
            out.append(f"GPU node group lacks the label {GPU_LABEL_KEY}={GPU_LABEL_VALUE} (has "
                       f"{value!r}): the NVIDIA device plugin DaemonSet selects nodes by it and "
                       "otherwise lands on none, silently")
    taints = props.get("taints")
    if taints is not UNKNOWN and not any(
            _get(t, "key") in (GPU_TAINT_KEY, UNKNOWN) for t in _items(taints)):
        out.append(f"GPU node group has no {GPU_TAINT_KEY} taint: pods that need no GPU would be "
                   "scheduled onto GPU nodes")
    if props.get("launchTemplate") is None:
        out.append("GPU node group has no launch template: EFA interfaces and the cluster "
                   "placement group of a managed node group come only through one")
    return out


def efa_launch_template_violations(template: Mapping[str, Any],
                                   placement_groups: Sequence[Mapping[str, Any]]) -> list[str]:
    """EFA interfaces and a cluster placement group in a GPU node group's launch template.

    `placement_groups` are the PlacementGroup resources the template's `placement` refers to.
    """
    out: list[str] = []
    interfaces = template.get("networkInterfaces")
    if interfaces is not UNKNOWN:
        types = [_get(ni, "interfaceType") for ni in _items(interfaces)]
        if UNKNOWN not in types:
            if not any(t in ("efa", "efa-only") for t in types):
                out.append("launch template of a GPU node group has no EFA network interface "
                           "(interfaceType efa): NCCL would fall back to TCP sockets")
            else:
                primary = _primary_interface(_items(interfaces))
                kind = _get(primary, "interfaceType")
                if primary is not None and kind not in PRIMARY_INTERFACE_TYPES:
                    out.append("the primary network interface (card 0, device 0) must have "
                               "interfaceType efa or interface (ENA), not "
                               f"{kind!r}: it carries the node's IP")
    group_name = _get(template, "placement", "groupName")
    if reservation_target(template) is not None:
        if group_name not in (None, "", UNKNOWN):
            out.append("launch template targets a capacity reservation and also sets a placement "
                       "group: instances in a placement group only draw on reservations made in "
                       "it, so they would fail with InsufficientInstanceCapacity")
    elif group_name is None or group_name == "":
        out.append("launch template of a GPU node group sets no placement group: EFA traffic "
                   "between nodes needs a cluster placement group")
    for group in placement_groups:
        strategy = group.get("strategy")
        if strategy is not UNKNOWN and strategy != "cluster":
            out.append(f"placement group strategy is {strategy!r}, not 'cluster'")
    return out


def _primary_interface(interfaces: list[Any]) -> Any:
    for ni in interfaces:
        card, device = _get(ni, "networkCardIndex"), _get(ni, "deviceIndex")
        if card in (None, 0) and device in (None, 0):
            return ni
    return None


def _referenced(by: StackResource, prop: str, candidates: Sequence[StackResource],
                match_keys: Sequence[str]) -> list[StackResource]:
    """The candidates that `by.props[prop]` refers to: through the property's dependencies, else
    through a known value equal to one of the candidate's `match_keys` properties, else through
    the resource's dependencies."""
    urns = set(by.property_dependencies.get(prop, ()))
    found = [c for c in candidates if c.urn in urns]
    if found:
        return found
    value = by.props.get(prop)
    values = {v for v in (value, _get(value, "id"), _get(value, "name"), _get(value, "groupName"))
              if isinstance(v, str) and v}
    found = [c for c in candidates
             if any(isinstance(c.props.get(k), str) and c.props.get(k) in values
                    for k in match_keys)]
    return found or [c for c in candidates if c.urn in by.dependencies]


def gpu_node_group_efa_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every GPU node group's launch template has EFA interfaces and a cluster placement group."""
    templates = [r for r in resources if r.type == LAUNCH_TEMPLATE]
    groups = [r for r in resources if r.type == PLACEMENT_GROUP]
    out: list[StackViolation] = []
    for ng in resources:
        if ng.type != NODE_GROUP or not is_gpu_node_group(ng.props):
            continue
        if ng.props.get("launchTemplate") is None:
            continue  # reported by gpu_node_group_violations on the node group itself
        linked = _referenced(ng, "launchTemplate", templates, ("id", "name"))
        if not linked:
            out.append(StackViolation(ng.urn, "GPU node group's launch template is not part of "
                                      "this stack, so its EFA setup cannot be checked"))
            continue
        for lt in linked:
            pgs = _referenced(lt, "placement", groups, ("name", "id"))
            out.extend(StackViolation(lt.urn, m)
                       for m in efa_launch_template_violations(lt.props, [g.props for g in pgs]))
    return out


# --- Capacity reservations and Capacity Blocks ----------------------------------------------

def reservation_target(template: Mapping[str, Any]) -> Any:
    """The capacity reservation ID a launch template targets (UNKNOWN during preview when it
    comes from another resource), or None when it targets none."""
    spec = template.get("capacityReservationSpecification")
    if spec is UNKNOWN:
        return UNKNOWN
    target = _get(spec, "capacityReservationTarget")
    if target is UNKNOWN:
        return UNKNOWN
    rid = _get(target, "capacityReservationId")
    return rid if rid not in (None, "") else None


def _targeted_reservations(template: StackResource,
                           reservations: Sequence[StackResource]) -> list[StackResource]:
    """The reservation resources a template targets: through the engine's property dependencies,
    else by a known ID equal to the reservation's."""
    urns = set(template.property_dependencies.get("capacityReservationSpecification", ()))
    found = [r for r in reservations if r.urn in urns]
    rid = reservation_target(template.props)
    return found or [r for r in reservations if isinstance(rid, str) and r.props.get("id") == rid]


def _is_block(template: Mapping[str, Any], reservation: StackResource) -> bool:
    return (reservation.type == CAPACITY_BLOCK
            or reservation.props.get("reservationType") == "capacity-block"
            or _get(template, "instanceMarketOptions", "marketType") == "capacity-block")


def _known_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def capacity_reservation_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """A launch template that targets a capacity reservation launches what the reservation holds:
    its instance type (on the template and on every node group using it) and its AZ (of every
    subnet of those node groups). The reservation's own resource (read from EC2) is the truth; a
    Capacity Block also needs market type capacity-block and node group capacity type
    CAPACITY_BLOCK."""
    templates = [r for r in resources if r.type == LAUNCH_TEMPLATE]
    reservations = [r for r in resources if r.type in (CAPACITY_RESERVATION, CAPACITY_BLOCK)]
    groups = [r for r in resources if r.type == NODE_GROUP]
    subnets = [r for r in resources if r.type == SUBNET]
    out: list[StackViolation] = []
    for lt in templates:
        rid = reservation_target(lt.props)
        if rid is None:
            continue
        targeted = _targeted_reservations(lt, reservations)
        if not targeted:
            shown = rid if isinstance(rid, str) else "(known at deploy time)"
            out.append(StackViolation(lt.urn, f"launch template targets capacity reservation "
                                      f"{shown}, which this stack does not read from EC2, so "
                                      "its instance type and AZ cannot be checked"))
            continue
        users = [ng for ng in groups if _referenced(ng, "launchTemplate", [lt], ("id", "name"))]
        for res in targeted:
            out.extend(_reservation_mismatches(lt, res, users, subnets))
    return out


def _reservation_mismatches(lt: StackResource, res: StackResource, users: list[StackResource],
                            subnets: Sequence[StackResource]) -> list[StackViolation]:
    block = _is_block(lt.props, res)
    what = "Capacity Block" if block else "capacity reservation"
    rid = _known_str(res.props.get("id")) or res.urn.rsplit("::", 1)[-1]
    want_type = _known_str(res.props.get("instanceType"))
    want_zone = _known_str(res.props.get("availabilityZone"))
    out: list[StackViolation] = []
    lt_type = _known_str(lt.props.get("instanceType"))
    if want_type and lt_type and lt_type != want_type:
        out.append(StackViolation(lt.urn, f"launch template launches {lt_type} into {what} {rid}, "
                                  f"which holds {want_type}: no instance would launch"))
    if block and _get(lt.props, "instanceMarketOptions", "marketType") not in (
            "capacity-block", UNKNOWN):
        out.append(StackViolation(lt.urn, f"launch template targets {what} {rid} without "
                                  "instanceMarketOptions.marketType capacity-block"))
    for ng in users:
        types = [t for t in _items(ng.props.get("instanceTypes")) if _known_str(t)]
        for t in types:
            if want_type and t != want_type:
                out.append(StackViolation(ng.urn, f"node group runs {t} in {what} {rid}, which "
                                          f"holds {want_type}"))
        capacity_type = ng.props.get("capacityType")
        if block and capacity_type not in ("CAPACITY_BLOCK", UNKNOWN):
            out.append(StackViolation(ng.urn, f"node group launches into {what} {rid} with "
                                      f"capacityType {capacity_type!r}, not CAPACITY_BLOCK"))
        for subnet in _referenced_all(ng, "subnetIds", subnets):
            zone = _known_str(subnet.props.get("availabilityZone"))
            if want_zone and zone and zone != want_zone:
                out.append(StackViolation(ng.urn, f"node group's subnet is in {zone}, but {what} "
                                          f"{rid} is in {want_zone}: no instance would launch"))
    return out


def _referenced_all(by: StackResource, prop: str,
                    candidates: Sequence[StackResource]) -> list[StackResource]:
    """The candidates a list property (e.g. subnetIds) refers to: through the property's
    dependencies, else by known IDs."""
    urns = set(by.property_dependencies.get(prop, ()))
    found = [c for c in candidates if c.urn in urns]
    ids = {v for v in _items(by.props.get(prop)) if isinstance(v, str)}
    return found or [c for c in candidates if c.props.get("id") in ids]


# --- Ray: worker resources, exposure ---------------------------------------------------------

_BINARY_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SUFFIX = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
                   "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_QUANTITY_RE = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)$")


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes resource quantity ("4", 4, "500m", "180Gi", "1e3") as a number."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    m = _QUANTITY_RE.match(text)
    if not m:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    try:
        number = Decimal(m.group(1))
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a Kubernetes quantity") from None
    suffix = m.group(2)
    return number * (_BINARY_SUFFIX.get(suffix) or _DECIMAL_SUFFIX[suffix])


def _pod_containers(pod_spec: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for key in ("initContainers", "containers"):
        for i, c in enumerate(_items(_get(pod_spec, key))):
            if isinstance(c, Mapping):
                name = c.get("name") if isinstance(c.get("name"), str) else f"{key}[{i}]"
                yield name, c


def _requests_equal_limits(where: str, container: Mapping[str, Any]) -> list[str]:
    requests = _get(container, "resources", "requests")
    limits = _get(container, "resources", "limits")
    if UNKNOWN in (requests, limits):
        return []
    if not requests or not limits:
        return [f"{where}: sets no resource requests and limits; requests must equal limits "
                "(Guaranteed QoS) so one throttled rank cannot stall the others"]
    out: list[str] = []
    for name in sorted(set(requests) | set(limits)):
        req, lim = requests.get(name), limits.get(name)
        if UNKNOWN in (req, lim):
            continue
        if req is None or lim is None:
            side = "requests" if req is None else "limits"
            out.append(f"{where}: {name} is missing from {side}; requests must equal limits")
            continue
        try:
            equal = parse_quantity(req) == parse_quantity(lim)
        except ValueError as exc:
            out.append(f"{where}: {name}: {exc}")
            continue
        if not equal:
            out.append(f"{where}: {name} request {req} != limit {lim}; requests must equal limits")
    return out


def ray_worker_violations(props: Mapping[str, Any]) -> list[str]:
    """Requests == limits on every worker container, and the EFA request on the Ray container."""
    groups = _get(props, "spec", "workerGroupSpecs")
    if groups is UNKNOWN:
        return []
    if not _items(groups):
        return ["RayCluster has no worker group"]
    out: list[str] = []
    for i, group in enumerate(_items(groups)):
        gname = _get(group, "groupName")
        label = f"worker group {gname if isinstance(gname, str) else i}"
        pod_spec = _get(group, "template", "spec")
        containers = _items(_get(pod_spec, "containers"))
        if pod_spec is UNKNOWN or _get(pod_spec, "containers") is UNKNOWN:
            continue
        if not containers:
            out.append(f"{label}: pod template has no containers")
            continue
        for name, container in _pod_containers(pod_spec):
            out.extend(_requests_equal_limits(f"{label}, container {name}", container))
        # KubeRay runs Ray in the first container of the pod.
        ray = containers[0]
        efa = _get(ray, "resources", "requests", EFA_RESOURCE)
        if efa is UNKNOWN:
            continue
        try:
            efa_count = parse_quantity(efa) if efa is not None else Decimal(0)
        except ValueError as exc:
            out.append(f"{label}: {EFA_RESOURCE}: {exc}")
            continue
        if efa_count < 1:
            out.append(f"{label}: the Ray container requests no {EFA_RESOURCE}; without it the "
                       "EFA device is not mounted and NCCL silently uses TCP sockets")
    return out


def _service_type_violation(where: str, service_type: Any) -> list[str]:
    if service_type is UNKNOWN or service_type in ALLOWED_SERVICE_TYPES:
        return []
    return [f"{where} is {service_type!r}: Ray's dashboard and Jobs API run arbitrary code, so "
            "they stay ClusterIP and are reached through kubectl port-forward"]


def ray_head_exposure_violations(props: Mapping[str, Any]) -> list[str]:
    """The head service stays ClusterIP and no ingress is put in front of it."""
    head = _get(props, "spec", "headGroupSpec")
    out = _service_type_violation("RayCluster head serviceType", _get(head, "serviceType"))
    out += _service_type_violation("RayCluster headService spec.type",
                                   _get(head, "headService", "spec", "type"))
    if _get(head, "enableIngress") is True:
        out.append("RayCluster head has enableIngress: true; nothing may be exposed in front of "
                   "Ray")
    return out


def selects_ray_pods(selector: Any) -> bool:
    """Whether a Service selector matches pods KubeRay creates (labels ray.io/*)."""
    if not isinstance(selector, Mapping):
        return False
    return any(isinstance(k, str) and k.startswith("ray.io/") for k in selector) or any(
        (k, v) in _RAY_POD_LABELS for k, v in selector.items())


def service_exposure_violations(props: Mapping[str, Any]) -> list[str]:
    """A Service selecting Ray pods is ClusterIP."""
    if not selects_ray_pods(_get(props, "spec", "selector")):
        return []
    return _service_type_violation("Service selecting Ray pods has type",
                                   _get(props, "spec", "type"))


# --- Pinned images and chart versions --------------------------------------------------------

def tag_pin_violation(tag: Any) -> str | None:
    """Why an image tag names no release (None when it does, e.g. v1.1 or 2.58.0-py311)."""
    text = str(tag)
    if text == "latest" or not _VERSION_IN_TAG_RE.search(text):
        return f"tag {text!r} names no release; pin a version tag (vX.Y) or a digest"
    return None


def image_pin_violation(image: Any) -> str | None:
    """Why `image` is not pinned to a release (None when it is): a digest or a version tag."""
    if image is UNKNOWN:
        return None
    if not isinstance(image, str) or not image.strip():
        return f"image {image!r} is not an image reference"
    if _DIGEST_RE.search(image):
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image {image} has no tag (means :latest); pin a version tag (vX.Y) or a digest"
    problem = tag_pin_violation(last.rsplit(":", 1)[1])
    return f"image {image}: {problem}" if problem else None


def _pod_specs(resource_type: str, props: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    if resource_type == RAY_CLUSTER:
        yield "head", _get(props, "spec", "headGroupSpec", "template", "spec")
        for i, group in enumerate(_items(_get(props, "spec", "workerGroupSpecs"))):
            gname = _get(group, "groupName")
            yield f"worker group {gname if isinstance(gname, str) else i}", _get(
                group, "template", "spec")
    elif resource_type in POD_SPEC_PATHS:
        yield "pod", _get(props, *POD_SPEC_PATHS[resource_type])


def workload_image_violations(resource_type: str, props: Mapping[str, Any]) -> list[str]:
    """Every container image of a RayCluster or Kubernetes workload is pinned."""
    out: list[str] = []
    for where, pod_spec in _pod_specs(resource_type, props):
        for name, container in _pod_containers(pod_spec):
            problem = image_pin_violation(container.get("image"))
            if problem:
                out.append(f"{where}, container {name}: {problem}")
    return out


def _helm_value_images(values: Any, path: str = "values") -> Iterator[tuple[str, Any, bool]]:
    """(path, image or tag, is_tag) for each image setting in Helm values."""
    if isinstance(values, Mapping):
        for key, value in values.items():
            here = f"{path}.{key}"
            if key == "image" and isinstance(value, str):
                yield here, value, False
            elif key == "image" and isinstance(value, Mapping) and "tag" in value:
                yield f"{here}.tag", value["tag"], True
            yield from _helm_value_images(value, here)
    elif isinstance(values, Sequence) and not isinstance(values, str):
        for i, value in enumerate(values):
            yield from _helm_value_images(value, f"{path}[{i}]")


def helm_violations(props: Mapping[str, Any]) -> list[str]:
    """An exact chart version, and no floating image tag in the values."""
    out: list[str] = []
    version = props.get("version")
    if version is not UNKNOWN:
        if not isinstance(version, str) or not _EXACT_CHART_VERSION_RE.match(version.strip()):
            chart = props.get("chart")
            out.append(f"Helm chart {chart!r} version {version!r} is not an exact version "
                       "(X.Y.Z): without one Helm installs whatever is newest")
    for path, value, is_tag in _helm_value_images(props.get("values")):
        if value is UNKNOWN or (is_tag and value in ("", None)):
            continue  # an empty tag means the chart's appVersion, pinned by the chart version
        problem = tag_pin_violation(value) if is_tag else image_pin_violation(value)
        if problem:
            out.append(f"{path}: {problem}")
    return out


# --- Checkpoint bucket -----------------------------------------------------------------------

def public_access_block_violations(props: Mapping[str, Any]) -> list[str]:
    """All four S3 public-access-block flags are true."""
    off = [f for f in PUBLIC_ACCESS_FLAGS if props.get(f) is not UNKNOWN and props.get(f) is not True]
    if not off:
        return []
    return [f"bucket public access block leaves {', '.join(off)} off; all four must be true"]


def encryption_config_violations(props: Mapping[str, Any]) -> list[str]:
    """A server-side encryption configuration sets default encryption with a real algorithm."""
    rules = props.get("rules")
    if rules is UNKNOWN:
        return []
    algorithms = [_get(r, "applyServerSideEncryptionByDefault", "sseAlgorithm")
                  for r in _items(rules)]
    if not algorithms:
        return ["server-side encryption configuration has no rule"]
    return [f"server-side encryption algorithm {a!r} is not one of {', '.join(SSE_ALGORITHMS)}"
            for a in algorithms if a is not UNKNOWN and a not in SSE_ALGORITHMS]


def _attached(resources: Sequence[StackResource], bucket: StackResource) -> list[StackResource]:
    """The resources whose `bucket` property names this bucket."""
    return [r for r in resources if _referenced(r, "bucket", [bucket], ("bucket", "id"))]


def bucket_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """Every bucket has its own public access block and server-side encryption configuration.

    What those set is checked on each of them by public_access_block_violations and
    encryption_config_violations. Only the separate resources count: the Bucket's inline encryption block is
    deprecated in pulumi-aws 7, and its output reports the AES256 default S3 applies to every new bucket, which
    would hide a missing configuration.
    """
    blocks = [r for r in resources if r.type == PUBLIC_ACCESS_BLOCK]
    configs = [r for r in resources if r.type in ENCRYPTION_CONFIGS]
    out: list[StackViolation] = []
    for bucket in (r for r in resources if r.type in BUCKETS):
        if not _attached(blocks, bucket):
            out.append(StackViolation(bucket.urn, "bucket has no BucketPublicAccessBlock"))
        if not _attached(configs, bucket):
            out.append(StackViolation(bucket.urn, "bucket has no "
                                      "BucketServerSideEncryptionConfiguration"))
    return out


# --- EKS API endpoint ------------------------------------------------------------------------

OPEN_CIDRS = ("0.0.0.0/0", "::/0")


def public_api_access_warnings(props: Mapping[str, Any]) -> list[str]:
    """The public EKS API endpoint is not open to the whole internet (a warning: IAM
    authentication still applies, and some teams have no fixed address to list)."""
    vpc = props.get("vpcConfig")
    public, cidrs = _get(vpc, "endpointPublicAccess"), _get(vpc, "publicAccessCidrs")
    if public is False or UNKNOWN in (vpc, public, cidrs):
        return []
    open_to = [c for c in _items(cidrs) if c in OPEN_CIDRS] or (
        ["0.0.0.0/0 (the default)"] if not _items(cidrs) else [])
    if not open_to:
        return []
    return [f"the public EKS API endpoint accepts connections from {', '.join(open_to)}; set "
            "ray-eks:apiAccessCidrs to your own address or range (docs/SECURITY.md shows how)"]
