"""`python -m capacity probe`: validate input, probe, decide, report, write the stack file.
(`blocks` and `release` are in capacity/blocks_cli.py.)

Exit codes: 0 placed and written (or shown, with --dry-run); 1 no placement, with a reason per
location; 2 bad input (one line, nothing probed, no file touched); 3 credentials or permissions;
4 AWS could not be reached (a connection problem, not an answer about capacity).
"""

from __future__ import annotations

import argparse
import contextvars
import dataclasses
import difflib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NoReturn, Sequence

import boto3
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from capacity import blocks_cli
from capacity import report as report_mod
from capacity import stackfile
from capacity.aws import AwsApi, AwsFailure, FailureKind, default_session
from capacity.hold import MAX_HOLD_HOURS, HeldLog, stack_keeper
from capacity.probe import (
    EXIT_BAD_INPUT,
    EXIT_NO_PLACEMENT,
    EXIT_PERMISSION,
    ProbeRequest,
    choose_placement,
    exit_code,
    rank_candidates,
    unplaced_reasons,
)
from capacity.regions import probe_instance_types
from capacity.reserve import prove_capacity
from infra.config import ConfigError, stack_file
from infra.instance_types import GPU_INSTANCE_TYPES, INSTANCE_TYPES

DEFAULT_REGIONS = ("us-west-2", "us-east-1", "us-east-2", "eu-west-1", "eu-central-1",
                   "ap-northeast-1")
"""Probed when neither --regions nor the stack names one: large regions that offer G6."""
DEFAULT_INSTANCE_TYPE = "g6.12xlarge"
"""The GPU instance type probed when neither the command line nor the stack file names one."""
DEFAULT_NODES = 2
"""GPU nodes probed for when neither the command line nor the stack file says how many."""
_STACK_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
_PARTITIONS = ("aws", "aws-us-gov", "aws-cn")
_COMMAND = contextvars.ContextVar("command", default="probe")
"""The subcommand being run, for the prefix of error lines."""
_JSON = contextvars.ContextVar("json", default=False)
"""--json was asked for: a failure is also one JSON document on stdout, for scripts."""
PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout this package belongs to (its Pulumi.yaml is beside the stack files)."""
EXIT_UNREACHABLE = 4
"""AWS did not answer (no network, a proxy, a wrong AWS_ENDPOINT_URL): nothing was learnt about
capacity, so this is not exit 1."""


class InputError(ValueError):
    """A user mistake on the command line."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """Parsed, validated command line."""

    request: ProbeRequest
    """What to place and where to look (with all_regions: only the stack's region, probed first)."""
    stack: str
    """Explicit --stack, or empty to name the stack after the chosen region."""
    all_regions: bool
    """Enumerate the account's enabled regions."""
    dry_run: bool
    """Show the stack-file change without writing it."""
    as_json: bool
    """Print one JSON document instead of the table."""
    region_timeout_s: float
    """Per-region probe deadline."""
    project_dir: Path
    """Where Pulumi.<stack>.yaml lives."""
    types_from_command_line: bool = False
    """--instance-type(s) named the types; without it the probe keeps the stack's own type."""
    deployed: Mapping[str, stackfile.GpuNodes] = dataclasses.field(default_factory=dict)
    """The GPU nodes each existing stack file the probe may write deploys, by stack name, as they
    were before the probe: what a placement of another type is said to replace."""

    @property
    def regions(self) -> tuple[str, ...]:
        return self.request.regions


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise InputError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m capacity",
                     description="Find, hold or buy GPU capacity and write it into "
                                 "Pulumi.<stack>.yaml (docs/CAPACITY.md).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("probe", help="find a region/AZ with launchable GPU capacity and write it",
                       description="Find where the GPU node group can launch and write it into "
                                   "Pulumi.<stack>.yaml.")
    p.add_argument("--stack", default="", help="stack to write (default: the chosen region)")
    p.add_argument("--new-stack", action="store_true",
                   help="--stack names a new stack that is not a region (without it, a name that "
                        "is neither a region nor an existing stack file is refused as a typo)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--regions", default="", help="comma-separated regions, in preference order")
    where.add_argument("--all-regions", action="store_true",
                       help="probe every region enabled in the account")
    types = p.add_mutually_exclusive_group()
    types.add_argument("--instance-type", default="",
                       help="GPU instance type (default: the stack's gpuInstanceType, else "
                            f"{DEFAULT_INSTANCE_TYPE}); one that differs from the stack's is written "
                            "with a line that says so")
    types.add_argument("--instance-types", default="",
                       help="comma-separated GPU instance types to fall back across: all are "
                            "probed, placements ranked by availability, quota and price")
    p.add_argument("--nodes", default="",
                   help=f"GPU nodes in one AZ (default: the stack's gpuNodeCount, else {DEFAULT_NODES})")
    p.add_argument("--capacity-type", default="on-demand", choices=("on-demand", "spot"),
                   help="on-demand (default) or spot: rank AZs by Spot placement score and price "
                        "against the Spot vCPU quota, and write gpuCapacityType: spot")
    p.add_argument("--reserve", action="store_true",
                   help="prove capacity with a capacity reservation, cancelled at once")
    p.add_argument("--hold", default="", metavar="HOURS",
                   help="prove capacity with a reservation and keep it for HOURS (it bills "
                        "until then); the GPU node group launches into it")
    p.add_argument("--dry-run", action="store_true",
                   help="show the stack-file change, write nothing")
    p.add_argument("--json", action="store_true", help="print JSON on stdout")
    p.add_argument("--region-timeout", default="60", help="seconds per region (default 60)")
    blocks_cli.add_commands(sub)
    return parser


