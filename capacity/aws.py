"""One typed wrapper over every AWS call the probe makes.

The boto3 session and `sleep` are passed in, so tests can stub clients (botocore Stubber) or point
the session at moto, and no test ever waits. Every AWS error leaves this module as `AwsFailure`,
already classified (no capacity, quota, unsupported, permission, credentials, ...) and naming the
IAM action of the call that failed.
"""

from __future__ import annotations

import enum
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any, Callable

import boto3
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError as BotoConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ProfileNotFound,
    ReadTimeoutError,
    TokenRetrievalError,
)
from botocore.parsers import ResponseParserError


class FailureKind(enum.Enum):
    NO_CAPACITY = "no-capacity"
    QUOTA = "quota-exceeded"
    UNSUPPORTED = "unsupported"
    DENIED = "permission-denied"
    CREDENTIALS = "credentials"
    REGION_DISABLED = "region-not-enabled"
    NOT_FOUND = "not-found"
    NETWORK = "network"
    TIMEOUT = "timeout"
    OTHER = "error"


_CODES: dict[FailureKind, frozenset[str]] = {
    FailureKind.NO_CAPACITY: frozenset({
        "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
        "InsufficientReservedInstanceCapacity", "InsufficientCapacityOnOutpost",
    }),
    FailureKind.QUOTA: frozenset({
        "InstanceLimitExceeded", "VcpuLimitExceeded", "ReservationLimitExceeded",
        "ReservationCapacityExceeded", "CapacityReservationLimitExceeded",
    }),
    FailureKind.UNSUPPORTED: frozenset({
        "Unsupported", "UnsupportedOperation", "InvalidInstanceType",
    }),
    FailureKind.DENIED: frozenset({
        "UnauthorizedOperation", "AccessDenied", "AccessDeniedException",
    }),
    FailureKind.CREDENTIALS: frozenset({
        "AuthFailure", "InvalidClientTokenId", "UnrecognizedClientException", "ExpiredToken",
        "ExpiredTokenException", "SignatureDoesNotMatch", "IncompleteSignature",
        "InvalidAccessKeyId", "RequestExpired",
    }),
    FailureKind.REGION_DISABLED: frozenset({"OptInRequired"}),
    FailureKind.NOT_FOUND: frozenset({
        "NoSuchResourceException", "InvalidCapacityReservationId.NotFound",
        "InvalidCapacityReservationId.Malformed",
    }),
}
_KIND_OF_CODE = {code: kind for kind, codes in _CODES.items() for code in codes}
# IAM prefixes differ from botocore service names for some services.
_IAM_PREFIX = {"service-quotas": "servicequotas", "monitoring": "cloudwatch"}
# "... is not authorized to perform: ec2:CreateTags on resource ..." names the real missing action,
# which can differ from the called operation (tags on create need ec2:CreateTags too).
_ACTION_IN_MESSAGE = re.compile(r"perform:\s*([a-z0-9-]+:[A-Za-z0-9]+)")


class AwsFailure(Exception):
    """An AWS call that failed, classified. `action` is the IAM action of the failing call."""

    def __init__(self, *, kind: FailureKind, code: str, message: str, action: str):
        # One line: some errors carry a whole response body.
        first_line = message.strip().splitlines()[0] if message.strip() else ""
        message = first_line if len(first_line) <= 300 else first_line[:297] + "..."
        self.kind, self.code, self.message, self.action = kind, code, message, action
        super().__init__(self.summary)

    @property
    def summary(self) -> str:
        if self.kind is FailureKind.DENIED:
            return f"permission denied: the caller lacks IAM action {self.action} ({self.code})"
        if self.kind is FailureKind.CREDENTIALS:
            calling = f" calling {self.action}" if self.action else ""
            return (f"AWS credentials problem{calling}: {self.code}: {self.message}; "
                    f"{credentials_hint(self.code)}")
        if self.kind in (FailureKind.NETWORK, FailureKind.TIMEOUT):
            return (f"cannot reach AWS calling {self.action}: {self.code}: {self.message}; check "
                    f"the network, HTTPS_PROXY and AWS_ENDPOINT_URL")
        return f"{self.code}: {self.message}" if self.message else self.code


