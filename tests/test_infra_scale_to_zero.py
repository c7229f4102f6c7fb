"""Idle GPUs cost nothing (`ray-eks:gpuIdleMinutes`): the setting, the RayCluster with Ray's
autoscaler against the real KubeRay CRD, the Cluster Autoscaler's Helm values against its chart's
values.yaml, its IAM policy, the GPU Auto Scaling group's tags, the program under mocks with the
setting (and with a reservation), the policy pack on what it registers, and the stack without the
setting exactly as before."""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pulumi
import pytest
from ruamel.yaml import YAML

from capacity.stackfile import plan_update, write
from infra import outputs
from infra.config import SUPPORTED_KUBERNETES_MINORS, ConfigError, StackConfig, parse_stack_config, read_stack_values
from infra.cost import cost_summary, estimated_cost_per_hour, estimated_idle_cost_per_hour, idle_cost_items
from infra.helm_values import CLUSTER_AUTOSCALER, chart_values, chart_versions
from infra.instance_types import INSTANCE_TYPES
from infra.nodes import SYSTEM_NODE_LABELS
from infra.raycluster import build_raycluster
from infra.render import rendered_objects
from infra.scale_to_zero import (CLUSTER_AUTOSCALER_IMAGE_TAGS, DISCOVERY_TAG_KEY, RAY_AUTOSCALER_RESOURCES,
                                 SAFE_TO_EVICT_ANNOTATION, SCALE_ACTIONS, cluster_autoscaler_policy,
                                 cluster_autoscaler_values, node_template_tags)
from infra.sizing import GPU_NODE_DAEMONSETS, node_allocatable
from test_infra_helm_values import _chart_file, _unknown_keys
from test_infra_program import REPO_ROOT, ProgramRun, _Mocks, autoscaling_group_of, run_program
from test_infra_raycluster import crd, raycluster_schema  # noqa: F401  (fixtures)
from test_infra_reservation import _ec2_view, block_values, odcr_values
from test_infra_reservation import _mocks as reservation_mocks
from test_policy_pack import analyze, servicer  # noqa: F401  (fixture)

BASE = StackConfig(region="eu-west-1", gpu_availability_zone="eu-west-1b",
                   gpu_availability_zone_id="euw1-az2")
IDLE = dataclasses.replace(BASE, gpu_idle_minutes=30)
CLUSTER = "ray-eks-eu-west-1"
RAY_CLUSTER = "kubernetes:ray.io/v1:RayCluster"
READY = "pulumi-python:dynamic/ray-eks:RayWorkersReady"
TAG = "aws:autoscaling/tag:Tag"
RELEASE = "kubernetes:helm.sh/v3:Release"
ASSOCIATION = "aws:eks/podIdentityAssociation:PodIdentityAssociation"
STACK_FILE = REPO_ROOT / "Pulumi.us-west-2.yaml"


# --- the setting ---------------------------------------------------------------------------------

def test_scaling_to_zero_is_off_by_default():
    assert parse_stack_config(read_stack_values(STACK_FILE)).gpu_idle_minutes == 0
    assert StackConfig.gpu_idle_minutes == 0


@pytest.mark.parametrize("value, problem", [
    (-5, "must be between 0 and 1440"), (1441, "must be between 0 and 1440"), ("half an hour", "whole number")])
def test_a_bad_idle_time_names_the_key(value, problem):
    values = {**read_stack_values(STACK_FILE), "ray-eks:gpuIdleMinutes": value}
    with pytest.raises(ConfigError, match=f"ray-eks:gpuIdleMinutes = .*{problem}"):
        parse_stack_config(values)


def test_the_cluster_autoscaler_chart_is_pinned_exactly():
    values = {**read_stack_values(STACK_FILE), "ray-eks:clusterAutoscalerChartVersion": "9.x"}
    with pytest.raises(ConfigError, match="clusterAutoscalerChartVersion = '9.x': must pin an exact chart"):
        parse_stack_config(values)


# --- the RayCluster ------------------------------------------------------------------------------

