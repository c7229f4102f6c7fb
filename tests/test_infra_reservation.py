"""A GPU node group that launches into a capacity reservation: the stack keys that say so, the pure
launch-template and timing rules (infra/reservation.py), and the Pulumi program under mocks with a
stack file holding an On-Demand Capacity Reservation or a Capacity Block."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pulumi
import pytest

from capacity.stackfile import PLACEMENT_KEYS, RESERVATION_KEYS, plan_update, write
from infra import outputs
from infra.config import ConfigError, GpuReservation, format_utc, parse_stack_config, parse_utc, read_stack_values
from infra.health import enable_node_auto_repair
from infra.instance_types import INSTANCE_TYPES
from infra.reservation import (CAPACITY_BLOCK_DRAIN_BUDGET, CAPACITY_BLOCK_RECLAIM, CAPACITY_BLOCK_SCALE_DOWN_LEAD,
                               EKS_SCALE_DOWN_LEAD, EKS_SCALE_IN_DRAIN_ALLOWANCE, END_ACTION, MINIMAL_UPDATE_CONFIG,
                               SCHEDULED_ACTION_DELAY, START_ACTION, UPDATE_SURGE_PER_AZ, ReservationEnded,
                               after_destroy, efa_network_interfaces, idle_usd_per_hour, launch_window,
                               reservation_update_config)
from infra.spot import SIGKILL_MARGIN_S, SPOT_TERMINATION_GRACE_PERIOD_S
from test_infra_program import REPO_ROOT, Declared, ProgramRun, _Mocks, autoscaling_group_of, run_program

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
CLUSTER_SG = "sg-0c1u5te7000000000"
LT = "aws:ec2/launchTemplate:LaunchTemplate"
BLOCK = "aws:ec2/capacityBlockReservation:CapacityBlockReservation"
ODCR = "aws:ec2/capacityReservation:CapacityReservation"
RAY_CLUSTER = "kubernetes:ray.io/v1:RayCluster"
READY = "pulumi-python:dynamic/ray-eks:RayWorkersReady"
SCHEDULE = "aws:autoscaling/schedule:Schedule"


def odcr_values(**changes: Any) -> dict[str, Any]:
    """A stack written by `probe --hold 8`: 2 x g6.12xlarge held in us-west-2a until 2099."""
    values = {**dict(zip(PLACEMENT_KEYS, ("us-west-2", "us-west-2a", "usw2-az1", "g6.12xlarge",
                                          2))),
              **dict(zip(RESERVATION_KEYS, ("cr-0123456789abcdef0", "on-demand", "g6.12xlarge",
                                            "us-west-2a", 2, "2026-12-01T10:00:00Z",
                                            "2099-01-01T10:00:00Z")))}
    values.update(changes)
    return values


def block_values(start: str, end: str, **changes: Any) -> dict[str, Any]:
    """A stack written by `capacity blocks --purchase`: 2 x p5.48xlarge in us-east-2b."""
    values = {**dict(zip(PLACEMENT_KEYS, ("us-east-2", "us-east-2b", "use2-az2", "p5.48xlarge",
                                          2))),
              **dict(zip(RESERVATION_KEYS, ("cr-0b10c0000000000a1", "capacity-block",
                                            "p5.48xlarge", "us-east-2b", 2, start, end)))}
    values.update(changes)
    return values


def reservation(kind: str = "capacity-block", *, start: datetime = NOW + timedelta(days=1),
                end: datetime = NOW + timedelta(days=3)) -> GpuReservation:
    return GpuReservation(reservation_id="cr-0b10c0000000000a1", kind=kind,
                          instance_type="p5.48xlarge", availability_zone="us-east-2b",
                          instance_count=2, start=start, end=end)


# --- the stack keys --------------------------------------------------------------------------

def test_reservation_keys_parse_into_one_value():
    cfg = parse_stack_config(odcr_values())
    assert cfg.gpu_reservation == GpuReservation(
        reservation_id="cr-0123456789abcdef0", kind="on-demand", instance_type="g6.12xlarge",
        availability_zone="us-west-2a", instance_count=2,
        start=datetime(2026, 12, 1, 10, tzinfo=timezone.utc),
        end=datetime(2099, 1, 1, 10, tzinfo=timezone.utc))
    unset = dict(zip(RESERVATION_KEYS, ("", "", "", "", 0, "", "")))
    assert parse_stack_config(odcr_values(**unset)).gpu_reservation is None


@pytest.mark.parametrize("changes, key, problem", [
    ({"ray-eks:gpuInstanceType": "g6e.12xlarge"}, "ray-eks:gpuInstanceType",
     "differs from reservation cr-0123456789abcdef0's instance type g6.12xlarge"),
    ({"ray-eks:gpuAvailabilityZone": "us-west-2b"}, "ray-eks:gpuAvailabilityZone",
     "differs from reservation cr-0123456789abcdef0's AZ us-west-2a"),
    ({"ray-eks:gpuNodeCount": 3}, "ray-eks:gpuNodeCount", "exceeds the 2 instances"),
    ({"ray-eks:gpuReservationId": "sg-123"}, "ray-eks:gpuReservationId", "is not a capacity"),
    ({"ray-eks:gpuReservationType": "spot"}, "ray-eks:gpuReservationType", "must be one of"),
    ({"ray-eks:gpuReservationEnd": "tomorrow"}, "ray-eks:gpuReservationEnd", "ISO 8601"),
    ({"ray-eks:gpuReservationEnd": "2026-12-01T09:00:00Z"}, "ray-eks:gpuReservationEnd",
     "is not after"),
    ({"ray-eks:gpuReservationType": "capacity-block"}, "ray-eks:gpuReservationType",
     "EC2 sells no Capacity Blocks for g6.12xlarge"),
])
def test_reservation_that_disagrees_with_the_placement_is_refused(changes, key, problem):
    with pytest.raises(ConfigError) as err:
        parse_stack_config(odcr_values(**changes))
    assert err.value.key == key and problem in str(err.value)


def test_reservation_keys_come_all_or_none():
    values = odcr_values()
    del values["ray-eks:gpuReservationId"]
    with pytest.raises(ConfigError, match="is set without ray-eks:gpuReservationId"):
        parse_stack_config(values)
    values = odcr_values()
    del values["ray-eks:gpuReservationEnd"]
    with pytest.raises(ConfigError, match="gpuReservationEnd = None: is required"):
        parse_stack_config(values)


def test_an_unquoted_timestamp_in_hand_written_yaml_is_read(tmp_path: Path):
    path = tmp_path / "Pulumi.dev.yaml"
    text = "config:\n" + "".join(f"  {k}: {v}\n" for k, v in odcr_values().items())
    path.write_text(text.replace("'", ""))
    assert "2099-01-01T10:00:00Z\n" in path.read_text()
    cfg = parse_stack_config(read_stack_values(path))
    assert cfg.gpu_reservation_end == "2099-01-01T10:00:00Z"


# --- launch template and timing --------------------------------------------------------------

def test_p5_gets_one_efa_interface_on_each_of_its_32_network_cards():
    interfaces = efa_network_interfaces(INSTANCE_TYPES["p5.48xlarge"], ["sg-1"])
    assert len(interfaces) == 32 == INSTANCE_TYPES["p5.48xlarge"].efa_interfaces
    assert [i["network_card_index"] for i in interfaces] == list(range(32))
    assert (interfaces[0]["interface_type"], interfaces[0]["device_index"]) == ("efa", 0)
    assert {(i["interface_type"], i["device_index"]) for i in interfaces[1:]} == {("efa-only", 1)}
    (single,) = efa_network_interfaces(INSTANCE_TYPES["g6.12xlarge"], ["sg-1"])
    assert single["interface_type"] == "efa" and single["security_groups"] == ["sg-1"]


def test_a_block_not_started_yet_gets_no_nodes_and_says_when_it_starts():
    window = launch_window(reservation(), node_count=2, now=NOW, stack="us-east-2")
    assert window.desired_nodes == 0
    assert "starts at 2026-12-02T12:00:00Z (in 24.0 h)" in window.note
    assert "30 minutes before it ends" in window.note


def test_a_running_block_gets_every_node_and_names_the_reclaim_time():
    window = launch_window(reservation(start=NOW - timedelta(hours=1)), node_count=2, now=NOW,
                           stack="us-east-2")
    assert window.desired_nodes == 2
    assert "reclaims its instances from 2026-12-04T11:30:00Z" in window.note
    assert (window.scale_up_at, window.scale_down_at) == (None, NOW + timedelta(days=3, minutes=-45))
    assert "takes the GPU nodes to zero at 2026-12-04T11:15:00Z" in window.note


def test_a_block_is_scaled_up_at_its_start_and_down_before_ec2_and_eks_act():
    block = reservation()
    window = launch_window(block, node_count=2, now=NOW, stack="us-east-2")
    assert (window.desired_nodes, window.scale_up_at) == (0, block.start)
    assert window.scale_down_at == block.end - CAPACITY_BLOCK_SCALE_DOWN_LEAD
    # Before EKS's own scale-down (actions of one group may not share a time), and before EC2's
    # reclaim by enough for the action's delay, EKS's drain, and the worker's grace period with
    # its margin, the same as on a Spot notice.
    assert CAPACITY_BLOCK_SCALE_DOWN_LEAD > EKS_SCALE_DOWN_LEAD > CAPACITY_BLOCK_RECLAIM
    assert (SCHEDULED_ACTION_DELAY + EKS_SCALE_IN_DRAIN_ALLOWANCE
            + timedelta(seconds=SPOT_TERMINATION_GRACE_PERIOD_S + SIGKILL_MARGIN_S)) <= CAPACITY_BLOCK_DRAIN_BUDGET


def test_a_block_that_ends_within_the_hour_is_a_warning_with_the_time_left():
    window = launch_window(reservation(start=NOW - timedelta(hours=5), end=NOW + timedelta(minutes=55)),
                           node_count=2, now=NOW, stack="us-east-2")
    assert (window.desired_nodes, window.scale_up_at) == (2, None)
    assert window.scale_down_at == NOW + timedelta(minutes=10)
    assert window.note.startswith("Capacity Block cr-0b10c0000000000a1 ends in 55 min, at 2026-12-01T12:55:00Z: "
                                  "a job started now has until 2026-12-01T12:10:00Z (10 min)")


@pytest.mark.parametrize("minutes_left", [50, 44, 31])
def test_a_block_past_its_scale_down_keeps_no_node_and_says_so(minutes_left):
    window = launch_window(reservation(start=NOW - timedelta(hours=5), end=NOW + timedelta(minutes=minutes_left)),
                           node_count=2, now=NOW, stack="us-east-2")
    assert (window.desired_nodes, window.scale_up_at, window.scale_down_at) == (0, None, None)
    assert f"ends at {(NOW + timedelta(minutes=minutes_left)).strftime('%Y-%m-%dT%H:%M:%SZ')}" in window.note
    assert "the GPU node group stays at 0 nodes" in window.note


@pytest.mark.parametrize("kind, end, message", [
    ("capacity-block", NOW + timedelta(minutes=29), "EC2 reclaims its instances from"),
    ("on-demand", NOW - timedelta(seconds=1), "it ended at 2026-12-01T11:59:59Z"),
])
def test_a_reservation_past_its_last_launch_is_refused(kind, end, message):
    with pytest.raises(ReservationEnded, match=message) as err:
        launch_window(reservation(kind, start=NOW - timedelta(days=1), end=end), node_count=2,
                      now=NOW, stack="us-east-2")
    assert "python -m capacity release --stack us-east-2" in str(err.value)


def test_on_demand_reservation_runs_at_once():
    odcr = reservation("on-demand", start=NOW + timedelta(hours=1))
    assert launch_window(odcr, node_count=2, now=NOW, stack="s").desired_nodes == 2


def test_what_destroy_leaves_and_what_it_costs_idle():
    odcr = parse_stack_config(odcr_values())
    assert idle_usd_per_hour(odcr) == round(2 * INSTANCE_TYPES["g6.12xlarge"].usd_per_hour, 2)
    note = after_destroy(odcr, stack="us-west-2")
    assert "leaves On-Demand Capacity Reservation cr-0123456789abcdef0 active until " \
           "2099-01-01T10:00:00Z" in note
    assert "9.20 USD/hour" in note and "capacity release --stack us-west-2" in note
    block = parse_stack_config(block_values("2026-12-02T11:30:00Z", "2026-12-04T11:30:00Z"))
    assert idle_usd_per_hour(block) == 0.0
    assert "paid up front, cannot be cancelled" in after_destroy(block, stack="us-east-2")
    unset = dict(zip(RESERVATION_KEYS, ("", "", "", "", 0, "", "")))
    assert after_destroy(parse_stack_config(odcr_values(**unset)), stack="s") == ""


# --- the program under mocks -----------------------------------------------------------------

def _ec2_view(values: dict[str, Any]) -> dict[str, Any]:
    """What EC2 reports for the stack's reservation (the read resource's state), in the engine's
    camelCase."""
    return {"instanceType": values.get("ray-eks:gpuReservationInstanceType"),
            "availabilityZone": values.get("ray-eks:gpuReservationAvailabilityZone"),
            "instanceCount": values.get("ray-eks:gpuReservationInstanceCount"),
            "endDate": values.get("ray-eks:gpuReservationEnd")}


def _mocks(ec2_view: dict[str, Any]):
    class ReservationMocks(_Mocks):
        """The base mocks, plus EC2's answer for a read of the reservation and EKS's answer for
        the cluster (whose security group the EFA interfaces carry)."""

        def new_resource(self, args: pulumi.runtime.MockResourceArgs):
            if args.resource_id and args.typ in (BLOCK, ODCR):
                state = {"id": args.resource_id, **ec2_view}
                self.run.resources.append(Declared(args.typ, args.name, state))
                return args.resource_id, state
            return super().new_resource(args)

        def call(self, args: pulumi.runtime.MockCallArgs):
            if args.token == "aws:eks/getCluster:getCluster":
                self.run.invokes.append(args.token)
                return {"name": args.args["name"],
                        "vpcConfig": {"clusterSecurityGroupId": CLUSTER_SG}}
            return super().call(args)

    return ReservationMocks


def run_stack(tmp_path: Path, stack: str, values: dict[str, Any], *,
              ec2_view: dict[str, Any] | None = None) -> ProgramRun:
    """Write the stack file as the capacity tools do, then run the program with it; a read of the
    reservation answers what the stack file says, with `ec2_view` changed on top."""
    path = tmp_path / f"Pulumi.{stack}.yaml"
    write(plan_update(path, values))
    config = read_stack_values(path)
    with pytest.MonkeyPatch.context() as mp:
        return run_program(repo_root=REPO_ROOT, stack=stack, config=config, monkeypatch=mp,
                           mocks=_mocks({**_ec2_view(values), **(ec2_view or {})}))


def gpu_group(run: ProgramRun) -> dict[str, Any]:
    (group,) = [g.inputs for g in run.of_type("eks:index:ManagedNodeGroup")
                if g.inputs.get("amiType") == "AL2023_x86_64_NVIDIA"]
    return group


def test_held_odcr_is_the_launch_templates_target_without_a_placement_group(tmp_path):
    run = run_stack(tmp_path, "us-west-2", odcr_values())
    (read,) = run.of_type(ODCR)
    template = run.one(LT).inputs
    target = template["capacityReservationSpecification"]["capacityReservationTarget"]
    assert read.read and read.inputs["id"] == "cr-0123456789abcdef0"
    assert read not in run.registered()
    assert target == {"capacityReservationId": "cr-0123456789abcdef0"}
    # The reservation's facts ride on the template (policies never see the read), and the
    # template waits for the read: an ID EC2 does not know stops the update before it.
    assert template["tags"] == {
        "ray-eks:reservation-id": "cr-0123456789abcdef0", "ray-eks:reservation-type": "on-demand",
        "ray-eks:reservation-instance-type": "g6.12xlarge",
        "ray-eks:reservation-availability-zone": "us-west-2a"}
    assert read.name in run.waits_for(LT, "gpu-launch-template")
    assert "instanceMarketOptions" not in template
    assert template["instanceType"] == "g6.12xlarge"
    assert "placement" not in template and not run.of_type("aws:ec2/placementGroup:PlacementGroup")
    (interface,) = template["networkInterfaces"]
    assert interface["interfaceType"] == "efa" and interface["securityGroups"] == [CLUSTER_SG]
    assert template["blockDeviceMappings"][0]["ebs"]["volumeSize"] == 200
    group = gpu_group(run)
    assert group["capacityType"] == "ON_DEMAND"
    assert group["launchTemplate"]["id"] == "gpu-launch-template-id"
    assert group["scalingConfig"] == {"desiredSize": 2, "minSize": 2, "maxSize": 2}
    for conflicting in ("enableEfaSupport", "placementGroupAvailabilityZone", "diskSize",
                        "instanceTypes"):
        assert conflicting not in group
    assert group["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}]
    # Reserved nodes are repaired too: the transform reaches the node group pulumi-eks creates.
    (declared,) = [g for g in run.of_type("eks:index:ManagedNodeGroup") if g.inputs is group]
    assert declared.transforms[0] is enable_node_auto_repair
    out = run.outputs[outputs.GPU_RESERVATION]
    assert out["id"] == "cr-0123456789abcdef0" and out["idleUsdPerHour"] == 9.2
    assert "leaves On-Demand Capacity Reservation" in out["afterDestroy"]


def test_started_capacity_block_is_targeted_with_market_type_capacity_block(tmp_path):
    run = run_stack(tmp_path, "us-east-2", block_values("2026-01-01T11:30:00Z",
                                                        "2099-01-01T11:30:00Z"))
    (read,) = run.of_type(BLOCK)
    template = run.one(LT).inputs
    assert template["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert template["tags"]["ray-eks:reservation-type"] == "capacity-block"
    assert template["capacityReservationSpecification"]["capacityReservationTarget"] == {
        "capacityReservationId": read.inputs["id"]} == {
        "capacityReservationId": "cr-0b10c0000000000a1"}
    assert len(template["networkInterfaces"]) == 32 and template["instanceType"] == "p5.48xlarge"
    assert not run.of_type("aws:ec2/placementGroup:PlacementGroup")
    group = gpu_group(run)
    assert group["capacityType"] == "CAPACITY_BLOCK"
    assert group["scalingConfig"] == {"desiredSize": 2, "minSize": 2, "maxSize": 2}
    assert "cannot be cancelled" in run.outputs[outputs.GPU_RESERVATION]["afterDestroy"]


def test_block_not_started_yet_deploys_with_no_gpu_nodes_and_scales_up_at_its_start_by_itself(tmp_path):
    run = run_stack(tmp_path, "us-east-2", block_values("2099-01-01T11:30:00Z", "2099-01-03T11:30:00Z"))
    assert gpu_group(run)["scalingConfig"] == {"desiredSize": 0, "minSize": 0, "maxSize": 2}
    assert any("Capacity Block cr-0b10c0000000000a1 starts at 2099-01-01T11:30:00Z" in warning
               and "no second `pulumi up` needed" in warning for warning in run.warnings)
    # Scheduled actions on the GPU group's own Auto Scaling group: up to 2 at the start, down to 0
    # 45 minutes before the end (EC2 reclaims from 30, EKS schedules its own at 40).
    actions = {a.inputs["scheduledActionName"]: a.inputs for a in run.of_type(SCHEDULE)}
    assert actions == {
        START_ACTION: {"scheduledActionName": START_ACTION, "autoscalingGroupName": autoscaling_group_of("gpu-nodes"),
                       "startTime": "2099-01-01T11:30:00Z", "minSize": 2, "maxSize": 2, "desiredCapacity": 2},
        END_ACTION: {"scheduledActionName": END_ACTION, "autoscalingGroupName": autoscaling_group_of("gpu-nodes"),
                     "startTime": "2099-01-03T10:45:00Z", "minSize": 0, "maxSize": 0, "desiredCapacity": 0}}
    for action in run.of_type(SCHEDULE):
        assert "gpu-nodes" in run.waits_for(SCHEDULE, action.name)
    # The workers drain as on a Spot notice: the checkpoint is saved before the instances go.
    worker = run.one(RAY_CLUSTER).inputs["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] == SPOT_TERMINATION_GRACE_PERIOD_S
    # The RayCluster keeps its 2 replicas (Pending until the block starts); `pulumi up` waits for
    # the workers the node group can run now, none, instead of running into its timeout.
    ray = run.one(RAY_CLUSTER).inputs
    assert ray["spec"]["workerGroupSpecs"][0]["replicas"] == 2
    assert run.one(READY).inputs["expectedWorkers"] == 0
    (warning,) = [w for w in run.warnings if "Ray worker pods" in w]
    assert warning.startswith("pulumi up waits for 0 of the 2 Ray worker pods")
    assert "starts at 2099-01-01T11:30:00Z" in warning


def _block_from_now(*, started_hours_ago: float, ends_in_minutes: float) -> dict[str, Any]:
    now = datetime.now(timezone.utc).replace(microsecond=0)
    return block_values(format_utc(now - timedelta(hours=started_hours_ago)),
                        format_utc(now + timedelta(minutes=ends_in_minutes)))


def test_a_block_ending_within_the_hour_deploys_with_its_scale_down_and_a_warning(tmp_path):
    values = _block_from_now(started_hours_ago=5, ends_in_minutes=58)
    run = run_stack(tmp_path, "us-east-2", values)
    assert gpu_group(run)["scalingConfig"] == {"desiredSize": 2, "minSize": 2, "maxSize": 2}
    (action,) = run.of_type(SCHEDULE)
    end = parse_utc(values["ray-eks:gpuReservationEnd"])
    assert action.inputs["startTime"] == format_utc(end - CAPACITY_BLOCK_SCALE_DOWN_LEAD)
    assert (action.inputs["desiredCapacity"], action.inputs["maxSize"]) == (0, 0)
    (warning,) = [w for w in run.warnings if "Capacity Block cr-0b10c0000000000a1" in w]
    assert "ends in 58 min" in warning and "a job started now has until" in warning


def test_a_block_past_its_scale_down_deploys_at_zero_and_says_why(tmp_path):
    run = run_stack(tmp_path, "us-east-2", _block_from_now(started_hours_ago=5, ends_in_minutes=40))
    assert gpu_group(run)["scalingConfig"] == {"desiredSize": 0, "minSize": 0, "maxSize": 2}
    assert run.of_type(SCHEDULE) == []
    assert any("the GPU node group stays at 0 nodes" in w for w in run.warnings)


def test_a_block_whose_nodes_scale_to_zero_gets_only_the_scale_down(tmp_path, monkeypatch):
    # With gpuIdleMinutes the Cluster Autoscaler raises the group for a job; the end still caps it.
    values = block_values("2099-01-01T11:30:00Z", "2099-01-03T11:30:00Z")
    path = tmp_path / "Pulumi.us-east-2.yaml"
    write(plan_update(path, values))
    config = {**read_stack_values(path), "ray-eks:gpuIdleMinutes": 20}
    run = run_program(repo_root=REPO_ROOT, stack="us-east-2", config=config, monkeypatch=monkeypatch,
                      mocks=_mocks(_ec2_view(values)))
    (action,) = run.of_type(SCHEDULE)
    assert action.inputs["scheduledActionName"] == END_ACTION and action.inputs["maxSize"] == 0


def _node_group_props(run: ProgramRun) -> dict[str, Any]:
    """What the GPU ManagedNodeGroup's transforms make of the aws:eks/nodeGroup:NodeGroup that
    pulumi-eks creates inside it (mocks never see that child)."""
    (declared,) = [g for g in run.of_type("eks:index:ManagedNodeGroup")
                   if g.inputs.get("amiType") == "AL2023_x86_64_NVIDIA"]
    props: dict[str, Any] = {"clusterName": "c", "amiType": "AL2023_x86_64_NVIDIA"}
    for transform in declared.transforms:
        result = transform(pulumi.ResourceTransformArgs(
            custom=True, type_="aws:eks/nodeGroup:NodeGroup", name="gpu-nodes", props=props,
            opts=pulumi.ResourceOptions()))
        props = result.props if result is not None else props
    return props


@pytest.mark.parametrize("values", [
    odcr_values(),  # 2 nodes in 2 held instances
    odcr_values(**{"ray-eks:gpuReservationInstanceCount": 3}),  # one spare: EKS may launch 2
    block_values("2026-01-01T11:30:00Z", "2099-01-01T11:30:00Z"),  # 2 nodes in a 2-instance block
], ids=["odcr-full", "odcr-one-spare", "capacity-block-full"])
def test_an_update_inside_a_full_reservation_replaces_nodes_one_by_one(tmp_path, values):
    # EKS's default update launches up to two new nodes per AZ before it removes old ones; with
    # no spare instance in the reservation they could never launch and the update would stall.
    run = run_stack(tmp_path, values["aws:region"], values)
    props = _node_group_props(run)
    assert props["updateConfig"] == {"maxUnavailable": 1, "updateStrategy": "MINIMAL"}
    assert props["nodeRepairConfig"] == {"enabled": True}


def test_a_reservation_with_room_for_the_surge_keeps_the_default_update(tmp_path):
    run = run_stack(tmp_path, "us-west-2", odcr_values(**{"ray-eks:gpuReservationInstanceCount": 4}))
    assert "updateConfig" not in _node_group_props(run)
    plain = run_stack(tmp_path, "plain", dict(zip(PLACEMENT_KEYS, (
        "us-west-2", "us-west-2a", "usw2-az1", "g6.12xlarge", 2))))
    assert "updateConfig" not in _node_group_props(plain)


def test_the_update_rule_counts_the_spare_instances():
    assert reservation_update_config(reservation(), node_count=2) == MINIMAL_UPDATE_CONFIG
    roomy = dataclasses.replace(reservation(), instance_count=2 + UPDATE_SURGE_PER_AZ)
    assert reservation_update_config(roomy, node_count=2) is None
    assert reservation_update_config(roomy, node_count=2, availability_zones=2) == \
        MINIMAL_UPDATE_CONFIG


def test_started_block_and_odcr_stacks_wait_for_every_worker(tmp_path):
    block = run_stack(tmp_path, "us-east-2", block_values("2026-01-01T11:30:00Z",
                                                          "2099-01-01T11:30:00Z"))
    odcr = run_stack(tmp_path, "us-west-2", odcr_values())
    for run in (block, odcr):
        assert run.one(READY).inputs["expectedWorkers"] == 2
        assert not [w for w in run.warnings if "Ray worker pods" in w]


def test_ended_reservation_stops_the_program_with_the_way_out(tmp_path):
    values = odcr_values(**{"ray-eks:gpuReservationEnd": "2026-01-01T10:00:00Z",
                            "ray-eks:gpuReservationStart": "2025-12-31T10:00:00Z"})
    with pytest.raises(Exception, match="it ended at 2026-01-01T10:00:00Z") as err:
        run_stack(tmp_path, "us-west-2", values)
    assert "python -m capacity release --stack us-west-2" in str(err.value)


def test_stack_without_reservation_keeps_pulumi_eks_efa_template_and_placement_group(tmp_path):
    run = run_stack(tmp_path, "plain", dict(zip(PLACEMENT_KEYS, (
        "us-west-2", "us-west-2a", "usw2-az1", "g6.12xlarge", 2))))
    group = gpu_group(run)
    assert group["enableEfaSupport"] is True
    assert group["placementGroupAvailabilityZone"] == "us-west-2a"
    assert not run.of_type(LT) and not run.of_type(ODCR) and not run.of_type(BLOCK)
    assert run.outputs[outputs.GPU_RESERVATION] is None