_CREDENTIALS_HINTS = {
    "ProfileNotFound": "`aws configure list-profiles` lists the profiles: set AWS_PROFILE to one "
                       "of them, or unset it",
    "NoCredentialsError": "sign in first: `aws configure`, `aws sso login --profile NAME` (then "
                          "AWS_PROFILE=NAME), or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "TokenRetrievalError": "the SSO session has expired: run `aws sso login --profile NAME`",
    "NoRegionError": "set AWS_REGION (or `region` in the profile), or pass --regions",
}
_EXPIRED = ("ExpiredToken", "ExpiredTokenException", "RequestExpired")


def credentials_hint(code: str) -> str:
    """What to do about a credentials failure with this code."""
    if code in _CREDENTIALS_HINTS:
        return _CREDENTIALS_HINTS[code]
    if code in _EXPIRED:
        return ("the session token has expired: sign in again (`aws sso login --profile NAME`) "
                "or refresh AWS_SESSION_TOKEN")
    return ("check which identity is used with `aws sts get-caller-identity`; "
            "`aws configure list` shows where the credentials come from")


def default_session() -> boto3.Session:
    """boto3's session from the standard environment (AWS_PROFILE, AWS_REGION, ...); AwsFailure
    (credentials) when it names a profile that does not exist."""
    try:
        return boto3.Session()
    except BotoCoreError as exc:
        raise classify(exc, action="") from None


def classify(error: Exception, *, action: str) -> AwsFailure:
    """Turn a botocore exception into an `AwsFailure` (pure: inspects the exception only)."""
    if isinstance(error, ClientError):
        err = error.response.get("Error", {})
        code = str(err.get("Code") or "")
        if not code or code.isdigit():  # some endpoints answer with a bare HTTP status
            code = f"HTTP {error.response.get('ResponseMetadata', {}).get('HTTPStatusCode', code)}"
        message = str(err.get("Message", "")).strip()
        kind = _KIND_OF_CODE.get(code, FailureKind.OTHER)
        if kind is FailureKind.DENIED and (m := _ACTION_IN_MESSAGE.search(message)):
            action = m.group(1)
        return AwsFailure(kind=kind, code=code, message=message, action=action)
    if isinstance(error, (NoCredentialsError, PartialCredentialsError, ProfileNotFound,
                          TokenRetrievalError, NoRegionError)):
        return AwsFailure(kind=FailureKind.CREDENTIALS, code=type(error).__name__,
                          message=str(error), action=action)
    if isinstance(error, ReadTimeoutError):
        return AwsFailure(kind=FailureKind.TIMEOUT, code="ReadTimeout", message=str(error),
                          action=action)
    if isinstance(error, BotoConnectionError):
        return AwsFailure(kind=FailureKind.NETWORK, code=type(error).__name__, message=str(error),
                          action=action)
    return AwsFailure(kind=FailureKind.OTHER, code=type(error).__name__, message=str(error),
                      action=action)


@dataclass(frozen=True, kw_only=True)
class InstanceFacts:
    """What describe_instance_types says about one instance type in one region."""

    name: str
    """Instance type, e.g. g6.12xlarge."""
    vcpus: int
    """Default vCPUs: what the On-Demand vCPU quota counts."""
    gpus: int
    """GPUs per instance (0 for none)."""
    gpu_model: str
    """GPU name as AWS reports it (e.g. L4), empty without GPUs."""
    efa_supported: bool
    """Whether the type supports Elastic Fabric Adapter at all."""
    max_efa_interfaces: int
    """EFA interfaces one instance can attach (0 without EFA)."""
    memory_mib: int | None = None
    """The instance's memory (MemoryInfo.SizeInMiB); None when EC2 did not say."""
    gpu_memory_mib: int | None = None
    """Memory of one GPU (GpuInfo.Gpus[].MemoryInfo.SizeInMiB); None when EC2 did not say."""
    network_cards: int | None = None
    """NetworkInfo.MaximumNetworkCards; None when EC2 did not say."""


@dataclass(frozen=True, kw_only=True)
class RunningInstance:
    """A pending or running instance, counted against the vCPU quota of its family."""

    instance_type: str
    """Its instance type."""
    vcpus: int
    """Its vCPUs (cores x threads per core)."""
    spot: bool = False
    """A Spot instance (`InstanceLifecycle: spot`): it counts against the Spot quota instead."""


@dataclass(frozen=True, kw_only=True)
class SpotPrice:
    """The latest Spot price of an instance type in one AZ (DescribeSpotPriceHistory)."""

    zone: str
    """AZ name."""
    zone_id: str
    """AZ ID (empty when EC2 did not report it)."""
    usd_per_hour: float
    """Linux/UNIX price per instance-hour."""
    timestamp: datetime
    """When the price took effect."""


