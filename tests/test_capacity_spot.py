"""`python -m capacity probe --capacity-type spot`: the Spot placement score and price calls
(botocore's Stubber checks every parameter against EC2's service model and answers with EC2's
response shapes), the Spot quota (its own codes, its own usage class), the ranking of zones by
score then price, the stack file it writes, and the refusals (Spot with a reservation)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest
from botocore.stub import ANY, Stubber

from capacity import cli, stackfile
from capacity.aws import AwsApi, InstanceFacts
from capacity.probe import Candidate, Evidence, ProbeRequest, RegionReport, ZoneOffer, choose_placement, rank_candidates
from capacity.quota import QuotaCheck, quota_group
from capacity.regions import probe_region
from capacity.report import SPOT_MEANING, ProbeResult, as_json, print_human
from infra.config import parse_stack_config, read_stack_values
from infra.cost import cost_items, estimated_cost_per_hour

NOW = datetime(2026, 12, 2, 10, 0, tzinfo=timezone.utc)
ZONES = {"us-west-2a": "usw2-az2", "us-west-2b": "usw2-az1", "us-west-2c": "usw2-az3"}


@pytest.fixture
def api(fake_aws_session):
    return AwsApi(session=fake_aws_session, sleep=lambda _: None, now=lambda: NOW)


def _instance_type_response() -> dict:
    return {"InstanceTypes": [{
        "InstanceType": "g6.12xlarge", "VCpuInfo": {"DefaultVCpus": 48},
        "GpuInfo": {"Gpus": [{"Name": "L4", "Manufacturer": "NVIDIA", "Count": 4}]},
        "NetworkInfo": {"EfaSupported": True, "EfaInfo": {"MaximumEfaInterfaces": 1}}}]}


def _stub_region(ec2: Stubber, *, scores: dict[str, int], prices: dict[str, str]) -> None:
    """EC2's answers for one Spot probe of us-west-2, in call order."""
    ec2.add_response("describe_instance_types", _instance_type_response(),
                     {"InstanceTypes": ["g6.12xlarge"]})
    ec2.add_response("describe_availability_zones", {"AvailabilityZones": [
        {"ZoneName": name, "ZoneId": zid, "State": "available", "RegionName": "us-west-2",
         "ZoneType": "availability-zone"} for name, zid in ZONES.items()]}, {"Filters": ANY})
    ec2.add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": [
        {"InstanceType": "g6.12xlarge", "LocationType": "availability-zone", "Location": name}
        for name in ZONES]}, {"LocationType": "availability-zone", "Filters": ANY})
    ec2.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
        {"Region": "us-west-2", "AvailabilityZoneId": zid, "Score": score}
        for zid, score in scores.items()]},
        {"InstanceTypes": ["g6.12xlarge"], "TargetCapacity": 2, "TargetCapacityUnitType": "units",
         "SingleAvailabilityZone": True, "RegionNames": ["us-west-2"], "MaxResults": 10})
    ec2.add_response("describe_spot_price_history", {"NextToken": "", "SpotPriceHistory": [
        {"AvailabilityZone": name, "AvailabilityZoneId": ZONES[name], "InstanceType": "g6.12xlarge",
         "ProductDescription": "Linux/UNIX", "SpotPrice": price, "Timestamp": NOW}
        for name, price in prices.items()]},
        {"InstanceTypes": ["g6.12xlarge"], "ProductDescriptions": ["Linux/UNIX"], "StartTime": NOW})


def _stub_spot_quota(sq: Stubber, cw: Stubber, *, limit: float, used: float) -> None:
    sq.add_response("get_service_quota", {"Quota": {"ServiceCode": "ec2", "QuotaCode": "L-3819A6DF",
                                                    "QuotaName": "All G and VT Spot Instance Requests",
                                                    "Value": limit}},
                    {"ServiceCode": "ec2", "QuotaCode": "L-3819A6DF"})
    cw.add_response("get_metric_statistics", {"Label": "ResourceCount", "Datapoints": [
        {"Timestamp": NOW, "Maximum": used, "Unit": "None"}]},
        {"Namespace": "AWS/Usage", "MetricName": "ResourceCount", "StartTime": ANY, "EndTime": ANY,
         "Period": 60, "Statistics": ["Maximum"],
         "Dimensions": [{"Name": "Service", "Value": "EC2"}, {"Name": "Type", "Value": "Resource"},
                        {"Name": "Resource", "Value": "vCPU"}, {"Name": "Class", "Value": "G/Spot"}]})


def spot_request(**kw) -> ProbeRequest:
    return ProbeRequest(instance_type="g6.12xlarge", node_count=2, regions=("us-west-2",),
                        capacity_type="spot", **kw)


