"""Region probes against moto (regions, AZs, offerings, instance facts, DryRun) and the concurrent
fan-out: a failing or slow region is data, never an abort."""

from __future__ import annotations

import threading

import pytest
from botocore.exceptions import ClientError, NoCredentialsError
from botocore.stub import Stubber
from moto import mock_aws

from capacity import regions as regions_mod
from capacity.aws import AwsApi, AwsFailure, FailureKind, classify
from capacity.probe import ProbeRequest, RegionReport
from capacity.quota import QuotaVerdict
from capacity.regions import probe_region, probe_regions


@pytest.fixture
def api(fake_aws_session):
    with mock_aws():
        yield AwsApi(session=fake_aws_session, sleep=lambda _: None)


def request(*regions: str, instance_type: str = "g6.12xlarge") -> ProbeRequest:
    return ProbeRequest(instance_type=instance_type, node_count=2, regions=regions)


def test_instance_facts_come_from_describe_instance_types(api):
    g6 = api.instance_facts(region="us-west-2", instance_type="g6.12xlarge")
    assert (g6.vcpus, g6.gpus, g6.gpu_model) == (48, 4, "L4")
    assert g6.efa_supported and g6.max_efa_interfaces == 1
    t3 = api.instance_facts(region="us-west-2", instance_type="t3.micro")
    assert (t3.gpus, t3.efa_supported, t3.max_efa_interfaces) == (0, False, 0)
    assert api.instance_facts(region="us-west-2", instance_type="zz9.huge") is None


def test_regions_and_az_names_joined_to_ids(api):
    assert {"us-west-2", "eu-west-1", "ap-northeast-1"} <= set(
        api.enabled_regions(region="us-east-1"))
    zones = api.availability_zones(region="us-west-2")
    assert zones["us-west-2a"].startswith("usw2-az")
    assert len(set(zones.values())) == len(zones)


def test_probe_region_offered_with_quota(api):
    with Stubber(api.client("service-quotas", "us-west-2")) as sq:
        sq.add_response("get_service_quota",
                        {"Quota": {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA", "Value": 192}},
                        {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
        report = probe_region(api, region="us-west-2", request=request("us-west-2"))
    ids = api.availability_zones(region="us-west-2")
    offered = api.offered_zones(region="us-west-2", instance_type="g6.12xlarge")
    assert {z.name for z in report.offered} == offered and offered
    assert all(z.zone_id == ids[z.name] for z in report.zones)
    assert report.quota.verdict is QuotaVerdict.OK and report.quota.usage_source
    assert report.blocker == ""


def test_probe_region_not_offered_checks_no_quota(api):
    report = probe_region(api, region="eu-west-1", request=request("eu-west-1"))
    assert report.facts is not None and report.offered == () and report.quota is None
    assert report.blocker == "g6.12xlarge not offered in any AZ"


def test_probe_region_refuses_a_type_without_efa(api):
    report = probe_region(api, region="us-west-2",
                          request=request("us-west-2", instance_type="t3.micro"))
    assert report.lacks_efa and report.quota is None
    assert report.blocker == "t3.micro does not support EFA"


def test_dry_run_answer_from_moto_is_recognised(api):
    ec2 = api.client("ec2", "us-west-2")
    with pytest.raises(ClientError) as err:
        ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1,
                          InstanceType="g6.12xlarge", DryRun=True)
    failure = classify(err.value, action="ec2:RunInstances")
    assert failure.code == "DryRunOperation" and failure.kind is FailureKind.OTHER


def test_classify_credentials_and_denials():
    missing = classify(NoCredentialsError(), action="sts:GetCallerIdentity")
    assert missing.kind is FailureKind.CREDENTIALS
    auth = classify(ClientError({"Error": {"Code": "AuthFailure", "Message": "bad key"}},
                                "DescribeRegions"), action="ec2:DescribeRegions")
    assert auth.kind is FailureKind.CREDENTIALS
    denied = classify(ClientError({"Error": {"Code": "UnauthorizedOperation", "Message": (
        "User: arn:aws:iam::1:user/x is not authorized to perform: ec2:CreateTags on resource")}},
        "CreateCapacityReservation"), action="ec2:CreateCapacityReservation")
    assert denied.kind is FailureKind.DENIED and denied.action == "ec2:CreateTags"
    assert "ec2:CreateTags" in denied.summary
    opt_in = classify(ClientError({"Error": {"Code": "OptInRequired", "Message": "x"}},
                                  "DescribeAvailabilityZones"), action="ec2:X")
    assert opt_in.kind is FailureKind.REGION_DISABLED


def test_a_failing_or_slow_region_does_not_stop_the_others(monkeypatch):
    release = threading.Event()

    def fake_probe(api, *, region, request):
        if region == "ap-south-2":
            release.wait(30)
        if region == "eu-west-1":
            raise AwsFailure(kind=FailureKind.DENIED, code="UnauthorizedOperation", message="",
                             action="ec2:DescribeInstanceTypes")
        if region == "sa-east-1":
            raise KeyError("unexpected response shape")
        return RegionReport(region=region)

    monkeypatch.setattr(regions_mod, "probe_region", fake_probe)
    done: list[str] = []
    try:
        reports = probe_regions(object(), request=request("us-west-2", "ap-south-2", "eu-west-1",
                                                          "sa-east-1"),
                                timeout_s=2.0, on_done=lambda r: done.append(r.region))
    finally:
        release.set()
    by_region = {r.region: r for r in reports}
    assert [r.region for r in reports] == ["us-west-2", "ap-south-2", "eu-west-1", "sa-east-1"]
    assert by_region["us-west-2"].failure is None
    assert by_region["ap-south-2"].failure.kind is FailureKind.TIMEOUT
    assert by_region["eu-west-1"].failure.kind is FailureKind.DENIED
    assert "ec2:DescribeInstanceTypes" in by_region["eu-west-1"].failure.message
    assert by_region["sa-east-1"].failure.kind is FailureKind.OTHER
    assert sorted(done) == sorted(by_region) and done[-1] == "ap-south-2"
