"""The validation rules of every setting but the reservation: placement, versions, images, names
and ranges. Each yields ConfigErrors; none makes a cloud call."""

from __future__ import annotations

import difflib
import functools
import ipaddress
import re
from typing import Iterator

from infra.config.errors import ConfigError, fix_cmd
from infra.config.open_addresses import LIMIT_NAMES, OPEN_ADDRESS_LIMITS, addresses_opened
from infra.config.schema import CAPACITY_TYPES, DEFAULT_RAY_IMAGE, MLFLOW_SIZES, StackConfig, config_key
from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES, SYSTEM_INSTANCE_TYPES
from infra.sizing import HUGE_PAGE_MIB, max_huge_pages_mib

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


def looks_like_region(name: str) -> bool:
    """Spelt like an AWS region name (a country code, one or more direction words, a number; the
    partition's word first for GovCloud): whether it exists is AWS's to say."""
    return bool(_REGION_RE.match(name))


@functools.cache
def known_regions() -> frozenset[str]:
    """The regions of every AWS partition, from botocore's endpoint data (no call to AWS)."""
    import botocore.session

    session = botocore.session.get_session()
    return frozenset(region for partition in session.get_available_partitions()
                     for region in session.get_available_regions("ec2", partition_name=partition))


def az_id_prefix(region: str) -> str:
    """The region part of its AZ IDs (usw2 in usw2-az1): the country code, a letter per part of
    the name (two for northeast and the like), the number; every region follows the scheme."""
    country, *parts, number = region.split("-")
    return country + "".join(_DIRECTION_LETTERS.get(part, part[:1]) for part in parts) + number


_DIRECTION_LETTERS = {"northeast": "ne", "northwest": "nw", "southeast": "se", "southwest": "sw"}


def placement_problems(cfg: StackConfig, *, skip: set[str]) -> Iterator[ConfigError]:
    k = config_key
    region_ok = k("region") not in skip and bool(_REGION_RE.match(cfg.region))
    if k("region") not in skip and not region_ok:
        yield ConfigError(k("region"), cfg.region, "is not an AWS region name",
                          fix_cmd(k("region"), "<region>"))
    elif region_ok and cfg.region not in known_regions():
        # Spelt like a region but none (us-wset-2): the region is at fault, not the AZs that follow it.
        region_ok = False
        close = difflib.get_close_matches(cfg.region, sorted(known_regions()), n=1)
        yield ConfigError(k("region"), cfg.region, "is not an AWS region",
                          f"did you mean {close[0]}?" if close else fix_cmd(k("region"), "<region>"))
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
                          fix_cmd(k("gpu_node_count"), 2))
    if cfg.gpu_instance_type in GPU_INSTANCE_TYPES and cfg.gpu_huge_pages_mib > 0:
        most = max_huge_pages_mib(INSTANCE_TYPES[cfg.gpu_instance_type])
        if cfg.gpu_huge_pages_mib > most:
            yield ConfigError(k("gpu_huge_pages_mib"), cfg.gpu_huge_pages_mib,
                              f"is more than a {cfg.gpu_instance_type} node can offer ({most} MiB, "
                              "what a full EFA installation reserves)",
                              f"{fix_cmd(k('gpu_huge_pages_mib'), 0)}; or the hugepages-2Mi "
                              f"your GPU nodes report, at most {most}")


_PRICE_RE = re.compile(r"^\d{1,4}(\.\d{1,6})?$")