SPOT_SCORE_REGIONS_MAX = 10
"""GetSpotPlacementScores scores at most 10 regions per call (botocore: RegionNames max 10)."""


@dataclass(frozen=True, kw_only=True)
class Reservation:
    """A capacity reservation as AWS reports it."""

    reservation_id: str
    """cr-... identifier."""
    state: str
    """active, pending, failed, cancelled, expired, scheduled, payment-pending, ..."""
    availability_zone: str
    """AZ name the reservation is in."""
    zone_id: str = ""
    """AZ ID, when EC2 reports it."""
    instance_type: str = ""
    """Instance type reserved."""
    instance_count: int = 0
    """Instances reserved."""
    start: datetime | None = None
    """When it starts (a Capacity Block's start; an ODCR's creation)."""
    end: datetime | None = None
    """When it ends (None: unlimited)."""
    reservation_type: str = "default"
    """`default` (an ODCR) or `capacity-block`."""
    tags: dict[str, str] = field(default_factory=dict)
    """Its tags."""


def _reservation(r: dict[str, Any]) -> Reservation:
    """A Reservation from EC2's CapacityReservation shape."""
    return Reservation(
        reservation_id=r["CapacityReservationId"], state=r["State"],
        availability_zone=r["AvailabilityZone"], zone_id=r.get("AvailabilityZoneId", ""),
        instance_type=r.get("InstanceType", ""),
        instance_count=int(r.get("TotalInstanceCount", 0)),
        start=r.get("StartDate") or r.get("CreateDate"), end=r.get("EndDate"),
        reservation_type=r.get("ReservationType", "default"),
        tags={t["Key"]: t["Value"] for t in r.get("Tags", [])})


@dataclass(frozen=True, kw_only=True)
class BlockOffering:
    """A Capacity Block for ML that EC2 offers for sale (DescribeCapacityBlockOfferings)."""

    offering_id: str
    """cb-... identifier: what a purchase names."""
    instance_type: str
    """Instance type."""
    availability_zone: str
    """AZ name the block would be in."""
    instance_count: int
    """Instances."""
    start: datetime
    """Start of the reservation."""
    end: datetime
    """End of the reservation (EC2 reclaims instances from 30 minutes before)."""
    duration_hours: int
    """Length in hours."""
    upfront_fee: Decimal
    """Price, paid at purchase."""
    currency: str
    """Currency of the price (USD)."""

    @property
    def per_instance_hour(self) -> Decimal:
        hours = Decimal(max(1, self.duration_hours * self.instance_count))
        return (self.upfront_fee / hours).quantize(Decimal("0.0001"))


