"""A Spot stack: ray-eks:gpuCapacityType validated, the GPU managed node group on SPOT, the Ray
workers' grace period and Ray's drain timeout inside the two-minute notice, the cost at the Spot
price; rendered against the KubeRay CRD, run under Pulumi mocks and fed to the policy pack."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import kubernetes_validate
import pytest

from capacity.probe import Evidence, Placement
from capacity.stackfile import placement_values, plan_update, spot_keys_removed, write
from infra import outputs
from infra.config import ConfigError, StackConfig, parse_stack_config, read_stack_values
from infra.cost import estimated_cost_per_hour
from infra.raycluster import build_raycluster
from infra.helm_values import NODE_TERMINATION_HANDLER, chart_values, chart_versions
from infra.spot import (DRAIN_TIMEOUT_ENV, NOTICE_TO_SIGTERM_S, NTH_EVENT_LOOP_S, NTH_IMDS_POLL_S, PREEMPTION_POLL_S,
                        SPOT_DRAIN_TIMEOUT_S, SPOT_NOTICE_S, SPOT_TERMINATION_GRACE_PERIOD_S,
                        node_termination_handler_values, save_budget_s)
from test_infra_helm_values import _chart_file, _unknown_keys
from test_infra_raycluster import crd, raycluster_schema  # noqa: F401  (fixtures)
from test_infra_program import REPO_ROOT, _tolerates, run_program
from test_policy_pack import analyze, servicer  # noqa: F401  (a fixture)

BASE = {"aws:region": "us-west-2", "ray-eks:gpuAvailabilityZone": "us-west-2a",
        "ray-eks:gpuAvailabilityZoneId": "usw2-az1"}
SPOT = StackConfig(region="us-west-2", gpu_availability_zone="us-west-2a", gpu_availability_zone_id="usw2-az1",
                   gpu_capacity_type="spot", gpu_spot_price_usd_per_hour="1.8312")


def _problems(**values) -> str:
    with pytest.raises(ConfigError) as err:
        parse_stack_config({**BASE, **values})
    return str(err.value)


def test_the_capacity_type_is_on_demand_by_default_and_spot_when_asked():
    assert not parse_stack_config(BASE).is_spot
    assert parse_stack_config({**BASE, "ray-eks:gpuCapacityType": "spot"}).is_spot


@pytest.mark.parametrize("values, expected", [
    ({"ray-eks:gpuCapacityType": "SPOT"}, "must be one of on-demand, spot"),
    ({"ray-eks:gpuSpotPriceUsdPerHour": "1.83"}, "is set while ray-eks:gpuCapacityType is on-demand"),
    ({"ray-eks:gpuCapacityType": "spot", "ray-eks:gpuSpotPriceUsdPerHour": "$1.83"}, "is not a price"),
    ({"ray-eks:gpuCapacityType": "spot", "ray-eks:gpuReservationId": "cr-0123456789abcdef0",
      "ray-eks:gpuReservationType": "on-demand", "ray-eks:gpuReservationInstanceType": "g6.12xlarge",
      "ray-eks:gpuReservationAvailabilityZone": "us-west-2a", "ray-eks:gpuReservationInstanceCount": 2,
      "ray-eks:gpuReservationStart": "2026-12-01T00:00:00Z", "ray-eks:gpuReservationEnd": "2099-12-01T00:00:00Z"},
     "cannot launch into capacity reservation cr-0123456789abcdef0"),
])
def test_bad_capacity_settings_are_refused_with_the_key_and_a_fix(values, expected):
    text = _problems(**values)
    assert expected in text and "Fix:" in text


def test_the_checkpoint_fits_inside_the_notice():
    # SIGTERM at most NOTICE_TO_SIGTERM_S after the notice; SIGKILL at the grace period's end,
    # before EC2 takes the instance; Ray's drain ends before the SIGKILL.
    assert NOTICE_TO_SIGTERM_S + SPOT_TERMINATION_GRACE_PERIOD_S < SPOT_NOTICE_S
    assert SPOT_DRAIN_TIMEOUT_S < SPOT_TERMINATION_GRACE_PERIOD_S
    assert (SPOT_TERMINATION_GRACE_PERIOD_S, SPOT_DRAIN_TIMEOUT_S) == (105, 95)
    # Asking every 10 steps of 1.5 s (the 1.5B model on L4s is slower per step than that only
    # with a larger batch) leaves a checkpoint 75 s.
    assert save_budget_s(step_s=1.5, check_every=10) == SPOT_DRAIN_TIMEOUT_S - PREEMPTION_POLL_S - 15


# --- the Node Termination Handler ------------------------------------------------------------------

def test_the_termination_handler_chart_is_pinned_and_its_values_are_keys_of_its_values_yaml(shared_dir):
    chart = _chart_file(shared_dir, NODE_TERMINATION_HANDLER.name, "Chart")
    assert (str(chart["version"]), str(chart["appVersion"])) == ("0.27.6", "1.25.6")
    assert chart_versions(SPOT)[NODE_TERMINATION_HANDLER.name] == str(chart["version"])
    values = chart_values(SPOT, cluster_name="ray-eks-us-west-2")[NODE_TERMINATION_HANDLER.name]
    defaults = _chart_file(shared_dir, NODE_TERMINATION_HANDLER.name, "values")
    # daemonsetNodeSelector is a free-form map, resources a container's (the chart's default is {}).
    free_form = {k: v for k, v in values.items() if k not in ("daemonsetNodeSelector", "resources")}
    assert list(_unknown_keys(free_form, defaults)) == []
    assert {"daemonsetNodeSelector", "resources"} <= set(defaults) and defaults["resources"] == {}
    # IMDS mode: no queue, and the chart's host network, through which the pod reaches the
    # instance metadata with a hop limit of 1 (docs/SECURITY.md).
    assert values["enableSqsTerminationDraining"] is False and defaults["useHostNetwork"] is True
    assert "useHostNetwork" not in values


def test_the_termination_handler_runs_on_the_spot_gpu_nodes_and_only_on_spot_stacks(spot_run):
    config, run = spot_run
    values = node_termination_handler_values()
    gpu = next(g.inputs for g in run.of_type("eks:index:ManagedNodeGroup") if g.inputs.get("enableEfaSupport"))
    (taint,) = gpu["taints"]
    assert any(_tolerates(t, taint) for t in values["daemonsetTolerations"])
    # Its node selector matches the GPU group's labels and the label EKS gives every Spot node.
    eks_labels = {**gpu["labels"], "eks.amazonaws.com/capacityType": gpu["capacityType"]}
    assert values["daemonsetNodeSelector"].items() <= eks_labels.items()
    releases = {r.inputs["chart"]: r for r in run.of_type("kubernetes:helm.sh/v3:Release")}
    release = releases[NODE_TERMINATION_HANDLER.name]
    assert release.inputs["values"] == values
    assert release.inputs["version"] == parse_stack_config(config).node_termination_handler_chart_version
    assert release.inputs["namespace"] == "kube-system"
    assert "gpu-nodes" in run.waits_for("kubernetes:helm.sh/v3:Release", release.name)
    on_demand = chart_values(dataclasses.replace(SPOT, gpu_capacity_type="on-demand", gpu_spot_price_usd_per_hour=""),
                             cluster_name="ray-eks-us-west-2")
    assert NODE_TERMINATION_HANDLER.name not in on_demand


def test_the_termination_handler_drains_on_the_notice_at_once_and_leaves_each_pod_its_grace_period():
    values = node_termination_handler_values()
    assert values["enableSpotInterruptionDraining"] is True
    # NTH drains from (interruption time - nodeTerminationGracePeriod); the interruption time is the
    # notice + 120 s, so at 120 the drain starts at the notice.
    assert values["nodeTerminationGracePeriod"] == SPOT_NOTICE_S
    # -1: the eviction asks for no grace period, so the worker pod's own applies.
    assert values["podTerminationGracePeriod"] == -1
    # Rebalance recommendations are the managed node group's (replacement first, then its drain).
    assert values["enableRebalanceMonitoring"] is False and values["enableRebalanceDraining"] is False
    # The budget to SIGTERM is NTH's poll and hand-off and an allowance for its API calls.
    assert NTH_IMDS_POLL_S + NTH_EVENT_LOOP_S < NOTICE_TO_SIGTERM_S == 10


def _worker_pod(manifest: dict) -> dict:
    (group,) = manifest["spec"]["workerGroupSpecs"]
    return group["template"]["spec"]


def test_spot_workers_get_the_grace_period_and_the_drain_timeout(raycluster_schema):  # noqa: F811
    manifest = build_raycluster(SPOT)
    raycluster_schema.validate(manifest)
    pod = _worker_pod(manifest)
    assert pod["terminationGracePeriodSeconds"] == SPOT_TERMINATION_GRACE_PERIOD_S
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env[DRAIN_TIMEOUT_ENV] == str(SPOT_DRAIN_TIMEOUT_S)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w"}, "spec": pod},
                                 desired_version="1.34", strict=True)
    # The head runs on On-Demand system nodes: untouched.
    assert "terminationGracePeriodSeconds" not in manifest["spec"]["headGroupSpec"]["template"]["spec"]


def test_on_demand_workers_keep_the_defaults():
    on_demand = dataclasses.replace(SPOT, gpu_capacity_type="on-demand", gpu_spot_price_usd_per_hour="")
    pod = _worker_pod(build_raycluster(on_demand))
    assert "terminationGracePeriodSeconds" not in pod
    assert DRAIN_TIMEOUT_ENV not in {e["name"] for e in pod["containers"][0]["env"]}


def test_the_cost_is_at_the_spot_price_or_at_most_on_demand():
    on_demand = dataclasses.replace(SPOT, gpu_capacity_type="on-demand", gpu_spot_price_usd_per_hour="")
    no_price = dataclasses.replace(SPOT, gpu_spot_price_usd_per_hour="")
    assert estimated_cost_per_hour(SPOT) == round(estimated_cost_per_hour(on_demand) - 2 * (4.6016 - 1.8312), 2)
    assert estimated_cost_per_hour(no_price) == estimated_cost_per_hour(on_demand)


@pytest.fixture(scope="module")
def spot_run(tmp_path_factory):
    """The program with a Spot stack file written by the probe's writer."""
    path = tmp_path_factory.mktemp("spot") / "Pulumi.us-west-2.yaml"
    placement = Placement(region="us-west-2", zone="us-west-2a", zone_id="usw2-az1", instance_type="g6.12xlarge",
                          node_count=2, evidence=Evidence.QUOTA_OK, capacity_type="spot", spot_score=6,
                          spot_usd_per_hour=1.8312)
    write(plan_update(path, placement_values(placement), remove=spot_keys_removed(placement)))
    config = read_stack_values(path)
    with pytest.MonkeyPatch.context() as mp:
        return config, run_program(repo_root=REPO_ROOT, stack="us-west-2", config=config, monkeypatch=mp)