def capacity_type_problems(cfg: StackConfig) -> Iterator[ConfigError]:
    """gpuCapacityType is on-demand or spot; a Spot price is a plain number, and only with spot;
    Spot capacity has no reservation to launch into."""
    k = config_key
    if cfg.gpu_capacity_type not in CAPACITY_TYPES:
        yield ConfigError(k("gpu_capacity_type"), cfg.gpu_capacity_type,
                          f"must be one of {', '.join(CAPACITY_TYPES)}",
                          fix_cmd(k("gpu_capacity_type"), "spot"))
        return
    price = cfg.gpu_spot_price_usd_per_hour
    if price and not _PRICE_RE.match(price):
        yield ConfigError(k("gpu_spot_price_usd_per_hour"), price,
                          "is not a price in USD per hour like 1.7412",
                          "run `python -m capacity probe --capacity-type spot` to read it from EC2, "
                          "or remove it")
    elif price and not cfg.is_spot:
        yield ConfigError(k("gpu_spot_price_usd_per_hour"), price,
                          f"is set while {k('gpu_capacity_type')} is {cfg.gpu_capacity_type}",
                          f"remove it, or {fix_cmd(k('gpu_capacity_type'), 'spot')}")
    if cfg.is_spot and cfg.gpu_reservation_id:
        yield ConfigError(k("gpu_capacity_type"), cfg.gpu_capacity_type,
                          f"cannot launch into capacity reservation {cfg.gpu_reservation_id}: a "
                          "reservation holds On-Demand (or Capacity Block) capacity, never Spot",
                          "run `python -m capacity release --stack <stack>` first, or remove "
                          f"{k('gpu_capacity_type')} to use the reservation")


def range_problems(cfg: StackConfig, name: str, low: int, high: int, why: str) -> Iterator[ConfigError]:
    value = getattr(cfg, name)
    if not low <= value <= high:
        yield ConfigError(config_key(name), value, f"must be between {low} and {high} ({why})",
                          fix_cmd(config_key(name), getattr(StackConfig, name)))


def settings_problems(cfg: StackConfig) -> Iterator[ConfigError]:
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
                          fix_cmd(k("kubernetes_version"), f"1.{SUPPORTED_KUBERNETES_MINORS[-1]}"))
    yield from image_problems(cfg.ray_image)
    if not _SEMVER_RE.match(cfg.ray_version) or cfg.ray_version.startswith("v"):
        yield ConfigError(k("ray_version"), cfg.ray_version, "must be a Ray release like 2.58.0",
                          fix_cmd(k("ray_version"), "2.58.0"))
    for name in ("nvidia_device_plugin_chart_version", "efa_device_plugin_chart_version",
                 "kuberay_operator_chart_version", "cluster_autoscaler_chart_version",
                 "node_termination_handler_chart_version"):
        value = getattr(cfg, name)
        if not _SEMVER_RE.match(value):
            yield ConfigError(k(name), value, "must pin an exact chart version (X.Y.Z)",
                              fix_cmd(k(name), getattr(StackConfig, name, None) or "1.0.0"))
    yield from api_access_problems(cfg)
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
                          fix_cmd(k("checkpoint_bucket_prefix"), "ray-checkpoints"))
    if not _DNS_LABEL_RE.match(cfg.ray_namespace):
        yield ConfigError(k("ray_namespace"), cfg.ray_namespace,
                          "must be a Kubernetes namespace name (a DNS label)",
                          fix_cmd(k("ray_namespace"), "ray"))
    if not 100 <= cfg.gpu_root_volume_gib <= 16384:
        yield ConfigError(k("gpu_root_volume_gib"), cfg.gpu_root_volume_gib,
                          "must be between 100 and 16384 GiB (the DLC image alone is tens of GB)",
                          fix_cmd(k("gpu_root_volume_gib"), 200))
    for addon in ("pod_identity_agent_version", "vpc_cni_version", "node_monitoring_agent_version"):
        if not _EKS_ADDON_VERSION_RE.match(getattr(cfg, addon)):
            yield ConfigError(k(addon), getattr(cfg, addon),
                              f"must pin an EKS add-on version like {getattr(StackConfig, addon)}",
                              fix_cmd(k(addon), getattr(StackConfig, addon)))
    yield from range_problems(cfg, "system_node_count", 1, 10, "they run a handful of small pods")
    yield from range_problems(cfg, "checkpoint_noncurrent_version_days", 0, 3650, "0 keeps every version")
    yield from range_problems(cfg, "checkpoint_incomplete_upload_days", 1, 365, "S3 counts whole days")
    yield from range_problems(cfg, "workers_ready_timeout_minutes", 0, 180, "0 does not wait")
    yield from range_problems(cfg, "gpu_idle_minutes", 0, 1440,
                              "0 keeps the GPU nodes up; at most a day")
    if cfg.gpu_huge_pages_mib < 0 or cfg.gpu_huge_pages_mib % HUGE_PAGE_MIB:
        yield ConfigError(k("gpu_huge_pages_mib"), cfg.gpu_huge_pages_mib,
                          f"must be 0 or more, in whole {HUGE_PAGE_MIB} MiB pages (an even number)",
                          fix_cmd(k("gpu_huge_pages_mib"), 0))
    if cfg.mlflow_size not in MLFLOW_SIZES:
        close = next((s for s in MLFLOW_SIZES if s.lower() == str(cfg.mlflow_size).lower()), "Small")
        yield ConfigError(k("mlflow_size"), cfg.mlflow_size,
                          f"is not a tracking server size ({', '.join(MLFLOW_SIZES)})",
                          fix_cmd(k("mlflow_size"), close))
    if not _ACCOUNT_RE.match(cfg.eks_image_registry_account):
        yield ConfigError(k("eks_image_registry_account"), cfg.eks_image_registry_account,
                          "must be a 12-digit AWS account ID",
                          fix_cmd(k("eks_image_registry_account"), "602401143452"))


