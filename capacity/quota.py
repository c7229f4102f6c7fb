"""The On-Demand (or Spot) vCPU quota that governs an instance type, and how much of it is free.

Spot instances count against quotas of their own ("All G and VT Spot Instance Requests",
L-3819A6DF, is 0 in a new account), separate from the On-Demand ones: a free On-Demand quota says
nothing about Spot. EC2 counts On-Demand usage in vCPUs per instance-family group, each group with its own quota code.
The limit is the account's applied value, else the AWS default; usage is the AWS/Usage metric, else
the vCPUs of pending and running instances of the group. When an answer cannot be had, the check
says why instead of passing.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from capacity.aws import AwsApi, AwsFailure, FailureKind, InstanceFacts


@dataclass(frozen=True, kw_only=True)
class QuotaGroup:
    """Instance families sharing one On-Demand vCPU quota."""

    quota_code: str
    """Service Quotas code of the group's `Running On-Demand ... instances` quota."""
    usage_class: str
    """The `Class` dimension of the group's AWS/Usage metric."""
    families: frozenset[str]
    """Family prefixes (the letters before the generation digit) in the group."""
    generations: frozenset[int] = frozenset()
    """The generations of those families in the group (the number after the letters: 5 for p5,
    p5e and p5en); empty: every generation."""

    def takes(self, family: str, generation: int) -> bool:
        return family in self.families and (not self.generations or generation in self.generations)


QUOTA_GROUPS: tuple[QuotaGroup, ...] = (
    QuotaGroup(quota_code="L-DB2E81BA", usage_class="G/OnDemand", families=frozenset({"g", "vt"})),
    QuotaGroup(quota_code="L-417A185B", usage_class="P/OnDemand", families=frozenset({"p"})),
    QuotaGroup(quota_code="L-1216C47A", usage_class="Standard/OnDemand",
               families=frozenset("acdhimrtz")),
    QuotaGroup(quota_code="L-1945791B", usage_class="Inf/OnDemand", families=frozenset({"inf"})),
    QuotaGroup(quota_code="L-2C3B7624", usage_class="Trn/OnDemand", families=frozenset({"trn"})),
    QuotaGroup(quota_code="L-6E869C2A", usage_class="DL/OnDemand", families=frozenset({"dl"})),
    QuotaGroup(quota_code="L-7295265B", usage_class="X/OnDemand", families=frozenset({"x"})),
    QuotaGroup(quota_code="L-74FC7D96", usage_class="F/OnDemand", families=frozenset({"f"})),
)

SPOT_QUOTA_GROUPS: tuple[QuotaGroup, ...] = (
    QuotaGroup(quota_code="L-3819A6DF", usage_class="G/Spot", families=frozenset({"g", "vt"})),
    QuotaGroup(quota_code="L-7212CCBC", usage_class="P/Spot", families=frozenset({"p"}),
               generations=frozenset({2, 3, 4})),
    QuotaGroup(quota_code="L-C4BD4855", usage_class="P5/Spot", families=frozenset({"p"}),
               generations=frozenset({5})),
    QuotaGroup(quota_code="L-34B43A08", usage_class="Standard/Spot",
               families=frozenset("acdhimrtz")),
    QuotaGroup(quota_code="L-B5D1601B", usage_class="Inf/Spot", families=frozenset({"inf"})),
    QuotaGroup(quota_code="L-6B0D517C", usage_class="Trn/Spot", families=frozenset({"trn"})),
    QuotaGroup(quota_code="L-85EED4F7", usage_class="DL/Spot", families=frozenset({"dl"})),
    QuotaGroup(quota_code="L-E3A00192", usage_class="X/Spot", families=frozenset({"x"})),
    QuotaGroup(quota_code="L-88CF9481", usage_class="F/Spot", families=frozenset({"f"})),
)
"""The `All ... Spot Instance Requests` vCPU quotas, by the same family groups, except P: EC2's list of
Spot quotas (user guide, "Spot Instance quotas") has "All P4, P3 and P2 Spot Instance Requests" and
"All P5 Spot Instance Requests" (P5, P5e and P5en), and no group for P6, so a P6 Spot check says it
cannot tell rather than read another generation's quota."""

_FAMILY_RE = re.compile(r"^([a-z]+)(\d+)")


