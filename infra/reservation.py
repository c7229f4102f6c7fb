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

A Capacity Block has a start and an end, and nothing else moves the node group's size between two
`pulumi up`s: so the group gets scheduled actions on its Auto Scaling group, as EKS documents for
managed node groups on Capacity Blocks. One raises it to the node count at the block's start (a
block bought for later deploys at 0 nodes and comes up by itself); one takes it to zero 45 minutes
before the end. EC2 begins terminating a block's instances 30 minutes before its end, and EKS
schedules its own scale-down at 40 minutes; ours comes first, with 15 minutes for the action's
delay, EKS's drain and the worker pod's grace period, inside which the loop saves its checkpoint on
the drain, as on a Spot notice (the worker pods of a block get Spot's shutdown timing).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from infra.config import GpuReservation, StackConfig, format_utc
from infra.instance_types import INSTANCE_TYPES, InstanceType
from infra.prices import on_demand

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


CAPACITY_BLOCK_SCALE_DOWN_LEAD = timedelta(minutes=45)
"""How long before a Capacity Block's end its GPU nodes are scheduled down to zero: before EC2's
reclaim (`CAPACITY_BLOCK_RECLAIM`) by `CAPACITY_BLOCK_DRAIN_BUDGET`, and before the scale-down EKS
schedules itself (`EKS_SCALE_DOWN_LEAD`), so that this one acts and EKS's finds the group at zero."""
EKS_SCALE_DOWN_LEAD = timedelta(minutes=40)
"""EKS schedules its own scale-down of a managed node group on a Capacity Block this long before the
block ends ("Amazon EKS Node Group Capacity Scaledown Before Reservation End"; EKS user guide,
"Create a managed node group with Capacity Blocks for ML"). Scheduled actions of one Auto Scaling
group may not share a start time, so ours is at another."""
SCHEDULED_ACTION_DELAY = timedelta(minutes=2)
"""A scheduled action may start up to two minutes after its time (EC2 Auto Scaling user guide,
"Scheduled scaling")."""
EKS_SCALE_IN_DRAIN_ALLOWANCE = timedelta(minutes=5)
"""From the Auto Scaling group's scale-in to EKS evicting the node's pods (its termination lifecycle
hook drains the node; EKS gives no figure, and terminates the node after 15 minutes whatever is
left)."""
CAPACITY_BLOCK_DRAIN_BUDGET = CAPACITY_BLOCK_SCALE_DOWN_LEAD - CAPACITY_BLOCK_RECLAIM
"""From the scheduled scale-down to EC2's reclaim (15 min): the action's delay, EKS's drain, and the
worker pod's grace period, inside which the loop saves its checkpoint (as on a Spot notice,
infra/spot.py)."""
SCHEDULE_MIN_LEAD = timedelta(minutes=5)
"""A scheduled action is declared only this far ahead: Auto Scaling refuses a start time in the
past, and `pulumi up` runs a while after its preview."""
SHORT_BLOCK = timedelta(hours=1)
"""A block that ends sooner than this gets a warning of its own: a job has little time left."""
START_ACTION = "ray-eks-capacity-block-start"
END_ACTION = "ray-eks-capacity-block-end"
"""The scheduled actions' names on the GPU Auto Scaling group."""


class ReservationEnded(ValueError):
    """The stack targets a reservation that can no longer launch instances."""


@dataclass(frozen=True, kw_only=True)
class LaunchWindow:
    """How many GPU nodes the node group asks for now, when scheduled actions change that, and why."""

    desired_nodes: int
    """0 until a Capacity Block starts and from its scale-down on, else the stack's node count."""
    note: str
    """One line for `pulumi up` (empty when there is nothing to say)."""
    scale_up_at: datetime | None = None
    """A Capacity Block that starts later: when a scheduled action raises the group to the node
    count (no second `pulumi up` needed). None otherwise."""
    scale_down_at: datetime | None = None
    """A Capacity Block: when a scheduled action takes the group to zero, early enough for a job's
    checkpoint before EC2 reclaims the instances. None otherwise, or once that time is near."""


def _span(delta: timedelta) -> str:
    minutes = delta.total_seconds() / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    hours = minutes / 60
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def launch_window(reservation: GpuReservation, *, node_count: int, now: datetime,
                  stack: str) -> LaunchWindow:
    """The node group's size at `now` and, for a Capacity Block, its scheduled scaling: up at the
    block's start, down `CAPACITY_BLOCK_SCALE_DOWN_LEAD` before its end. ReservationEnded when no
    instance can launch into the reservation any more (for a Capacity Block: from 30 minutes
    before its end)."""
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
    if not reservation.is_capacity_block:
        return LaunchWindow(desired_nodes=node_count, note="")
    scale_down = reservation.end - CAPACITY_BLOCK_SCALE_DOWN_LEAD
    reclaim = (f"EC2 reclaims its instances from {format_utc(last_launch)}, 30 minutes before it "
               f"ends")
    if now >= scale_down - SCHEDULE_MIN_LEAD:
        return LaunchWindow(desired_nodes=0, note=(
            f"Capacity Block {rid} ends at {format_utc(reservation.end)} (in "
            f"{_span(reservation.end - now)}): its GPU nodes are scaled to zero from "
            f"{format_utc(scale_down)}, 45 minutes before, so that a job saves its checkpoint on "
            f"the drain before {reclaim}; the GPU node group stays at 0 nodes. Buy new capacity "
            f"(`python -m capacity blocks`) to train again."))
    down = (f"a scheduled action takes the GPU nodes to zero at {format_utc(scale_down)} (in "
            f"{_span(scale_down - now)}), 45 minutes before it ends, so that a job saves its "
            f"checkpoint on the drain before {reclaim}")
    if now < reservation.start - SCHEDULE_MIN_LEAD:
        return LaunchWindow(desired_nodes=0, scale_up_at=reservation.start, scale_down_at=scale_down, note=(
            f"Capacity Block {rid} starts at {format_utc(reservation.start)} (in "
            f"{_span(reservation.start - now)}): the GPU node group has 0 nodes until then, when "
            f"a scheduled action raises it to {node_count} (no second `pulumi up` needed); {down}."))
    if reservation.end - now < SHORT_BLOCK:
        return LaunchWindow(desired_nodes=node_count, scale_down_at=scale_down, note=(
            f"Capacity Block {rid} ends in {_span(reservation.end - now)}, at "
            f"{format_utc(reservation.end)}: a job started now has until "
            f"{format_utc(scale_down)} ({_span(scale_down - now)}), when a scheduled action takes "
            f"the GPU nodes to zero so that the job saves its checkpoint on the drain before "
            f"{reclaim}."))
    return LaunchWindow(desired_nodes=node_count, scale_down_at=scale_down, note=(
        f"Capacity Block {rid} runs until {format_utc(reservation.end)}; {down}."))


def odcr_idle_usd_per_hour(reservation: GpuReservation) -> float:
    """An On-Demand Capacity Reservation bills every reserved instance at the On-Demand price
    (from the price table), used or not; a type the table lists no such price for counts 0 (EC2
    reserves it through Capacity Blocks, paid up front)."""
    return round(reservation.instance_count
                 * (INSTANCE_TYPES[reservation.instance_type].usd_per_hour or 0.0), 2)


def idle_usd_per_hour(cfg: StackConfig) -> float:
    """What the reservation costs per hour while no node uses it, at the On-Demand price of the
    stack's region (a Capacity Block is paid up front: nothing more; a type with no On-Demand price
    counts 0, as in `odcr_idle_usd_per_hour`)."""
    reservation = cfg.gpu_reservation
    if reservation is None or reservation.is_capacity_block:
        return 0.0
    return round(reservation.instance_count
                 * (on_demand(reservation.instance_type, cfg.region).usd_per_hour or 0.0), 2)


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
