"""The policy pack on a GPU node group that launches into a capacity reservation: the rule that
the launch template and node group match what the reservation holds (instance type, AZ, market
type of a Capacity Block), that no placement group comes with a reservation, and the same rules on
what the Pulumi program registers for a Capacity Block stack under mocks.

The stacks are fed as Pulumi's engine feeds stack policies: registered resources only. The
reservation the program reads with `.get()` is a read (OpRead), which never reaches a policy."""

from __future__ import annotations

import copy
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "policy"))

import rules  # noqa: E402
from rules import UNKNOWN, StackResource  # noqa: E402
from test_policy_pack import analyze_stack, servicer  # noqa: E402,F401  (servicer: a fixture)
from test_policy_rules import LT_URN, NG_URN, gpu_node_group  # noqa: E402

from infra.config import GpuReservation  # noqa: E402
from infra.instance_types import INSTANCE_TYPES  # noqa: E402
from infra.reservation import RESERVATION_TAG_KEYS, efa_network_interfaces, reservation_tags  # noqa: E402

BLOCK_URN = ("urn:pulumi:us-east-2::ray-eks::ray-eks:infra:GpuNodeGroup"
             "$aws:ec2/capacityBlockReservation:CapacityBlockReservation::gpu-reservation")
SUBNET_URN = ("urn:pulumi:us-east-2::ray-eks::ray-eks:infra:Network"
              "$aws:ec2/subnet:Subnet::network-private-us-east-2b")
BLOCK_ID = "cr-0b10c0000000000a1"
BLOCK = GpuReservation(reservation_id=BLOCK_ID, kind="capacity-block", instance_type="p5.48xlarge",
                       availability_zone="us-east-2b", instance_count=2,
                       start=datetime(2026, 12, 1, 11, 30, tzinfo=timezone.utc),
                       end=datetime(2026, 12, 3, 11, 30, tzinfo=timezone.utc))


def block_template() -> dict[str, Any]:
    """The launch template infra/nodegroups.py declares for a p5.48xlarge Capacity Block, in the
    engine's camelCase: the stack file's reservation ID, and the reservation's facts as tags."""
    interfaces = [{"networkCardIndex": i["network_card_index"], "deviceIndex": i["device_index"],
                   "interfaceType": i["interface_type"], "deleteOnTermination": "true",
                   "securityGroups": [UNKNOWN]}
                  for i in efa_network_interfaces(INSTANCE_TYPES["p5.48xlarge"], None)]
    return {"instanceType": "p5.48xlarge", "networkInterfaces": interfaces,
            "capacityReservationSpecification": {
                "capacityReservationTarget": {"capacityReservationId": BLOCK_ID}},
            "instanceMarketOptions": {"marketType": "capacity-block"},
            "tags": reservation_tags(BLOCK),
            "blockDeviceMappings": [{"deviceName": "/dev/xvda", "ebs": {"volumeSize": 200}}]}


def block_stack(*, template: dict | None = None, registered_block: dict | None = None,
                node_group: dict | None = None, zone: str = "us-east-2b") -> list[StackResource]:
    """Node group, its launch template and the node group's subnet, linked as the engine links
    them during preview: what the engine hands stack policies. The block the program reads with
    `.get()` is not among them; `registered_block` adds a reservation resource the stack would
    register itself (its properties)."""
    ng = {**gpu_node_group(), "capacityType": "CAPACITY_BLOCK", "subnetIds": [UNKNOWN]}
    ng.pop("instanceTypes")
    stack = [
        StackResource(urn=NG_URN, type=rules.NODE_GROUP, props=node_group or ng,
                      dependencies=(LT_URN, SUBNET_URN),
                      property_dependencies={"launchTemplate": (LT_URN,),
                                             "subnetIds": (SUBNET_URN,)}),
        StackResource(urn=LT_URN, type=rules.LAUNCH_TEMPLATE, props=template or block_template()),
        StackResource(urn=SUBNET_URN, type=rules.SUBNET,
                      props={"availabilityZone": zone, "cidrBlock": "10.0.32.0/19"}),
    ]
    if registered_block is not None:
        stack.append(StackResource(urn=BLOCK_URN, type=rules.CAPACITY_BLOCK, props=registered_block))
    return stack


def test_the_pack_spells_the_programs_reservation_tags():
    assert rules.RESERVATION_TAG_KEYS == RESERVATION_TAG_KEYS
    assert set(block_template()["tags"]) == set(RESERVATION_TAG_KEYS)


def test_block_stack_as_the_engine_delivers_it_passes():
    # No read resource reaches the policies: the template's tags carry the block's facts.
    stack = block_stack()
    assert not [r for r in stack if r.type in (rules.CAPACITY_BLOCK, rules.CAPACITY_RESERVATION)]
    assert rules.capacity_reservation_violations(stack) == []
    assert rules.gpu_node_group_efa_violations(stack) == []  # no placement group is needed


def _set_tag(key: str, value: str):
    return lambda s: s[1].props["tags"].update({key: value})