def test_spot_quotas_are_their_own_codes():
    assert quota_group("g6.12xlarge").quota_code == "L-DB2E81BA"
    spot = quota_group("g6.12xlarge", spot=True)
    assert (spot.quota_code, spot.usage_class) == ("L-3819A6DF", "G/Spot")
    assert quota_group("p4d.24xlarge", spot=True).quota_code == "L-7212CCBC"
    assert quota_group("p5.48xlarge", spot=True).quota_code == "L-C4BD4855"  # "All P5 Spot Instance Requests"


def test_a_spot_probe_reads_scores_by_zone_id_prices_by_zone_and_the_spot_quota(api):
    with Stubber(api.client("ec2", "us-west-2")) as ec2, \
            Stubber(api.client("service-quotas", "us-west-2")) as sq, \
            Stubber(api.client("cloudwatch", "us-west-2")) as cw:
        _stub_region(ec2, scores={"usw2-az1": 3, "usw2-az3": 7},
                     prices={"us-west-2a": "1.901200", "us-west-2b": "1.722300", "us-west-2c": "2.004100"})
        _stub_spot_quota(sq, cw, limit=192, used=48)
        report = probe_region(api, region="us-west-2", request=spot_request())
        ec2.assert_no_pending_responses()
    by_name = {z.name: z for z in report.zones}
    assert (by_name["us-west-2c"].spot_score, by_name["us-west-2c"].spot_usd_per_hour) == (7, 2.0041)
    assert by_name["us-west-2a"].spot_score is None  # EC2 scored only its top zones
    assert report.quota.spot and report.quota.quota_code == "L-3819A6DF"
    assert report.quota.free_vcpus == 144 and report.blocker == ""
    ranked = rank_candidates((report,), request=spot_request())
    # Score first (7 beats 3 though dearer), unscored last.
    assert [c.zone_id for c in ranked] == ["usw2-az3", "usw2-az1", "usw2-az2"]
    placement = choose_placement(ranked, (), request=spot_request())
    assert (placement.capacity_type, placement.spot_score, placement.spot_usd_per_hour) == ("spot", 7, 2.0041)


def test_a_short_spot_quota_blocks_the_region_and_says_spot(api):
    with Stubber(api.client("ec2", "us-west-2")) as ec2, \
            Stubber(api.client("service-quotas", "us-west-2")) as sq, \
            Stubber(api.client("cloudwatch", "us-west-2")) as cw:
        _stub_region(ec2, scores={"usw2-az1": 9}, prices={"us-west-2b": "1.7"})
        _stub_spot_quota(sq, cw, limit=0, used=0)  # a new account's Spot G/VT quota
        report = probe_region(api, region="us-west-2", request=spot_request())
    assert report.blocker == "Spot vCPU quota L-3819A6DF short: 0 free < 96 needed"
    assert rank_candidates((report,), request=spot_request()) == ()


def test_unreadable_scores_are_said_and_the_zones_still_ranked_by_price(api):
    with Stubber(api.client("ec2", "us-west-2")) as ec2, \
            Stubber(api.client("service-quotas", "us-west-2")) as sq, \
            Stubber(api.client("cloudwatch", "us-west-2")) as cw:
        ec2.add_response("describe_instance_types", _instance_type_response())
        ec2.add_response("describe_availability_zones", {"AvailabilityZones": [
            {"ZoneName": n, "ZoneId": z, "State": "available"} for n, z in ZONES.items()]})
        ec2.add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": [
            {"InstanceType": "g6.12xlarge", "LocationType": "availability-zone", "Location": n} for n in ZONES]})
        ec2.add_client_error("get_spot_placement_scores", "UnauthorizedOperation", "not authorized")
        ec2.add_response("describe_spot_price_history", {"SpotPriceHistory": [
            {"AvailabilityZone": n, "InstanceType": "g6.12xlarge", "ProductDescription": "Linux/UNIX",
             "SpotPrice": p, "Timestamp": NOW} for n, p in (("us-west-2a", "2.1"), ("us-west-2c", "1.6"))]})
        _stub_spot_quota(sq, cw, limit=192, used=0)
        report = probe_region(api, region="us-west-2", request=spot_request())
    assert report.spot_problem == "Spot placement scores unread (missing IAM action ec2:GetSpotPlacementScores)"
    ranked = rank_candidates((report,), request=spot_request())
    assert [c.zone for c in ranked][:2] == ["us-west-2c", "us-west-2a"]


def test_the_latest_price_of_each_zone_is_kept(api):
    older = datetime(2026, 12, 2, 9, 0, tzinfo=timezone.utc)
    with Stubber(api.client("ec2", "us-west-2")) as ec2:
        ec2.add_response("describe_spot_price_history", {"NextToken": "t", "SpotPriceHistory": [
            {"AvailabilityZone": "us-west-2a", "SpotPrice": "1.5", "Timestamp": older}]})
        ec2.add_response("describe_spot_price_history", {"SpotPriceHistory": [
            {"AvailabilityZone": "us-west-2a", "SpotPrice": "1.8", "Timestamp": NOW}]},
            {"InstanceTypes": ["g6.12xlarge"], "ProductDescriptions": ["Linux/UNIX"], "StartTime": NOW,
             "NextToken": "t"})
        (price,) = api.spot_prices(region="us-west-2", instance_type="g6.12xlarge")
    assert (price.zone, price.usd_per_hour) == ("us-west-2a", 1.8)