def known_regions(session: boto3.Session) -> frozenset[str]:
    return frozenset(r for part in _PARTITIONS
                     for r in session.get_available_regions("ec2", partition_name=part))


def _positive_int(name: str, raw: str) -> int:
    if not re.fullmatch(r"\d+", raw.strip()) or int(raw) < 1:
        raise InputError(f"{name} must be a whole number of at least 1, got {raw!r}")
    return int(raw)


def _check_instance_type(name: str, *, source: str = "--instance-type") -> None:
    if name in GPU_INSTANCE_TYPES:
        return
    why = ("has no GPU or no EFA" if name in INSTANCE_TYPES
           else "is not an EFA-capable GPU instance type this stack can deploy")
    raise InputError(f"{source} {name} {why}; use one of {', '.join(GPU_INSTANCE_TYPES)}")


def _check_regions(regions: Sequence[str], known: frozenset[str]) -> None:
    for region in regions:
        if region not in known:
            hint = difflib.get_close_matches(region, sorted(known), n=1)
            raise InputError(f"unknown region {region!r}"
                             + (f"; did you mean {hint[0]}?" if hint else ""))


def _deployed_gpu_nodes(stacks: Sequence[str], *, project_dir: Path, need_type: bool,
                        need_nodes: bool) -> dict[str, stackfile.GpuNodes]:
    """The GPU nodes the existing stack files of `stacks` (those the probe may write) deploy, by
    stack name. InputError when they disagree on what the command line leaves to them."""
    found = {s: nodes for s in stacks
             if (nodes := stackfile.read_gpu_nodes(stack_file(s, project_dir))) is not None}
    for needed, attr, what, flag in ((need_type, "instance_type", "GPU instance types", "--instance-type"),
                                     (need_nodes, "node_count", "GPU node counts", "--nodes")):
        if needed and len({getattr(n, attr) for n in found.values()}) > 1:
            listing = ", ".join(f"Pulumi.{s}.yaml {getattr(n, attr)}" for s, n in found.items())
            raise InputError(f"the stack files this probe may write deploy different {what} ({listing}): "
                             f"pass {flag}, or --stack to probe for one of them")
    return found


def _instance_types(args: argparse.Namespace, *, deployed: Mapping[str, stackfile.GpuNodes]) -> tuple[str, ...]:
    """The types to probe: those of the command line, else the stack's own, else the default."""
    if not args.instance_types and not args.instance_type:
        if not deployed:
            return (DEFAULT_INSTANCE_TYPE,)
        stack, nodes = next(iter(deployed.items()))
        _check_instance_type(nodes.instance_type, source=f"Pulumi.{stack}.yaml's ray-eks:gpuInstanceType")
        return (nodes.instance_type,)
    if not args.instance_types:
        _check_instance_type(args.instance_type)
        return (args.instance_type,)
    names = tuple(dict.fromkeys(t.strip() for t in args.instance_types.split(",") if t.strip()))
    if not names:
        raise InputError("--instance-types is empty")
    for name in names:
        _check_instance_type(name)
    return names


