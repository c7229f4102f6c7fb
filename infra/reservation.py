"""How the GPU node group uses a capacity reservation: its launch template, its size over time,
and what `pulumi destroy` leaves behind. Pure data: no Pulumi.

A targeted reservation and a cluster placement group do not mix here. A reservation is found and
kept by `python -m capacity probe --hold` (or bought as a Capacity Block) before `pulumi up`, when
the node group's placement group does not exist yet; EC2 cannot move a reservation into a
placement group afterwards, an instance launched into a placement group only draws on reservations
created in that group (otherwise EC2 answers InsufficientInstanceCapacity), and a placement group
holding an active reservation cannot be deleted, which would stall `pulumi destroy`. So a node
group that targets a reservation gets no placement group. Capacity Blocks lose nothing by it: EC2
places a block's instances together in an UltraCluster. An On-Demand reservation is only
guaranteed to be in the AZ, so its nodes may sit farther apart than in a cluster placement group;
EFA still carries NCCL between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from infra.config import GpuReservation, StackConfig, format_utc
from infra.instance_types import INSTANCE_TYPES, InstanceType

CAPACITY_BLOCK_RECLAIM = timedelta(minutes=30)
"""EC2 starts terminating a Capacity Block's instances this long before the block ends."""
EKS_CAPACITY_TYPE = {"on-demand": "ON_DEMAND", "capacity-block": "CAPACITY_BLOCK"}
"""The node group's capacityType for each kind of reservation."""


def efa_network_interfaces(instance: InstanceType, security_group_ids: Any) -> list[dict[str, Any]]:
    """One EFA interface per network card. Card 0 (device 0) is `efa` and carries the node's IP;
    the others are `efa-only` at device index 1, so they take no IP address from the subnet."""
    return [{"network_card_index": card, "device_index": 0 if card == 0 else 1,
             "interface_type": "efa" if card == 0 else "efa-only",
             "delete_on_termination": "true", "security_groups": security_group_ids}
            for card in range(max(1, instance.network_cards))]


def reservation_launch_options(reservation: GpuReservation) -> dict[str, Any]:
    """Launch template arguments that send every instance into the reservation of the stack
    config, and tag the template with what the reservation holds (RESERVATION_TAG_KEYS)."""
    options: dict[str, Any] = {
        "capacity_reservation_specification": {"capacity_reservation_target": {
            "capacity_reservation_id": reservation.reservation_id}},
        "tags": reservation_tags(reservation)}
    if reservation.is_capacity_block:
        options["instance_market_options"] = {"market_type": "capacity-block"}
    return options


RESERVATION_TAG_KEYS = ("ray-eks:reservation-id", "ray-eks:reservation-type",
                        "ray-eks:reservation-instance-type",
                        "ray-eks:reservation-availability-zone")
"""Tags on the GPU launch template that carry the targeted reservation's facts, as the capacity
tools wrote them from EC2's answer into the stack file. The policy pack reads them
(policy/rules/reservations.py, which spells the same keys: the pack is a program of its own):
Pulumi's engine hands policies the resources a program registers, never the ones it reads with
`.get()`, so the read reservation itself never reaches a policy."""


def reservation_tags(reservation: GpuReservation) -> dict[str, str]:
    """RESERVATION_TAG_KEYS -> the reservation's ID, kind, instance type and AZ."""
    return dict(zip(RESERVATION_TAG_KEYS, (
        reservation.reservation_id, reservation.kind, reservation.instance_type,
        reservation.availability_zone)))


UPDATE_SURGE_PER_AZ = 2
"""Instances a managed node group update may launch per AZ before it removes old nodes (EKS user
guide, "Managed node update behavior", scale-up phase): the default update strategy adds nodes
first."""
MINIMAL_UPDATE_CONFIG = {"maxUnavailable": 1, "updateStrategy": "MINIMAL"}
"""The node group's updateConfig that replaces one node at a time and terminates it before
launching its replacement (EKS's MINIMAL strategy), so an update needs no spare instance."""


def reservation_update_config(reservation: GpuReservation, *, node_count: int,
                              availability_zones: int = 1) -> dict[str, object] | None:
    """The updateConfig of a node group inside `reservation`: MINIMAL_UPDATE_CONFIG when the
    reservation has fewer spare instances than an update would launch first (a launch template or
    AMI change would otherwise wait for capacity that cannot come), None (EKS's default) when it
    has enough."""
    spare = reservation.instance_count - node_count
    if spare >= UPDATE_SURGE_PER_AZ * availability_zones:
        return None
    return dict(MINIMAL_UPDATE_CONFIG)


