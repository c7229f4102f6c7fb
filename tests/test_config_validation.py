"""The stack-config model: the committed stack parses, and each bad value is refused with its own
one-line error naming the key, the value and the fix."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from infra.config import (KNOWN_KEYS, ConfigError, ConfigErrors, StackConfig, az_id_prefix,
                          config_key, load_stack_config, parse_stack_config, read_stack_values)

REPO_ROOT = Path(__file__).resolve().parent.parent
GOOD = {"aws:region": "eu-west-1", "ray-eks:gpuAvailabilityZone": "eu-west-1b",
        "ray-eks:gpuAvailabilityZoneId": "euw1-az2"}

BAD = [
    ("aws:region", "europe", "is not an AWS region name"),
    ("ray-eks:gpuAvailabilityZone", "us-east-1a", "is not an availability zone of eu-west-1"),
    ("ray-eks:gpuAvailabilityZoneId", "az2", "is not an AZ ID"),
    ("ray-eks:gpuInstanceType", "g6.48xlarge", "not a known EFA-capable GPU instance type"),
    ("ray-eks:gpuInstanceType", "m7i.xlarge", "not a known EFA-capable GPU instance type"),
    ("ray-eks:gpuNodeCount", "0", "must be at least 1"),
    ("ray-eks:gpuNodeCount", "two", "must be a whole number"),
    ("ray-eks:systemInstanceType", "g6.12xlarge", "not a known non-GPU instance type"),
    ("ray-eks:kubernetesVersion", "1.29", "EKS standard support"),
    ("ray-eks:kubernetesVersion", "latest", "EKS standard support"),
    ("ray-eks:rayImage", "public.ecr.aws/deep-learning-containers/ray:latest", "is not a version"),
    ("ray-eks:rayImage", "public.ecr.aws/deep-learning-containers/ray", "has no tag"),
    ("ray-eks:rayVersion", "v2.58.0", "must be a Ray release"),
    ("ray-eks:nvidiaDevicePluginChartVersion", "0.20", "must pin an exact chart version"),
    ("ray-eks:efaDevicePluginChartVersion", "latest", "must pin an exact chart version"),
    ("ray-eks:kuberayOperatorChartVersion", ">=1.7", "must pin an exact chart version"),
    ("ray-eks:apiAccessCidrs", '["0.0.0.0/0"]', "to every address on the internet"),
    ("ray-eks:apiAccessCidrs", '["10.0.0.1/8"]', "is not an IPv4 CIDR"),
    ("ray-eks:adminPrincipalArns", '["alice"]', "is not an IAM role or user ARN"),
    ("ray-eks:adminPrincipalArns",
     '["arn:aws:sts::123456789012:assumed-role/Admin/alice"]', "is an STS session"),
    ("ray-eks:adminPrincipalArns", '["arn:aws:iam::123456789012:group/Admins"]',
     "is not an IAM role or user ARN"),
    ("ray-eks:systemNodeCount", "0", "between 1 and 10"),
    ("ray-eks:podIdentityAgentVersion", "latest", "must pin an EKS add-on version"),
    ("ray-eks:nodeMonitoringAgentVersion", "v1.4.0", "must pin an EKS add-on version"),
    ("ray-eks:checkpointNoncurrentVersionDays", "-1", "0 keeps every version"),
    ("ray-eks:checkpointIncompleteUploadDays", "0", "S3 counts whole days"),
    ("ray-eks:workersReadyTimeoutMinutes", "600", "0 does not wait"),
    ("ray-eks:checkpointBucketPrefix", "My_Bucket", "S3 naming"),
    ("ray-eks:retainCheckpointsOnDestroy", "maybe", "must be true or false"),
    ("ray-eks:rayNamespace", "Ray_NS", "Kubernetes namespace name"),
    ("ray-eks:gpuRootVolumeGib", "20", "between 100 and 16384"),
    ("ray-eks:gpuHugePagesMib", "5121", "in whole 2 MiB pages (an even number)"),
    ("ray-eks:gpuHugePagesMib", "-2", "must be 0 or more"),
    # A g6.12xlarge (48 vCPUs) with a full EFA installation reserves 48 x 110 + 1 pages.
    ("ray-eks:gpuHugePagesMib", "10564", "more than a g6.12xlarge node can offer (10562 MiB"),
    ("ray-eks:eksImageRegistryAccount", "ecr", "12-digit AWS account ID"),
    ("ray-eks:gpuNodeCont", "2", "did you mean ray-eks:gpuNodeCount?"),
]


def test_committed_stack_parses_with_the_reference_defaults():
    cfg = load_stack_config("us-west-2", REPO_ROOT)
    assert (cfg.gpu_instance_type, cfg.gpu_node_count, cfg.system_instance_type) == (
        "g6.12xlarge", 2, "m7i.xlarge")
    assert cfg.ray_image == "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
    assert (cfg.nvidia_device_plugin_chart_version, cfg.efa_device_plugin_chart_version,
            cfg.kuberay_operator_chart_version) == ("0.20.0", "v0.5.30", "1.7.0")


def test_engine_style_strings_parse_like_yaml_values():
    cfg = parse_stack_config({**GOOD, "ray-eks:gpuNodeCount": "3",
                              "ray-eks:apiAccessCidrs": '["203.0.113.0/24"]',
                              "ray-eks:retainCheckpointsOnDestroy": "false"})
    assert (cfg.gpu_node_count, cfg.api_access_cidrs, cfg.retain_checkpoints_on_destroy) == (
        3, ("203.0.113.0/24",), False)


@pytest.mark.parametrize(("key", "value", "problem"), BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_each_bad_value_names_key_value_and_fix(key, value, problem):
    with pytest.raises(ConfigError) as info:
        parse_stack_config({**GOOD, key: value})
    message = str(info.value)
    assert info.value.key == key
    assert message.startswith(f"{key} = ")
    assert problem in message
    assert "Fix: " in message and "\n" not in message


def test_each_bad_value_has_its_own_message():
    messages = set()
    for key, value, _ in BAD:
        with pytest.raises(ConfigError) as info:
            parse_stack_config({**GOOD, key: value})
        messages.add(str(info.value))
    assert len(messages) == len(BAD)


@pytest.mark.parametrize("missing", ["aws:region", "ray-eks:gpuAvailabilityZone",
                                     "ray-eks:gpuAvailabilityZoneId"])
def test_a_missing_placement_key_points_at_the_probe(missing):
    values = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(ConfigError, match=rf"{missing} = None: is required.*capacity probe"):
        parse_stack_config(values)


def test_an_sts_session_arn_is_refused_with_the_role_arn_as_fix():
    arn = "arn:aws:sts::123456789012:assumed-role/Admin/alice@example.com"
    with pytest.raises(ConfigError, match=r"Fix: list the role itself: "
                                          r"arn:aws:iam::123456789012:role/Admin "):
        parse_stack_config({**GOOD, "ray-eks:adminPrincipalArns": [arn]})


def test_iam_roles_and_users_are_accepted():
    arns = ["arn:aws:iam::123456789012:role/Admin", "arn:aws:iam::123456789012:user/alice",
            "arn:aws-cn:iam::123456789012:role/path/to/Ops"]
    assert parse_stack_config({**GOOD, "ray-eks:adminPrincipalArns": arns}).admin_principal_arns \
        == tuple(arns)


def test_a_secret_value_is_refused():
    with pytest.raises(ConfigError, match="is not a secret value"):
        parse_stack_config({**GOOD, "ray-eks:rayNamespace": {"secure": "AAAB"}})


def test_other_namespaces_are_left_alone():
    assert parse_stack_config({**GOOD, "aws:profile": "dev", "pulumi:tags": {"a": "b"}}).region \
        == "eu-west-1"


# The keys as users write them in Pulumi.<stack>.yaml and docs/INFRA.md lists them, spelled out here
# rather than derived, so that a renamed field or a changed key mapping shows up as a difference.
STACK_FILE_KEYS = {
    "region": "aws:region",
    "gpu_availability_zone": "ray-eks:gpuAvailabilityZone",
    "gpu_availability_zone_id": "ray-eks:gpuAvailabilityZoneId",
    "gpu_instance_type": "ray-eks:gpuInstanceType",
    "gpu_node_count": "ray-eks:gpuNodeCount",
    "gpu_capacity_type": "ray-eks:gpuCapacityType",
    "gpu_spot_price_usd_per_hour": "ray-eks:gpuSpotPriceUsdPerHour",
    "system_instance_type": "ray-eks:systemInstanceType",
    "kubernetes_version": "ray-eks:kubernetesVersion",
    "ray_image": "ray-eks:rayImage",
    "allow_unpinned_images": "ray-eks:allowUnpinnedImages",
    "ray_version": "ray-eks:rayVersion",
    "nvidia_device_plugin_chart_version": "ray-eks:nvidiaDevicePluginChartVersion",
    "efa_device_plugin_chart_version": "ray-eks:efaDevicePluginChartVersion",
    "kuberay_operator_chart_version": "ray-eks:kuberayOperatorChartVersion",
    "node_termination_handler_chart_version": "ray-eks:nodeTerminationHandlerChartVersion",
    "api_access_cidrs": "ray-eks:apiAccessCidrs",
    "api_open_to_internet": "ray-eks:apiOpenToInternet",
    "admin_principal_arns": "ray-eks:adminPrincipalArns",
    "checkpoint_bucket_prefix": "ray-eks:checkpointBucketPrefix",
    "retain_checkpoints_on_destroy": "ray-eks:retainCheckpointsOnDestroy",
    "ray_namespace": "ray-eks:rayNamespace",
    "gpu_root_volume_gib": "ray-eks:gpuRootVolumeGib",
    "eks_image_registry_account": "ray-eks:eksImageRegistryAccount",
    "system_node_count": "ray-eks:systemNodeCount",
    "pod_identity_agent_version": "ray-eks:podIdentityAgentVersion",
    "vpc_cni_version": "ray-eks:vpcCniVersion",
    "node_monitoring_agent_version": "ray-eks:nodeMonitoringAgentVersion",
    "checkpoint_noncurrent_version_days": "ray-eks:checkpointNoncurrentVersionDays",
    "checkpoint_incomplete_upload_days": "ray-eks:checkpointIncompleteUploadDays",
    "gpu_huge_pages_mib": "ray-eks:gpuHugePagesMib",
    "gpu_idle_minutes": "ray-eks:gpuIdleMinutes",
    "cluster_autoscaler_chart_version": "ray-eks:clusterAutoscalerChartVersion",
    "workers_ready_timeout_minutes": "ray-eks:workersReadyTimeoutMinutes",
    "gpu_reservation_id": "ray-eks:gpuReservationId",
    "gpu_reservation_type": "ray-eks:gpuReservationType",
    "gpu_reservation_instance_type": "ray-eks:gpuReservationInstanceType",
    "gpu_reservation_availability_zone": "ray-eks:gpuReservationAvailabilityZone",
    "gpu_reservation_instance_count": "ray-eks:gpuReservationInstanceCount",
    "gpu_reservation_start": "ray-eks:gpuReservationStart",
    "gpu_reservation_end": "ray-eks:gpuReservationEnd",
    "mlflow": "ray-eks:mlflow",
    "mlflow_size": "ray-eks:mlflowSize",
}


def test_every_field_has_its_stack_file_key_and_a_docstring():
    fields = dataclasses.fields(StackConfig)
    assert {field.name: config_key(field.name) for field in fields} == STACK_FILE_KEYS
    assert sorted(KNOWN_KEYS) == sorted(STACK_FILE_KEYS.values())
    # The keys of the committed stack file are all known ones.
    assert set(read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")) <= set(STACK_FILE_KEYS.values())
    source = Path(inspect.getsourcefile(StackConfig)).read_text()
    for field in fields:
        block = source.split(f"    {field.name}: ", 1)[1].split("\n", 2)
        assert block[1].strip().startswith('"""'), f"{field.name} has no docstring"


