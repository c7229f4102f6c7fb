"""The probe's results as plain frozen data, and the pure decisions taken on them.

Nothing here calls AWS: `capacity.regions` gathers `RegionReport`s, `capacity.reserve` records
`ReservationAttempt`s, and the functions below rank the zones, pick the placement and explain, per
location, why anything else was not picked. Tests build these values by hand.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from capacity.aws import FailureKind, InstanceFacts
from capacity.quota import QuotaCheck, QuotaVerdict
from infra.instance_types import INSTANCE_TYPES

EXIT_PLACED = 0
EXIT_NO_PLACEMENT = 1
EXIT_BAD_INPUT = 2
EXIT_PERMISSION = 3


@dataclass(frozen=True, kw_only=True)
class ProbeRequest:
    """What to place: validated user input."""

    instance_type: str
    """GPU instance type of the node group."""
    node_count: int
    """GPU nodes, all in one AZ (cluster placement group)."""
    regions: tuple[str, ...]
    """Regions to probe, in the user's order of preference."""
    reserve: bool = False
    """Prove capacity with a create-and-cancel On-Demand Capacity Reservation."""
    current_zone_id: str = ""
    """AZ ID the stack uses now; kept when it still qualifies, so the node group does not move."""
    fallback_types: tuple[str, ...] = ()
    """Further instance types to probe (`--instance-types`): placements of all of them are
    ranked together."""
    hold_hours: float = 0.0
    """Keep the proving reservation for this many hours instead of cancelling it (`--hold`)."""
    capacity_type: str = "on-demand"
    """`on-demand` or `spot` (`--capacity-type`): Spot zones are ranked by EC2's Spot placement
    score and price, against the Spot vCPU quota."""

    @property
    def spot(self) -> bool:
        return self.capacity_type == "spot"

    @property
    def instance_types(self) -> tuple[str, ...]:
        return (self.instance_type, *self.fallback_types)


@dataclass(frozen=True, kw_only=True)
class ZoneOffer:
    """One AZ of a region and whether it offers the instance type."""

    name: str
    """AZ name in this account (e.g. us-west-2a); names are shuffled between accounts."""
    zone_id: str
    """AZ ID (e.g. usw2-az1); the same physical zone in every account."""
    offered: bool
    """describe_instance_type_offerings lists the type in this AZ."""
    spot_score: int | None = None
    """Spot placement score of the node group in this AZ (1-10, GetSpotPlacementScores); None
    when not asked (On-Demand) or when EC2 gave this zone none."""
    spot_usd_per_hour: float | None = None
    """The latest Spot price of one instance here (DescribeSpotPriceHistory); None when not asked
    or EC2 sells no Spot of the type in this AZ."""


@dataclass(frozen=True, kw_only=True)
class RegionFailure:
    """Why a region could not be probed."""

    kind: FailureKind
    """Classification of the failure."""
    message: str
    """One line for the user."""
    action: str = ""
    """IAM action of the failing call (names the missing permission when kind is DENIED)."""


@dataclass(frozen=True, kw_only=True)
class RegionReport:
    """Everything learned about one region, or the failure that stopped the probe there."""

    region: str
    """Region name."""
    facts: InstanceFacts | None = None
    """Instance facts; None when the region does not know the type or the probe failed."""
    zones: tuple[ZoneOffer, ...] = ()
    """The region's AZs, sorted by name."""
    quota: QuotaCheck | None = None
    """Quota check; None when no AZ offers the type (nothing to check)."""
    failure: RegionFailure | None = None
    """Set when the probe of this region failed or timed out."""
    elapsed_s: float = 0.0
    """Wall time of this region's probe."""
    instance_type: str = ""
    """The instance type probed (empty: the request's only type)."""
    spot_problem: str = ""
    """Why the Spot scores or prices could not be read (the zones are then ranked without them)."""

    @property
    def offered(self) -> tuple[ZoneOffer, ...]:
        return tuple(z for z in self.zones if z.offered)

    @property
    def lacks_efa(self) -> bool:
        return self.facts is not None and (not self.facts.efa_supported
                                           or self.facts.max_efa_interfaces < 1)

    @property
    def table_mismatch(self) -> str:
        """How EC2's facts differ from the instance table's, empty when they agree (or unknown)."""
        return "" if self.facts is None else table_mismatch(self.facts)

    @property
    def blocker(self) -> str:
        """Why no AZ of this region qualifies, empty when some may."""
        if self.failure is not None:
            return self.failure.message
        if self.facts is None:
            return "instance type not available in this region"
        if self.lacks_efa:
            return f"{self.facts.name} does not support EFA"
        if self.table_mismatch:
            return self.table_mismatch
        if not self.offered:
            return f"{self.facts.name} not offered in any AZ"
        if self.quota is not None and self.quota.verdict is QuotaVerdict.SHORT:
            return (f"{self.quota.market} vCPU quota {self.quota.quota_code} short: "
                    f"{self.quota.free_vcpus:g} free < {self.quota.needed_vcpus} needed")
        return ""