def test_with_idle_minutes_the_raycluster_autoscales_and_validates_against_the_crd(raycluster_schema):  # noqa: F811
    manifest = build_raycluster(IDLE)
    raycluster_schema.validate(manifest)  # unknown fields rejected
    spec = manifest["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    options = spec["autoscalerOptions"]
    assert options["idleTimeoutSeconds"] == 30 * 60
    assert options["version"] == "v2"
    assert options["resources"]["requests"] == options["resources"]["limits"] == RAY_AUTOSCALER_RESOURCES
    (group,) = spec["workerGroupSpecs"]
    # Ray's autoscaler owns the count: Pulumi sets no `replicas` it would reset on the next `up`.
    assert "replicas" not in group
    assert (group["minReplicas"], group["maxReplicas"]) == (0, IDLE.gpu_node_count)
    for template in (spec["headGroupSpec"]["template"], group["template"]):
        assert template["metadata"]["annotations"] == {SAFE_TO_EVICT_ANNOTATION: "false"}


def test_without_idle_minutes_the_raycluster_is_unchanged(raycluster_schema):  # noqa: F811
    manifest = build_raycluster(BASE)
    assert manifest["spec"]["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in manifest["spec"]
    (group,) = manifest["spec"]["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)
    assert "annotations" not in group["template"]["metadata"]
    assert build_raycluster(dataclasses.replace(BASE, gpu_idle_minutes=0)) == manifest


def test_a_stack_without_the_setting_renders_exactly_as_before(capsys, monkeypatch):
    # tests/fixtures/render/us-west-2.yaml is `python -m infra render --stack us-west-2` of the
    # commit before scaling to zero existed. A change meant to alter stacks without the setting
    # regenerates it with that command.
    from infra.__main__ import main

    monkeypatch.chdir(REPO_ROOT)
    assert main(["render", "--stack", "us-west-2"]) == 0
    assert capsys.readouterr().out == (REPO_ROOT / "tests/fixtures/render/us-west-2.yaml").read_text()


def test_the_system_node_fits_the_head_its_autoscaler_the_cluster_autoscaler_and_the_rest(shared_dir):
    from rules import parse_quantity  # the policy pack's reading (test_policy_pack put it on the path)

    from infra.sizing import head_pod_size

    node = node_allocatable(INSTANCE_TYPES[IDLE.system_instance_type])
    head = head_pod_size(IDLE.system_instance).resources()
    operator = _chart_file(shared_dir, "kuberay-operator", "values")["resources"]["limits"]
    ca = cluster_autoscaler_values(IDLE, cluster_name=CLUSTER)["resources"]["requests"]
    pods = [head, RAY_AUTOSCALER_RESOURCES, operator, ca, *[{"cpu": "100m", "memory": "70Mi"}] * 2]  # + CoreDNS
    addons = [d for d in GPU_NODE_DAEMONSETS if d.name in ("aws-node", "kube-proxy", "eks-pod-identity-agent")]
    cpu = sum(parse_quantity(p["cpu"]) for p in pods) + Decimal(sum(d.cpu_millicores for d in addons)) / 1000
    memory = sum(parse_quantity(p["memory"]) for p in pods) + sum(d.memory_mib * 2**20 for d in addons)
    assert cpu <= Decimal(node.cpu_millicores) / 1000
    assert memory <= node.memory_kib * 1024


# --- the Cluster Autoscaler ----------------------------------------------------------------------

def _commented_extra_args(shared_dir: Path) -> set[str]:
    """The flags the chart's values.yaml lists (as comments) under extraArgs, and its defaults."""
    text = (shared_dir / "charts" / "cluster-autoscaler.values.yaml").read_text()
    block = text.split("\nextraArgs:\n", 1)[1].split("\n\n", 1)[0]
    return {line.strip().lstrip("# ").split(":", 1)[0] for line in block.splitlines() if ":" in line}


def test_cluster_autoscaler_values_are_keys_of_its_charts_values_yaml(shared_dir):
    values = chart_values(IDLE, cluster_name=CLUSTER)[CLUSTER_AUTOSCALER.name]
    defaults = _chart_file(shared_dir, "cluster-autoscaler", "values")
    # extraArgs takes any flag; resources is a container's (the chart's default is {}).
    free_form = {k: v for k, v in values.items() if k not in ("extraArgs", "resources")}
    assert list(_unknown_keys(free_form, defaults)) == []
    assert defaults["resources"] == {} and set(values["resources"]) == {"requests", "limits"}
    assert set(values["extraArgs"]) <= _commented_extra_args(shared_dir)
    assert values["extraArgs"]["skip-nodes-with-local-storage"] is True  # Ray pods' /dev/shm
    assert str(_chart_file(shared_dir, "cluster-autoscaler", "Chart")["version"]) == \
        chart_versions(IDLE)[CLUSTER_AUTOSCALER.name] == IDLE.cluster_autoscaler_chart_version


def test_the_cluster_autoscaler_finds_the_gpu_group_alone_and_runs_on_a_system_node():
    values = cluster_autoscaler_values(IDLE, cluster_name=CLUSTER)
    assert values["autoDiscovery"] == {"clusterName": CLUSTER, "tags": [f"{DISCOVERY_TAG_KEY}={CLUSTER}"]}
    # EKS puts the k8s.io/cluster-autoscaler/* keys on every managed node group, the system one's
    # too: discovery by them would let the autoscaler remove the nodes that run the Ray head.
    assert not any(tag.startswith("k8s.io/cluster-autoscaler/") for tag in values["autoDiscovery"]["tags"])
    assert values["nodeSelector"] == SYSTEM_NODE_LABELS
    assert values["awsRegion"] == "eu-west-1" and values["cloudProvider"] == "aws"
    assert not {"awsAccessKeyID", "awsSecretAccessKey"} & set(values)  # Pod Identity, no keys


@pytest.mark.parametrize("minor", [f"1.{m}" for m in SUPPORTED_KUBERNETES_MINORS])
def test_the_cluster_autoscaler_image_is_the_clusters_kubernetes_minor(minor):
    tag = cluster_autoscaler_values(dataclasses.replace(IDLE, kubernetes_version=minor),
                                    cluster_name=CLUSTER)["image"]["tag"]
    assert tag.startswith(f"v{minor}.") and tag.count(".") == 2
    assert set(CLUSTER_AUTOSCALER_IMAGE_TAGS) == {f"1.{m}" for m in SUPPORTED_KUBERNETES_MINORS}


def test_each_minors_image_is_the_newest_patch_promoted_for_that_minor():
    # The table's rule (infra/scale_to_zero.py): the cluster's minor, its newest promoted patch.
    listed = REPO_ROOT / "tests/fixtures/cluster-autoscaler/promoted-tags.txt"
    promoted: dict[str, list[tuple[int, str]]] = {}
    for line in listed.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            tag = line.split()[0]
            major, minor, patch = tag.removeprefix("v").split(".")
            promoted.setdefault(f"{major}.{minor}", []).append((int(patch), tag))
    assert set(promoted) >= set(CLUSTER_AUTOSCALER_IMAGE_TAGS)
    assert CLUSTER_AUTOSCALER_IMAGE_TAGS == {minor: max(promoted[minor])[1] for minor in CLUSTER_AUTOSCALER_IMAGE_TAGS}


def test_the_autoscaler_may_resize_only_groups_with_this_stacks_discovery_tag():
    policy = cluster_autoscaler_policy(cluster_name=CLUSTER, partition="aws", region="eu-west-1")
    statements = policy["Statement"]
    assert all(s["Effect"] == "Allow" for s in statements)
    assert not any("*" in a for s in statements for a in s["Action"])
    scaling = [s for s in statements if set(s["Action"]) & set(SCALE_ACTIONS)]
    assert len(scaling) == 1 and set(scaling[0]["Action"]) == set(SCALE_ACTIONS)
    assert scaling[0]["Condition"]["StringEquals"][f"aws:ResourceTag/{DISCOVERY_TAG_KEY}"] == CLUSTER
    for statement in statements:  # only its own Pod Identity session
        tags = statement["Condition"]["StringEquals"]
        assert tags["aws:PrincipalTag/kubernetes-service-account"] == "cluster-autoscaler"
        assert tags["aws:PrincipalTag/kubernetes-namespace"] == "kube-system"
        assert tags["aws:PrincipalTag/eks-cluster-name"] == CLUSTER
    (nodegroups,) = [s for s in statements if s["Action"] == ["eks:DescribeNodegroup"]]
    assert nodegroups["Resource"] == f"arn:aws:eks:eu-west-1:*:nodegroup/{CLUSTER}/*/*"


def test_node_template_tags_describe_a_gpu_node_of_an_empty_group():
    tags = node_template_tags(IDLE, cluster_name=CLUSTER)
    prefix = "k8s.io/cluster-autoscaler/node-template"
    assert tags == {
        DISCOVERY_TAG_KEY: CLUSTER,
        f"{prefix}/resources/nvidia.com/gpu": "4",
        f"{prefix}/resources/vpc.amazonaws.com/efa": "1",
        f"{prefix}/label/role": "gpu",
        f"{prefix}/label/nvidia.com/gpu.present": "true",
        f"{prefix}/label/k8s.amazonaws.com/accelerator": "nvidia-l4",
        f"{prefix}/taint/nvidia.com/gpu": "true:NoSchedule",
    }
    # A worker that asks for huge pages grows the group only if the template offers them.
    paged = node_template_tags(dataclasses.replace(IDLE, gpu_huge_pages_mib=5120), cluster_name=CLUSTER)
    assert paged[f"{prefix}/resources/hugepages-2Mi"] == "5120Mi"
    worker = build_raycluster(dataclasses.replace(IDLE, gpu_huge_pages_mib=5120))["spec"]["workerGroupSpecs"][0]
    requests = worker["template"]["spec"]["containers"][0]["resources"]["requests"]
    for name in ("nvidia.com/gpu", "vpc.amazonaws.com/efa", "hugepages-2Mi"):
        assert paged[f"{prefix}/resources/{name}"] == requests[name]
    p5 = node_template_tags(dataclasses.replace(IDLE, gpu_instance_type="p5.48xlarge"), cluster_name=CLUSTER)
    assert (p5[f"{prefix}/resources/nvidia.com/gpu"], p5[f"{prefix}/resources/vpc.amazonaws.com/efa"]) == ("8", "32")


# --- cost ----------------------------------------------------------------------------------------

def test_idle_costs_the_stack_without_its_gpu_nodes():
    busy, idle = estimated_cost_per_hour(IDLE), estimated_idle_cost_per_hour(IDLE)
    assert busy == estimated_cost_per_hour(BASE) == 9.82
    assert idle == round(busy - 2 * 4.6016 - 400 * 0.08 / 730, 2) == 0.57
    assert estimated_idle_cost_per_hour(BASE) == estimated_cost_per_hour(BASE)  # nodes never stop
    line = cost_summary(IDLE)
    assert line.startswith("estimated cost: about $9.82/hour busy (2x g6.12xlarge $9.20, ")
    assert "$0.57/hour idle, the GPU nodes scaled to zero 30 min after the last job" in line


def test_idle_still_pays_a_held_reservation():
    odcr = parse_stack_config({**odcr_values(), "ray-eks:gpuIdleMinutes": 20})
    items = idle_cost_items(odcr)
    assert items["reservation cr-0123456789abcdef0 (idle, still billed)"] == 9.2
    assert "idle still pays On-Demand Capacity Reservation cr-0123456789abcdef0, $9.20/hour" in cost_summary(odcr)
    block = parse_stack_config({**block_values("2026-01-01T11:30:00Z", "2099-01-01T11:30:00Z"),
                                "ray-eks:gpuIdleMinutes": 20})
    assert not [k for k in idle_cost_items(block) if "reservation" in k]
    assert "Capacity Block cr-0b10c0000000000a1 was paid up front: scaling to zero saves none of it" in \
        cost_summary(block)


# --- the program under mocks ---------------------------------------------------------------------

class _EksMocks(_Mocks):
    """The base mocks, plus EKS's answer about the cluster's node groups (each with the Auto Scaling
    group EKS made for it), for a program that would look them up rather than read its own node
    group's outputs."""

    GPU_LABELS = {"role": "gpu", "nvidia.com/gpu.present": "true", "k8s.amazonaws.com/accelerator": "nvidia-l4"}
    GROUPS = {"system-nodes-0a1b2c3": ({"role": "system"}, autoscaling_group_of("system-nodes")),
              "gpu-nodes-4d5e6f7": (GPU_LABELS, autoscaling_group_of("gpu-nodes"))}

    def call(self, args: pulumi.runtime.MockCallArgs):
        if args.token == "aws:eks/getNodeGroups:getNodeGroups":
            self.run.invokes.append(args.token)
            return {"clusterName": args.args["clusterName"], "names": sorted(self.GROUPS), "id": "groups"}
        if args.token == "aws:eks/getNodeGroup:getNodeGroup":
            self.run.invokes.append(args.token)
            name = args.args["nodeGroupName"]
            labels, asg = self.GROUPS[name]
            return {"clusterName": args.args["clusterName"], "nodeGroupName": name, "labels": labels,
                    "resources": [{"autoscalingGroups": [{"name": asg}]}]}
        return super().call(args)


OLD_GPU_ASG = "eks-gpu-nodes-0000000-asg"


class _ReplacedGpuGroupMocks(_EksMocks):
    """EKS during the `pulumi up` that replaces the GPU node group (here, On-Demand to Spot): Pulumi
    creates the new group before it deletes the old, so the cluster has both, with the same labels,
    and the old one's name sorts first."""

    GROUPS = {**_EksMocks.GROUPS, "gpu-nodes-0000000": (_EksMocks.GPU_LABELS, OLD_GPU_ASG)}


@pytest.fixture(scope="module")
def idle_run() -> ProgramRun:
    config = {**read_stack_values(STACK_FILE), "ray-eks:gpuIdleMinutes": 30}
    with pytest.MonkeyPatch.context() as mp:
        return run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=mp,
                           mocks=_EksMocks)


def _groups(run: ProgramRun) -> tuple[dict[str, Any], dict[str, Any]]:
    groups = run.of_type("eks:index:ManagedNodeGroup")
    (gpu,) = [g.inputs for g in groups if g.inputs["amiType"] == "AL2023_x86_64_NVIDIA"]
    (system,) = [g.inputs for g in groups if g.inputs["amiType"] != "AL2023_x86_64_NVIDIA"]
    return gpu, system


def test_the_gpu_group_may_go_to_zero_and_pulumi_leaves_its_size_to_the_autoscaler(idle_run):
    gpu, system = _groups(idle_run)
    assert gpu["scalingConfig"] == {"desiredSize": 0, "minSize": 0, "maxSize": 2}
    assert gpu["ignoreScalingChanges"] is True  # pulumi-eks: ignore_changes scalingConfig.desiredSize
    assert gpu["labels"]["k8s.amazonaws.com/accelerator"] == "nvidia-l4"
    # Nothing about the system node group changes.
    assert system["scalingConfig"] == {"desiredSize": 2, "minSize": 2, "maxSize": 2}
    assert "ignoreScalingChanges" not in system


def test_the_gpu_auto_scaling_group_and_no_other_carries_the_node_template(idle_run):
    tags = idle_run.of_type(TAG)
    assert {t.inputs["autoscalingGroupName"] for t in tags} == {autoscaling_group_of("gpu-nodes")}
    assert {t.inputs["tag"]["key"]: t.inputs["tag"]["value"] for t in tags} == node_template_tags(
        parse_stack_config({**read_stack_values(STACK_FILE), "ray-eks:gpuIdleMinutes": 30}),
        cluster_name="ray-eks-us-west-2")
    assert not any(t.inputs["tag"]["propagateAtLaunch"] for t in tags)
    # Read once the node groups exist: the Auto Scaling group's name is EKS's.
    for tag in tags:
        assert "gpu-nodes" in idle_run.waits_for(TAG, tag.name)


def _after_the_update(run: ProgramRun) -> dict[str, dict[str, str]]:
    """The Auto Scaling groups left once `pulumi up` ends (the old node group, and its group, deleted),
    with the tags the program put on each."""
    left = {autoscaling_group_of(g.name): {} for g in run.of_type("eks:index:ManagedNodeGroup")}
    for tag in run.of_type(TAG):
        group = left.get(tag.inputs["autoscalingGroupName"])
        if group is not None:
            group[tag.inputs["tag"]["key"]] = tag.inputs["tag"]["value"]
    return left


def test_a_replaced_gpu_node_group_gets_the_tags_the_autoscaler_finds_and_may_resize(monkeypatch):
    config = {**read_stack_values(STACK_FILE), "ray-eks:gpuIdleMinutes": 30, "ray-eks:gpuCapacityType": "spot"}
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch,
                      mocks=_ReplacedGpuGroupMocks)
    new_group = autoscaling_group_of("gpu-nodes")
    assert {t.inputs["autoscalingGroupName"] for t in run.of_type(TAG)} == {new_group}  # not OLD_GPU_ASG
    groups = _after_the_update(run)
    # What the Cluster Autoscaler discovers (its auto-discovery tags, key=value each) ...
    cfg, cluster = parse_stack_config(config), "ray-eks-us-west-2"
    discovery = cluster_autoscaler_values(cfg, cluster_name=cluster)["autoDiscovery"]
    wanted = [tag.split("=", 1) for tag in discovery["tags"]]
    assert {name for name, tags in groups.items() if all(tags.get(k) == v for k, v in wanted)} == {new_group}
    # ... and what its IAM policy lets it resize, by the condition on the group's tags.
    policy = cluster_autoscaler_policy(cluster_name=cluster, partition="aws", region="us-west-2")
    (scaling,) = [s for s in policy["Statement"] if set(s["Action"]) == set(SCALE_ACTIONS)]
    condition = {k.removeprefix("aws:ResourceTag/"): v for k, v in scaling["Condition"]["StringEquals"].items()
                 if k.startswith("aws:ResourceTag/")}
    assert {name for name, tags in groups.items() if all(tags.get(k) == v for k, v in condition.items())} == {new_group}
    # The name came from the node group's own outputs: EKS's list of groups was never read.
    assert "aws:eks/getNodeGroups:getNodeGroups" not in run.invokes


def test_the_cluster_autoscaler_is_a_pinned_release_with_its_own_pod_identity(idle_run):
    cfg = parse_stack_config({**read_stack_values(STACK_FILE), "ray-eks:gpuIdleMinutes": 30})
    (release,) = [r for r in idle_run.of_type(RELEASE) if r.inputs["chart"] == "cluster-autoscaler"]
    assert release.inputs["version"] == "9.59.0"
    assert release.inputs["namespace"] == "kube-system"
    assert release.inputs["values"] == chart_values(cfg, cluster_name="ray-eks-us-west-2")["cluster-autoscaler"]
    assert release.inputs["values"]["image"]["tag"] == "v1.34.5"  # kubernetesVersion 1.34
    association = next(a for a in idle_run.of_type(ASSOCIATION) if a.inputs["namespace"] == "kube-system")
    assert association.inputs["serviceAccount"] == "cluster-autoscaler"
    assert association.inputs["roleArn"].endswith("/autoscaler-role")
    # Pods admitted before the association get no credentials; the pod runs on a system node.
    assert {association.name, "system-nodes"} <= idle_run.waits_for(RELEASE, release.name)
    (policy,) = [json.loads(p.inputs["policy"]) for p in idle_run.of_type("aws:iam/rolePolicy:RolePolicy")
                 if p.inputs["role"] == "autoscaler-role-id"]
    assert policy == cluster_autoscaler_policy(cluster_name="ray-eks-us-west-2", partition="aws",
                                               region="us-west-2")


def test_pulumi_up_waits_for_no_worker_meant_to_be_at_zero(idle_run):
    ray = idle_run.one(RAY_CLUSTER).inputs
    assert ray["spec"]["enableInTreeAutoscaling"] is True
    assert "replicas" not in ray["spec"]["workerGroupSpecs"][0]
    assert idle_run.of_type(READY) == []
    assert not [w for w in idle_run.warnings if "Ray worker pods" in w]


def test_outputs_show_the_cost_busy_and_idle(idle_run):
    assert idle_run.outputs[outputs.ESTIMATED_COST_PER_HOUR_USD] == 9.82
    assert idle_run.outputs[outputs.ESTIMATED_IDLE_COST_PER_HOUR_USD] == 0.57
    assert idle_run.outputs[outputs.GPU_IDLE_MINUTES] == 30


def test_every_resource_the_idle_stack_registers_passes_the_policy_pack(idle_run, servicer):  # noqa: F811
    for resource in idle_run.registered():
        assert analyze(servicer, resource.typ, resource.inputs) == [], resource.name


def test_the_setting_at_zero_declares_what_a_stack_without_it_declares(monkeypatch):
    def declared(config: dict[str, Any]) -> list[tuple[str, str, str]]:
        run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch,
                          mocks=_EksMocks)
        return sorted((r.typ, r.name, json.dumps(r.inputs, sort_keys=True, default=str)) for r in run.resources)

    without = declared(read_stack_values(STACK_FILE))
    assert declared({**read_stack_values(STACK_FILE), "ray-eks:gpuIdleMinutes": 0}) == without
    types = {typ for typ, _, _ in without}
    assert TAG not in types and "ray-eks:infra:ClusterAutoscaler" not in types
    assert not any("ignoreScalingChanges" in inputs for _, _, inputs in without)


