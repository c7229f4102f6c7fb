"""Present a probe: a table per AZ for people, one JSON document for machines."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from capacity.probe import (
    AttemptOutcome,
    Candidate,
    Placement,
    ProbeRequest,
    RegionReport,
    ReservationAttempt,
)
from capacity.quota import QuotaCheck, QuotaVerdict
from capacity.reserve import ReservationRun
from capacity.stackfile import StackUpdate
from infra.config import GpuReservation, format_utc
from infra.instance_types import INSTANCE_TYPES
from infra.reservation import odcr_idle_usd_per_hour
from infra.cost import gpu_nodes_cost_note


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """Everything one probe found and decided."""

    request: ProbeRequest
    """What was asked."""
    reports: tuple[RegionReport, ...]
    """One per region, in the user's order."""
    candidates: tuple[Candidate, ...]
    """Qualifying AZs, best first."""
    reservations: ReservationRun | None
    """Reservation attempts (only with --reserve)."""
    placement: Placement | None
    """The decision, None when nothing qualified."""
    reasons: tuple[str, ...]
    """Why each other location was not chosen."""
    exit_code: int
    """The process exit code."""
    stack: str = ""
    """Stack whose file is written (empty without a placement)."""
    update: StackUpdate | None = None
    """The planned stack-file change."""
    written: bool = False
    """Whether the stack file was written (False with --dry-run or without a change)."""
    held: GpuReservation | None = None
    """The reservation kept for the stack with --hold (written to its stack file)."""
    type_change: str = ""
    """The line that says the placement's instance type replaces the one the stack deploys now
    (empty when it keeps it)."""


def job_preset(instance_type: str) -> tuple[int, str]:
    """(GPU memory in GiB, the preset `python -m workloads submit` picks for it by default)."""
    from workloads.train.config import preset_for_gpu

    memory = INSTANCE_TYPES[instance_type].gpu_memory_gib
    return memory, preset_for_gpu(memory)


def _quota_cell(quota: QuotaCheck | None) -> str:
    if quota is None:
        return "-"
    free = quota.free_vcpus
    if free is None:
        return f"?/{quota.needed_vcpus} (see below)"
    return f"{free:g}/{quota.needed_vcpus}"


def _efa_cell(report: RegionReport) -> str:
    if report.facts is None:
        return "?"
    if report.lacks_efa:
        return "no"
    return f"yes ({report.facts.max_efa_interfaces})"


def _attempts_by_zone(result: ProbeResult) -> dict[tuple[str, str, str], ReservationAttempt]:
    """Attempts by (region, AZ, instance type)."""
    if result.reservations is None:
        return {}
    return {(a.region, a.zone, a.instance_type or result.request.instance_type): a
            for a in result.reservations.attempts}


def _verdict(report: RegionReport, zone: str, result: ProbeResult,
             attempt: ReservationAttempt | None) -> str:
    p = result.placement
    if p is not None and (p.region, p.zone, p.instance_type) == (
            report.region, zone, report.instance_type or result.request.instance_type):
        return f"[bold green]chosen[/] ({p.evidence.label})"
    if attempt is not None and attempt.outcome is not AttemptOutcome.PROVEN:
        return f"[red]{attempt.outcome.value}[/]"
    cand = next((c for c in result.candidates if (c.region, c.zone) == (report.region, zone)
                 and c.instance_type in ("", report.instance_type)), None)
    if cand is None:
        return "[red]blocked[/]"
    colour = "yellow" if report.quota and report.quota.verdict is QuotaVerdict.UNKNOWN else "green"
    return f"[{colour}]{cand.evidence.label}[/]"


SPOT_MEANING = (
    "Spot: EC2 may reclaim a node at any time on a two-minute notice (more often where the "
    "placement score is low); the Ray workers then save a checkpoint and the run resumes from it, "
    "on the nodes left with --min-nodes, or once the node group replaces the instance. Nothing is "
    "reserved: a score is EC2's estimate now, not a promise, and EC2 scores a single instance type "
    "low on purpose, so compare zones by it rather than read it as odds. The Spot vCPU quota is "
    "separate from the On-Demand one (0 in a new account).")
"""What the probe says a Spot placement means for the run."""


def _spot_cells(zone) -> tuple[str, str]:
    score = "-" if zone.spot_score is None else str(zone.spot_score)
    price = "-" if zone.spot_usd_per_hour is None else f"${zone.spot_usd_per_hour:.4f}"
    return score, price


def table(result: ProbeResult) -> Table:
    types = result.request.instance_types
    several = len(types) > 1
    spot = result.request.spot
    t = Table(title=f"{result.request.node_count} x {' / '.join(types)}"
              + (" on Spot" if spot else ""), title_justify="left")
    for col in (("type",) if several else ()) + (
            "region", "AZ", "AZ ID", "offered", "EFA") + (
            ("Spot score", "Spot $/h") if spot else ()) + (
            f"free/needed {'Spot ' if spot else ''}vCPUs", "reservation", "verdict"):
        t.add_column(col, overflow="fold")
    attempts = _attempts_by_zone(result)
    for report in result.reports:
        first = ((report.instance_type or result.request.instance_type,) if several else ())
        if report.blocker and not (report.quota and report.offered):
            offered = "?" if report.failure else ("no" if report.facts is None or not report.offered
                                                  else "yes")
            t.add_row(*first, report.region, "-", "-", offered, _efa_cell(report),
                      *(("-", "-") if spot else ()),
                      _quota_cell(report.quota), "", f"[red]{report.blocker}[/]")
            continue
        for zone in report.offered:
            attempt = attempts.get((report.region, zone.name,
                                    report.instance_type or result.request.instance_type))
            res_cell = "" if attempt is None else attempt.outcome.value + (
                f" ({attempt.reservation_id}, cancelled)" if attempt.cancelled else
                f" ({attempt.reservation_id}, held)" if attempt.held else "")
            verdict = (f"[red]{report.blocker}[/]" if report.blocker
                       else _verdict(report, zone.name, result, attempt))
            t.add_row(*first, report.region, zone.name, zone.zone_id, "yes", _efa_cell(report),
                      *(_spot_cells(zone) if spot else ()),
                      _quota_cell(report.quota), res_cell, verdict)
    return t


