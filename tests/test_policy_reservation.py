"""The policy pack on a GPU node group that launches into a capacity reservation: the rule that
the launch template and node group match the reservation EC2 reports (instance type, AZ, market
type of a Capacity Block), that no placement group comes with a reservation, and the same rules on
what the Pulumi program declares for a Capacity Block stack under mocks."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "policy"))

import rules  # noqa: E402
from rules import UNKNOWN, StackResource  # noqa: E402
from test_policy_pack import analyze_stack, servicer  # noqa: E402,F401  (servicer: a fixture)
from test_policy_rules import LT_URN, NG_URN, gpu_node_group  # noqa: E402

from infra.instance_types import INSTANCE_TYPES  # noqa: E402
from infra.reservation import efa_network_interfaces  # noqa: E402

BLOCK_URN = ("urn:pulumi:us-east-2::ray-eks::ray-eks:infra:GpuNodeGroup"
             "$aws:ec2/capacityBlockReservation:CapacityBlockReservation::gpu-reservation")
SUBNET_URN = ("urn:pulumi:us-east-2::ray-eks::ray-eks:infra:Network"
              "$aws:ec2/subnet:Subnet::network-private-us-east-2b")
BLOCK_ID = "cr-0b10c0000000000a1"


def block_template() -> dict[str, Any]:
    """The launch template infra/nodegroups.py declares for a p5.48xlarge Capacity Block, in the
    engine's camelCase (the reservation ID comes from the read resource: unknown in preview)."""
    interfaces = [{"networkCardIndex": i["network_card_index"], "deviceIndex": i["device_index"],
                   "interfaceType": i["interface_type"], "deleteOnTermination": "true",
                   "securityGroups": [UNKNOWN]}
                  for i in efa_network_interfaces(INSTANCE_TYPES["p5.48xlarge"], None)]
    return {"instanceType": "p5.48xlarge", "networkInterfaces": interfaces,
            "capacityReservationSpecification": {
                "capacityReservationTarget": {"capacityReservationId": UNKNOWN}},
            "instanceMarketOptions": {"marketType": "capacity-block"},
            "blockDeviceMappings": [{"deviceName": "/dev/xvda", "ebs": {"volumeSize": 200}}]}


def block_stack(*, template: dict | None = None, block: dict | None = None,
                node_group: dict | None = None, zone: str = "us-east-2b") -> list[StackResource]:
    """Node group, its launch template, the block as read from EC2, and the node group's subnet,
    linked as the engine links them during preview."""
    ng = {**gpu_node_group(), "capacityType": "CAPACITY_BLOCK", "subnetIds": [UNKNOWN]}
    ng.pop("instanceTypes")
    return [
        StackResource(urn=NG_URN, type=rules.NODE_GROUP, props=node_group or ng,
                      dependencies=(LT_URN, SUBNET_URN),
                      property_dependencies={"launchTemplate": (LT_URN,),
                                             "subnetIds": (SUBNET_URN,)}),
        StackResource(urn=LT_URN, type=rules.LAUNCH_TEMPLATE, props=template or block_template(),
                      dependencies=(BLOCK_URN,),
                      property_dependencies={"capacityReservationSpecification": (BLOCK_URN,)}),
        StackResource(urn=BLOCK_URN, type=rules.CAPACITY_BLOCK, props=block or {
            "id": BLOCK_ID, "instanceType": "p5.48xlarge", "availabilityZone": "us-east-2b",
            "instanceCount": 2, "reservationType": "capacity-block"}),
        StackResource(urn=SUBNET_URN, type=rules.SUBNET,
                      props={"availabilityZone": zone, "cidrBlock": "10.0.32.0/19"}),
    ]


def test_block_stack_as_the_program_declares_it_passes():
    stack = block_stack()
    assert rules.capacity_reservation_violations(stack) == []
    assert rules.gpu_node_group_efa_violations(stack) == []  # no placement group is needed


