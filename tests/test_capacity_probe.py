"""Ranking, the decision, reasons and exit codes, tested as plain data."""

from __future__ import annotations

from capacity.aws import FailureKind, InstanceFacts
from capacity.probe import (
    EXIT_BAD_INPUT,
    EXIT_NO_PLACEMENT,
    EXIT_PERMISSION,
    EXIT_PLACED,
    AttemptOutcome,
    Evidence,
    ProbeRequest,
    RegionFailure,
    RegionReport,
    ReservationAttempt,
    ZoneOffer,
    choose_placement,
    exit_code,
    rank_candidates,
    unplaced_reasons,
)
from capacity.quota import QuotaCheck

G6 = InstanceFacts(name="g6.12xlarge", vcpus=48, gpus=4, gpu_model="L4", efa_supported=True,
                   max_efa_interfaces=1)
NO_EFA = InstanceFacts(name="g6.12xlarge", vcpus=48, gpus=4, gpu_model="L4", efa_supported=False,
                       max_efa_interfaces=0)
QUOTA_OK = QuotaCheck(quota_code="L-DB2E81BA", needed_vcpus=96, limit_vcpus=192,
                      limit_source="applied", used_vcpus=0, usage_source="cloudwatch")
QUOTA_SHORT = QuotaCheck(quota_code="L-DB2E81BA", needed_vcpus=96, limit_vcpus=64,
                         limit_source="default", used_vcpus=0, usage_source="cloudwatch")
QUOTA_UNKNOWN = QuotaCheck(quota_code="L-DB2E81BA", needed_vcpus=96,
                           problem="missing IAM action servicequotas:GetServiceQuota")


def region(name: str, *zones: tuple[str, str, bool], quota=QUOTA_OK, facts=G6) -> RegionReport:
    return RegionReport(region=name, facts=facts, quota=quota,
                        zones=tuple(ZoneOffer(name=z, zone_id=i, offered=o) for z, i, o in zones))


def request(*regions: str, reserve: bool = False, current_zone_id: str = "") -> ProbeRequest:
    return ProbeRequest(instance_type="g6.12xlarge", node_count=2, regions=regions,
                        reserve=reserve, current_zone_id=current_zone_id)


WEST = region("us-west-2", ("us-west-2a", "usw2-az2", True), ("us-west-2b", "usw2-az1", True),
              ("us-west-2c", "usw2-az3", False))
EAST = region("us-east-1", ("us-east-1a", "use1-az4", True))


def test_ranking_follows_evidence_then_region_order_then_az_id():
    east_unknown = region("us-east-1", ("us-east-1a", "use1-az4", True), quota=QUOTA_UNKNOWN)
    ranked = rank_candidates((east_unknown, WEST), request=request("us-east-1", "us-west-2"))
    assert [(c.zone, c.evidence) for c in ranked] == [
        ("us-west-2b", Evidence.QUOTA_OK), ("us-west-2a", Evidence.QUOTA_OK),
        ("us-east-1a", Evidence.QUOTA_UNCHECKED)]
    ranked = rank_candidates((EAST, WEST), request=request("us-east-1", "us-west-2"))
    assert [c.zone for c in ranked] == ["us-east-1a", "us-west-2b", "us-west-2a"]


def test_the_stacks_current_az_is_kept_when_it_still_qualifies():
    ranked = rank_candidates((WEST,), request=request("us-west-2", current_zone_id="usw2-az2"))
    assert ranked[0].zone == "us-west-2a"


def test_blocked_regions_give_no_candidates_and_one_reason_each():
    reports = (region("us-west-2", ("us-west-2a", "usw2-az2", True), quota=QUOTA_SHORT),
               region("eu-west-1", ("eu-west-1a", "euw1-az1", False), quota=None),
               RegionReport(region="ap-south-2"),
               RegionReport(region="sa-east-1", failure=RegionFailure(
                   kind=FailureKind.TIMEOUT, message="no answer within 60s")))
    assert rank_candidates(reports, request=request("us-west-2")) == ()
    assert unplaced_reasons(reports, ()) == (
        "us-west-2: On-Demand vCPU quota L-DB2E81BA short: 64 free < 96 needed",
        "eu-west-1: g6.12xlarge not offered in any AZ",
        "ap-south-2: instance type not available in this region",
        "sa-east-1: no answer within 60s")


def test_without_reserve_the_best_candidate_is_placed():
    req = request("us-west-2")
    placement = choose_placement(rank_candidates((WEST,), request=req), (), request=req)
    assert (placement.region, placement.zone, placement.zone_id) == (
        "us-west-2", "us-west-2b", "usw2-az1")
    assert placement.evidence is Evidence.QUOTA_OK and placement.node_count == 2


def test_with_reserve_only_a_proven_az_is_placed():
    req = request("us-west-2", reserve=True)
    cands = rank_candidates((WEST,), request=req)
    no_cap = ReservationAttempt(region="us-west-2", zone="us-west-2b", zone_id="usw2-az1",
                                outcome=AttemptOutcome.NO_CAPACITY,
                                detail="InsufficientInstanceCapacity")
    proven = ReservationAttempt(region="us-west-2", zone="us-west-2a", zone_id="usw2-az2",
                                outcome=AttemptOutcome.PROVEN, reservation_id="cr-1",
                                cancelled=True)
    assert choose_placement(cands, (no_cap,), request=req) is None
    placement = choose_placement(cands, (no_cap, proven), request=req)
    assert placement.zone == "us-west-2a" and placement.evidence is Evidence.CAPACITY_PROVEN
    assert unplaced_reasons((WEST,), (no_cap, proven)) == (
        "us-west-2 us-west-2b (usw2-az1): no capacity - InsufficientInstanceCapacity",)


def test_exit_codes():
    req = request("us-west-2")
    placement = choose_placement(rank_candidates((WEST,), request=req), (), request=req)
    assert exit_code(placement, (WEST,), ()) == EXIT_PLACED
    not_offered = region("eu-west-1", ("eu-west-1a", "euw1-az1", False), quota=None)
    assert exit_code(None, (not_offered,), ()) == EXIT_NO_PLACEMENT
    no_efa = region("us-west-2", ("us-west-2a", "usw2-az2", True), quota=None, facts=NO_EFA)
    assert exit_code(None, (no_efa, RegionReport(region="ap-south-2")), ()) == EXIT_BAD_INPUT
    denied = RegionReport(region="us-east-1", failure=RegionFailure(
        kind=FailureKind.DENIED, message="permission denied", action="ec2:DescribeInstanceTypes"))
    assert exit_code(None, (not_offered, denied), ()) == EXIT_PERMISSION
    denied_attempt = ReservationAttempt(region="us-west-2", zone="us-west-2b", zone_id="usw2-az1",
                                        outcome=AttemptOutcome.DENIED)
    assert exit_code(None, (WEST,), (denied_attempt,)) == EXIT_PERMISSION