def print_human(result: ProbeResult, *, out: Console, err: Console) -> None:
    out.print(table(result))
    for r in result.reports:
        if r.quota is not None and r.quota.verdict is QuotaVerdict.UNKNOWN:
            out.print(f"[yellow]{r.region}: {r.quota.market} vCPU quota not checked[/]: {r.quota.problem}")
        if r.spot_problem:
            out.print(f"[yellow]{r.region}: ranked without them[/]: {r.spot_problem}")
    run = result.reservations
    if run is not None:
        for rid in run.swept:
            out.print(f"cancelled leftover reservation {rid} from an earlier probe")
        for line in run.sweep_errors:
            err.print(f"[yellow]could not look for leftover reservations[/] in {line}")
        for rid in run.leaked:
            err.print(f"[bold red]reservation {rid} could not be cancelled[/]: it ends by itself "
                      f"within 30 minutes; cancel it now with `aws ec2 cancel-capacity-reservation "
                      f"--capacity-reservation-id {rid}`")
    p = result.placement
    if p is None:
        out.print("[bold red]No placement.[/] Why, per location:")
        for line in result.reasons:
            out.print(f"  - {line}", markup=False)
        return
    market = ""
    if p.capacity_type == "spot":
        market = " on Spot" + ("" if p.spot_score is None else f" (placement score {p.spot_score}/10)")
    out.print(f"Placement: {p.node_count} x {p.instance_type}{market} in {p.region} {p.zone} "
              f"({p.zone_id}), {p.evidence.label}; "
              f"{gpu_nodes_cost_note(p.instance_type, p.node_count, spot_usd_per_hour=p.spot_usd_per_hour)}.",
              markup=False)
    if p.capacity_type == "spot":
        out.print(SPOT_MEANING, markup=False)
    memory, preset = job_preset(p.instance_type)
    if len(result.request.instance_types) > 1:
        out.print(f"{p.instance_type} GPUs have {memory} GiB: `python -m workloads submit` runs "
                  f"preset {preset} by default.", markup=False)
    if result.held is not None:
        held = result.held
        out.print(f"Held On-Demand Capacity Reservation {held.reservation_id} until "
                  f"{format_utc(held.end)}: the GPU node group launches into it. Idle, it bills "
                  f"about {odcr_idle_usd_per_hour(held):.2f} USD/hour; `pulumi destroy` leaves "
                  f"it to its end date; "
                  f"`python -m capacity release --stack {result.stack}` cancels it.",
                  markup=False)
    unchecked = [r.region for r in result.reports
                 if r.region == p.region and r.quota and r.quota.verdict is QuotaVerdict.UNKNOWN]
    if unchecked:
        out.print("[yellow]The vCPU quota could not be read; `pulumi up` may still hit it. "
                  "Run with --reserve to prove capacity.[/]")
    if result.update is None:
        return
    if result.type_change:
        out.print(f"[bold yellow]Instance type changed:[/] {escape(result.type_change)}")
    if not result.update.changed:
        out.print(f"{result.update.path} already holds this placement; nothing to write.",
                  markup=False)
    elif result.written:
        out.print(f"Wrote {result.update.path} (stack {result.stack}).", markup=False)
    else:
        out.print(f"--dry-run: {result.update.path} would change as follows; nothing written.",
                  markup=False)
        out.print(result.update.diff(), markup=False, highlight=False, end="")


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value if not isinstance(value, int) else value.name.lower()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple, frozenset, set)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def as_json(result: ProbeResult) -> str:
    doc = {
        "exit_code": result.exit_code,
        "request": _plain(result.request),
        "placement": _plain(result.placement),
        "spot_meaning": SPOT_MEANING if result.request.spot else None,
        "reasons": list(result.reasons),
        "regions": [dict(_plain(r), blocker=r.blocker,
                         quota=None if r.quota is None else dict(
                             _plain(r.quota), free_vcpus=r.quota.free_vcpus,
                             verdict=r.quota.verdict.value))
                    for r in result.reports],
        "candidates": _plain(result.candidates),
        "reservations": _plain(result.reservations),
        "stack": result.stack or None,
        "held": None if result.held is None else {
            "reservation_id": result.held.reservation_id,
            "end": format_utc(result.held.end)},
        "gpu_memory_gib": None if result.placement is None else job_preset(
            result.placement.instance_type)[0],
        "preset": None if result.placement is None else job_preset(
            result.placement.instance_type)[1],
        "instance_type_change": result.type_change or None,
        "stack_file": None if result.update is None else str(result.update.path),
        "changed": None if result.update is None else result.update.changed,
        "written": result.written,
        "diff": None if result.update is None else result.update.diff(),
    }
    return json.dumps(doc, indent=2, default=str)