def test_a_file_that_is_not_a_stack_file_is_refused(tmp_path):
    path = tmp_path / "Pulumi.x.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="not a Pulumi stack file"):
        read_stack_values(path)


def test_every_problem_of_a_stack_file_is_reported_at_once_each_with_its_line(tmp_path):
    (tmp_path / "Pulumi.dev.yaml").write_text(
        "config:\n"
        "  aws:region: us-west-2\n"
        "  ray-eks:gpuAvailabilityZone: us-west-2a\n"
        "  ray-eks:gpuAvailabilityZoneId: use1-az1\n"      # line 4: another region's AZ ID
        "  rayeks:gpuNodeCount: 3\n"                        # line 5: misspelt namespace
        "  ray-eks:kubernetesVersion: 1.30\n"               # line 6: a float in YAML
        "  ray-eks:rayNamespace: Not_A_Label\n")            # line 7
    with pytest.raises(ConfigErrors) as info:
        load_stack_config("dev", tmp_path)
    lines = str(info.value).splitlines()
    path = tmp_path / "Pulumi.dev.yaml"
    assert [line.split(" = ")[0] for line in lines] == [
        f"{path}:4: ray-eks:gpuAvailabilityZoneId", f"{path}:5: rayeks:gpuNodeCount",
        f"{path}:6: ray-eks:kubernetesVersion", f"{path}:7: ray-eks:rayNamespace"]
    assert all("Fix: " in line and "<stack>" not in line for line in lines)
    assert "is an AZ ID of another region (us-west-2's start with usw2-)" in lines[0]
    assert "--stack dev --regions us-west-2" in lines[0]
    assert "did you mean ray-eks:gpuNodeCount?" in lines[1]
    # The value as the file spells it, and the fix quoting that same value (not the default).
    assert lines[2].startswith(f"{path}:6: ray-eks:kubernetesVersion = 1.30: is a number to YAML, not text: "
                               "unquoted, 1.30 is read as 1.3")
    assert lines[2].endswith('Fix: quote it in the stack file: ray-eks:kubernetesVersion: "1.30"')
    assert "(or edit it in Pulumi.dev.yaml)" in lines[3]