class ReservationEnded(ValueError):
    """The stack targets a reservation that can no longer launch instances."""


@dataclass(frozen=True, kw_only=True)
class LaunchWindow:
    """How many GPU nodes the node group asks for now, and why."""

    desired_nodes: int
    """0 until a Capacity Block starts, else the stack's node count."""
    note: str
    """One line for `pulumi up` (empty when there is nothing to say)."""


def _span(delta: timedelta) -> str:
    hours = delta.total_seconds() / 3600
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def launch_window(reservation: GpuReservation, *, node_count: int, now: datetime,
                  stack: str) -> LaunchWindow:
    """The node group's size at `now`. ReservationEnded when no instance can launch into the
    reservation any more (for a Capacity Block: from 30 minutes before its end)."""
    rid = reservation.reservation_id
    last_launch = reservation.end - (CAPACITY_BLOCK_RECLAIM if reservation.is_capacity_block
                                     else timedelta(0))
    if now >= last_launch:
        why = (f"EC2 reclaims its instances from {format_utc(last_launch)}, 30 minutes before it "
               f"ends at {format_utc(reservation.end)}" if reservation.is_capacity_block
               else f"it ended at {format_utc(reservation.end)}")
        raise ReservationEnded(
            f"the GPU node group targets {reservation.kind} reservation {rid}, and {why}. Buy or "
            f"hold new capacity (`python -m capacity blocks` or `python -m capacity probe "
            f"--hold`), or stop targeting it: `python -m capacity release --stack {stack}`")
    if reservation.is_capacity_block and now < reservation.start:
        return LaunchWindow(desired_nodes=0, note=(
            f"Capacity Block {rid} starts at {format_utc(reservation.start)} (in "
            f"{_span(reservation.start - now)}): the GPU node group has 0 nodes until then; run "
            f"`pulumi up` again after it starts. EC2 reclaims its instances from "
            f"{format_utc(last_launch)}, 30 minutes before it ends."))
    if reservation.is_capacity_block:
        return LaunchWindow(desired_nodes=node_count, note=(
            f"Capacity Block {rid} runs until {format_utc(reservation.end)}; EC2 reclaims its "
            f"instances from {format_utc(last_launch)} (in {_span(last_launch - now)})."))
    return LaunchWindow(desired_nodes=node_count, note="")


def odcr_idle_usd_per_hour(reservation: GpuReservation) -> float:
    """An On-Demand Capacity Reservation bills every reserved instance at the On-Demand price
    (from the price table), used or not."""
    return round(reservation.instance_count
                 * INSTANCE_TYPES[reservation.instance_type].usd_per_hour, 2)


def idle_usd_per_hour(cfg: StackConfig) -> float:
    """What the reservation costs per hour while no node uses it (a Capacity Block is paid up
    front: nothing more)."""
    reservation = cfg.gpu_reservation
    if reservation is None or reservation.is_capacity_block:
        return 0.0
    return odcr_idle_usd_per_hour(reservation)


def after_destroy(cfg: StackConfig, *, stack: str) -> str:
    """What `pulumi destroy` does with the reservation (a stack output, so destroy prints it)."""
    reservation = cfg.gpu_reservation
    if reservation is None:
        return ""
    rid, end = reservation.reservation_id, format_utc(reservation.end)
    if reservation.is_capacity_block:
        return (f"pulumi destroy leaves Capacity Block {rid} as it is: it was paid up front, "
                f"cannot be cancelled, and ends at {end}.")
    return (f"pulumi destroy leaves On-Demand Capacity Reservation {rid} active until {end}; "
            f"idle, it bills about {idle_usd_per_hour(cfg):.2f} USD/hour "
            f"({reservation.instance_count} x {reservation.instance_type} at On-Demand list "
            f"price). Cancel it with `python -m capacity release --stack {stack}`.")


def reservation_output(cfg: StackConfig, *, stack: str) -> dict[str, Any] | None:
    """The `gpuReservation` stack output: the reservation and what destroy does with it."""
    reservation = cfg.gpu_reservation
    if reservation is None:
        return None
    return {"id": reservation.reservation_id, "type": reservation.kind,
            "availabilityZone": reservation.availability_zone,
            "instanceType": reservation.instance_type,
            "instanceCount": reservation.instance_count,
            "start": format_utc(reservation.start), "end": format_utc(reservation.end),
            "idleUsdPerHour": idle_usd_per_hour(cfg),
            "afterDestroy": after_destroy(cfg, stack=stack)}