@pytest.mark.parametrize("change, urn, expected", [
    (lambda s: s[1].props.update(instanceType="p4d.24xlarge"), LT_URN,
     "launches p4d.24xlarge into Capacity Block cr-0b10c0000000000a1, which holds p5.48xlarge"),
    (lambda s: s[0].props.update(instanceTypes=["p4d.24xlarge"]), NG_URN,
     "node group runs p4d.24xlarge in Capacity Block"),
    (lambda s: s[3].props.update(availabilityZone="us-east-2a"), NG_URN,
     "subnet is in us-east-2a, but Capacity Block cr-0b10c0000000000a1 is in us-east-2b"),
    (lambda s: s[2].props.update(availabilityZone="us-east-2c"), NG_URN,
     "is in us-east-2c"),
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


def test_odcr_with_another_instance_type_is_refused_too():
    odcr = StackResource(urn=BLOCK_URN.replace("capacityBlockReservation:CapacityBlock",
                                               "capacityReservation:Capacity"),
                         type=rules.CAPACITY_RESERVATION,
                         props={"id": "cr-0123456789abcdef0", "instanceType": "g6.12xlarge",
                                "availabilityZone": "us-east-2b", "reservationType": "default"})
    template = {**block_template(), "instanceType": "g6e.12xlarge"}
    template.pop("instanceMarketOptions")
    ng, lt, _, subnet = block_stack(template=template)
    ng = StackResource(urn=ng.urn, type=ng.type, props={**ng.props, "capacityType": "ON_DEMAND"},
                       dependencies=ng.dependencies,
                       property_dependencies=ng.property_dependencies)
    lt = StackResource(urn=lt.urn, type=lt.type, props=lt.props,
                       property_dependencies={"capacityReservationSpecification": (odcr.urn,)})
    (violation,) = rules.capacity_reservation_violations([ng, lt, odcr, subnet])
    assert "launches g6e.12xlarge into capacity reservation cr-0123456789abcdef0" in \
        violation.message


def test_reservation_found_by_its_known_id_without_property_dependencies():
    ng, lt, block, subnet = block_stack()
    props = copy.deepcopy(lt.props)
    props["capacityReservationSpecification"]["capacityReservationTarget"][
        "capacityReservationId"] = BLOCK_ID
    props["instanceType"] = "p4d.24xlarge"
    lt = StackResource(urn=lt.urn, type=lt.type, props=props)
    (violation,) = rules.capacity_reservation_violations([ng, lt, block, subnet])
    assert violation.urn == LT_URN and "holds p5.48xlarge" in violation.message


def test_a_target_the_stack_does_not_read_cannot_be_checked():
    ng, lt, _, subnet = block_stack()
    props = copy.deepcopy(lt.props)
    props["capacityReservationSpecification"]["capacityReservationTarget"][
        "capacityReservationId"] = "cr-0ffffffffffffffff"
    lt = StackResource(urn=lt.urn, type=lt.type, props=props)
    (violation,) = rules.capacity_reservation_violations([ng, lt, subnet])
    assert "cr-0ffffffffffffffff, which this stack does not read from EC2" in violation.message


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


def test_program_block_stack_passes_and_a_block_ec2_places_elsewhere_is_refused(tmp_path):
    """The resources the program declares for a Capacity Block stack (the node group inside
    pulumi-eks's remote component rebuilt from the component's inputs), checked against EC2's
    answer for the block: the same AZ passes, another AZ is refused."""
    from test_infra_reservation import block_values, gpu_group, run_stack

    values = block_values("2026-01-01T11:30:00Z", "2099-01-01T11:30:00Z")

    def resources(ec2_zone: str) -> list[StackResource]:
        run = run_stack(tmp_path, "us-east-2", values,
                        ec2_view={"availabilityZone": ec2_zone})
        out = [StackResource(urn=f"urn:{d.typ}::{d.name}", type=d.typ,
                             props={"id": d.inputs.get("id", f"{d.name}-id"), **d.inputs})
               for d in run.resources if d.typ in (rules.LAUNCH_TEMPLATE, rules.SUBNET)]
        (read,) = run.of_type(rules.CAPACITY_BLOCK)
        out.append(StackResource(urn=f"urn:{read.typ}::{read.name}", type=read.typ,
                                 props=read.inputs))
        group = gpu_group(run)
        out.append(StackResource(urn="urn:gpu-nodes", type=rules.NODE_GROUP, props={
            **group, "launchTemplate": {"id": group["launchTemplate"]["id"]}}))
        return out

    assert rules.capacity_reservation_violations(resources("us-east-2b")) == []
    (violation,) = rules.capacity_reservation_violations(resources("us-east-2a"))
    assert "subnet is in us-east-2b, but Capacity Block cr-0b10c0000000000a1 is in us-east-2a" \
        in violation.message
