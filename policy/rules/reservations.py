"""Capacity reservations and Capacity Blocks: a launch template that targets one launches what it
holds, where it holds it.

Pulumi's engine puts what a program reads with `Resource.get` (OpRead steps) in a deployment's
reads, and hands policies only the resources the program registers, so the reservation the GPU
node group reads from EC2 never reaches these rules. The program writes the reservation's facts
on the launch template as tags instead (RESERVATION_TAG_KEYS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .resources import (CAPACITY_BLOCK, CAPACITY_RESERVATION, LAUNCH_TEMPLATE, NODE_GROUP, SUBNET, UNKNOWN,
                        StackResource, StackViolation, as_list, referenced, referenced_all, value_at)


def reservation_target(template: Mapping[str, Any]) -> Any:
    """The capacity reservation ID a launch template targets (UNKNOWN during preview when it
    comes from another resource), or None when it targets none."""
    spec = template.get("capacityReservationSpecification")
    if spec is UNKNOWN:
        return UNKNOWN
    target = value_at(spec, "capacityReservationTarget")
    if target is UNKNOWN:
        return UNKNOWN
    rid = value_at(target, "capacityReservationId")
    return rid if rid not in (None, "") else None


RESERVATION_TAG_KEYS = ("ray-eks:reservation-id", "ray-eks:reservation-type",
                        "ray-eks:reservation-instance-type",
                        "ray-eks:reservation-availability-zone")
"""The launch template tags that carry the targeted reservation's facts; the same keys as
infra/reservation.py writes (a test holds the two equal: the pack imports nothing of infra)."""


@dataclass(frozen=True, kw_only=True)
class ReservationFacts:
    """What a reservation holds, from the reservation's own resource or the template's tags."""

    reservation_id: str
    is_block: bool
    instance_type: str | None
    availability_zone: str | None


def _targeted_reservations(template: StackResource,
                           reservations: Sequence[StackResource]) -> list[StackResource]:
    """The reservation resources a template targets: through the engine's property dependencies,
    else by a known ID equal to the reservation's."""
    urns = set(template.property_dependencies.get("capacityReservationSpecification", ()))
    found = [r for r in reservations if r.urn in urns]
    rid = reservation_target(template.props)
    return found or [r for r in reservations if isinstance(rid, str) and r.props.get("id") == rid]


def _facts_of_resource(template: Mapping[str, Any], reservation: StackResource) -> ReservationFacts:
    block = (reservation.type == CAPACITY_BLOCK
             or reservation.props.get("reservationType") == "capacity-block"
             or value_at(template, "instanceMarketOptions", "marketType") == "capacity-block")
    return ReservationFacts(
        reservation_id=_known_str(reservation.props.get("id")) or reservation.urn.rsplit("::", 1)[-1],
        is_block=block, instance_type=_known_str(reservation.props.get("instanceType")),
        availability_zone=_known_str(reservation.props.get("availabilityZone")))


def _facts_of_tags(template: Mapping[str, Any]) -> ReservationFacts | None:
    """The reservation's facts the template's tags carry (None without its ID tag)."""
    tags = template.get("tags")
    if not isinstance(tags, Mapping):
        return None
    rid, kind, instance_type, zone = (_known_str(tags.get(k)) for k in RESERVATION_TAG_KEYS)
    if rid is None:
        return None
    block = (kind == "capacity-block"
             or value_at(template, "instanceMarketOptions", "marketType") == "capacity-block")
    return ReservationFacts(reservation_id=rid, is_block=block, instance_type=instance_type,
                            availability_zone=zone)


def _known_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def capacity_reservation_violations(resources: Sequence[StackResource]) -> list[StackViolation]:
    """A launch template that targets a capacity reservation launches what the reservation holds:
    its instance type (on the template and on every node group using it) and its AZ (of every
    subnet of those node groups). What it holds comes from the reservation's own resource when
    the stack registers one, else from the template's RESERVATION_TAG_KEYS tags (the engine hands
    policies no resource a program reads with `.get()`). A Capacity Block also needs market type
    capacity-block and node group capacity type CAPACITY_BLOCK."""
    templates = [r for r in resources if r.type == LAUNCH_TEMPLATE]
    reservations = [r for r in resources if r.type in (CAPACITY_RESERVATION, CAPACITY_BLOCK)]
    groups = [r for r in resources if r.type == NODE_GROUP]
    subnets = [r for r in resources if r.type == SUBNET]
    out: list[StackViolation] = []
    for lt in templates:
        rid = reservation_target(lt.props)
        if rid is None:
            continue
        facts = [_facts_of_resource(lt.props, r) for r in _targeted_reservations(lt, reservations)]
        if not facts:
            tagged = _facts_of_tags(lt.props)
            if tagged is not None and isinstance(rid, str) and tagged.reservation_id != rid:
                out.append(StackViolation(lt.urn, f"launch template targets capacity reservation "
                                          f"{rid}, but its {RESERVATION_TAG_KEYS[0]} tag names "
                                          f"{tagged.reservation_id}"))
                continue
            facts = [tagged] if tagged is not None else []
        if not facts:
            shown = rid if isinstance(rid, str) else "(known at deploy time)"
            out.append(StackViolation(lt.urn, f"launch template targets capacity reservation "
                                      f"{shown}, but the stack neither registers that reservation "
                                      f"nor tags the template with what it holds "
                                      f"({', '.join(RESERVATION_TAG_KEYS)}), so its instance "
                                      "type and AZ cannot be checked"))
            continue
        users = [ng for ng in groups if referenced(ng, "launchTemplate", [lt], ("id", "name"))]
        for held in facts:
            out.extend(_reservation_mismatches(lt, held, users, subnets))
    return out


def _reservation_mismatches(lt: StackResource, held: ReservationFacts, users: list[StackResource],
                            subnets: Sequence[StackResource]) -> list[StackViolation]:
    block = held.is_block
    what = "Capacity Block" if block else "capacity reservation"
    rid, want_type, want_zone = held.reservation_id, held.instance_type, held.availability_zone
    out: list[StackViolation] = []
    lt_type = _known_str(lt.props.get("instanceType"))
    if want_type and lt_type and lt_type != want_type:
        out.append(StackViolation(lt.urn, f"launch template launches {lt_type} into {what} {rid}, "
                                  f"which holds {want_type}: no instance would launch"))
    if block and value_at(lt.props, "instanceMarketOptions", "marketType") not in (
            "capacity-block", UNKNOWN):
        out.append(StackViolation(lt.urn, f"launch template targets {what} {rid} without "
                                  "instanceMarketOptions.marketType capacity-block"))
    for ng in users:
        types = [t for t in as_list(ng.props.get("instanceTypes")) if _known_str(t)]
        for t in types:
            if want_type and t != want_type:
                out.append(StackViolation(ng.urn, f"node group runs {t} in {what} {rid}, which "
                                          f"holds {want_type}"))
        capacity_type = ng.props.get("capacityType")
        if block and capacity_type not in ("CAPACITY_BLOCK", UNKNOWN):
            out.append(StackViolation(ng.urn, f"node group launches into {what} {rid} with "
                                      f"capacityType {capacity_type!r}, not CAPACITY_BLOCK"))
        for subnet in referenced_all(ng, "subnetIds", subnets):
            zone = _known_str(subnet.props.get("availabilityZone"))
            if want_zone and zone and zone != want_zone:
                out.append(StackViolation(ng.urn, f"node group's subnet is in {zone}, but {what} "
                                          f"{rid} is in {want_zone}: no instance would launch"))
    return out