def _hold_hours(args: argparse.Namespace) -> float:
    if not args.hold:
        return 0.0
    try:
        hours = float(args.hold)
    except ValueError:
        hours = 0.0
    if not 1 <= hours <= MAX_HOLD_HOURS:
        raise InputError(f"--hold must be a number of hours from 1 to {MAX_HOLD_HOURS}, "
                         f"got {args.hold!r}")
    if args.dry_run:
        raise InputError("--hold keeps a billed reservation and writes the stack file; it "
                         "cannot be combined with --dry-run")
    return hours


def _check_new_stack(stack: str, *, project_dir: Path, known: frozenset[str]) -> None:
    """A --stack that names no stack file here must be a region (the usual stack name) or be
    asked for with --new-stack: a typo would otherwise write a new stack file and exit 0."""
    if stack in known or stack_file(stack, project_dir).exists():
        return
    stacks = sorted(p.name.removeprefix("Pulumi.").removesuffix(".yaml")
                    for p in project_dir.glob("Pulumi.*.yaml"))
    close = difflib.get_close_matches(stack, [*stacks, *sorted(known)], n=1)
    hint = f"did you mean --stack {close[0]}? Or add" if close else "add"
    raise InputError(f"--stack {stack!r} is neither a stack file here nor an AWS region; {hint} "
                     f"--new-stack to create Pulumi.{stack}.yaml")


def check_project_dir(project_dir: Path) -> None:
    """The stack files live beside Pulumi.yaml: run from elsewhere, the probe would read no stack
    file and write a stray one."""
    if (project_dir / "Pulumi.yaml").is_file():
        return
    root = f" ({PROJECT_ROOT})" if (PROJECT_ROOT / "Pulumi.yaml").is_file() else ""
    raise InputError(f"there is no Pulumi.yaml in {project_dir}: the capacity commands read and "
                     f"write Pulumi.<stack>.yaml in the project's root{root}; run them from there")


def _refuse_if_reserved(path: Path, stack: str) -> None:
    try:
        blocks_cli.refuse_if_reserved(path, stack)
    except blocks_cli.BlocksInputError as exc:
        raise InputError(str(exc)) from None


def parse_options(argv: Sequence[str], *, project_dir: Path, known: frozenset[str],
                  default_region: str = "") -> Options | blocks_cli.BlocksOptions | \
        blocks_cli.ReleaseOptions:
    """Validate everything that needs no cloud call. InputError, ConfigError or StackFileError
    on a user mistake."""
    args = build_parser().parse_args(argv)
    if args.command != "probe":
        try:
            return blocks_cli.parse(args, project_dir=project_dir, known=known,
                                    default_region=default_region)
        except blocks_cli.BlocksInputError as exc:
            raise InputError(str(exc)) from None
    nodes = _positive_int("--nodes", args.nodes) if args.nodes else 0
    try:
        timeout = float(args.region_timeout)
    except ValueError:
        timeout = 0.0
    if timeout <= 0:
        raise InputError(f"--region-timeout must be a positive number of seconds, "
                         f"got {args.region_timeout!r}")
    hold_hours = _hold_hours(args)
    if args.capacity_type == "spot" and (args.reserve or hold_hours):
        raise InputError(f"--capacity-type spot cannot be combined with {'--hold' if hold_hours else '--reserve'}: "
                         "a capacity reservation holds On-Demand capacity, and EC2 reserves no Spot "
                         "capacity (a Spot placement score is the nearest evidence; the probe shows it)")
    if args.stack and not _STACK_NAME_RE.match(args.stack):
        raise InputError(f"--stack {args.stack!r} is not a stack name (letters, digits, - _ .)")
    regions = tuple(r.strip() for r in args.regions.split(",") if r.strip())
    if args.regions and not regions:
        raise InputError("--regions is empty")
    current_zone_id = ""
    if args.stack:
        if not args.new_stack:
            _check_new_stack(args.stack, project_dir=project_dir, known=known)
        path = stack_file(args.stack, project_dir)
        stackfile.precheck(path)
        _refuse_if_reserved(path, args.stack)
        stack_region = stackfile.read_region(path)
        if not regions and stack_region:
            regions = (stack_region,)  # with --all-regions: probed first
        current_zone_id = stackfile.read_zone_id(path)
    if not regions and not args.all_regions:
        regions = DEFAULT_REGIONS
    _check_regions(regions, known)
    if not args.stack:
        for region in regions:
            stackfile.precheck(stack_file(region, project_dir))
            _refuse_if_reserved(stack_file(region, project_dir), region)
    # The GPU nodes of the stack this probe writes, unless the command line says otherwise: a probe
    # run to find an AZ must not put the default type back over the one the stack was set to.
    writable = ([args.stack] if args.stack else
                sorted(known) if args.all_regions else list(regions))
    deployed = _deployed_gpu_nodes(writable, project_dir=project_dir,
                                   need_type=not (args.instance_type or args.instance_types),
                                   need_nodes=not nodes)
    instance_types = _instance_types(args, deployed=deployed)
    nodes = nodes or next((n.node_count for n in deployed.values()), DEFAULT_NODES)
    return Options(
        request=ProbeRequest(instance_type=instance_types[0], node_count=nodes, regions=regions,
                             reserve=args.reserve or bool(hold_hours),
                             current_zone_id=current_zone_id, fallback_types=instance_types[1:],
                             hold_hours=hold_hours, capacity_type=args.capacity_type),
        stack=args.stack, all_regions=args.all_regions, dry_run=args.dry_run,
        as_json=args.json, region_timeout_s=timeout, project_dir=project_dir,
        types_from_command_line=bool(args.instance_type or args.instance_types), deployed=deployed)