def test_one_bad_value_among_good_ones_is_still_a_single_error():
    with pytest.raises(ConfigError) as info:
        parse_stack_config({**GOOD, "aws:region": "europe"})
    assert not isinstance(info.value, ConfigErrors)  # the AZ checks that need a region stay quiet
    assert info.value.key == "aws:region"


@pytest.mark.parametrize(("key", "meant"), [
    ("rayeks:gpuNodeCount", "ray-eks:gpuNodeCount"),
    ("ray_eks:rayNamespace", "ray-eks:rayNamespace"),
    ("Ray-EKS:gpuNodeCount", "ray-eks:gpuNodeCount"),
    ("aws:gpuInstanceType", "ray-eks:gpuInstanceType"),
    ("gpuNodeCount", "ray-eks:gpuNodeCount"),
    ("rayeks:gpuNodeCont", "ray-eks:gpuNodeCount"),
])
def test_a_key_meant_for_this_program_under_another_namespace_is_refused(key, meant):
    with pytest.raises(ConfigError, match=f"did you mean {meant}\\?") as info:
        parse_stack_config({**GOOD, key: "3"})
    assert info.value.key == key and "is not read" in str(info.value)


def test_keys_of_providers_are_still_left_alone():
    values = {**GOOD, "eks:someSetting": 1, "kubernetes:context": "x", "aws:profile": "dev",
              "aws:defaultTags": {"tags": {}}, "pulumi:disable-default-providers": ["*"]}
    assert parse_stack_config(values).region == "eu-west-1"


