"""Every Helm value the stack sets is a key of that chart's own values.yaml, at the pinned
chart version."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from ruamel.yaml import YAML

from infra.config import StackConfig
from infra.helm_values import chart_values, chart_versions

CFG = StackConfig(region="eu-west-1", gpu_availability_zone="eu-west-1b",
                  gpu_availability_zone_id="euw1-az2")
CLUSTER = "ray-eks-eu-west-1"
# Keys whose values are free-form maps in the chart (any label, any selector).
FREE_FORM = {"nodeSelector"}


def _unknown_keys(values: Any, defaults: Any, path: str = "") -> Iterator[str]:
    if not isinstance(values, dict):
        return
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if not isinstance(defaults, dict) or key not in defaults:
            yield where
        elif key not in FREE_FORM:
            yield from _unknown_keys(value, defaults[key], where)


def _chart_file(shared_dir: Path, chart: str, kind: str) -> Any:
    return YAML(typ="safe").load((shared_dir / "charts" / f"{chart}.{kind}.yaml").read_text())


@pytest.mark.parametrize("chart", sorted(chart_values(CFG, cluster_name=CLUSTER)))
def test_every_value_key_exists_in_the_charts_values_yaml(shared_dir, chart):
    defaults = _chart_file(shared_dir, chart, "values")
    assert list(_unknown_keys(chart_values(CFG, cluster_name=CLUSTER)[chart], defaults)) == []


@pytest.mark.parametrize("chart", sorted(chart_values(CFG, cluster_name=CLUSTER)))
def test_reference_chart_is_the_pinned_version(shared_dir, chart):
    assert str(_chart_file(shared_dir, chart, "Chart")["version"]) == chart_versions(CFG)[chart]


def test_the_key_check_catches_a_misspelled_key(shared_dir):
    defaults = _chart_file(shared_dir, "kuberay-operator", "values")
    assert list(_unknown_keys({"nodeSelektor": {}, "image": {"tagg": "x"}}, defaults)) == [
        "nodeSelektor", "image.tagg"]


def test_plugins_tolerate_the_gpu_taint_and_the_operator_runs_on_the_system_node():
    values = chart_values(CFG, cluster_name=CLUSTER)
    toleration = {"key": "nvidia.com/gpu", "operator": "Equal", "value": "true",
                  "effect": "NoSchedule"}
    assert toleration in values["nvidia-device-plugin"]["tolerations"]
    assert toleration in values["aws-efa-k8s-device-plugin"]["tolerations"]
    assert values["nvidia-device-plugin"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert values["kuberay-operator"]["nodeSelector"] == {"role": "system"}


def test_efa_plugin_image_comes_from_the_stacks_region():
    repo = chart_values(CFG, cluster_name=CLUSTER)["aws-efa-k8s-device-plugin"]["image"]["repository"]
    assert repo == "602401143452.dkr.ecr.eu-west-1.amazonaws.com/eks/aws-efa-k8s-device-plugin"
    other = StackConfig(region="af-south-1", gpu_availability_zone="af-south-1a",
                        gpu_availability_zone_id="afs1-az1",
                        eks_image_registry_account="877085696533")
    assert chart_values(other, cluster_name=CLUSTER)["aws-efa-k8s-device-plugin"]["image"]["repository"].startswith(
        "877085696533.dkr.ecr.af-south-1.amazonaws.com/")