def _home_region(session: boto3.Session, regions: Sequence[str]) -> str:
    return session.region_name or (regions[0] if regions else "us-east-1")


def _fail(err: Console, message: str, code: int, *, json_doc: bool = True) -> int:
    """The error on stderr, one line per problem; with --json, also one JSON document on stdout
    (unless the command printed its report already: `json_doc` off)."""
    for line in message.splitlines():
        err.print(f"capacity {_COMMAND.get()}: error: {line}", markup=False, highlight=False,
                  soft_wrap=True)
    if json_doc and _JSON.get():
        print(json.dumps({"exit_code": code, "error": message.splitlines()}, indent=2))
    return code


_UNREACHABLE = (FailureKind.NETWORK, FailureKind.TIMEOUT)


def _failure_exit_code(failure: AwsFailure) -> int:
    if failure.kind in (FailureKind.CREDENTIALS, FailureKind.DENIED):
        return EXIT_PERMISSION
    if failure.kind in _UNREACHABLE:
        return EXIT_UNREACHABLE
    return EXIT_NO_PLACEMENT


def instance_type_change(opts: Options, placement, *, stack: str) -> str:
    """The line said when the placement's type replaces the one the stack file deployed before the
    probe (empty when it keeps it, or there was no file)."""
    before = opts.deployed.get(stack)
    if before is None or before.instance_type == placement.instance_type:
        return ""
    was = before.instance_type + ("" if before.instance_type_set else ", its default")
    why = "as the command line asked" if opts.types_from_command_line else "the type that placed"
    return (f"Pulumi.{stack}.yaml deploys {was}: this sets ray-eks:gpuInstanceType to "
            f"{placement.instance_type}, {why} (pass --instance-type {before.instance_type} to keep it)")