def same_gpu_memory(table_gib: int, ec2_mib: int) -> bool:
    """Whether EC2's MiB of one GPU is the table's figure: EC2 gives HBM parts in GiB (81920 MiB
    for an 80 GiB H100) and GDDR cards in decimal GB (22888 MiB for a 24 GB L4)."""
    return table_gib in (round(ec2_mib / 1024), round(ec2_mib * 2**20 / 1e9))


def table_mismatch(facts: InstanceFacts) -> str:
    """Where DescribeInstanceTypes contradicts infra/instance_types.py (vCPUs, memory, GPUs, GPU
    memory, EFA interfaces, network cards), naming both figures; empty when they agree or the table
    lacks the type. The worker pods, the launch template and the presets are sized from the table, so a
    difference stops the probe there rather than deploy a cluster that does not fit its nodes."""
    known = INSTANCE_TYPES.get(facts.name)
    if known is None:
        return ""
    differences = []
    if facts.vcpus != known.vcpus:
        differences.append(f"vCPUs: the table {known.vcpus}, EC2 {facts.vcpus}")
    if facts.memory_mib is not None and facts.memory_mib != known.memory_gib * 1024:
        differences.append(f"memory: the table {known.memory_gib} GiB, EC2 {facts.memory_mib} MiB")
    if (facts.gpus, facts.gpu_model) != (known.gpus, known.gpu_model):
        differences.append(f"GPUs: the table {known.gpus} x {known.gpu_model or '-'}, "
                           f"EC2 {facts.gpus} x {facts.gpu_model or '-'}")
    if facts.gpu_memory_mib is not None and known.gpus and not same_gpu_memory(known.gpu_memory_gib,
                                                                               facts.gpu_memory_mib):
        differences.append(f"memory per GPU: the table {known.gpu_memory_gib} GiB, EC2 "
                           f"{facts.gpu_memory_mib} MiB")
    if facts.max_efa_interfaces != known.efa_interfaces:
        differences.append(f"EFA interfaces: the table {known.efa_interfaces}, EC2 "
                           f"{facts.max_efa_interfaces}")
    if facts.network_cards is not None and facts.network_cards != known.network_cards:
        differences.append(f"network cards: the table {known.network_cards}, EC2 {facts.network_cards}")
    if not differences:
        return ""
    return (f"infra/instance_types.py and EC2's DescribeInstanceTypes disagree on {facts.name}: "
            + "; ".join(differences) + " (the pods and launch template are sized from the table: "
            "correct it)")


class Evidence(enum.IntEnum):
    """How strongly a placement is backed; lower is stronger."""

    CAPACITY_PROVEN = 0
    QUOTA_OK = 1
    QUOTA_UNCHECKED = 2

    @property
    def label(self) -> str:
        return {0: "capacity proven", 1: "offered, quota ok",
                2: "offered, quota unchecked"}[self.value]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """An AZ that passed the offering, EFA and quota checks."""

    region: str
    """Region name."""
    zone: str
    """AZ name."""
    zone_id: str
    """AZ ID."""
    evidence: Evidence
    """Strongest evidence before any reservation."""
    instance_type: str = ""
    """Instance type (empty: the request's only type)."""
    spot_score: int | None = None
    """The zone's Spot placement score (Spot only)."""
    spot_usd_per_hour: float | None = None
    """The zone's latest Spot price per instance (Spot only)."""


class AttemptOutcome(enum.Enum):
    PROVEN = "proven"
    NO_CAPACITY = "no capacity"
    QUOTA = "quota exceeded"
    UNSUPPORTED = "not supported"
    DENIED = "permission denied"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True, kw_only=True)
class ReservationAttempt:
    """One create-and-cancel of a capacity reservation in one AZ."""

    region: str
    """Region name."""
    zone: str
    """AZ name."""
    zone_id: str
    """AZ ID."""
    outcome: AttemptOutcome
    """What happened."""
    detail: str = ""
    """Error code and message, or why the attempt was skipped."""
    reservation_id: str = ""
    """The reservation created, if any."""
    cancelled: bool = False
    """Whether the created reservation was cancelled (always, unless cancelling failed or it is
    held)."""
    instance_type: str = ""
    """Instance type reserved (empty: the request's only type)."""
    held: bool = False
    """Kept for the stack (`--hold`) and written to its stack file."""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """The decision: where the GPU node group goes."""

    region: str
    """Region name; also the default stack name."""
    zone: str
    """AZ name."""
    zone_id: str
    """AZ ID."""
    instance_type: str
    """GPU instance type."""
    node_count: int
    """GPU nodes."""
    evidence: Evidence
    """What backs the choice."""
    capacity_type: str = "on-demand"
    """`on-demand` or `spot`."""
    spot_score: int | None = None
    """Spot placement score of the zone when chosen (Spot only)."""
    spot_usd_per_hour: float | None = None
    """Latest Spot price per instance in the zone (Spot only)."""