def test_an_az_id_of_another_region_is_refused():
    with pytest.raises(ConfigError, match="is an AZ ID of another region .eu-west-1's start with euw1-"):
        parse_stack_config({**GOOD, "ray-eks:gpuAvailabilityZoneId": "use1-az1"})


def test_the_az_id_prefix_of_every_region_moto_knows():
    """moto's table of real AZ IDs, 38 regions including GovCloud and China."""
    from moto.ec2.models.availability_zones_and_regions import RegionsAndZonesBackend

    zones = RegionsAndZonesBackend.zones
    assert len(zones) > 30
    for region, region_zones in zones.items():
        for zone in region_zones:
            assert zone.zone_id.startswith(az_id_prefix(region) + "-az"), (region, zone.zone_id)


def test_invalid_yaml_names_its_line(tmp_path):
    (tmp_path / "Pulumi.dev.yaml").write_text("config:\n  aws:region: us-west-2\n  bad: [\n")
    with pytest.raises(ConfigError) as info:
        load_stack_config("dev", tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'Pulumi.dev.yaml'}:4: is not valid YAML (")
    assert "None" not in message and "ParserError" not in message


def test_a_missing_stack_file_names_the_stack_and_the_closest_one(tmp_path):
    (tmp_path / "Pulumi.yaml").write_text("name: ray-eks\n")
    (tmp_path / "Pulumi.us-west-2.yaml").write_text("config: {}\n")
    with pytest.raises(ConfigError, match=r"Fix: did you mean --stack us-west-2\? Or run `python -m capacity "
                                          r"probe --stack us-wst-2` to create it$"):
        load_stack_config("us-wst-2", tmp_path)
    with pytest.raises(ConfigError, match=r"--stack eu-central-1` to create it; stacks here: us-west-2$"):
        load_stack_config("eu-central-1", tmp_path)
    # A name that is not a region: the probe creates it only when asked to.
    with pytest.raises(ConfigError, match=r"--stack dev --new-stack` to create it"):
        load_stack_config("dev", tmp_path)


def test_a_missing_stack_file_in_another_folder_says_to_run_from_the_projects_root(tmp_path):
    """Not `run the probe`, which would create a stray stack file in that folder."""
    with pytest.raises(ConfigError) as info:
        load_stack_config("us-west-2", tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'Pulumi.us-west-2.yaml'}: does not exist. Fix: the stack files "
                              f"are in the project's root ({REPO_ROOT}), beside Pulumi.yaml")
    assert message.endswith(f"{tmp_path} has no Pulumi.yaml: run the command from the project's root")
    assert "capacity probe" not in message