def api_access_problems(cfg: StackConfig) -> Iterator[ConfigError]:
    """Each of apiAccessCidrs is an IPv4 CIDR, and together they open no more than one organisation's
    range (OPEN_ADDRESS_LIMITS), unless apiOpenToInternet says the stack means it."""
    key = config_key("api_access_cidrs")
    open_fix = (f"list your own address or range (pulumi config set --path '{key}[0]' "
                f"\"$(curl -fsS https://checkip.amazonaws.com)/32\"), or remove it for a private endpoint; if you "
                f"mean it, pulumi config set {config_key('api_open_to_internet')} true")
    parsed = []
    for cidr in cfg.api_access_cidrs:
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError as exc:
            yield ConfigError(key, cidr, f"is not an IPv4 CIDR ({exc})", "write it like 203.0.113.0/24")
            continue
        if network.version == 6:
            yield ConfigError(key, cidr, "is an IPv6 CIDR, and EKS takes IPv6 public access CIDRs only on IPv6 "
                              "clusters (this stack's cluster is IPv4)",
                              "list the IPv4 address or range you reach the API from, like 203.0.113.7/32")
        elif "/" not in cidr:  # ipaddress reads a bare address as /32: say so rather than guess
            yield ConfigError(key, cidr, "is an address, not a CIDR", f"write {cidr}/32 for that one address")
        elif network.prefixlen == 0 and not cfg.api_open_to_internet:
            yield ConfigError(key, cidr, "opens the EKS API of a cluster that runs any code it is sent to every "
                              "address on the internet", open_fix)
        else:
            parsed.append(cidr)
    if len(parsed) < len(cfg.api_access_cidrs) or cfg.api_open_to_internet:
        return
    opened = addresses_opened(parsed).get(4, 0)
    if opened > OPEN_ADDRESS_LIMITS[4]:
        yield ConfigError(key, list(cfg.api_access_cidrs),
                          f"together open {opened:,} IPv4 addresses, more than {LIMIT_NAMES[4]} "
                          f"({OPEN_ADDRESS_LIMITS[4]:,}, the most one organisation holds): the EKS API of a "
                          "cluster that runs any code it is sent would be open to a large part of the internet",
                          open_fix)


def image_problems(image: str) -> Iterator[ConfigError]:
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
