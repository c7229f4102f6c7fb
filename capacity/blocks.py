"""Capacity Blocks for ML: list the offerings, buy one for a stack, and release a stack's
reservation.

A purchase bills at once and cannot be undone, so it is guarded: an explicit offering ID that EC2
still lists for the same request, `--yes`, the price printed before the call, the stack file
checked before it, and the call sent once (it takes no client token). The purchase and the
stack-file write run with SIGINT/SIGTERM held back, so an interrupt lands after the block is
recorded. A purchase whose answer never arrived (a timeout, a dropped connection, a 5xx) is looked
up by the tag it carried: found, it is recorded like any other; not found, nothing was bought.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from capacity import stackfile
from capacity.aws import AwsApi, AwsFailure, BlockOffering, FailureKind, Reservation
from capacity.probe import Evidence, Placement
from capacity.reserve import signals_deferred
from infra.config import GpuReservation, config_key, format_utc
from infra.instance_types import CAPACITY_BLOCK_FAMILIES, INSTANCE_TYPES
from infra.reservation import CAPACITY_BLOCK_RECLAIM

PURCHASE_TAG = "ray-eks:capacity-block-purchase"
"""Tag on every block bought; its value is the purchase's own token, to find it again."""
MAX_DAYS_BY_ONE = 14
"""Durations of 1 to 14 days go by one day; longer ones by 7 days, up to 182."""
MAX_DAYS = 182
_UNANSWERED = (FailureKind.TIMEOUT, FailureKind.NETWORK)
_BLOCK_STATES = ("scheduled", "payment-pending", "active")


def check_days(days: int) -> str | None:
    """Why EC2 would refuse this duration (None when it is one EC2 sells)."""
    if 1 <= days <= MAX_DAYS_BY_ONE or (days <= MAX_DAYS and days % 7 == 0):
        return None
    return (f"Capacity Blocks last 1 to {MAX_DAYS_BY_ONE} days, or a multiple of 7 days up to "
            f"{MAX_DAYS}; got {days}")


def sellable_problem(instance_type: str) -> str | None:
    """Why this stack cannot use Capacity Blocks of this type (None when it can)."""
    family = instance_type.split(".", 1)[0]
    if family not in CAPACITY_BLOCK_FAMILIES:
        return (f"EC2 sells no Capacity Blocks for {instance_type} (only for "
                f"{', '.join(CAPACITY_BLOCK_FAMILIES)})")
    known = INSTANCE_TYPES.get(instance_type)
    if known is None or not (known.gpus and known.efa_interfaces):
        return (f"{instance_type} is sold as Capacity Blocks, but this stack deploys only the EFA "
                f"GPU types of infra/instance_types.py")
    return None


def sorted_offerings(offerings: list[BlockOffering]) -> list[BlockOffering]:
    """Soonest first, then cheapest."""
    return sorted(offerings, key=lambda o: (o.start, o.upfront_fee, o.availability_zone))


def _span(start: datetime, end: datetime) -> str:
    hours = (end - start).total_seconds() / 3600
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def offer_summary(offering: BlockOffering) -> str:
    """One line: what the offering is and what it costs."""
    on_demand = INSTANCE_TYPES.get(offering.instance_type)
    compare = (f"; On-Demand list price {on_demand.usd_per_hour:.2f}"
               if on_demand and on_demand.usd_per_hour is not None else "")
    return (f"{offering.offering_id}: {offering.instance_count} x {offering.instance_type} in "
            f"{offering.availability_zone}, {format_utc(offering.start)} to "
            f"{format_utc(offering.end)} ({offering.duration_hours} h), upfront "
            f"{offering.upfront_fee:,.2f} {offering.currency} ({offering.per_instance_hour} "
            f"{offering.currency} per instance-hour{compare})")


def when_it_starts(start: datetime, end: datetime, now: datetime) -> str:
    """When the block starts (or that it runs), and when EC2 reclaims its instances."""
    reclaim = format_utc(end - CAPACITY_BLOCK_RECLAIM)
    if now < start:
        return (f"starts at {format_utc(start)} (in {_span(now, start)}): until then `pulumi up` "
                f"deploys the GPU node group with 0 nodes. EC2 reclaims its instances from "
                f"{reclaim}, 30 minutes before it ends at {format_utc(end)}")
    return (f"is running: EC2 reclaims its instances from {reclaim}, 30 minutes before it ends "
            f"at {format_utc(end)}")


class PurchaseError(Exception):
    """A purchase that did not happen, or whose outcome is recorded only in this message."""


@dataclass(frozen=True, kw_only=True)
class Bought:
    """A block bought and written to the stack file."""

    reservation: GpuReservation
    """The block as the stack file now holds it."""
    update: stackfile.StackUpdate
    """The stack-file change written."""
    state: str
    """EC2's state of it (payment-pending, scheduled, active)."""
    found_by_tag: bool = False
    """The purchase's answer was lost and the block was found by its tag."""