def rank_candidates(reports: tuple[RegionReport, ...], *,
                    request: ProbeRequest) -> tuple[Candidate, ...]:
    """Qualifying AZs, best first: strongest evidence (availability, quota); for Spot, then the
    higher Spot placement score (unscored zones last) and the lower Spot price; then the node
    group's On-Demand price per hour (with several instance types), the user's type order, region
    order, the stack's current AZ, and AZ ID (a stable order across accounts)."""
    order = {r: i for i, r in enumerate(request.regions)}
    type_order = {t: i for i, t in enumerate(request.instance_types)}
    out = []
    for report in reports:
        if report.blocker or report.quota is None:
            continue
        evidence = (Evidence.QUOTA_OK if report.quota.verdict is QuotaVerdict.OK
                    else Evidence.QUOTA_UNCHECKED)
        instance_type = report.instance_type or request.instance_type
        out.extend(Candidate(region=report.region, zone=z.name, zone_id=z.zone_id,
                             evidence=evidence, instance_type=instance_type,
                             spot_score=z.spot_score, spot_usd_per_hour=z.spot_usd_per_hour)
                   for z in report.offered)

    def key(c: Candidate) -> tuple:
        t = c.instance_type or request.instance_type
        spot = ((-(c.spot_score or 0), c.spot_usd_per_hour if c.spot_usd_per_hour is not None
                 else float("inf")) if request.spot else ())
        return (c.evidence, *spot, node_group_usd_per_hour(t, request.node_count),
                type_order.get(t, len(type_order)), order.get(c.region, len(order)),
                c.zone_id != request.current_zone_id, c.zone_id)

    return tuple(sorted(out, key=key))


def node_group_usd_per_hour(instance_type: str, node_count: int) -> float:
    """The GPU nodes' On-Demand list price per hour (infra/instance_types.py); infinite for a type
    without one, so it ranks after those that have one."""
    known = INSTANCE_TYPES.get(instance_type)
    if known is None or known.usd_per_hour is None:
        return float("inf")
    return node_count * known.usd_per_hour


def choose_placement(candidates: tuple[Candidate, ...], attempts: tuple[ReservationAttempt, ...],
                     *, request: ProbeRequest) -> Placement | None:
    """With --reserve, the first AZ whose reservation succeeded; otherwise the best candidate."""
    if request.reserve:
        proven = next((a for a in attempts if a.outcome is AttemptOutcome.PROVEN), None)
        if proven is None:
            return None
        return Placement(region=proven.region, zone=proven.zone, zone_id=proven.zone_id,
                         instance_type=proven.instance_type or request.instance_type,
                         node_count=request.node_count, evidence=Evidence.CAPACITY_PROVEN)
    if not candidates:
        return None
    best = candidates[0]
    return Placement(region=best.region, zone=best.zone, zone_id=best.zone_id,
                     instance_type=best.instance_type or request.instance_type,
                     node_count=request.node_count, evidence=best.evidence,
                     capacity_type=request.capacity_type, spot_score=best.spot_score,
                     spot_usd_per_hour=best.spot_usd_per_hour)


def unplaced_reasons(reports: tuple[RegionReport, ...],
                     attempts: tuple[ReservationAttempt, ...]) -> tuple[str, ...]:
    """One line per location that was not chosen: each region's blocker, each failed attempt
    (named with its instance type when several types were probed)."""
    several = len({r.instance_type for r in reports} | {a.instance_type for a in attempts}) > 1

    def where(region: str, instance_type: str) -> str:
        return f"{region} {instance_type}" if several and instance_type else region

    lines = [f"{where(r.region, r.instance_type)}: {r.blocker}" for r in reports if r.blocker]
    lines += [f"{where(a.region, a.instance_type)} {a.zone} ({a.zone_id}): {a.outcome.value}"
              + (f" - {a.detail}" if a.detail else "")
              for a in attempts if a.outcome is not AttemptOutcome.PROVEN]
    return tuple(lines)


def exit_code(placement: Placement | None, reports: tuple[RegionReport, ...],
              attempts: tuple[ReservationAttempt, ...]) -> int:
    """0 placed; 2 the type lacks EFA wherever AWS knows it; 3 blocked by credentials or
    permissions; else 1."""
    if placement is not None:
        return EXIT_PLACED
    known = [r for r in reports if r.facts is not None]
    if known and all(r.lacks_efa for r in known):
        return EXIT_BAD_INPUT
    denied = {FailureKind.DENIED, FailureKind.CREDENTIALS}
    if any(r.failure is not None and r.failure.kind in denied for r in reports) or any(
            a.outcome is AttemptOutcome.DENIED for a in attempts):
        return EXIT_PERMISSION
    return EXIT_NO_PLACEMENT