class AwsApi:
    """Typed access to EC2, Service Quotas, CloudWatch and STS, one client per (service, region).

    Clients are created under a lock (a boto3 Session is not thread-safe; its clients are), so the
    region probes can share one AwsApi from a thread pool.
    """

    def __init__(self, *, session: boto3.Session, sleep: Callable[[float], None] = time.sleep,
                 call_timeout_s: float = 20.0, now: Callable[[], datetime] | None = None):
        self._session = session
        self.sleep = sleep
        self._now = now or (lambda: datetime.now(timezone.utc))
        # Standard retries (3 attempts unless AWS_MAX_ATTEMPTS says otherwise) for throttling and
        # 5xx. Creating a reservation is sent once: EC2 reports no capacity as a 5xx, and the next
        # AZ should be tried at once rather than the same one after a backoff.
        timeouts = {"connect_timeout": min(5.0, call_timeout_s), "read_timeout": call_timeout_s}
        self._configs = {True: Config(**timeouts, retries={"mode": "standard"}),
                         False: Config(**timeouts, retries={"mode": "standard",
                                                            "total_max_attempts": 1})}
        self._clients: dict[tuple[str, str, bool], BaseClient] = {}
        self._lock = threading.Lock()

    def client(self, service: str, region: str, *, retry: bool = True) -> BaseClient:
        key = (service, region, retry)
        with self._lock:
            if key not in self._clients:
                try:
                    self._clients[key] = self._session.client(service, region_name=region,
                                                              config=self._configs[retry])
                except BotoCoreError as exc:
                    raise classify(exc, action=f"{service}:client") from None
            return self._clients[key]

    def _call(self, service: str, region: str, operation: str, *, retry: bool = True,
              **kwargs: Any) -> dict[str, Any]:
        client = self.client(service, region, retry=retry)
        op_name = client.meta.method_to_api_mapping.get(operation, operation)
        action = f"{_IAM_PREFIX.get(service, service)}:{op_name}"
        try:
            return getattr(client, operation)(**kwargs)
        except (ClientError, BotoCoreError, ResponseParserError) as exc:
            raise classify(exc, action=action) from None

    def _paginate(self, service: str, region: str, operation: str, key: str,
                  **kwargs: Any) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        while True:
            page = self._call(service, region, operation, **kwargs)
            items.extend(page.get(key, []))
            if not page.get("NextToken"):
                return items
            kwargs["NextToken"] = page["NextToken"]

    # --- identity and regions --------------------------------------------------------------------

    def caller_account(self, *, region: str) -> str:
        return str(self._call("sts", region, "get_caller_identity")["Account"])

    def enabled_regions(self, *, region: str) -> list[str]:
        regions = self._call("ec2", region, "describe_regions")["Regions"]
        return sorted(r["RegionName"] for r in regions)

    # --- offerings and instance facts ------------------------------------------------------------

    def availability_zones(self, *, region: str) -> dict[str, str]:
        """AZ name -> AZ ID of the region's available, standard AZs (no Local/Wavelength zones)."""
        zones = self._call("ec2", region, "describe_availability_zones",
                           Filters=[{"Name": "zone-type", "Values": ["availability-zone"]},
                                    {"Name": "state", "Values": ["available"]}])
        return {z["ZoneName"]: z["ZoneId"] for z in zones["AvailabilityZones"]}

    def offered_zones(self, *, region: str, instance_type: str) -> frozenset[str]:
        """Names of the AZs where the instance type is offered."""
        offers = self._paginate("ec2", region, "describe_instance_type_offerings",
                                "InstanceTypeOfferings", LocationType="availability-zone",
                                Filters=[{"Name": "instance-type", "Values": [instance_type]}])
        return frozenset(o["Location"] for o in offers)

    def instance_facts(self, *, region: str, instance_type: str) -> InstanceFacts | None:
        """Facts about the type, or None when the region does not know it."""
        try:
            found = self._call("ec2", region, "describe_instance_types",
                               InstanceTypes=[instance_type])["InstanceTypes"]
        except AwsFailure as failure:
            if failure.code in ("InvalidInstanceType", "InvalidParameterValue"):
                return None
            raise
        if not found:
            return None
        t = found[0]
        gpus = t.get("GpuInfo", {}).get("Gpus", [])
        net = t.get("NetworkInfo", {})
        memory = gpus[0].get("MemoryInfo", {}).get("SizeInMiB") if gpus else None
        cards = net.get("MaximumNetworkCards")
        return InstanceFacts(
            name=t["InstanceType"], vcpus=int(t["VCpuInfo"]["DefaultVCpus"]),
            gpus=sum(int(g.get("Count", 0)) for g in gpus),
            gpu_model=gpus[0].get("Name", "") if gpus else "",
            efa_supported=bool(net.get("EfaSupported", False)),
            max_efa_interfaces=int(net.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)),
            memory_mib=t.get("MemoryInfo", {}).get("SizeInMiB"),
            gpu_memory_mib=None if memory is None else int(memory),
            network_cards=None if cards is None else int(cards))

    # --- quota and usage -------------------------------------------------------------------------

    def applied_quota(self, *, region: str, quota_code: str) -> float | None:
        """The account's applied quota value, or None when no value is applied (default holds)."""
        try:
            quota = self._call("service-quotas", region, "get_service_quota", ServiceCode="ec2",
                               QuotaCode=quota_code)
        except AwsFailure as failure:
            if failure.kind is FailureKind.NOT_FOUND:
                return None
            raise
        return float(quota["Quota"]["Value"])

    def default_quota(self, *, region: str, quota_code: str) -> float | None:
        try:
            quota = self._call("service-quotas", region, "get_aws_default_service_quota",
                               ServiceCode="ec2", QuotaCode=quota_code)
        except AwsFailure as failure:
            if failure.kind is FailureKind.NOT_FOUND:
                return None
            raise
        return float(quota["Quota"]["Value"])

    def usage_metric(self, *, region: str, usage_class: str) -> float | None:
        """Latest AWS/Usage vCPU count of an On-Demand usage class (e.g. G/OnDemand), if any."""
        end = self._now()
        stats = self._call(
            "cloudwatch", region, "get_metric_statistics", Namespace="AWS/Usage",
            MetricName="ResourceCount", StartTime=end - timedelta(minutes=15), EndTime=end,
            Period=60, Statistics=["Maximum"],
            Dimensions=[{"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"},
                        {"Name": "Resource", "Value": "vCPU"},
                        {"Name": "Class", "Value": usage_class}])
        points = sorted(stats.get("Datapoints", []), key=lambda p: p["Timestamp"])
        return float(points[-1]["Maximum"]) if points else None

    def running_instances(self, *, region: str) -> list[RunningInstance]:
        reservations = self._paginate(
            "ec2", region, "describe_instances", "Reservations",
            Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
        instances = [i for res in reservations for i in res.get("Instances", [])]
        # CpuOptions is normally present; where it is not, count the type's default vCPUs.
        missing = sorted({i["InstanceType"] for i in instances if "CpuOptions" not in i})
        default_vcpus = self._default_vcpus(region=region, instance_types=missing)
        out = []
        for inst in instances:
            cpu = inst.get("CpuOptions")
            vcpus = (int(cpu.get("CoreCount", 0)) * int(cpu.get("ThreadsPerCore", 1)) if cpu
                     else default_vcpus.get(inst["InstanceType"], 0))
            out.append(RunningInstance(instance_type=inst["InstanceType"], vcpus=vcpus,
                                       spot=inst.get("InstanceLifecycle") == "spot"))
        return out

    # --- Spot ------------------------------------------------------------------------------------

    def spot_placement_scores(self, *, region: str, instance_type: str,
                              count: int) -> dict[str, int]:
        """AZ ID -> Spot placement score (1-10) of `count` instances of one type launched in one
        AZ of `region` (SingleAvailabilityZone; units are instances). EC2 answers only for the
        zones it scores (the top ones), and scores a single instance type low on purpose: the
        scores rank the zones, they are no promise."""
        scores = self._paginate(
            "ec2", region, "get_spot_placement_scores", "SpotPlacementScores",
            InstanceTypes=[instance_type], TargetCapacity=count, TargetCapacityUnitType="units",
            SingleAvailabilityZone=True, RegionNames=[region], MaxResults=10)
        return {s["AvailabilityZoneId"]: int(s["Score"]) for s in scores
                if s.get("AvailabilityZoneId") and s.get("Region", region) == region}

    def spot_prices(self, *, region: str, instance_type: str) -> list[SpotPrice]:
        """The current Linux/UNIX Spot price of the type in each AZ of the region that sells it:
        with StartTime now, EC2 returns the price in effect in each zone."""
        history = self._paginate(
            "ec2", region, "describe_spot_price_history", "SpotPriceHistory",
            InstanceTypes=[instance_type], ProductDescriptions=["Linux/UNIX"],
            StartTime=self._now())
        latest: dict[str, SpotPrice] = {}
        for h in history:
            price = SpotPrice(zone=h["AvailabilityZone"], zone_id=h.get("AvailabilityZoneId", ""),
                              usd_per_hour=float(h["SpotPrice"]), timestamp=h["Timestamp"])
            if price.zone not in latest or price.timestamp > latest[price.zone].timestamp:
                latest[price.zone] = price
        return [latest[zone] for zone in sorted(latest)]

    def _default_vcpus(self, *, region: str, instance_types: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in range(0, len(instance_types), 100):
            found = self._call("ec2", region, "describe_instance_types",
                               InstanceTypes=instance_types[i:i + 100])["InstanceTypes"]
            out.update({t["InstanceType"]: int(t["VCpuInfo"]["DefaultVCpus"]) for t in found})
        return out

    # --- capacity reservations -------------------------------------------------------------------

    def create_reservation(self, *, region: str, availability_zone: str, instance_type: str,
                           count: int, end_date: datetime, tags: dict[str, str],
                           client_token: str, dry_run: bool = False) -> Reservation:
        """A targeted, limited-end-date On-Demand Capacity Reservation. With dry_run, AWS only
        checks permissions: success raises nothing and returns an empty Reservation."""
        try:
            res = self._call(
                "ec2", region, "create_capacity_reservation", retry=False, ClientToken=client_token,
                InstanceType=instance_type, InstancePlatform="Linux/UNIX",
                AvailabilityZone=availability_zone, InstanceCount=count, Tenancy="default",
                InstanceMatchCriteria="targeted", EndDateType="limited", EndDate=end_date,
                TagSpecifications=[{"ResourceType": "capacity-reservation",
                                    "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}],
                DryRun=dry_run)["CapacityReservation"]
        except AwsFailure as failure:
            if dry_run and failure.code == "DryRunOperation":
                return Reservation(reservation_id="", state="dry-run",
                                   availability_zone=availability_zone)
            raise
        return _reservation(res)

    def cancel_reservation(self, *, region: str, reservation_id: str,
                           dry_run: bool = False) -> None:
        try:
            self._call("ec2", region, "cancel_capacity_reservation",
                       CapacityReservationId=reservation_id, DryRun=dry_run)
        except AwsFailure as failure:
            if dry_run and failure.code == "DryRunOperation":
                return
            raise

    def reservations_tagged(self, *, region: str, tag_key: str, tag_value: str | None = None,
                            states: tuple[str, ...] = ("active", "pending")) -> list[Reservation]:
        """Reservations carrying the tag (any value unless given) in one of `states` (by default
        those that still hold capacity)."""
        tag_filter = ({"Name": f"tag:{tag_key}", "Values": [tag_value]} if tag_value is not None
                      else {"Name": "tag-key", "Values": [tag_key]})
        found = self._paginate("ec2", region, "describe_capacity_reservations",
                               "CapacityReservations",
                               Filters=[tag_filter, {"Name": "state", "Values": list(states)}])
        return [_reservation(r) for r in found]

    def reservation(self, *, region: str, reservation_id: str) -> Reservation:
        found = self._call("ec2", region, "describe_capacity_reservations",
                           CapacityReservationIds=[reservation_id])["CapacityReservations"]
        return _reservation(found[0])

    def extend_reservation(self, *, region: str, reservation_id: str, end_date: datetime,
                           dry_run: bool = False) -> None:
        """Move a reservation's (limited) end date."""
        try:
            self._call("ec2", region, "modify_capacity_reservation",
                       CapacityReservationId=reservation_id, EndDateType="limited",
                       EndDate=end_date, DryRun=dry_run)
        except AwsFailure as failure:
            if dry_run and failure.code == "DryRunOperation":
                return
            raise

    def tag_reservation(self, *, region: str, reservation_id: str, tags: dict[str, str],
                        dry_run: bool = False) -> None:
        """Set tags on a reservation (a tag that exists gets the new value)."""
        try:
            self._call("ec2", region, "create_tags", Resources=[reservation_id],
                       Tags=[{"Key": k, "Value": v} for k, v in tags.items()], DryRun=dry_run)
        except AwsFailure as failure:
            if dry_run and failure.code == "DryRunOperation":
                return
            raise

    # --- Capacity Blocks for ML ------------------------------------------------------------------

    def capacity_block_offerings(self, *, region: str, instance_type: str, count: int,
                                 duration_hours: int, start_after: datetime | None = None,
                                 end_before: datetime | None = None) -> list[BlockOffering]:
        """The blocks EC2 offers for sale now for this type, count and duration."""
        dates: dict[str, Any] = {}
        if start_after is not None:
            dates["StartDateRange"] = start_after
        if end_before is not None:
            dates["EndDateRange"] = end_before
        found = self._paginate("ec2", region, "describe_capacity_block_offerings",
                               "CapacityBlockOfferings", InstanceType=instance_type,
                               InstanceCount=count, CapacityDurationHours=duration_hours,
                               **dates)
        return [BlockOffering(
            offering_id=o["CapacityBlockOfferingId"], instance_type=o["InstanceType"],
            availability_zone=o["AvailabilityZone"], instance_count=int(o["InstanceCount"]),
            start=o["StartDate"], end=o["EndDate"],
            duration_hours=int(o.get("CapacityBlockDurationHours", 0)),
            upfront_fee=Decimal(str(o["UpfrontFee"])), currency=o.get("CurrencyCode", "USD"))
            for o in found]

    def purchase_capacity_block(self, *, region: str, offering_id: str,
                                tags: dict[str, str]) -> Reservation:
        """Buy a Capacity Block (it bills at once and cannot be cancelled). Sent once, never
        retried: the call takes no client token, so a retry could buy a second block."""
        res = self._call(
            "ec2", region, "purchase_capacity_block", retry=False,
            CapacityBlockOfferingId=offering_id, InstancePlatform="Linux/UNIX",
            TagSpecifications=[{"ResourceType": "capacity-reservation",
                                "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])
        return _reservation(res["CapacityReservation"])

    def now(self) -> datetime:
        return self._now()
