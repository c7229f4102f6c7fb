"""The stack configuration: one typed, validated model of `Pulumi.<stack>.yaml`.

Written by `python -m capacity probe`, read by the Pulumi program and by `python -m infra render`.
This module imports no Pulumi so the probe and the tests can use it without a Pulumi engine.
Every bad value is refused naming the key, the value and the fix, before any resource is declared
or any cloud call is made; all of a config's problems are reported at once (`ConfigErrors`), and
read from a stack file, each with its line.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from dataclasses import MISSING, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

from infra.instance_types import (GPU_INSTANCE_TYPES, INSTANCE_TYPES, SYSTEM_INSTANCE_TYPES,
                                  sells_capacity_blocks)

_T = TypeVar("_T")

PROJECT = "ray-eks"
"""The Pulumi project name (Pulumi.yaml `name`): the namespace of this program's config keys."""

REGION_KEY = "aws:region"
DEFAULT_RAY_IMAGE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"

_REGION_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_AZ_ID_RE = re.compile(r"^[a-z]{3,4}\d-az\d+$")
_K8S_VERSION_RE = re.compile(r"^1\.(\d+)$")
_SEMVER_RE = re.compile(r"^v?\d+\.\d+\.\d+$")
# A pinned image: a tag like v1.1 / 2.58.0 / train-ml-cuda-v1.1 (ends in a version), or a digest.
_PINNED_TAG_RE = re.compile(r"^[\w.-]*v?\d+(\.\d+)+$")
_DIGEST_RE = re.compile(r"@sha256:[0-9a-f]{64}$")
# IAM roles and users only: EKS access entries refuse STS session principals (assumed-role ARNs).
_ARN_RE = re.compile(r"^arn:aws[\w-]*:iam::\d{12}:(role|user)/[\w+=,.@/-]+$")
_ASSUMED_ROLE_RE = re.compile(r"^arn:(aws[\w-]*):sts::(\d{12}):assumed-role/([\w+=,.@-]+)/")
_EKS_ADDON_VERSION_RE = re.compile(r"^v\d+\.\d+\.\d+-eksbuild\.\d+$")
_BUCKET_PREFIX_RE = re.compile(r"^[a-z0-9][a-z0-9-]{1,38}$")
_ACCOUNT_RE = re.compile(r"^\d{12}$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# EKS gives each minor about 14 months of standard support, then bills extended support at 6x the
# control-plane price. This is the window the program was last checked against; move it with the
# EKS release calendar (a minor that has left standard support is refused, not silently upgraded).
SUPPORTED_KUBERNETES_MINORS = range(32, 36)


class _NoValue:
    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Any = _NoValue()
"""The `value` of a problem with a whole file rather than with one key's value."""


class ConfigError(ValueError):
    """A user mistake in the stack configuration: the key, the value, and how to fix it; `where`
    is the file and line it was read from, when known."""

    def __init__(self, key: str, value: Any, problem: str, fix: str, *, where: str = ""):
        self.key, self.value, self.problem, self.fix, self.where = key, value, problem, fix, where
        subject = key if value is NO_VALUE else f"{key} = {value!r}"
        super().__init__(f"{where + ': ' if where else ''}{subject}: {problem}. Fix: {fix}")


class ConfigErrors(ConfigError):
    """Several problems of one config, each a ConfigError; one line each. The attributes of the
    first are this error's own."""

    def __init__(self, errors: Sequence[ConfigError]):
        self.errors = tuple(errors)
        first = self.errors[0]
        self.key, self.value, self.problem, self.fix, self.where = (
            first.key, first.value, first.problem, first.fix, first.where)
        ValueError.__init__(self, "\n".join(str(e) for e in self.errors))


def _raise_all(errors: Sequence[ConfigError]) -> None:
    """Raise the one problem as it is, several as ConfigErrors, nothing when there is none."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


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
    system_instance_type: str = "m7i.xlarge"
    """Instance type of the system nodes (KubeRay operator, Ray head, CoreDNS); no GPU."""
    system_node_count: int = 2
    """System nodes. With one, losing it stops CoreDNS, the KubeRay operator and the Ray head
    together (the running job dies and nothing reschedules the head until a node returns)."""
    kubernetes_version: str = "1.34"
    """EKS Kubernetes minor version, in standard support."""
    ray_image: str = DEFAULT_RAY_IMAGE
    """Ray Train image for head and workers, pinned by a version tag or a digest."""
    ray_version: str = "2.58.0"
    """Ray version inside `ray_image` (RayCluster `rayVersion`); the client pins the same."""
    nvidia_device_plugin_chart_version: str = "0.20.0"
    """Helm chart version of nvidia-device-plugin."""
    efa_device_plugin_chart_version: str = "v0.5.30"
    """Helm chart version of aws-efa-k8s-device-plugin."""
    pod_identity_agent_version: str = "v1.3.10-eksbuild.2"
    """Version of the EKS Pod Identity agent add-on (`aws eks describe-addon-versions
    --addon-name eks-pod-identity-agent --kubernetes-version <minor>` lists them)."""
    node_monitoring_agent_version: str = "v1.4.0-eksbuild.2"
    """Version of the EKS node monitoring agent add-on (infra/health.py); v1.3.0 or later, the first
    whose configuration takes the `dcgmAgent` tolerations (`aws eks describe-addon-versions
    --addon-name eks-node-monitoring-agent --kubernetes-version <minor>` lists them)."""
    kuberay_operator_chart_version: str = "1.7.0"
    """Helm chart version of kuberay-operator (must match the CRD the RayCluster is built for)."""
    api_access_cidrs: tuple[str, ...] = ("0.0.0.0/0",)
    """CIDRs allowed to reach the public EKS API endpoint (IAM authentication still applies);
    narrow it to your own address or range (the policy pack warns on 0.0.0.0/0)."""
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

    @property
    def gpu_instance(self):
        return INSTANCE_TYPES[self.gpu_instance_type]

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


def config_key(field_name: str) -> str:
    """The stack-file key of a StackConfig field: `region` -> `aws:region`, others camelCase."""
    if field_name == "region":
        return REGION_KEY
    head, *rest = field_name.split("_")
    return f"{PROJECT}:{head}{''.join(p.capitalize() for p in rest)}"


_FIELDS = {config_key(f.name): f for f in fields(StackConfig)}
KNOWN_KEYS = tuple(_FIELDS)


def _fix_cmd(key: str, example: Any) -> str:
    return f"pulumi config set {key} {example}  (or edit it in Pulumi.<stack>.yaml)"


def _as_int(key: str, raw: Any) -> int:
    if isinstance(raw, bool):
        raise ConfigError(key, raw, "must be a whole number", _fix_cmd(key, 2))
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
        return int(raw)
    raise ConfigError(key, raw, "must be a whole number", _fix_cmd(key, 2))


def _as_bool(key: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ConfigError(key, raw, "must be true or false", _fix_cmd(key, "true"))


def _as_str(key: str, raw: Any) -> str:
    if isinstance(raw, float):
        default = _FIELDS[key].default
        example = default if isinstance(default, str) else "<value>"
        raise ConfigError(key, raw, "was read as a number, which drops trailing zeros (an unquoted "
                          "1.30 becomes 1.3)", f'quote it in the stack file: {key}: "{example}"')
    if isinstance(raw, (str, int)) and not isinstance(raw, bool):
        return str(raw).strip()
    if isinstance(raw, datetime):  # an unquoted timestamp in hand-written YAML
        return format_utc(raw)
    raise ConfigError(key, raw, "must be a string", _fix_cmd(key, "<value>"))


def _as_str_list(key: str, raw: Any) -> tuple[str, ...]:
    # Pulumi hands structured values to the program as JSON strings; stack files hold YAML lists.
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raw = [s for s in raw.split(",") if s.strip()]
    if not isinstance(raw, (list, tuple)) or not all(isinstance(x, str) for x in raw):
        raise ConfigError(key, raw, "must be a list of strings",
                          f"pulumi config set --path '{key}[0]' <value>")
    return tuple(x.strip() for x in raw)


def _coerce(name: str, key: str, raw: Any) -> Any:
    annotation = str(_FIELDS[key].type)
    if annotation == "int":
        return _as_int(key, raw)
    if annotation == "bool":
        return _as_bool(key, raw)
    if annotation.startswith("tuple"):
        return _as_str_list(key, raw)
    return _as_str(key, raw)


def _problems(cfg: StackConfig, *, placement: bool = True,
              known_bad: Sequence[ConfigError] = ()) -> list[ConfigError]:
    """Every problem of `cfg`, after those already found (`known_bad`), one per key: a key whose
    value is already refused is not judged again."""
    found = list(known_bad)

    def add(problems: Iterator[ConfigError]) -> None:
        for problem in problems:
            if problem.key not in {e.key for e in found}:
                found.append(problem)

    if placement:
        add(_placement_problems(cfg, skip={e.key for e in known_bad}))
        # The reservation is judged against the placement: only once both read cleanly, so that
        # one bad value is one problem, not a cascade.
        watched = {config_key(name) for name in PLACEMENT_FIELDS + RESERVATION_FIELDS}
        if not watched & {e.key for e in found}:
            add(_reservation_problems(cfg))
    add(_settings_problems(cfg))
    return found


def az_id_prefix(region: str) -> str:
    """The region part of its AZ IDs (usw2 in usw2-az1): the country code, a letter per part of
    the name (two for northeast and the like), the number; every region follows the scheme."""
    country, *parts, number = region.split("-")
    return country + "".join(_DIRECTION_LETTERS.get(part, part[:1]) for part in parts) + number


_DIRECTION_LETTERS = {"northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw"}


def _placement_problems(cfg: StackConfig, *, skip: set[str]) -> Iterator[ConfigError]:
    k = config_key
    region_ok = k("region") not in skip and bool(_REGION_RE.match(cfg.region))
    if k("region") not in skip and not region_ok:
        yield ConfigError(k("region"), cfg.region, "is not an AWS region name",
                          _fix_cmd(k("region"), "<region>"))
    if region_ok and (not cfg.gpu_availability_zone.startswith(cfg.region) or not re.fullmatch(
            r"[a-z]", cfg.gpu_availability_zone[len(cfg.region):] or "-")):
        yield ConfigError(k("gpu_availability_zone"), cfg.gpu_availability_zone,
                          f"is not an availability zone of {cfg.region}",
                          f"run `python -m capacity probe --stack <stack> --regions {cfg.region}`"
                          " to pick one")
    if not _AZ_ID_RE.match(cfg.gpu_availability_zone_id):
        yield ConfigError(k("gpu_availability_zone_id"), cfg.gpu_availability_zone_id,
                          "is not an AZ ID like usw2-az1",
                          "run `python -m capacity probe` to write the AZ name and ID together")
    elif region_ok and not cfg.gpu_availability_zone_id.startswith(az_id_prefix(cfg.region) + "-"):
        yield ConfigError(k("gpu_availability_zone_id"), cfg.gpu_availability_zone_id,
                          f"is an AZ ID of another region ({cfg.region}'s start with "
                          f"{az_id_prefix(cfg.region)}-)",
                          f"run `python -m capacity probe --stack <stack> --regions {cfg.region}` "
                          "to write the AZ name and ID together")
    if cfg.gpu_instance_type not in GPU_INSTANCE_TYPES:
        yield ConfigError(k("gpu_instance_type"), cfg.gpu_instance_type,
                          "is not a known EFA-capable GPU instance type",
                          f"use one of {', '.join(GPU_INSTANCE_TYPES)} (or add it to "
                          "infra/instance_types.py)")
    if cfg.gpu_node_count < 1:
        yield ConfigError(k("gpu_node_count"), cfg.gpu_node_count, "must be at least 1",
                          _fix_cmd(k("gpu_node_count"), 2))


def _range_problems(cfg: StackConfig, name: str, low: int, high: int, why: str) -> Iterator[ConfigError]:
    value = getattr(cfg, name)
    if not low <= value <= high:
        yield ConfigError(config_key(name), value, f"must be between {low} and {high} ({why})",
                          _fix_cmd(config_key(name), getattr(StackConfig, name)))


RESERVATION_KINDS = ("on-demand", "capacity-block")
_RESERVATION_ID_RE = re.compile(r"^cr-[0-9a-f]{8,17}$")


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


def _reservation_problems(cfg: StackConfig) -> Iterator[ConfigError]:
    """The reservation keys are all set or all unset, and agree with the GPU placement: the first
    problem only, since each check assumes the ones before it passed."""
    first = next(_reservation_checks(cfg), None)
    if first is not None:
        yield first


def _reservation_checks(cfg: StackConfig) -> Iterator[ConfigError]:
    k = config_key
    release = "or run `python -m capacity release --stack <stack>` to stop targeting it"
    set_fields = [name for name in RESERVATION_FIELDS[1:] if getattr(cfg, name)]
    if not cfg.gpu_reservation_id:
        if set_fields:
            yield ConfigError(k(set_fields[0]), getattr(cfg, set_fields[0]),
                              f"is set without {k('gpu_reservation_id')}",
                              "remove the ray-eks:gpuReservation* keys, or let `python -m "
                              "capacity probe --hold` or `python -m capacity blocks` write them")
        return
    if not _RESERVATION_ID_RE.match(cfg.gpu_reservation_id):
        yield ConfigError(k("gpu_reservation_id"), cfg.gpu_reservation_id,
                          "is not a capacity reservation ID like cr-0123456789abcdef0",
                          "let `python -m capacity probe --hold` or `python -m capacity blocks` "
                          "write it")
    missing = [name for name in RESERVATION_FIELDS[1:] if not getattr(cfg, name)]
    if missing:
        yield ConfigError(k(missing[0]), None, f"is required with {k('gpu_reservation_id')}",
                          "let `python -m capacity probe --hold` or `python -m capacity blocks` "
                          "write every ray-eks:gpuReservation* key")
    if cfg.gpu_reservation_type not in RESERVATION_KINDS:
        yield ConfigError(k("gpu_reservation_type"), cfg.gpu_reservation_type,
                          f"must be one of {', '.join(RESERVATION_KINDS)}",
                          _fix_cmd(k("gpu_reservation_type"), RESERVATION_KINDS[0]))
    for name in ("gpu_reservation_start", "gpu_reservation_end"):
        try:
            parse_utc(getattr(cfg, name))
        except ValueError:
            yield ConfigError(k(name), getattr(cfg, name), "is not an ISO 8601 time in UTC",
                              "write it like 2026-12-03T11:30:00Z")
    if parse_utc(cfg.gpu_reservation_end) <= parse_utc(cfg.gpu_reservation_start):
        yield ConfigError(k("gpu_reservation_end"), cfg.gpu_reservation_end,
                          f"is not after {k('gpu_reservation_start')} "
                          f"({cfg.gpu_reservation_start})",
                          "write the times EC2 reports for the reservation")
    if cfg.gpu_reservation_instance_type not in INSTANCE_TYPES:
        yield ConfigError(k("gpu_reservation_instance_type"), cfg.gpu_reservation_instance_type,
                          "is not an instance type of infra/instance_types.py",
                          "write the type EC2 reports for the reservation")
    if not cfg.gpu_reservation_availability_zone.startswith(cfg.region) or not re.fullmatch(
            r"[a-z]", cfg.gpu_reservation_availability_zone[len(cfg.region):] or "-"):
        yield ConfigError(k("gpu_reservation_availability_zone"),
                          cfg.gpu_reservation_availability_zone,
                          f"is not an availability zone of {cfg.region}",
                          "write the AZ EC2 reports for the reservation")
    if cfg.gpu_reservation_instance_count < 1:
        yield ConfigError(k("gpu_reservation_instance_count"),
                          cfg.gpu_reservation_instance_count, "must be at least 1",
                          "write the instance count EC2 reports for the reservation")
    owner = f"reservation {cfg.gpu_reservation_id}"
    if cfg.gpu_instance_type != cfg.gpu_reservation_instance_type:
        yield ConfigError(k("gpu_instance_type"), cfg.gpu_instance_type,
                          f"differs from {owner}'s instance type "
                          f"{cfg.gpu_reservation_instance_type}: no instance could launch into it",
                          f"set it back to {cfg.gpu_reservation_instance_type}, {release}")
    if cfg.gpu_availability_zone != cfg.gpu_reservation_availability_zone:
        yield ConfigError(k("gpu_availability_zone"), cfg.gpu_availability_zone,
                          f"differs from {owner}'s AZ {cfg.gpu_reservation_availability_zone}",
                          f"set it back to {cfg.gpu_reservation_availability_zone}, {release}")
    if cfg.gpu_node_count > cfg.gpu_reservation_instance_count:
        yield ConfigError(k("gpu_node_count"), cfg.gpu_node_count,
                          f"exceeds the {cfg.gpu_reservation_instance_count} instances "
                          f"{owner} holds",
                          f"set it to at most {cfg.gpu_reservation_instance_count}, {release}")
    if (cfg.gpu_reservation_type == "capacity-block"
            and not sells_capacity_blocks(cfg.gpu_reservation_instance_type)):
        yield ConfigError(k("gpu_reservation_type"), cfg.gpu_reservation_type,
                          f"EC2 sells no Capacity Blocks for {cfg.gpu_reservation_instance_type}",
                          "write the type EC2 reports for the reservation (on-demand for an ODCR)")


def _settings_problems(cfg: StackConfig) -> Iterator[ConfigError]:
    k = config_key
    if cfg.system_instance_type not in SYSTEM_INSTANCE_TYPES:
        yield ConfigError(k("system_instance_type"), cfg.system_instance_type,
                          "is not a known non-GPU instance type",
                          f"use one of {', '.join(SYSTEM_INSTANCE_TYPES)}")
    m = _K8S_VERSION_RE.match(cfg.kubernetes_version)
    if not m or int(m.group(1)) not in SUPPORTED_KUBERNETES_MINORS:
        ok = ", ".join(f"1.{v}" for v in SUPPORTED_KUBERNETES_MINORS)
        yield ConfigError(k("kubernetes_version"), cfg.kubernetes_version,
                          f"must be a minor version in EKS standard support ({ok})",
                          _fix_cmd(k("kubernetes_version"), f"1.{SUPPORTED_KUBERNETES_MINORS[-1]}"))
    yield from _image_problems(cfg.ray_image)
    if not _SEMVER_RE.match(cfg.ray_version) or cfg.ray_version.startswith("v"):
        yield ConfigError(k("ray_version"), cfg.ray_version, "must be a Ray release like 2.58.0",
                          _fix_cmd(k("ray_version"), "2.58.0"))
    for name in ("nvidia_device_plugin_chart_version", "efa_device_plugin_chart_version",
                 "kuberay_operator_chart_version"):
        value = getattr(cfg, name)
        if not _SEMVER_RE.match(value):
            yield ConfigError(k(name), value, "must pin an exact chart version (X.Y.Z)",
                              _fix_cmd(k(name), getattr(StackConfig, name, None) or "1.0.0"))
    if not cfg.api_access_cidrs:
        yield ConfigError(k("api_access_cidrs"), list(cfg.api_access_cidrs),
                          "must list at least one CIDR allowed to reach the EKS API",
                          f"pulumi config set --path '{k('api_access_cidrs')}[0]' 203.0.113.0/24")
    for cidr in cfg.api_access_cidrs:
        try:
            ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as exc:
            yield ConfigError(k("api_access_cidrs"), cidr, f"is not an IPv4 CIDR ({exc})",
                              "write it like 203.0.113.0/24")
    for arn in cfg.admin_principal_arns:
        session = _ASSUMED_ROLE_RE.match(arn)
        if session:
            partition, account, role = session.groups()
            yield ConfigError(k("admin_principal_arns"), arn,
                              "is an STS session, which EKS access entries refuse",
                              f"list the role itself: arn:{partition}:iam::{account}:role/{role}"
                              " (with its path, if it has one)")
        elif not _ARN_RE.match(arn):
            yield ConfigError(k("admin_principal_arns"), arn, "is not an IAM role or user ARN",
                              "write it like arn:aws:iam::123456789012:role/Admin")
    if not _BUCKET_PREFIX_RE.match(cfg.checkpoint_bucket_prefix):
        yield ConfigError(k("checkpoint_bucket_prefix"), cfg.checkpoint_bucket_prefix,
                          "must be 2-39 lowercase letters, digits or dashes (S3 naming)",
                          _fix_cmd(k("checkpoint_bucket_prefix"), "ray-checkpoints"))
    if not _DNS_LABEL_RE.match(cfg.ray_namespace):
        yield ConfigError(k("ray_namespace"), cfg.ray_namespace,
                          "must be a Kubernetes namespace name (a DNS label)",
                          _fix_cmd(k("ray_namespace"), "ray"))
    if not 100 <= cfg.gpu_root_volume_gib <= 16384:
        yield ConfigError(k("gpu_root_volume_gib"), cfg.gpu_root_volume_gib,
                          "must be between 100 and 16384 GiB (the DLC image alone is tens of GB)",
                          _fix_cmd(k("gpu_root_volume_gib"), 200))
    for addon in ("pod_identity_agent_version", "node_monitoring_agent_version"):
        if not _EKS_ADDON_VERSION_RE.match(getattr(cfg, addon)):
            yield ConfigError(k(addon), getattr(cfg, addon),
                              f"must pin an EKS add-on version like {getattr(StackConfig, addon)}",
                              _fix_cmd(k(addon), getattr(StackConfig, addon)))
    yield from _range_problems(cfg, "system_node_count", 1, 10, "they run a handful of small pods")
    yield from _range_problems(cfg, "checkpoint_noncurrent_version_days", 0, 3650, "0 keeps every version")
    yield from _range_problems(cfg, "checkpoint_incomplete_upload_days", 1, 365, "S3 counts whole days")
    yield from _range_problems(cfg, "workers_ready_timeout_minutes", 0, 180, "0 does not wait")
    if not _ACCOUNT_RE.match(cfg.eks_image_registry_account):
        yield ConfigError(k("eks_image_registry_account"), cfg.eks_image_registry_account,
                          "must be a 12-digit AWS account ID",
                          _fix_cmd(k("eks_image_registry_account"), "602401143452"))


def _image_problems(image: str) -> Iterator[ConfigError]:
    key = config_key("ray_image")
    if _DIGEST_RE.search(image):
        return
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        yield ConfigError(key, image, "has no tag, so it is not pinned",
                          f"pin a version tag or digest, e.g. {DEFAULT_RAY_IMAGE}")
    if tag == "latest" or not _PINNED_TAG_RE.match(tag):
        yield ConfigError(key, image, f"tag {tag!r} is not a version (vX.Y) or a digest",
                          f"pin a version tag or digest, e.g. {DEFAULT_RAY_IMAGE}")


def parse_stack_config(values: Mapping[str, Any]) -> StackConfig:
    """Build a StackConfig from `key -> value` (a stack file's `config:` or Pulumi's config).

    Keys of other namespaces (aws:profile, pulumi:tags, ...) are left alone; unknown keys in this
    program's namespace are refused with the nearest known key as a hint.
    """
    kwargs, errors = _coerce_values(values)
    for f in fields(StackConfig):
        if f.name not in kwargs and f.default is MISSING:  # no default: required
            key = config_key(f.name)
            if key not in {e.key for e in errors}:
                errors.append(ConfigError(key, None, "is required",
                                          "run `python -m capacity probe --stack <stack>` to write it"))
            kwargs[f.name] = ""
    cfg = StackConfig(**kwargs)
    _raise_all(_problems(cfg, known_bad=errors))
    return cfg


PLACEMENT_FIELDS = ("region", "gpu_availability_zone", "gpu_availability_zone_id",
                    "gpu_instance_type", "gpu_node_count")
"""What `python -m capacity probe` writes into a stack file; it keeps every other key."""


RESERVATION_FIELDS = ("gpu_reservation_id", "gpu_reservation_type", "gpu_reservation_instance_type",
                      "gpu_reservation_availability_zone", "gpu_reservation_instance_count",
                      "gpu_reservation_start", "gpu_reservation_end")
"""What `probe --hold` and `blocks` write beside the placement, and `release` removes."""


def check_settings(values: Mapping[str, Any]) -> None:
    """Validate every key of a stack file except the placement the probe is about to write, so a
    bad value fails before the probe makes any cloud call."""
    values_by_name, errors = _coerce_values(values)
    kwargs = {name: value for name, value in values_by_name.items()
              if name not in PLACEMENT_FIELDS + RESERVATION_FIELDS}
    cfg = StackConfig(region="", gpu_availability_zone="", gpu_availability_zone_id="", **kwargs)
    _raise_all(_problems(cfg, placement=False, known_bad=errors))


def _coerce_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[ConfigError]]:
    """Field name -> typed value for this program's keys, and the problems: values of the wrong
    type, unknown keys of its namespace, and keys that look meant for it under another namespace."""
    kwargs: dict[str, Any] = {}
    errors: list[ConfigError] = []
    for key, raw in values.items():
        try:
            if key in _FIELDS:
                if isinstance(raw, Mapping) and "secure" in raw:
                    raise ConfigError(key, "<secret>", "is not a secret value",
                                      _fix_cmd(key, "<value>") + " without --secret")
                kwargs[_FIELDS[key].name] = _coerce(_FIELDS[key].name, key, raw)
            elif key.startswith(f"{PROJECT}:"):
                hint = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
                raise ConfigError(key, raw, "is not a setting of this program",
                                  f"did you mean {hint[0]}?" if hint else
                                  f"remove it; known keys: {', '.join(KNOWN_KEYS)}")
            elif (meant := _meant_for_this_program(key)) is not None:
                raise ConfigError(key, raw, f"is not read: this program's keys are under "
                                  f"`{PROJECT}:`", f"did you mean {meant}?")
        except ConfigError as exc:
            errors.append(exc)
    return kwargs, errors


_NAMES = {key.split(":", 1)[1].lower(): key for key in KNOWN_KEYS if key.startswith(f"{PROJECT}:")}


def _meant_for_this_program(key: str) -> str | None:
    """The key of this program that `key` (of another namespace, or of none) was probably meant
    as: a namespace spelt close to the project's (`rayeks:`), or a setting's own name under
    another namespace (`aws:gpuNodeCount`). None for genuine keys of other namespaces."""
    namespace, _, name = key.rpartition(":")
    close_namespace = difflib.SequenceMatcher(a=namespace.lower(), b=PROJECT).ratio() >= 0.75
    if name.lower() in _NAMES:
        return _NAMES[name.lower()]
    if close_namespace:
        hint = difflib.get_close_matches(f"{PROJECT}:{name}", KNOWN_KEYS, n=1)
        return hint[0] if hint else f"{PROJECT}:{name}"
    return None


def stack_file(stack: str, project_dir: Path | str = ".") -> Path:
    return Path(project_dir) / f"Pulumi.{stack}.yaml"


def read_stack_values(path: Path) -> dict[str, Any]:
    """The `config:` mapping of a stack file; ConfigError when the file is not a stack file."""
    from ruamel.yaml import YAML, YAMLError

    try:
        doc = YAML(typ="safe").load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), NO_VALUE, "does not exist",
                          f"run `python -m capacity probe --stack {_stack_name(path)}` to create it"
                          f"{_other_stacks_hint(path)}") from None
    except YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or exc.__class__.__name__
        raise ConfigError(where, NO_VALUE, f"is not valid YAML ({problem})",
                          "fix the syntax, or move the file away and run the probe again") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("config", {}), dict):
        raise ConfigError(str(path), NO_VALUE, "is not a Pulumi stack file (no `config:` mapping)",
                          "fix the file, or move it away and run the probe again")
    return dict(doc.get("config") or {})


def _stack_name(path: Path) -> str:
    return path.name.removeprefix("Pulumi.").removesuffix(".yaml")


def _other_stacks_hint(path: Path) -> str:
    stacks = sorted(_stack_name(p) for p in path.parent.glob("Pulumi.*.yaml"))
    close = difflib.get_close_matches(_stack_name(path), stacks, n=1)
    if close:
        return f"; or did you mean --stack {close[0]}?"
    return f"; stacks here: {', '.join(stacks)}" if stacks else ""


def key_lines(path: Path) -> dict[str, int]:
    """The line (1-based) of each key under `config:` in a stack file that parses."""
    from ruamel.yaml import YAML

    config = (YAML().load(path.read_text()) or {}).get("config") or {}
    return {key: config.lc.key(key)[0] + 1 for key in config}


def located(error: ConfigError, path: Path) -> ConfigError:
    """`error` (each of ConfigErrors) read from the stack file `path`: with the file and the line
    of its key, in line order, and the stack's name in its fix."""
    errors = error.errors if isinstance(error, ConfigErrors) else (error,)
    lines = key_lines(path)
    placed = sorted(((lines.get(e.key, 0), i, e) for i, e in enumerate(errors)), key=lambda t: t[:2])
    out = [ConfigError(e.key, e.value, e.problem,
                       e.fix.replace("Pulumi.<stack>.yaml", path.name).replace("<stack>", _stack_name(path)),
                       where=f"{path}:{line}" if line else str(path))
           for line, _, e in placed]
    return out[0] if len(out) == 1 else ConfigErrors(out)


def _checked(path: Path, check: Callable[[dict[str, Any]], _T]) -> _T:
    values = read_stack_values(path)
    try:
        return check(values)
    except ConfigError as exc:
        raise located(exc, path) from None


def check_stack_file_settings(path: Path) -> None:
    """`check_settings` of a stack file: every problem at once, each with its line."""
    _checked(path, check_settings)


def load_stack_config(stack: str, project_dir: Path | str = ".") -> StackConfig:
    """The validated config of `Pulumi.<stack>.yaml`: every problem at once, each with its line."""
    return _checked(stack_file(stack, project_dir), parse_stack_config)