def _placed(tmp_path: Path, request: ProbeRequest, zone: ZoneOffer):
    report = RegionReport(region="us-west-2", zones=(zone,), instance_type="g6.12xlarge",
                          quota=QuotaCheck(quota_code="L-3819A6DF", needed_vcpus=96, limit_vcpus=192,
                                           used_vcpus=0, spot=request.spot),
                          facts=InstanceFacts(name="g6.12xlarge", vcpus=48, gpus=4, gpu_model="L4",
                                              efa_supported=True, max_efa_interfaces=1))
    candidate = Candidate(region="us-west-2", zone=zone.name, zone_id=zone.zone_id, evidence=Evidence.QUOTA_OK,
                          spot_score=zone.spot_score, spot_usd_per_hour=zone.spot_usd_per_hour)
    return report, choose_placement((candidate,), (), request=request)


def test_the_stack_file_gets_the_capacity_type_and_price_and_an_on_demand_probe_removes_them(tmp_path):
    path = tmp_path / "Pulumi.us-west-2.yaml"
    zone = ZoneOffer(name="us-west-2c", zone_id="usw2-az3", offered=True, spot_score=7, spot_usd_per_hour=1.72234)
    _, spot = _placed(tmp_path, spot_request(), zone)
    stackfile.write(stackfile.plan_update(path, stackfile.placement_values(spot),
                                          remove=stackfile.spot_keys_removed(spot)))
    values = read_stack_values(path)
    assert (values["ray-eks:gpuCapacityType"], values["ray-eks:gpuSpotPriceUsdPerHour"]) == ("spot", "1.7223")
    cfg = parse_stack_config(values)
    assert cfg.is_spot
    assert cost_items(cfg)["2x g6.12xlarge Spot (the probe's price)"] == pytest.approx(3.4446)
    assert estimated_cost_per_hour(cfg) == 4.06  # against 9.81 On-Demand: the GPU nodes are most of it

    _, on_demand = _placed(tmp_path, ProbeRequest(instance_type="g6.12xlarge", node_count=2,
                                                  regions=("us-west-2",)), zone)
    stackfile.write(stackfile.plan_update(path, stackfile.placement_values(on_demand),
                                          remove=stackfile.spot_keys_removed(on_demand)))
    values = read_stack_values(path)
    assert "ray-eks:gpuCapacityType" not in values and "ray-eks:gpuSpotPriceUsdPerHour" not in values
    assert not parse_stack_config(values).is_spot


def test_the_report_says_what_spot_means_and_what_it_costs(tmp_path, capsys):
    from rich.console import Console

    zone = ZoneOffer(name="us-west-2c", zone_id="usw2-az3", offered=True, spot_score=7, spot_usd_per_hour=1.8)
    report, placement = _placed(tmp_path, spot_request(), zone)
    result = ProbeResult(request=spot_request(), reports=(report,), candidates=(), reservations=None,
                         placement=placement, reasons=(), exit_code=0)
    out = Console(width=200, record=True)
    print_human(result, out=out, err=out)
    text = " ".join(out.export_text().split())
    assert "chosen" in text and "Spot score" in text and "$1.8000" in text
    assert "on Spot (placement score 7/10)" in text
    assert "$3.60/hour on Spot" in text and "61% below the $9.20/hour On-Demand" in text
    assert SPOT_MEANING.split(":")[0] in text and "two-minute notice" in text
    assert '"spot_meaning"' in as_json(result)


@pytest.mark.parametrize("extra", [["--reserve"], ["--hold", "2"]])
def test_spot_with_a_reservation_is_refused_before_any_call(tmp_path, extra):
    (tmp_path / "Pulumi.yaml").write_text("name: ray-eks\n")
    with pytest.raises(cli.InputError, match="--capacity-type spot cannot be combined"):
        cli.parse_options(["probe", "--capacity-type", "spot", "--regions", "us-west-2", *extra],
                          project_dir=tmp_path, known=frozenset({"us-west-2"}))


def test_the_capacity_type_is_parsed():
    opts = cli.parse_options(["probe", "--capacity-type", "spot", "--regions", "us-west-2"],
                             project_dir=Path("/nonexistent"), known=frozenset({"us-west-2"}))
    assert opts.request.spot
    with pytest.raises(cli.InputError):
        cli.parse_options(["probe", "--capacity-type", "Spot"], project_dir=Path("/nonexistent"),
                          known=frozenset({"us-west-2"}))
