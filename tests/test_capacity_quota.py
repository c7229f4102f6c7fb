"""On-Demand vCPU quota: group codes, applied/default limits, usage sources, and saying so when
AWS cannot answer. Service Quotas and CloudWatch are stubbed (moto has no EC2 quotas); running
instances come from moto."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from botocore.stub import Stubber
from moto import mock_aws

from capacity.aws import AwsApi, InstanceFacts
from capacity.quota import QuotaVerdict, check_quota, quota_group

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
MOTO_AMI = "ami-12c6146b"  # one of the images moto serves
G6 = InstanceFacts(name="g6.12xlarge", vcpus=48, gpus=4, gpu_model="L4", efa_supported=True,
                   max_efa_interfaces=1)


@pytest.mark.parametrize(("instance_type", "code"), [
    ("g6.12xlarge", "L-DB2E81BA"), ("g5.48xlarge", "L-DB2E81BA"), ("vt1.3xlarge", "L-DB2E81BA"),
    ("p5.48xlarge", "L-417A185B"), ("p4d.24xlarge", "L-417A185B"),
    ("m7i.xlarge", "L-1216C47A"), ("c7gn.16xlarge", "L-1216C47A"), ("t3.micro", "L-1216C47A"),
    ("inf2.48xlarge", "L-1945791B"), ("trn1.32xlarge", "L-2C3B7624"),
    ("dl1.24xlarge", "L-6E869C2A"), ("x2idn.32xlarge", "L-7295265B"),
    ("f1.16xlarge", "L-74FC7D96"),
])
def test_quota_group_by_family(instance_type, code):
    assert quota_group(instance_type).quota_code == code


@pytest.mark.parametrize("instance_type", ["u-6tb1.metal", "mac2.metal", "hpc7g.16xlarge", ""])
def test_families_without_a_known_group(instance_type):
    assert quota_group(instance_type) is None


@pytest.fixture
def api(fake_aws_session):
    with mock_aws():
        yield AwsApi(session=fake_aws_session, sleep=lambda _: None, now=lambda: NOW)


def quota_response(value: float) -> dict:
    return {"Quota": {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA", "Value": value}}


def usage_params(usage_class: str = "G/OnDemand") -> dict:
    return {"Namespace": "AWS/Usage", "MetricName": "ResourceCount",
            "StartTime": NOW - timedelta(minutes=15), "EndTime": NOW, "Period": 60,
            "Statistics": ["Maximum"],
            "Dimensions": [{"Name": "Service", "Value": "EC2"},
                           {"Name": "Type", "Value": "Resource"},
                           {"Name": "Resource", "Value": "vCPU"},
                           {"Name": "Class", "Value": usage_class}]}


def run_instances(api: AwsApi, instance_type: str, count: int) -> None:
    ec2 = api.client("ec2", "us-west-2")
    ec2.run_instances(ImageId=MOTO_AMI, InstanceType=instance_type, MinCount=count, MaxCount=count)


def test_applied_quota_and_cloudwatch_usage(api):
    with Stubber(api.client("service-quotas", "us-west-2")) as sq, \
            Stubber(api.client("cloudwatch", "us-west-2")) as cw:
        sq.add_response("get_service_quota", quota_response(192),
                        {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
        cw.add_response("get_metric_statistics", {"Datapoints": [
            {"Timestamp": NOW - timedelta(minutes=2), "Maximum": 20.0},
            {"Timestamp": NOW - timedelta(minutes=1), "Maximum": 48.0}]}, usage_params())
        check = check_quota(api, region="us-west-2", facts=G6, node_count=2)
    assert (check.limit_vcpus, check.limit_source) == (192, "applied")
    assert (check.used_vcpus, check.usage_source) == (48, "cloudwatch")
    assert check.free_vcpus == 144 and check.needed_vcpus == 96
    assert check.verdict is QuotaVerdict.OK


def test_default_quota_and_usage_from_running_instances_of_the_same_group(api):
    run_instances(api, "g6.12xlarge", 1)
    run_instances(api, "m7i.xlarge", 3)  # another quota group: not counted
    with Stubber(api.client("service-quotas", "us-west-2")) as sq, \
            Stubber(api.client("cloudwatch", "us-west-2")) as cw:
        sq.add_client_error("get_service_quota", "NoSuchResourceException", "no applied value",
                            400)
        sq.add_response("get_aws_default_service_quota", quota_response(64),
                        {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
        cw.add_response("get_metric_statistics", {"Datapoints": []}, usage_params())
        check = check_quota(api, region="us-west-2", facts=G6, node_count=2)
    assert (check.limit_vcpus, check.limit_source) == (64, "default")
    assert (check.used_vcpus, check.usage_source) == (48, "running-instances")
    assert check.free_vcpus == 16
    assert check.verdict is QuotaVerdict.SHORT


def test_quota_api_denied_is_unknown_and_names_the_action(api):
    with Stubber(api.client("service-quotas", "us-west-2")) as sq:
        for op in ("get_service_quota", "get_aws_default_service_quota"):
            sq.add_client_error(op, "AccessDeniedException", "User is not authorized", 400)
        check = check_quota(api, region="us-west-2", facts=G6, node_count=2)
    assert check.verdict is QuotaVerdict.UNKNOWN and check.free_vcpus is None
    assert "servicequotas:GetServiceQuota" in check.problem
    assert "servicequotas:GetAWSDefaultServiceQuota" in check.problem


def test_usage_unreadable_is_unknown(api):
    with Stubber(api.client("service-quotas", "us-west-2")) as sq, \
            Stubber(api.client("cloudwatch", "us-west-2")) as cw, \
            Stubber(api.client("ec2", "us-west-2")) as ec2:
        sq.add_response("get_service_quota", quota_response(192),
                        {"ServiceCode": "ec2", "QuotaCode": "L-DB2E81BA"})
        cw.add_client_error("get_metric_statistics", "AccessDenied", "no", 403)
        ec2.add_client_error("describe_instances", "UnauthorizedOperation", "no", 403)
        check = check_quota(api, region="us-west-2", facts=G6, node_count=2)
    assert check.verdict is QuotaVerdict.UNKNOWN and check.limit_vcpus == 192
    assert "cloudwatch:GetMetricStatistics" in check.problem
    assert "ec2:DescribeInstances" in check.problem