def test_with_a_held_reservation_pulumi_up_says_idle_still_pays_it(tmp_path, monkeypatch):
    path = tmp_path / "Pulumi.us-west-2.yaml"
    write(plan_update(path, odcr_values()))  # as `probe --hold` writes it
    config = {**read_stack_values(path), "ray-eks:gpuIdleMinutes": 20}
    mocks = type("ReservedEksMocks", (_EksMocks, reservation_mocks(_ec2_view(odcr_values()))), {})
    run = run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=monkeypatch,
                      mocks=mocks)
    (warning,) = [w for w in run.warnings if "gpuIdleMinutes" in w]
    assert "idle still pays On-Demand Capacity Reservation cr-0123456789abcdef0, $9.20/hour" in warning
    assert run.outputs[outputs.ESTIMATED_IDLE_COST_PER_HOUR_USD] == round(0.57 + 9.2, 2)
    (gpu,) = [g.inputs for g in run.of_type("eks:index:ManagedNodeGroup") if g.inputs["amiType"].endswith("NVIDIA")]
    assert gpu["scalingConfig"] == {"desiredSize": 0, "minSize": 0, "maxSize": 2}
    assert gpu["ignoreScalingChanges"] is True


def test_render_of_an_idle_stack_prints_the_autoscaler_values(tmp_path, capsys):
    from infra.__main__ import main

    text = STACK_FILE.read_text().replace("  ray-eks:gpuNodeCount: 2\n",
                                          "  ray-eks:gpuNodeCount: 2\n  ray-eks:gpuIdleMinutes: 30\n")
    (tmp_path / "Pulumi.idle.yaml").write_text(text)
    assert main(["render", "--stack", "idle", "--project-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("# estimated cost: about $9.82/hour busy")
    docs = list(YAML(typ="safe").load_all(out))
    cfg = dataclasses.replace(parse_stack_config(read_stack_values(tmp_path / "Pulumi.idle.yaml")))
    assert docs[0] == build_raycluster(cfg)
    assert docs[-1] == rendered_objects(cfg, stack="idle")["helm"]["cluster-autoscaler"]["values"]
    assert docs[-1]["autoDiscovery"]["clusterName"] == "ray-eks-idle"
    assert "# Helm values of cluster-autoscaler 9.59.0" in out
