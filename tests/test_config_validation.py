"""The stack-config model: the committed stack parses, and each bad value is refused with its own
one-line error naming the key, the value and the fix."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from infra.config import (KNOWN_KEYS, ConfigError, StackConfig, config_key, load_stack_config,
                          parse_stack_config, read_stack_values)

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
    ("ray-eks:apiAccessCidrs", "[]", "at least one CIDR"),
    ("ray-eks:apiAccessCidrs", '["10.0.0.1/8"]', "is not an IPv4 CIDR"),
    ("ray-eks:adminPrincipalArns", '["alice"]', "is not an IAM role or user ARN"),
    ("ray-eks:checkpointBucketPrefix", "My_Bucket", "S3 naming"),
    ("ray-eks:retainCheckpointsOnDestroy", "maybe", "must be true or false"),
    ("ray-eks:rayNamespace", "Ray_NS", "Kubernetes namespace name"),
    ("ray-eks:gpuRootVolumeGib", "20", "between 100 and 16384"),
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
    "system_instance_type": "ray-eks:systemInstanceType",
    "kubernetes_version": "ray-eks:kubernetesVersion",
    "ray_image": "ray-eks:rayImage",
    "ray_version": "ray-eks:rayVersion",
    "nvidia_device_plugin_chart_version": "ray-eks:nvidiaDevicePluginChartVersion",
    "efa_device_plugin_chart_version": "ray-eks:efaDevicePluginChartVersion",
    "kuberay_operator_chart_version": "ray-eks:kuberayOperatorChartVersion",
    "api_access_cidrs": "ray-eks:apiAccessCidrs",
    "admin_principal_arns": "ray-eks:adminPrincipalArns",
    "checkpoint_bucket_prefix": "ray-eks:checkpointBucketPrefix",
    "retain_checkpoints_on_destroy": "ray-eks:retainCheckpointsOnDestroy",
    "ray_namespace": "ray-eks:rayNamespace",
    "gpu_root_volume_gib": "ray-eks:gpuRootVolumeGib",
    "eks_image_registry_account": "ray-eks:eksImageRegistryAccount",
}


def test_every_field_has_its_stack_file_key_and_a_docstring():
    fields = dataclasses.fields(StackConfig)
    assert {field.name: config_key(field.name) for field in fields} == STACK_FILE_KEYS
    assert sorted(KNOWN_KEYS) == sorted(STACK_FILE_KEYS.values())
    # The keys of the committed stack file are all known ones.
    assert set(read_stack_values(REPO_ROOT / "Pulumi.us-west-2.yaml")) <= set(STACK_FILE_KEYS.values())
    source = (REPO_ROOT / "infra" / "config.py").read_text()
    for field in fields:
        block = source.split(f"    {field.name}: ", 1)[1].split("\n", 2)
        assert block[1].strip().startswith('"""'), f"{field.name} has no docstring"


def test_a_file_that_is_not_a_stack_file_is_refused(tmp_path):
    path = tmp_path / "Pulumi.x.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="not a Pulumi stack file"):
        read_stack_values(path)
