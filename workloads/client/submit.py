"""`python -m workloads submit|logs|stop|list`: run the fine-tune on a RayCluster through the Jobs API.

`--stack NAME` or `--address URL` names the cluster (workloads/client/cluster.py reaches it). A GPU run on
EKS (`--expect efa`, the default with --stack) gets the EFA transport env and the GPU-only packages
in its runtime_env; a CPU run installs nothing at job start.

A run has one job on a cluster at a time: its submission id is derived from the run name, so
`submit` of a run whose job is already running attaches to that job, and a submission whose answer
was lost is looked up before it is sent again. While following, a dropped connection is restored;
a job that the cluster lost with a restarted head is submitted again (`--resubmits`), and resumes
from its latest checkpoint. On a stack whose GPU nodes scale to zero, while the job waits for its
GPUs it says what comes (nodes requested, launched, joined; worker pods pulling the image, ready)
and why the nodes do not, if EC2 says (workloads/client/wakeup.py).

Exit codes: 0 the job succeeded (its ranks ran on the nodes the driver planned and, on GPUs, its
NCCL connections passed the transport check); 1 it failed, was stopped, or failed a check; 2 bad
input; 3 the cluster could not be reached or refused the token; 4 the connection was lost while
following and could not be restored (the job keeps running; the message says how to reattach);
130 interrupted by Ctrl-C, 143 by SIGTERM (the job keeps running).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional

from rich.console import Console

from workloads.client import revisions, tracking
from workloads.client.cluster import (PROJECT_DIR, UnreachableError, client_factory, connect, first_line, job_client,
                                      read_token_file)
from workloads.client.datapaths import files_for_job, local_inputs
from workloads.client.inputs_check import check_inputs
from workloads.client.interrupts import INTERRUPTIONS, sigterm_raises
from workloads.client.interrupts import exit_code as interruption_exit_code
from workloads.client.overrides import given_keys, user_overrides
from workloads.client.report import eval_warnings, loop_summary
from workloads.client.plan import DEFAULT_NODES
from workloads.client.usage import Parser, UsageError
from workloads.client.wakeup import WakeWatching, wake_wait_s, watch_for
# The names below are this module's public interface too (local.py, docs and tests use them from here).
from workloads.client.follow import (  # noqa: F401
    FollowLostError,
    JobGoneError,
    LogPrinter,
    follow,
    reattach_hint,
    wait_terminal,
)
from workloads.client.jobs import Submitted, same_world_size, submission_id, submit_and_follow, submit_or_attach  # noqa: F401
from workloads.client.outcome import (  # noqa: F401
    EXIT_DETACHED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    GateOutcome,
    JobOutcome,
    finish,
    placement_check,
    report_outcome,
    transport_check,
)
from workloads.client.submission import (  # noqa: F401
    GPU_PACKAGES,
    JOB_ENV,
    PACKAGE_DIR,
    TRACKING_PACKAGES,
    Submission,
    SubmitRequest,
    build_submission,
    runtime_env,
    staged_package,
    submit_job,
)


def _target_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster (one of)")
    group.add_argument("--stack", help="Pulumi stack whose RayCluster to use (port-forwarded with kubectl)")
    group.add_argument("--address", help="Ray Jobs API URL, e.g. http://127.0.0.1:8265 (skips the stack)")
    group.add_argument("--token-file", type=Path, metavar="FILE",
                       help="a file holding the Ray auth token, with --address (default: $RAY_AUTH_TOKEN)")
    group.add_argument("--insecure", action="store_true",
                       help="allow a plain http:// --address on another machine (the token crosses in the clear)")
    group.add_argument("--token", help=argparse.SUPPRESS)  # shown to every user by `ps`: RAY_AUTH_TOKEN or --token-file


TOKEN_ON_COMMAND_LINE = ("--token puts the Ray token where every user of this machine sees it (ps) and in your shell "
                         "history: set RAY_AUTH_TOKEN or use --token-file FILE")

ELASTIC_WITHOUT_RETRIES = (
    "--min-nodes with --max-failures 0: the run ends at the first node lost without notice, and Ray Train "
    "charges a Spot node's drain to --max-failures when it sees its worker's failed health check before the "
    "drain (docs/RELIABILITY.md section 2b): keep --max-failures at 1 or more for an elastic run")


def _connect(args: argparse.Namespace):
    """The cluster the options name, with the Ray token from --token-file or RAY_AUTH_TOKEN (a
    --token given anyway is used, with a warning)."""
    token = None
    if args.token_file is not None:
        token = read_token_file(args.token_file)
    elif args.token:
        print(f"warning: {TOKEN_ON_COMMAND_LINE}", file=sys.stderr)
        token = args.token
    return connect(stack=args.stack, address=args.address, token=token, insecure=args.insecure)


def _arg_parser(command: str) -> argparse.ArgumentParser:
    parser = Parser(prog=f"python -m workloads {command}")
    _target_options(parser)
    if command == "submit":
        parser.description = "Submit the fine-tune and follow it to the end."
        parser.add_argument("--preset", help="training preset (default: by --model-size and the stack's GPUs: "
                            "qwen2.5-1.5b on 80 GB GPUs, qwen2.5-1.5b-24gb on smaller ones; for 7b, "
                            "qwen2.5-7b, qwen2.5-7b-24gb on 8 or more smaller GPUs, else qwen2.5-7b-lora-24gb)")
        parser.add_argument("--model-size", default="1.5b", choices=("1.5b", "7b"),
                            help="without --preset: the model whose preset to choose (default 1.5b)")
        parser.add_argument("--instance-type", help="with --address: the cluster's GPU instance type, to check that "
                            "the run fits its GPUs before submitting (--stack reads it from the stack file)")
        parser.add_argument("--nodes", type=int, help=f"with --instance-type: the cluster's GPU nodes (default "
                            f"{DEFAULT_NODES}, as plan's)")
        parser.add_argument("--config", type=Path, help="a TrainConfig JSON file instead of a preset")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="override a config field, e.g. --set steps=20 (repeatable)")
        parser.add_argument("--run-name", help="Ray Train run name; reuse one to resume that run")
        parser.add_argument("--storage-path", help="Ray Train storage (default: the stack's checkpoint bucket)")
        parser.add_argument("--max-failures", type=int, default=1,
                            help="worker-group restarts after a lost worker or node (default: 1)")
        parser.add_argument("--min-nodes", type=int, default=0,
                            help="go on training with at least this many nodes when a node is lost (a Spot "
                            "interruption), restarting from the latest checkpoint at the same tokens per "
                            "step, and grow back when it returns (default: all nodes)")
        parser.add_argument("--wait-nodes-s", type=float,
                            help="how long the job waits for a lost node to come back before it fails "
                            "(default: 1200)")
        parser.add_argument("--wait-gpus-s", type=float,
                            help="how long the job waits for its GPUs before it trains, or fails (default: 900; "
                            "on a stack whose GPU nodes scale to zero, which come back for the job, the nodes' "
                            "provision limit and the image pull: 1800 for G types, 2700 for P types)")
        parser.add_argument("--resubmits", type=int, default=3,
                            help="times the run is submitted again when the cluster loses its job with a "
                            "restarted head (default: 3)")
        parser.add_argument("--gpus", type=int, help="GPUs the job waits for before training "
                            "(default: the stack's rayWorkerGpus output; with --address, none)")
        parser.add_argument("--offline", action="store_true",
                            help="the cluster cannot reach PyPI: install nothing into the job's runtime_env "
                            "(the loop then uses its chunked loss instead of liger-kernel's)")
        parser.add_argument("--expect", choices=("efa", "any"),
                            help="network between nodes (default: efa with --stack, any with --address)")
        parser.add_argument("--no-follow", action="store_true", help="print the job id and return")
        parser.add_argument("--dry-run", action="store_true",
                            help="run every check made before the cluster (the stack file, the config and its data, "
                            "the fit, the hub's commits, the tools and AWS credentials) and stop there")
        parser.add_argument("--verbose", action="store_true", help="show every job log line, not only progress")
        parser.add_argument("--quiet", action="store_true",
                            help="progress only: the default now (kept for scripts that pass it)")
    elif command == "logs":
        parser.description = "Print a job's logs; --follow streams them until the job ends."
        parser.add_argument("job_id")
        parser.add_argument("--follow", action="store_true",
                            help="follow the job to its end: every line of its log, progress lines formatted")
    elif command == "stop":
        parser.description = "Stop a job."
        parser.add_argument("job_id")
    elif command == "list":
        parser.description = "List the cluster's jobs."
    return parser


def _train_config(args: argparse.Namespace, *, expect: str, preset_name: str, target=None) -> dict:
    """The run's config: --config's, else the preset's, with --set applied; a preset's micro-batch the
    largest the target's GPU memory takes (its rows per step stay), unless --set gives one."""
    from workloads.client.fit import sized_for
    from workloads.train.config import TrainConfig, preset, with_overrides
    from workloads.train.starting import with_starting_model

    if args.config is not None:
        try:
            cfg = TrainConfig.from_json(args.config.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read --config {args.config}: {exc.strerror or exc}") from None
    else:
        cfg = preset(preset_name)
    cfg = with_overrides(cfg, [*user_overrides(cfg.to_dict(), args.set), f"transport.expect={expect}"])
    cfg, _ = with_starting_model(cfg)  # model.name_or_path naming a run: its model (workloads/train/starting.py)
    if target is not None and args.config is None and "micro_batch" not in given_keys(args.set):
        cfg = sized_for(cfg, target, cwd=Path.cwd())
    return cfg.to_dict()


def fit_target(args: argparse.Namespace, console: Console):
    """The GPUs the run goes to, for the fit check: the stack file's instance type and node count
    with --stack, --instance-type/--nodes with --address; None when unknown (said why)."""
    from workloads.client.fit import Target

    if args.address or not args.stack:
        if args.instance_type is None:
            if args.nodes is not None:
                raise ValueError("--nodes goes with --instance-type (the cluster's GPU instance type)")
            return None
        return Target.instances(args.instance_type, DEFAULT_NODES if args.nodes is None else args.nodes)
    if args.instance_type or args.nodes is not None:
        raise ValueError("--instance-type and --nodes are for --address: with --stack they come from the stack file")
    from infra.config import ConfigErrors, load_stack_config

    try:
        stack = load_stack_config(args.stack, PROJECT_DIR)
    except (ConfigErrors, ValueError, OSError) as exc:
        console.print(f"[yellow]fit[/] not checked: the stack file of {args.stack!r} could not be read "
                      f"({first_line(str(exc))})")
        return None
    return Target.instances(stack.gpu_instance_type, stack.gpu_node_count)


def check_fit(train: dict, target, *, what: str, console: Console) -> None:
    """Refuse (ValueError) a run that does not fit `target`; one line saying what it takes when it does."""
    from workloads.client.fit import check_fits
    from workloads.train.config import TrainConfig

    fit = check_fits(TrainConfig.from_dict(train), target, what=what, cwd=Path.cwd())
    if fit is None:
        console.print(f"[yellow]fit[/] not checked: the shape of {train['model']['name_or_path']!r} cannot be read "
                      "here")
    else:
        console.print(f"[bold cyan]fit[/] {fit.describe()} on {target.label}")
        if fit.cfg.model.activation_offloading:
            console.print("[bold cyan]fit[/] activation offloading on: each checkpointed layer's input waits in "
                          "pinned host memory (set model.activation_offloading=false to keep them on the GPU)",
                          highlight=False)
        run = fit.cfg  # as the target's ranks run it
        console.print(f"[bold cyan]rows[/] {run.samples_per_rank_per_step * target.world_size} per step = micro-batch "
                      f"{run.micro_batch} x {run.grad_accum_steps} micro-steps x {target.world_size} ranks",
                      highlight=False)


def check_evaluation(train: dict, *, offline: bool, console: Optional[Console]) -> None:
    """The run's evaluation is possible (workloads/evaluate/stage.py) before anything is uploaded: a
    cluster that cannot reach PyPI (--offline) cannot reach the hub's task datasets either. Its notes
    go to `console` (None: not said)."""
    from workloads.evaluate.stage import check_before_training

    for note in check_before_training(train, network=not offline, evaluated_here=False):
        if console is not None:
            console.print(f"[bold cyan]evaluate[/] {note}", highlight=False)


def _preset_choice(args: argparse.Namespace, *, gpu_memory_gib, gpus, cluster: str):
    from workloads.client.presets import choose_preset

    return choose_preset(preset_name=args.preset, model_size=args.model_size, gpu_memory_gib=gpu_memory_gib,
                         gpus=gpus, overrides=args.set, cluster=cluster)


def _say_preset(choice, args: argparse.Namespace, console: Console) -> None:
    if args.config is None:
        console.print(f"[bold cyan]preset[/] {choice.label}: {choice.why}", highlight=False)


def _submit(args: argparse.Namespace, console: Console) -> int:
    expect = args.expect or ("efa" if args.stack and not args.address else "any")
    # Checked before reaching the cluster, so a mistake costs no port-forward.
    upload_absolute = bool(args.stack)  # the stack's nodes cannot see this machine's files
    target = fit_target(args, console)
    planned = _preset_choice(args, gpu_memory_gib=None if target is None else target.gpu_memory_gib,
                             gpus=None if target is None else target.world_size,
                             cluster="the cluster" if target is None else target.label)
    planned_preset = planned.name
    if target is not None:
        _say_preset(planned, args, console)
    first = _train_config(args, expect=expect, preset_name=planned_preset, target=target)
    files_for_job(first, cwd=Path.cwd(), upload_absolute=upload_absolute)
    # The files uploaded with the job are read here as the job will read them; the hub's files are
    # the cluster's to fetch (this machine only asks which commit a revision names, below).
    check_inputs(first, local=local_inputs(first, cwd=Path.cwd(), upload_absolute=upload_absolute), hub=False)
    # Its notes are said when following (--no-follow's output is the job id alone); its errors always stop here.
    check_evaluation(first, offline=args.offline, console=None if args.no_follow else console)
    if target is not None:  # before anything is uploaded or a port-forward opened
        check_fit(first, target, what=planned_preset if args.config is None else str(args.config), console=console)
    if args.max_failures < 0:
        raise ValueError(f"--max-failures must be >= 0, got {args.max_failures}")
    if args.min_nodes < 0:
        raise ValueError(f"--min-nodes must be >= 1 (or 0 for all nodes), got {args.min_nodes}")
    if args.gpus is not None and args.gpus < 0:
        raise ValueError(f"--gpus must be >= 0, got {args.gpus}")
    if args.wait_nodes_s is not None and args.wait_nodes_s <= 0:
        raise ValueError(f"--wait-nodes-s must be > 0, got {args.wait_nodes_s:g}")
    if args.wait_gpus_s is not None and args.wait_gpus_s <= 0:
        raise ValueError(f"--wait-gpus-s must be > 0, got {args.wait_gpus_s:g}")
    if args.resubmits < 0:
        raise ValueError(f"--resubmits must be >= 0, got {args.resubmits}")
    if args.min_nodes > 0 and args.max_failures == 0:
        console.print(f"[bold yellow]warning[/] {ELASTIC_WITHOUT_RETRIES}", highlight=False)
    if args.dry_run:
        return _dry_run(args, first, console, upload_absolute=upload_absolute)
    with _connect(args) as conn:
        if target is None:
            chosen = _preset_choice(args, gpu_memory_gib=conn.gpu_memory_gib, gpus=conn.ray_worker_gpus,
                                    cluster=f"the cluster's {conn.ray_worker_gpus or 0} GPU(s)")
            if not args.no_follow:  # --no-follow's output is the job id alone
                _say_preset(chosen, args, console)
            preset_name = chosen.name
        else:
            preset_name = planned_preset
        config = _train_config(args, expect=expect, preset_name=preset_name, target=target)
        config_name = preset_name if args.config is None else args.config.stem
        run_name = args.run_name or f"{config_name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
        storage_path = args.storage_path or conn.storage_path
        if not storage_path:
            raise ValueError("--storage-path is needed with --address (s3://bucket/prefix or an absolute folder)")
        if "://" not in storage_path and not storage_path.startswith("/"):
            raise ValueError(f"--storage-path {storage_path!r} must be a URI (s3://...) or an absolute folder "
                             "on the cluster's nodes")
        # Once, here: every node and every restart of the job reads these commits.
        config, pinned = revisions.pin_hub_revisions(
            config, local=local_inputs(config, cwd=Path.cwd(), upload_absolute=upload_absolute))
        for line in pinned:
            console.print(f"[bold cyan]hub[/] {line}", highlight=False)
        train, files = files_for_job(config, cwd=Path.cwd(), upload_absolute=upload_absolute)
        gpus = args.gpus if args.gpus is not None else conn.ray_worker_gpus or 0
        tracking_uri = tracking.resolve_uri(train, stack_uri=conn.tracking_uri)
        if tracking_uri:
            train = tracking.with_tracking(train, uri=tracking_uri, run_name=run_name, experiment=args.stack or "",
                                           tags=tracking.client_tags(stack=args.stack))
            tracking_uri = train["tracking"]["uri"]
        if note := tracking.credentials_note(tracking.resolve_uri(first, stack_uri=conn.tracking_uri)):
            console.print(f"[bold]credentials[/] {note}", highlight=False)
        wait_gpus_s = args.wait_gpus_s or (wake_wait_s(target and target.instance_type) if conn.wake else None)
        request = SubmitRequest(train=train, run_name=run_name, storage_path=storage_path,
                                max_failures=args.max_failures, expect=expect, quiet=not args.verbose, gpus=gpus,
                                install=not args.offline, files=files, wait_nodes_s=args.wait_nodes_s,
                                resubmits=args.resubmits, min_nodes=args.min_nodes, wait_gpus_s=wait_gpus_s)
        if args.no_follow:
            submitted = submit_or_attach(client_factory(conn), request, say=lambda m: print(m, file=sys.stderr))
            if submitted.attached:
                print(f"run {run_name} is already on the cluster as job {submitted.job_id}", file=sys.stderr)
            print(submitted.job_id)
            return EXIT_OK
        job_ids: list[str] = []
        try:
            with _waking(conn, console, limit_s=wait_gpus_s or DRIVER_WAIT_GPUS_S) as waking:
                outcome = submit_and_follow(conn, request, console=console, on_submitted=job_ids.append)
            if waking is not None and outcome.exit_code != EXIT_OK and waking.failure_note():
                outcome = dataclasses.replace(outcome, reason=f"{outcome.reason} ({waking.failure_note()})")
        except INTERRUPTIONS as stop:
            if job_ids:
                console.print(reattach_hint(job_ids[-1], conn.target_args))
            return interruption_exit_code(stop)
        except FollowLostError as exc:
            console.print(reattach_hint(job_ids[-1], conn.target_args, why=f"lost the connection ({exc})"))
            return EXIT_DETACHED
        except JobGoneError as exc:
            console.print(f"[bold red]{exc}[/], {request.resubmits} time(s): giving up. Submitting again with "
                          f"--run-name {run_name} resumes the run from its latest checkpoint")
            return EXIT_FAILED
    report_outcome(outcome, console)
    for warning in eval_warnings(outcome.records, data=(loop_summary(outcome.logs.splitlines()) or {}).get("data")):
        console.print(f"[bold yellow]warning[/] {warning}", highlight=False)
    run = tracking.tracked_run(outcome.logs) if tracking_uri else None
    if run is not None:
        console.print(f"[bold]tracking[/] {tracking.where_to_look(run, uri=tracking_uri)}", highlight=False)
    return outcome.exit_code


def _dry_run(args: argparse.Namespace, config: dict, console: Console, *, upload_absolute: bool) -> int:
    """The checks of `submit` that need no cluster, after those of the config, its data and fit:
    the hub's commits, and with --stack the stack file, the tools and the AWS credentials."""
    from workloads.client.dry_run import check_aws_credentials, check_tools

    _, pinned = revisions.pin_hub_revisions(
        config, local=local_inputs(config, cwd=Path.cwd(), upload_absolute=upload_absolute))
    for line in pinned:
        console.print(f"[bold cyan]hub[/] {line}", highlight=False)
    if args.stack and not args.address:
        from infra.config import load_stack_config

        stack = load_stack_config(args.stack, PROJECT_DIR)
        console.print(f"[bold cyan]tools[/] {check_tools()}", highlight=False)
        console.print(f"[bold cyan]credentials[/] {check_aws_credentials(region=stack.region)}", highlight=False)
    console.print("[bold green]dry run[/]: every check passed; nothing was submitted (submit without --dry-run "
                  "starts it)", highlight=False)
    return EXIT_OK


DRIVER_WAIT_GPUS_S = 900.0
"""The driver's own default wait for its GPUs (workloads/launch/driver.py --wait-gpus-s)."""


@contextlib.contextmanager
def _waking(conn, console: Console, *, limit_s: float) -> Iterator[Optional[WakeWatching]]:
    """On a stack whose GPU nodes scale to zero, a watch of them coming back while the block runs;
    None elsewhere."""
    if conn.wake is None:
        yield None
        return
    with watch_for(conn.wake, limit_s=limit_s, say=lambda m: console.print(f"[bold cyan]nodes[/] {m}"),
                   warn=lambda m: console.print(f"[bold red]nodes[/] {m}")) as waking:
        yield waking


def _logs(args: argparse.Namespace, console: Console) -> int:
    with _connect(args) as conn:
        client = job_client(conn)
        if not args.follow:
            sys.stdout.write(client.get_job_logs(args.job_id))
            return EXIT_OK
        try:
            status = follow(client_factory(conn), args.job_id, LogPrinter(console=console, quiet=False),
                            say=lambda m: console.print(f"[yellow]{m}[/]"))
        except INTERRUPTIONS as stop:
            console.print(reattach_hint(args.job_id, conn.target_args))
            return interruption_exit_code(stop)
        except FollowLostError as exc:
            console.print(reattach_hint(args.job_id, conn.target_args, why=f"lost the connection ({exc})"))
            return EXIT_DETACHED
        except JobGoneError as exc:
            console.print(f"[bold red]{exc}[/]: submitting its run again under the same --run-name resumes it "
                          "from its latest checkpoint")
            return EXIT_FAILED
    console.print(f"job {args.job_id} {status}")
    return EXIT_OK if str(status) == "SUCCEEDED" else EXIT_FAILED


def _stop(args: argparse.Namespace, console: Console) -> int:
    with _connect(args) as conn:
        client = job_client(conn)
        stopped = client.stop_job(args.job_id)
        status = wait_terminal(client, args.job_id)
        console.print(f"job {args.job_id} {status}" + ("" if stopped else " (it had already ended)"))
        if stopped:  # its workers were killed with it: the tracker run would stay RUNNING (or FAILED)
            tracking.end_stopped_run(client.get_job_logs(args.job_id),
                                     say=lambda line: console.print(line, highlight=False, markup=False))
    return EXIT_OK


def _list(args: argparse.Namespace, console: Console) -> int:
    with _connect(args) as conn:
        jobs = job_client(conn).list_jobs()
    rows = [("JOB", "STATUS", "STARTED (UTC)", "RUN")]
    for job in sorted(jobs, key=lambda j: j.start_time or 0):
        started = (datetime.fromtimestamp(job.start_time / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
                   if job.start_time else "-")
        rows.append((job.submission_id or job.job_id or "-", str(job.status), started,
                     (job.metadata or {}).get("run_name", "-")))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        console.out("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return EXIT_OK


COMMANDS = {"submit": _submit, "logs": _logs, "stop": _stop, "list": _list}


def main(command: str, argv: list[str]) -> int:
    console = Console(highlight=False, soft_wrap=True)
    try:
        args = _arg_parser(command).parse_args(argv)
        if args.stack and not args.address:  # an unknown stack is bad input, said before anything else
            from infra.config import require_stack_file

            require_stack_file(args.stack, PROJECT_DIR)
        with sigterm_raises():
            return COMMANDS[command](args, console)
    except (UsageError, ValueError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnreachableError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except INTERRUPTIONS as stop:
        return interruption_exit_code(stop)
    except Exception as exc:
        # Ray's class is imported only here: importing ray takes about a second of CPU, which a
        # command refused for its arguments (or its --help) need not spend.
        from ray.exceptions import AuthenticationError

        if isinstance(exc, AuthenticationError):
            print(f"{command}: error: the cluster refused the Ray token: {first_line(str(exc))}", file=sys.stderr)
            return EXIT_UNREACHABLE
        if isinstance(exc, RuntimeError):  # the Jobs API refused a request (unknown job id, ...)
            print(f"{command}: error: {first_line(str(exc))}", file=sys.stderr)
            return EXIT_FAILED
        raise