def purchase(api: AwsApi, *, region: str, offering: BlockOffering, path: Path,
             node_count: int) -> Bought:
    """Buy the offering and record it in the stack file at `path` (checked beforehand by the
    caller). PurchaseError when EC2 refused, or when a bought block could not be recorded."""
    token = str(uuid.uuid4())
    tags = {PURCHASE_TAG: token, "Purpose": f"GPU nodes of stack file {path.name}"}
    bought: Bought | None = None
    try:
        with signals_deferred():
            found_by_tag = False
            try:
                res = api.purchase_capacity_block(region=region,
                                                  offering_id=offering.offering_id, tags=tags)
            except AwsFailure as failure:
                if failure.kind not in _UNANSWERED and not failure.code.startswith(
                        ("HTTP 5", "InternalError", "ServiceUnavailable", "Unavailable")):
                    raise
                found = api.reservations_tagged(region=region, tag_key=PURCHASE_TAG,
                                                tag_value=token, states=_BLOCK_STATES)
                if not found:
                    raise PurchaseError(f"the purchase got no answer ({failure.summary}), and "
                                        f"no Capacity Block carries its tag "
                                        f"{PURCHASE_TAG}={token}: nothing was bought") from None
                res, found_by_tag = found[0], True
            bought = _record(api, res, region=region, offering=offering, path=path,
                             node_count=node_count, found_by_tag=found_by_tag)
    except KeyboardInterrupt as interrupt:
        # Held back until the block was recorded: say what the interrupted run left.
        if bought is not None:
            interrupt.add_note(f"Capacity Block {bought.reservation.reservation_id} was bought "
                               f"and written to {path}")
        raise
    return bought


def _record(api: AwsApi, res: Reservation, *, region: str, offering: BlockOffering, path: Path,
            node_count: int, found_by_tag: bool) -> Bought:
    reservation = GpuReservation(
        reservation_id=res.reservation_id, kind="capacity-block",
        instance_type=res.instance_type or offering.instance_type,
        availability_zone=res.availability_zone,
        instance_count=res.instance_count or offering.instance_count,
        start=res.start or offering.start, end=res.end or offering.end)
    try:
        zone_id = res.zone_id or api.availability_zones(region=region)[res.availability_zone]
        placement = Placement(region=region, zone=res.availability_zone, zone_id=zone_id,
                              instance_type=reservation.instance_type, node_count=node_count,
                              evidence=Evidence.CAPACITY_PROVEN)
        values = {**stackfile.placement_values(placement),
                  **stackfile.reservation_values(reservation)}
        # A reservation holds On-Demand or Capacity Block capacity: a Spot stack becomes one of those.
        update = stackfile.plan_update(path, values, remove=stackfile.SPOT_KEYS)
        stackfile.write(update)
    except (AwsFailure, KeyError, ValueError, OSError) as exc:
        keys = ", ".join(f"{k}: {v}"
                         for k, v in stackfile.reservation_values(reservation).items())
        raise PurchaseError(f"bought Capacity Block {reservation.reservation_id} "
                            f"({offer_summary(offering)}) but could not write {path} ({exc}); "
                            f"set these keys by hand, with the placement keys for "
                            f"{res.availability_zone}: {keys}") from None
    return Bought(reservation=reservation, update=update, state=res.state,
                  found_by_tag=found_by_tag)


@dataclass(frozen=True, kw_only=True)
class Released:
    """What `release` did."""

    reservation_id: str
    """The reservation the stack targeted."""
    kind: str
    """on-demand or capacity-block."""
    cancelled: bool
    """An ODCR cancelled now (False for a block, or one that had already ended)."""
    state: str
    """EC2's state of it before the release."""
    update: stackfile.StackUpdate
    """The stack-file change (the reservation keys removed)."""


def release(api: AwsApi, *, region: str, path: Path, values: dict) -> Released:
    """Cancel the stack's held ODCR (a Capacity Block cannot be cancelled), then drop the
    reservation keys from its stack file. AwsFailure when EC2 would not cancel it: the keys stay."""
    rid = str(values[config_key("gpu_reservation_id")])
    kind = str(values.get(config_key("gpu_reservation_type"), ""))
    update = stackfile.plan_update(path, {}, remove=stackfile.RESERVATION_KEYS)
    try:
        found = api.reservation(region=region, reservation_id=rid)
        state = found.state
        if found.reservation_type == "capacity-block":  # EC2's word over the stack file's
            kind = "capacity-block"
    except AwsFailure as failure:
        if failure.kind is not FailureKind.NOT_FOUND:
            raise
        state = "not found"
    cancelled = False
    try:
        with signals_deferred():
            if kind != "capacity-block" and state in ("active", "pending"):
                try:
                    api.cancel_reservation(region=region, reservation_id=rid)
                    cancelled = True
                except AwsFailure as failure:
                    if failure.kind is not FailureKind.NOT_FOUND:
                        raise
            stackfile.write(update)
    except KeyboardInterrupt as interrupt:
        # Held back until the release was done.
        interrupt.add_note(f"reservation {rid} was {'cancelled and ' if cancelled else ''}"
                           f"removed from {path.name}")
        raise
    return Released(reservation_id=rid, kind=kind, cancelled=cancelled, state=state,
                    update=update)
