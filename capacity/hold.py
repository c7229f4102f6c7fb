"""`probe --hold HOURS`: keep the reservation that proved capacity, for the stack.

`capacity.reserve` creates the reservation (30-minute safety end date, probe tag) and, once it is
active, calls the keeper made here under held-back signals. The keeper plans the stack-file change
first (a file that cannot take it stops everything before EC2 is told anything), moves the end
date out to the hold, marks the tag `held:<stack>` so later sweeps leave it alone, and writes the
stack file. Whatever fails before the write is cancelled by `capacity.reserve`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from capacity import stackfile
from capacity.aws import AwsApi
from capacity.probe import Candidate, Evidence, Placement
from capacity.reserve import HELD_PREFIX, TAG_KEY, Keep
from infra.config import GpuReservation, format_utc, stack_file

MAX_HOLD_HOURS = 24 * 366
"""A longer hold is almost certainly a typo (the reservation bills every hour of it)."""


@dataclass
class HeldLog:
    """What the keeper recorded, for the report."""

    update: stackfile.StackUpdate | None = None
    """The stack-file change written."""
    reservation: GpuReservation | None = None
    """The reservation held."""
    stack: str = ""
    """The stack it is held for."""
    tried: list[str] = field(default_factory=list)
    """Reservation IDs handed to the keeper, in order."""


def stack_keeper(api: AwsApi, *, stack: str, project_dir: Path, node_count: int, hours: float,
                 log: HeldLog) -> Keep:
    """A keeper that holds the reservation for `stack` (empty: the stack named after the
    reservation's region) for `hours`."""

    def keep(candidate: Candidate, reservation_id: str) -> None:
        log.tried.append(reservation_id)
        name = stack or candidate.region
        now = api.now()
        reservation = GpuReservation(
            reservation_id=reservation_id, kind="on-demand",
            instance_type=candidate.instance_type, availability_zone=candidate.zone,
            instance_count=node_count, start=now, end=now + timedelta(hours=hours))
        placement = Placement(region=candidate.region, zone=candidate.zone,
                              zone_id=candidate.zone_id, instance_type=candidate.instance_type,
                              node_count=node_count, evidence=Evidence.CAPACITY_PROVEN)
        update = stackfile.plan_update(
            stack_file(name, project_dir),
            {**stackfile.placement_values(placement),
             **stackfile.reservation_values(reservation)}, remove=stackfile.SPOT_KEYS)
        api.extend_reservation(region=candidate.region, reservation_id=reservation_id,
                               end_date=reservation.end)
        api.tag_reservation(region=candidate.region, reservation_id=reservation_id, tags={
            TAG_KEY: f"{HELD_PREFIX}{name}",
            "Purpose": f"held for stack {name} until {format_utc(reservation.end)} by "
                       f"`python -m capacity probe --hold`; `python -m capacity release --stack "
                       f"{name}` cancels it"})
        stackfile.write(update)
        log.update, log.reservation, log.stack = update, reservation, name

    return keep