def test_the_spot_stack_puts_the_gpu_node_group_on_spot(spot_run):
    config, run = spot_run
    groups = {g.inputs["amiType"]: g.inputs for g in run.of_type("eks:index:ManagedNodeGroup")}
    assert groups["AL2023_x86_64_NVIDIA"]["capacityType"] == "SPOT"
    assert groups["AL2023_x86_64_NVIDIA"]["enableEfaSupport"] is True
    assert {t: g["capacityType"] for t, g in groups.items() if t != "AL2023_x86_64_NVIDIA"} == {
        t: "ON_DEMAND" for t in groups if t != "AL2023_x86_64_NVIDIA"}
    cfg = parse_stack_config(config)
    assert run.outputs[outputs.ESTIMATED_COST_PER_HOUR_USD] == estimated_cost_per_hour(cfg)


def test_the_spot_raycluster_is_registered_with_the_grace_period(spot_run):
    _, run = spot_run
    (rc,) = [r for r in run.of_type("kubernetes:ray.io/v1:RayCluster")]
    pod = _worker_pod(rc.inputs)
    assert pod["terminationGracePeriodSeconds"] == SPOT_TERMINATION_GRACE_PERIOD_S


def test_the_spot_stack_passes_the_policy_pack(spot_run, servicer):  # noqa: F811
    _, run = spot_run
    judged = 0
    for resource in run.registered():
        diagnostics = analyze(servicer, resource.typ, resource.inputs)
        assert diagnostics == [], (resource.typ, resource.name, [d.message for d in diagnostics])
        judged += 1
    assert judged > 20
    from test_policy_rules import gpu_node_group

    assert analyze(servicer, "aws:eks/nodeGroup:NodeGroup", {**gpu_node_group(), "capacityType": "SPOT"}) == []


def test_a_committed_stack_stays_on_demand():
    assert not parse_stack_config(read_stack_values(Path(REPO_ROOT) / "Pulumi.us-west-2.yaml")).is_spot