@pytest.mark.parametrize("change, urn, expected", [
    (lambda s: s[1].props.update(instanceType="p4d.24xlarge"), LT_URN,
     "launches p4d.24xlarge into Capacity Block cr-0b10c0000000000a1, which holds p5.48xlarge"),
    (_set_tag("ray-eks:reservation-instance-type", "p5e.48xlarge"), LT_URN,
     "launches p5.48xlarge into Capacity Block cr-0b10c0000000000a1, which holds p5e.48xlarge"),
    (lambda s: s[0].props.update(instanceTypes=["p4d.24xlarge"]), NG_URN,
     "node group runs p4d.24xlarge in Capacity Block"),
    (lambda s: s[2].props.update(availabilityZone="us-east-2a"), NG_URN,
     "subnet is in us-east-2a, but Capacity Block cr-0b10c0000000000a1 is in us-east-2b"),
    (_set_tag("ray-eks:reservation-availability-zone", "us-east-2c"), NG_URN,
     "subnet is in us-east-2b, but Capacity Block cr-0b10c0000000000a1 is in us-east-2c"),
    (_set_tag("ray-eks:reservation-id", "cr-0ffffffffffffffff"), LT_URN,
     "targets capacity reservation cr-0b10c0000000000a1, but its ray-eks:reservation-id tag "
     "names cr-0ffffffffffffffff"),
    (lambda s: s[1].props.pop("instanceMarketOptions"), LT_URN,
     "without instanceMarketOptions.marketType capacity-block"),
    (lambda s: s[0].props.update(capacityType="ON_DEMAND"), NG_URN,
     "capacityType 'ON_DEMAND', not CAPACITY_BLOCK"),
])
def test_block_targeted_with_another_type_or_az_is_refused(change, urn, expected):
    stack = block_stack()
    change(stack)
    (violation,) = rules.capacity_reservation_violations(stack)
    assert violation.urn == urn and expected in violation.message


def test_a_registered_reservation_is_the_truth_before_the_tags():
    odcr = StackResource(urn=BLOCK_URN.replace("capacityBlockReservation:CapacityBlock",
                                               "capacityReservation:Capacity"),
                         type=rules.CAPACITY_RESERVATION,
                         props={"id": "cr-0123456789abcdef0", "instanceType": "g6.12xlarge",
                                "availabilityZone": "us-east-2b", "reservationType": "default"})
    template = {**block_template(), "instanceType": "g6e.12xlarge"}
    template.pop("instanceMarketOptions")
    ng, lt, subnet = block_stack(template=template)
    ng = StackResource(urn=ng.urn, type=ng.type, props={**ng.props, "capacityType": "ON_DEMAND"},
                       dependencies=ng.dependencies,
                       property_dependencies=ng.property_dependencies)
    lt = StackResource(urn=lt.urn, type=lt.type, props=lt.props,
                       property_dependencies={"capacityReservationSpecification": (odcr.urn,)})
    (violation,) = rules.capacity_reservation_violations([ng, lt, odcr, subnet])
    assert "launches g6e.12xlarge into capacity reservation cr-0123456789abcdef0" in \
        violation.message


def test_a_registered_reservation_found_by_its_known_id_without_property_dependencies():
    stack = block_stack(registered_block={
        "id": BLOCK_ID, "instanceType": "p4d.24xlarge", "availabilityZone": "us-east-2b",
        "reservationType": "capacity-block"})
    (violation,) = rules.capacity_reservation_violations(stack)
    assert violation.urn == LT_URN and "which holds p4d.24xlarge" in violation.message


def test_a_target_without_tags_or_a_registered_reservation_cannot_be_checked():
    ng, lt, subnet = block_stack()
    props = copy.deepcopy(lt.props)
    props.pop("tags")
    lt = StackResource(urn=lt.urn, type=lt.type, props=props)
    (violation,) = rules.capacity_reservation_violations([ng, lt, subnet])
    assert "cr-0b10c0000000000a1, but the stack neither registers that reservation nor tags " \
        "the template" in violation.message


def test_reservation_and_placement_group_together_are_refused():
    template = {**block_template(), "placement": {"groupName": "gpu-nodes-4f2a"}}
    assert any("also sets a placement group" in m
               for m in rules.efa_launch_template_violations(template, []))
    assert rules.efa_launch_template_violations(block_template(), []) == []


def test_pack_reports_the_block_mismatch_as_mandatory(servicer):  # noqa: F811
    stack = block_stack(zone="us-east-2a")
    (diagnostic,) = analyze_stack(servicer, stack)
    assert diagnostic.policyName == "capacity-reservation-matches" and diagnostic.urn == NG_URN
    assert analyze_stack(servicer, block_stack()) == []


def test_program_block_stack_as_the_engine_delivers_it(tmp_path, servicer):  # noqa: F811
    """The resources a Capacity Block stack registers (the node group inside pulumi-eks's remote
    component rebuilt from the component's inputs; the block it reads with `.get()` left out, as
    the engine leaves it out) pass every stack policy; a node group moved to another AZ than the
    block's is refused."""
    from test_infra_reservation import block_values, gpu_group, run_stack

    run = run_stack(tmp_path, "us-east-2", block_values("2026-01-01T11:30:00Z",
                                                        "2099-01-01T11:30:00Z"))
    assert [r.typ for r in run.resources if r.read] == [rules.CAPACITY_BLOCK]

    def registered(subnet_zone: str | None = None) -> list[StackResource]:
        out = []
        for d in run.registered():
            if d.typ not in (rules.LAUNCH_TEMPLATE, rules.SUBNET):
                continue
            props = {"id": d.inputs.get("id", f"{d.name}-id"), **copy.deepcopy(d.inputs)}
            if d.typ == rules.SUBNET and subnet_zone:
                props["availabilityZone"] = subnet_zone
            out.append(StackResource(urn=f"urn:{d.typ}::{d.name}", type=d.typ, props=props))
        group = gpu_group(run)
        out.append(StackResource(urn="urn:gpu-nodes", type=rules.NODE_GROUP, props={
            **group, "launchTemplate": {"id": group["launchTemplate"]["id"]}}))
        return out

    assert rules.capacity_reservation_violations(registered()) == []
    assert [d.policyName for d in analyze_stack(servicer, registered())] == []
    (violation,) = rules.capacity_reservation_violations(registered(subnet_zone="us-east-2a"))
    assert "subnet is in us-east-2a, but Capacity Block cr-0b10c0000000000a1 is in us-east-2b" \
        in violation.message