def test_the_eks_api_is_private_unless_cidrs_are_named_and_open_to_all_only_when_said():
    assert StackConfig.api_access_cidrs == ()
    assert parse_stack_config(read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")).api_access_cidrs == ()
    with pytest.raises(ConfigError) as info:
        parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": ["203.0.113.5/32", "0.0.0.0/0"]})
    message = str(info.value)
    assert message.startswith("ray-eks:apiAccessCidrs = '0.0.0.0/0': opens the EKS API of a cluster that runs any "
                              "code it is sent to every address on the internet. Fix:")
    assert "checkip.amazonaws.com" in message and "pulumi config set ray-eks:apiOpenToInternet true" in message
    said = parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": ["0.0.0.0/0"], "ray-eks:apiOpenToInternet": True})
    assert (said.api_access_cidrs, said.api_open_to_internet) == (("0.0.0.0/0",), True)


@pytest.mark.parametrize(("cidrs", "opened"), [
    (["0.0.0.0/1", "128.0.0.0/1"], "4,294,967,296"),
    (["11.0.0.0/8", "12.0.0.0/8"], "33,554,432"),
    ([f"{i}.0.0.0/10" for i in range(1, 6)], "20,971,520"),
    (["0.0.0.0/7", "203.0.113.7/32"], "33,554,433"),
])
def test_api_access_cidrs_that_together_open_more_than_a_slash_8_are_refused_unless_said(cidrs, opened):
    """However the internet is spelt: what counts is how many addresses the list opens."""
    with pytest.raises(ConfigError) as info:
        parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": cidrs})
    assert str(info.value).startswith(
        f"ray-eks:apiAccessCidrs = {cidrs!r}: together open {opened} IPv4 addresses, more than a /8's worth "
        "(16,777,216, the most one organisation holds): the EKS API of a cluster that runs any code it is sent "
        "would be open to a large part of the internet. Fix: list your own address or range")
    assert "pulumi config set ray-eks:apiOpenToInternet true" in str(info.value)
    said = parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": cidrs, "ray-eks:apiOpenToInternet": True})
    assert said.api_access_cidrs == tuple(cidrs)


@pytest.mark.parametrize("cidrs", [["17.0.0.0/8"], ["10.0.0.0/8", "10.0.0.0/9", "10.128.0.0/9"],
                                   ["17.0.0.0/9", "18.0.0.0/9"], ["203.0.113.7/32", "198.51.100.0/24"]])
def test_api_access_cidrs_within_a_slash_8_are_taken(cidrs):
    assert parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": cidrs}).api_access_cidrs == tuple(cidrs)


@pytest.mark.parametrize("cidr", ["2001:db8::/32", "::/0", "::/1"])
def test_an_ipv6_cidr_is_refused_on_this_ipv4_cluster_with_why(cidr):
    with pytest.raises(ConfigError) as info:
        parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": ["203.0.113.7/32", cidr]})
    assert str(info.value) == (
        f"ray-eks:apiAccessCidrs = {cidr!r}: is an IPv6 CIDR, and EKS takes IPv6 public access CIDRs only on "
        "IPv6 clusters (this stack's cluster is IPv4). Fix: list the IPv4 address or range you reach the API "
        "from, like 203.0.113.7/32")


def test_a_bare_address_in_api_access_cidrs_is_refused_with_its_32():
    with pytest.raises(ConfigError) as info:
        parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": ["203.0.113.5"]})
    assert str(info.value) == ("ray-eks:apiAccessCidrs = '203.0.113.5': is an address, not a CIDR. "
                               "Fix: write 203.0.113.5/32 for that one address")
    cfg = parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": ["203.0.113.5/32"]})
    assert cfg.api_access_cidrs == ("203.0.113.5/32",)


@pytest.mark.parametrize("scalar", ["203.0.113.0/24", "203.0.113.0/24,198.51.100.0/24"])
def test_a_list_setting_given_as_a_single_value_is_refused(scalar, tmp_path):
    """A scalar in the stack file (`pulumi config set` without --path) reaches the program as a
    plain string, a YAML list as a JSON one."""
    with pytest.raises(ConfigError) as info:
        parse_stack_config({**GOOD, "ray-eks:apiAccessCidrs": scalar})
    assert str(info.value) == (f"ray-eks:apiAccessCidrs = {scalar!r}: is a single value, not a list. Fix: "
                               "pulumi config set --path 'ray-eks:apiAccessCidrs[0]' 203.0.113.0/24: a list "
                               "(in the stack file, `- 203.0.113.0/24` under the key)")
    (tmp_path / "Pulumi.dev.yaml").write_text(
        "config:\n  aws:region: eu-west-1\n  ray-eks:gpuAvailabilityZone: eu-west-1b\n"
        f"  ray-eks:gpuAvailabilityZoneId: euw1-az2\n  ray-eks:apiAccessCidrs: {scalar}\n")
    with pytest.raises(ConfigError, match=r"Pulumi.dev.yaml:5: ray-eks:apiAccessCidrs = .*: is a single value"):
        load_stack_config("dev", tmp_path)