def quota_group(instance_type: str, *, spot: bool = False) -> QuotaGroup | None:
    """The group whose quota the type counts against (its Spot quota with `spot`); None for types
    outside these groups."""
    m = _FAMILY_RE.match(instance_type)
    if not m:
        return None
    groups = SPOT_QUOTA_GROUPS if spot else QUOTA_GROUPS
    return next((g for g in groups if g.takes(m.group(1), int(m.group(2)))), None)


class QuotaVerdict(enum.Enum):
    OK = "ok"
    SHORT = "short"
    UNKNOWN = "unknown"


@dataclass(frozen=True, kw_only=True)
class QuotaCheck:
    """One region's On-Demand (or Spot) vCPU quota against what the node group needs."""

    quota_code: str | None
    """Quota code consulted (None when the type has no known group)."""
    needed_vcpus: int
    """Nodes x vCPUs per node."""
    limit_vcpus: float | None = None
    """The quota value, None when it could not be read."""
    limit_source: str = ""
    """`applied` (the account's value) or `default` (AWS's default value)."""
    used_vcpus: float | None = None
    """vCPUs already in use by the group, None when unknown."""
    usage_source: str = ""
    """`cloudwatch` (AWS/Usage) or `running-instances`."""
    problem: str = ""
    """Why the check could not answer (empty when it could)."""
    spot: bool = False
    """The Spot quota of the type, not the On-Demand one."""

    @property
    def market(self) -> str:
        return "Spot" if self.spot else "On-Demand"

    @property
    def free_vcpus(self) -> float | None:
        if self.limit_vcpus is None or self.used_vcpus is None:
            return None
        return max(0.0, self.limit_vcpus - self.used_vcpus)

    @property
    def verdict(self) -> QuotaVerdict:
        free = self.free_vcpus
        if free is None:
            return QuotaVerdict.UNKNOWN
        return QuotaVerdict.OK if free >= self.needed_vcpus else QuotaVerdict.SHORT


def _why(failure: AwsFailure) -> str:
    if failure.kind is FailureKind.DENIED:
        return f"missing IAM action {failure.action}"
    return f"{failure.action} failed: {failure.code}"


def check_quota(api: AwsApi, *, region: str, facts: InstanceFacts, node_count: int,
                spot: bool = False) -> QuotaCheck:
    needed = facts.vcpus * node_count
    group = quota_group(facts.name, spot=spot)
    market = "Spot" if spot else "On-Demand"
    if group is None:
        return QuotaCheck(quota_code=None, needed_vcpus=needed, spot=spot,
                          problem=f"no {market} vCPU quota group known for {facts.name} (EC2's list of "
                                  f"{market} quotas names none for its family and generation)")
    limit, limit_source, problems = None, "", []
    try:
        limit = api.applied_quota(region=region, quota_code=group.quota_code)
        limit_source = "applied"
    except AwsFailure as failure:
        problems.append(_why(failure))
    if limit is None:
        try:
            limit = api.default_quota(region=region, quota_code=group.quota_code)
            limit_source = "default" if limit is not None else ""
        except AwsFailure as failure:
            problems.append(_why(failure))
    if limit is None:
        problems.insert(0, f"quota {group.quota_code} unreadable")
        return QuotaCheck(quota_code=group.quota_code, needed_vcpus=needed, spot=spot,
                          problem="; ".join(problems))
    used, usage_source = _usage(api, region=region, group=group, problems=problems, spot=spot)
    return QuotaCheck(quota_code=group.quota_code, needed_vcpus=needed, limit_vcpus=limit, spot=spot,
                      limit_source=limit_source, used_vcpus=used, usage_source=usage_source,
                      problem="" if used is not None else "; ".join(problems))


def _usage(api: AwsApi, *, region: str, group: QuotaGroup, problems: list[str],
           spot: bool = False) -> tuple[float | None, str]:
    try:
        used = api.usage_metric(region=region, usage_class=group.usage_class)
        if used is not None:
            return used, "cloudwatch"
    except AwsFailure as failure:
        problems.append(_why(failure))
    try:
        running = api.running_instances(region=region)
    except AwsFailure as failure:
        problems.insert(0, "usage unreadable")
        problems.append(_why(failure))
        return None, ""
    in_group = [i.vcpus for i in running
                if i.spot == spot and quota_group(i.instance_type, spot=spot) == group]
    return float(sum(in_group)), "running-instances"