def run_probe(opts: Options, *, api: AwsApi, home_region: str, out: Console,
              err: Console) -> int:
    request = opts.request
    if opts.all_regions:
        enabled = api.enabled_regions(region=home_region)
        # Preference order: the stack's region, then the usual large GPU regions, then the rest.
        preferred = [r for r in (*request.regions, *DEFAULT_REGIONS) if r in enabled]
        regions = tuple(dict.fromkeys([*preferred, *sorted(enabled)]))
        if not opts.stack:  # any of them may become the stack: refuse a malformed one now
            for region in regions:
                stackfile.precheck(stack_file(region, opts.project_dir))
                _refuse_if_reserved(stack_file(region, opts.project_dir), region)
        request = dataclasses.replace(request, regions=regions)
    with Progress(TextColumn("probing regions"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.description}"), console=err,
                  transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("", total=len(request.regions) * len(request.instance_types))
        reports = probe_instance_types(
            api, request=request, timeout_s=opts.region_timeout_s,
            on_done=lambda r: progress.update(task, advance=1,
                                              description=f"{r.region} {r.instance_type}"))
    candidates = rank_candidates(reports, request=request)
    reservations, held = None, HeldLog()
    if request.reserve and candidates:
        if not opts.as_json:
            err.print("proving capacity with reservations ("
                      + (f"the first kept for {request.hold_hours:g} h" if request.hold_hours
                         else "cancelled at once") + f") in up to {len(candidates)} AZs")
        keep = (stack_keeper(api, stack=opts.stack, project_dir=opts.project_dir,
                             node_count=request.node_count, hours=request.hold_hours, log=held)
                if request.hold_hours else None)
        reservations = prove_capacity(api, candidates=candidates,
                                      instance_type=request.instance_type,
                                      count=request.node_count, keep=keep)
    attempts = reservations.attempts if reservations else ()
    placement = choose_placement(candidates, attempts, request=request)
    code = exit_code(placement, reports, attempts)
    if code == EXIT_NO_PLACEMENT and reports and all(r.failure is not None and r.failure.kind in _UNREACHABLE
                                         for r in reports):
        code = EXIT_UNREACHABLE  # no region answered: nothing is known about capacity
    result = report_mod.ProbeResult(
        request=request, reports=reports, candidates=candidates, reservations=reservations,
        placement=placement, reasons=unplaced_reasons(reports, attempts), exit_code=code)
    if code == EXIT_BAD_INPUT:
        return _fail(err, f"{request.instance_type} does not support EFA in any probed region; "
                          f"use one of {', '.join(GPU_INSTANCE_TYPES)}", code)
    if placement is not None and held.update is not None:
        result = dataclasses.replace(result, stack=held.stack, update=held.update, written=True,
                                     held=held.reservation,
                                     type_change=instance_type_change(opts, placement, stack=held.stack))
    elif placement is not None:
        stack = opts.stack or placement.region
        type_change = instance_type_change(opts, placement, stack=stack)
        update = stackfile.plan_update(stack_file(stack, opts.project_dir), stackfile.placement_values(placement),
                                       remove=stackfile.spot_keys_removed(placement))
        written = not opts.dry_run and update.changed
        if written:
            stackfile.write(update)
        result = dataclasses.replace(result, stack=stack, update=update, written=written,
                                     type_change=type_change)
    if opts.as_json:
        print(report_mod.as_json(result))
    else:
        report_mod.print_human(result, out=out, err=err)
    if code == EXIT_UNREACHABLE:
        _fail(err, "no region answered: this is a connection problem, not an answer about "
                   "capacity", code, json_doc=False)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    # Piped output keeps the whole table on one line per row instead of rich's 80-column default.
    out = Console(width=None if sys.stdout.isatty() else 160)
    err = Console(stderr=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    _COMMAND.set(blocks_cli.command_of(argv))
    _JSON.set("--json" in argv)
    try:
        session = default_session()
    except AwsFailure as failure:
        return _fail(err, failure.summary, EXIT_PERMISSION)
    try:
        if not {"-h", "--help"} & set(argv):
            check_project_dir(Path.cwd())
        opts = parse_options(argv, project_dir=Path.cwd(), known=known_regions(session),
                             default_region=session.region_name or "")
    except (InputError, ConfigError, stackfile.StackFileError) as exc:
        return _fail(err, str(exc), EXIT_BAD_INPUT)
    home = _home_region(session, opts.regions)
    api = AwsApi(session=session, call_timeout_s=min(20.0, opts.region_timeout_s))
    try:
        api.caller_account(region=home)
        if not isinstance(opts, Options):
            return blocks_cli.run(opts, api=api, out=out, err=err)
        return run_probe(opts, api=api, home_region=home, out=out, err=err)
    except AwsFailure as failure:
        return _fail(err, failure.summary, _failure_exit_code(failure))
    except (ConfigError, stackfile.StackFileError) as exc:
        return _fail(err, str(exc), EXIT_BAD_INPUT)
    except KeyboardInterrupt as interrupt:
        leftovers = getattr(interrupt, "__notes__", [])
        err.print("capacity probe: interrupted; " + ("; ".join(leftovers) if leftovers else
                  "a reservation in flight was cancelled (or ends by itself within 30 minutes)"))
        return 130
