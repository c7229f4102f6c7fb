"""`python -m capacity blocks` and `python -m capacity release`: their options and their runs.

    python -m capacity blocks --instance-type p5.48xlarge --nodes 2 --days 2
                              [--region R | --stack NAME] [--start-after T] [--end-before T]
                              [--purchase OFFERING_ID --yes --stack NAME] [--json]
    python -m capacity release --stack NAME

Exit codes (as `probe`): 0 listed, bought and written, or released; 1 no offering (or the named
offering is not listed any more); 2 bad input, or --purchase without --yes (the offer and its price
are printed, nothing is bought); 3 credentials or permissions; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from capacity import stackfile
from capacity.aws import AwsApi
from capacity.blocks import (PurchaseError, check_days, offer_summary, purchase, release,
                             sellable_problem, sorted_offerings, when_it_starts)
from infra.config import config_key, format_utc, parse_utc, stack_file

EXIT_DONE, EXIT_NONE, EXIT_BAD_INPUT = 0, 1, 2
_STACK_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


class BlocksInputError(ValueError):
    """A user mistake on the blocks or release command line."""


@dataclass(frozen=True, kw_only=True)
class BlocksOptions:
    """`capacity blocks`, validated."""

    instance_type: str
    """Instance type of the block."""
    node_count: int
    """Instances in the block (the GPU node count it is written as)."""
    days: int
    """Duration in days."""
    region: str
    """Region to look in."""
    stack: str
    """Stack file to write a purchase into (required with --purchase)."""
    start_after: datetime | None
    """Earliest start."""
    end_before: datetime | None
    """Latest end."""
    purchase_id: str
    """Offering to buy (empty: only list)."""
    yes: bool
    """The purchase is confirmed."""
    as_json: bool
    """One JSON document on stdout."""
    project_dir: Path
    """Where Pulumi.<stack>.yaml lives."""
    region_timeout_s: float = 20.0
    """Read timeout of each call."""

    @property
    def regions(self) -> tuple[str, ...]:
        return (self.region,) if self.region else ()


@dataclass(frozen=True, kw_only=True)
class ReleaseOptions:
    """`capacity release`, validated."""

    stack: str
    """Stack whose reservation is released."""
    region: str
    """The stack's region."""
    values: dict[str, Any]
    """The stack file's reservation keys."""
    project_dir: Path
    """Where Pulumi.<stack>.yaml lives."""
    region_timeout_s: float = 20.0
    """Read timeout of each call."""

    @property
    def regions(self) -> tuple[str, ...]:
        return (self.region,) if self.region else ()


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The blocks and release subcommands of `python -m capacity`."""
    b = sub.add_parser("blocks", help="list or buy Capacity Blocks for ML for a stack",
                       description="List the Capacity Blocks for ML that EC2 offers, or buy one "
                                   "and write it into Pulumi.<stack>.yaml.")
    b.add_argument("--instance-type", required=True, help="e.g. p5.48xlarge")
    b.add_argument("--nodes", default="2", help="instances in the block (default 2)")
    b.add_argument("--days", required=True, help="duration: 1-14 days, or 7-day steps to 182")
    b.add_argument("--region", default="", help="region (default: the stack's, else AWS_REGION)")
    b.add_argument("--stack", default="", help="stack file to write a purchase into")
    b.add_argument("--start-after", default="", help="earliest start, e.g. 2026-12-03T00:00:00Z")
    b.add_argument("--end-before", default="", help="latest end, e.g. 2026-12-20T00:00:00Z")
    b.add_argument("--purchase", default="", metavar="OFFERING_ID",
                   help="buy this offering (with --yes; the price is shown first)")
    b.add_argument("--yes", action="store_true", help="confirm the purchase: it bills at once "
                                                      "and cannot be cancelled")
    b.add_argument("--json", action="store_true", help="print JSON on stdout")
    r = sub.add_parser("release", help="stop targeting the stack's reservation (cancels a held "
                                       "On-Demand Capacity Reservation)",
                       description="Cancel the On-Demand Capacity Reservation `probe --hold` "
                                   "kept (a Capacity Block cannot be cancelled) and remove the "
                                   "reservation keys from Pulumi.<stack>.yaml.")
    r.add_argument("--stack", required=True, help="stack whose reservation is released")


def _time(flag: str, raw: str) -> datetime | None:
    if not raw:
        return None
    try:
        return parse_utc(raw)
    except ValueError:
        raise BlocksInputError(f"{flag} must be an ISO 8601 time with a UTC offset, like "
                               f"2026-12-03T00:00:00Z; got {raw!r}") from None


def _whole(flag: str, raw: str, low: int, high: int) -> int:
    if not re.fullmatch(r"\d+", raw.strip()) or not low <= int(raw) <= high:
        raise BlocksInputError(f"{flag} must be a whole number from {low} to {high}, got {raw!r}")
    return int(raw)


def _stack_region(stack: str, project_dir: Path) -> str:
    if not _STACK_NAME_RE.match(stack):
        raise BlocksInputError(f"--stack {stack!r} is not a stack name (letters, digits, - _ .)")
    return stackfile.read_region(stack_file(stack, project_dir)) or ""


def refuse_if_reserved(path: Path, stack: str) -> None:
    """A stack file that already targets a reservation is not given another placement."""
    held = stackfile.read_reservation(path)
    if not held:
        return
    rid = held[config_key("gpu_reservation_id")]
    kind = held.get(config_key("gpu_reservation_type"), "")
    raise BlocksInputError(
        f"{path.name} targets {kind} reservation {rid} until "
        f"{held.get(config_key('gpu_reservation_end'), '?')}; run `python -m capacity release "
        f"--stack {stack}` first (it cancels a held On-Demand reservation; a Capacity Block "
        f"stays paid until its end)")


def parse(args: argparse.Namespace, *, project_dir: Path, known: frozenset[str],
          default_region: str) -> BlocksOptions | ReleaseOptions:
    """Validate everything that needs no cloud call. BlocksInputError, ConfigError or
    StackFileError on a user mistake."""
    if args.command == "release":
        region = _stack_region(args.stack, project_dir)
        path = stack_file(args.stack, project_dir)
        if not path.exists():
            raise BlocksInputError(f"{path.name} does not exist")
        values = stackfile.read_reservation(path)
        stackfile.precheck(path)
        if values and not region:
            raise BlocksInputError(f"{path.name} names no aws:region, so its reservation "
                                   "cannot be found")
        return ReleaseOptions(stack=args.stack, region=region, values=values,
                              project_dir=project_dir)
    if problem := sellable_problem(args.instance_type):
        raise BlocksInputError(problem)
    nodes = _whole("--nodes", args.nodes, 1, 64)
    days = _whole("--days", args.days, 1, 182)
    if problem := check_days(days):
        raise BlocksInputError(f"--days: {problem}")
    start_after, end_before = (_time("--start-after", args.start_after),
                               _time("--end-before", args.end_before))
    if start_after and end_before and end_before <= start_after:
        raise BlocksInputError("--end-before must be later than --start-after")
    if args.yes and not args.purchase:
        raise BlocksInputError("--yes confirms a purchase: name the offering with --purchase")
    if args.purchase and not re.fullmatch(r"cb-[0-9a-f]{8,17}", args.purchase):
        raise BlocksInputError(f"--purchase {args.purchase!r} is not a Capacity Block offering "
                               "ID like cb-0123456789abcdef0")
    if args.purchase and not args.stack:
        raise BlocksInputError("--purchase needs --stack: the stack file the block is written to")
    region = args.region
    if args.stack:
        path = stack_file(args.stack, project_dir)
        stack_region = _stack_region(args.stack, project_dir)
        if region and stack_region and region != stack_region:
            raise BlocksInputError(f"--region {region} differs from {path.name}'s aws:region "
                                   f"{stack_region}")
        region = region or stack_region
        stackfile.precheck(path)
        if args.purchase:
            refuse_if_reserved(path, args.stack)
    region = region or default_region
    if not region:
        raise BlocksInputError("no region: pass --region, or --stack of a stack file with "
                               "aws:region, or set AWS_REGION")
    if region not in known:
        raise BlocksInputError(f"unknown region {region!r}")
    return BlocksOptions(instance_type=args.instance_type, node_count=nodes, days=days,
                         region=region, stack=args.stack, start_after=start_after,
                         end_before=end_before, purchase_id=args.purchase, yes=args.yes,
                         as_json=args.json, project_dir=project_dir)


def _offers_table(opts: BlocksOptions, offerings: list) -> Table:
    t = Table(title=f"Capacity Blocks: {opts.node_count} x {opts.instance_type} for {opts.days} "
                    f"days in {opts.region}", title_justify="left")
    for col in ("offering", "AZ", "start (UTC)", "end (UTC)", "hours", "upfront",
                "per instance-hour"):
        t.add_column(col, overflow="fold")
    for o in offerings:
        t.add_row(o.offering_id, o.availability_zone, format_utc(o.start), format_utc(o.end),
                  str(o.duration_hours), f"{o.upfront_fee:,.2f} {o.currency}",
                  f"{o.per_instance_hour} {o.currency}")
    return t


def _offering_json(o) -> dict[str, Any]:
    return {"offering_id": o.offering_id, "instance_type": o.instance_type,
            "availability_zone": o.availability_zone, "instance_count": o.instance_count,
            "start": format_utc(o.start), "end": format_utc(o.end),
            "duration_hours": o.duration_hours, "upfront_fee": str(o.upfront_fee),
            "currency": o.currency, "per_instance_hour": str(o.per_instance_hour)}


def run_blocks(opts: BlocksOptions, *, api: AwsApi, out: Console, err: Console) -> int:
    if not opts.as_json:
        err.print(f"asking EC2 for Capacity Block offerings in {opts.region}")
    offerings = sorted_offerings(api.capacity_block_offerings(
        region=opts.region, instance_type=opts.instance_type, count=opts.node_count,
        duration_hours=opts.days * 24, start_after=opts.start_after,
        end_before=opts.end_before))
    doc: dict[str, Any] = {"region": opts.region,
                           "offerings": [_offering_json(o) for o in offerings]}
    if not opts.purchase_id:
        if opts.as_json:
            print(json.dumps(doc, indent=2))
        elif offerings:
            out.print(_offers_table(opts, offerings))
            out.print(f"Buy one with: python -m capacity blocks --instance-type "
                      f"{opts.instance_type} --nodes {opts.node_count} --days {opts.days} "
                      f"--stack <stack> --purchase <offering> --yes", markup=False)
        else:
            out.print(f"No Capacity Block offering for {opts.node_count} x {opts.instance_type} "
                      f"for {opts.days} days in {opts.region}.", markup=False)
        return EXIT_DONE if offerings else EXIT_NONE
    offering = next((o for o in offerings if o.offering_id == opts.purchase_id), None)
    if offering is None:
        message = (f"offering {opts.purchase_id} is not among the {len(offerings)} EC2 lists now "
                   f"for {opts.node_count} x {opts.instance_type}, {opts.days} days, in "
                   f"{opts.region} (offerings go first come, first served); nothing bought. Run "
                   f"without --purchase to list them")
        _say(opts, out, err, doc | {"error": message}, message)
        return EXIT_NONE
    price = f"Capacity Block {offer_summary(offering)}"
    if not opts.yes:
        message = f"{price}. Not bought: add --yes to buy it (it cannot be cancelled)."
        _say(opts, out, err, doc | {"offering": _offering_json(offering), "bought": False},
             message, to_err=False)
        return EXIT_BAD_INPUT
    if not opts.as_json:
        out.print(f"Buying {price}.", markup=False)
    path = stack_file(opts.stack, opts.project_dir)
    try:
        bought = purchase(api, region=opts.region, offering=offering, path=path,
                          node_count=opts.node_count)
    except PurchaseError as exc:
        err.print(f"capacity blocks: error: {exc}", markup=False, highlight=False,
                  soft_wrap=True)
        return EXIT_NONE
    res = bought.reservation
    timing = when_it_starts(res.start, res.end, api.now())
    lines = [f"Bought Capacity Block {res.reservation_id} ({res.instance_count} x "
             f"{res.instance_type} in {res.availability_zone}, state {bought.state})"
             + (" - found by its tag after the answer was lost" if bought.found_by_tag else "")
             + ".", f"It {timing}.", f"Wrote {path} (stack {opts.stack})."]
    _say(opts, out, err, doc | {"offering": _offering_json(offering), "bought": True,
                                "reservation_id": res.reservation_id, "state": bought.state,
                                "stack_file": str(path), "diff": bought.update.diff()},
         "\n".join(lines), to_err=False)
    return EXIT_DONE


def _say(opts, out: Console, err: Console, doc: dict[str, Any], message: str,
         to_err: bool = True) -> None:
    if opts.as_json:
        print(json.dumps(doc, indent=2))
    elif to_err:
        err.print(f"capacity blocks: {message}", markup=False, highlight=False, soft_wrap=True)
    else:
        out.print(message, markup=False, highlight=False, soft_wrap=True)


def run_release(opts: ReleaseOptions, *, api: AwsApi, out: Console, err: Console) -> int:
    if not opts.values:
        out.print(f"Pulumi.{opts.stack}.yaml targets no reservation; nothing to release.",
                  markup=False)
        return EXIT_DONE
    path = stack_file(opts.stack, opts.project_dir)
    done = release(api, region=opts.region, path=path, values=opts.values)
    if done.cancelled:
        what = f"Cancelled On-Demand Capacity Reservation {done.reservation_id}"
    elif done.kind == "capacity-block":
        end = opts.values.get(config_key("gpu_reservation_end"), "its end date")
        what = (f"Capacity Block {done.reservation_id} cannot be cancelled: it stays paid and "
                f"ends at {end}")
    else:
        what = f"Reservation {done.reservation_id} was already {done.state}"
    out.print(f"{what}. Removed the reservation keys from {path}; the next `pulumi up` runs the "
              f"GPU nodes On-Demand in a cluster placement group.", markup=False)
    return EXIT_DONE


def run(opts: BlocksOptions | ReleaseOptions, *, api: AwsApi, out: Console,
        err: Console) -> int:
    command = "release" if isinstance(opts, ReleaseOptions) else "blocks"
    try:
        if isinstance(opts, ReleaseOptions):
            return run_release(opts, api=api, out=out, err=err)
        return run_blocks(opts, api=api, out=out, err=err)
    except KeyboardInterrupt as interrupt:
        notes = getattr(interrupt, "__notes__", [])
        err.print(f"capacity {command}: interrupted; "
                  + ("; ".join(notes) if notes else "nothing was bought, cancelled or written"),
                  markup=False, highlight=False, soft_wrap=True)
        return 130


def command_of(argv: Sequence[str]) -> str:
    """The subcommand named on the command line (probe when none is)."""
    return next((a for a in argv if a in ("probe", "blocks", "release")), "probe")
