"""`python -m workloads submit|logs|stop|list`: run the fine-tune on a RayCluster through the Jobs API.

`--stack NAME` or `--address URL` names the cluster (workloads/client/cluster.py reaches it). A GPU run on
EKS (`--expect efa`, the default with --stack) gets the EFA transport env and the GPU-only packages
in its runtime_env; a CPU run installs nothing at job start.

Exit codes: 0 the job succeeded (and, on GPUs, its NCCL connections passed the transport check);
1 it failed, was stopped, or failed the check; 2 bad input; 3 the cluster could not be reached or
refused the token; 130 interrupted (the job keeps running).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional

from ray.exceptions import AuthenticationError
from rich.console import Console

from workloads.client.cluster import (
    Connection,
    UnreachableError,
    connect,
    first_line,
    job_client,
)
from workloads.context import GATE_PREFIX
from workloads.launch.driver import parse_driver_line
from workloads.client.job_files import check_uploadable, stage_data_file
from workloads.client.report import format_record, parse_prefixed, parse_train_line, train_records
from workloads.transport.gate import EFA_TRANSPORT_ENV

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The `workloads` package, uploaded as the job's working_dir."""

GPU_PACKAGES = ("liger-kernel==0.8.5",)
"""Installed into GPU jobs' runtime_env: the loop's fused linear cross-entropy uses liger-kernel when
importable (docs/PERFORMANCE.md). The same pin as pyproject's `gpu` extra."""

JOB_ENV = {
    "RAY_DEDUP_LOGS": "0",
    "PYTHONUNBUFFERED": "1",
}
"""Every worker line reaches the job logs unfolded and at once (progress and the NCCL logs)."""


# --- the submission -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Submission:
    entrypoint: str
    runtime_env: dict
    metadata: dict


def runtime_env(*, working_dir: str, expect: Literal["efa", "any"]) -> dict:
    """The job's pinned runtime_env. Only an EFA (GPU) run declares the transport and installs
    GPU_PACKAGES; a CPU run needs no network at job start."""
    if expect != "efa":
        return {"working_dir": working_dir, "env_vars": dict(JOB_ENV)}
    return {
        "working_dir": working_dir,
        "env_vars": {**JOB_ENV, **EFA_TRANSPORT_ENV},
        # pip_check off: `pip check` would also judge the image's own packages, not just these.
        "pip": {"packages": list(GPU_PACKAGES), "pip_check": False},
    }


def build_submission(*, train: dict, run_name: str, storage_path: str, max_failures: int,
                     working_dir: str, expect: Literal["efa", "any"]) -> Submission:
    """The Jobs API request: the driver command, a pinned runtime_env and searchable metadata."""
    driver_args = ["python", "-m", "workloads.launch.driver", "--config-json", json.dumps(train, separators=(",", ":")),
                   "--run-name", run_name, "--storage-path", storage_path, "--max-failures", str(max_failures)]
    return Submission(
        entrypoint=shlex.join(driver_args),
        runtime_env=runtime_env(working_dir=working_dir, expect=expect),
        metadata={"run_name": run_name, "storage_path": storage_path},
    )


@contextmanager
def staged_package() -> Iterator[Path]:
    """A temporary folder holding only the `workloads` package: what the job's working_dir uploads."""
    with tempfile.TemporaryDirectory(prefix="workloads-job-") as tmp:
        shutil.copytree(PACKAGE_DIR, Path(tmp) / "workloads",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        yield Path(tmp)


# --- following a job ----------------------------------------------------------------------------


class LogPrinter:
    """Feeds log chunks in, prints progress lines (and, unless quiet, every other line)."""

    def __init__(self, *, console: Console, quiet: bool, total_steps: Optional[int] = None) -> None:
        self._gate_prefix = GATE_PREFIX
        self.console = console
        self.quiet = quiet
        self.total_steps = total_steps
        self._partial = ""
        # Ray Train forwards each worker line to the job logs twice; show a record once.
        self._last_shown: Optional[str] = None

    def feed(self, chunk: str) -> None:
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self.line(line)

    def flush(self) -> None:
        if self._partial:
            self.line(self._partial)
            self._partial = ""

    def line(self, line: str) -> None:
        if self._is_repeat(line):
            return
        record = parse_train_line(line)
        if record is not None:
            self.console.print(f"[bold cyan]train[/] {format_record(record, total_steps=self.total_steps)}")
            return
        gate = parse_prefixed(line, self._gate_prefix)
        if gate is not None:
            style = "red" if not gate.get("passed") else "green" if gate.get("applies") else "dim"
            self.console.print(f"[bold cyan]gate[/] [{style}]{gate.get('message', '')}[/]")
            return
        plan = parse_driver_line(line)
        if plan is not None and plan.get("event") == "plan":
            kind = "GPU" if plan["use_gpu"] else "CPU"
            self.console.print(f"[bold cyan]job[/] {plan['num_workers']} {kind} workers on {plan['nodes']} node(s), "
                               f"run {plan['run_name']}")
            return
        if not self.quiet:
            self.console.out(line, highlight=False)

    def _is_repeat(self, line: str) -> bool:
        keyed = parse_train_line(line) is not None or self._gate_prefix in line
        if not keyed:
            return False
        if line == self._last_shown:
            return True
        self._last_shown = line
        return False


async def _tail(client, job_id: str, printer: LogPrinter) -> None:
    async for chunk in client.tail_job_logs(job_id):
        printer.feed(chunk)
    printer.flush()


def wait_terminal(client, job_id: str, *, poll_s: float = 0.5):
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        time.sleep(poll_s)


def follow(client, job_id: str, printer: LogPrinter):
    """Stream the job's logs through printer until it ends; returns its terminal JobStatus."""
    asyncio.run(_tail(client, job_id, printer))
    return wait_terminal(client, job_id)


# --- the outcome --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GateOutcome:
    applies: bool
    passed: bool
    message: str


def transport_check(logs: str, *, expect: Literal["efa", "any"]) -> GateOutcome:
    """The second gate: NCCL's connections as the job logs show them, judged offline."""
    from workloads.transport import verify

    plan = next((p for p in map(parse_driver_line, logs.splitlines()) if p and p.get("event") == "plan"), None)
    if plan is None:
        return GateOutcome(applies=False, passed=True,
                           message="transport check skipped: the job never sized its workers")
    if not plan["use_gpu"]:
        return GateOutcome(applies=False, passed=True,
                           message="transport check does not apply: CPU workers talk over gloo, not NCCL")
    verdict = verify.verify_transport(logs, expect=expect, nodes=plan["nodes"])
    return GateOutcome(applies=True, passed=verdict.status == verify.Status.PASS,
                       message=verify.render(verdict))


@dataclass(frozen=True, kw_only=True)
class JobOutcome:
    job_id: str
    status: str
    """The job's terminal status (SUCCEEDED, FAILED, STOPPED)."""
    records: list[dict] = field(default_factory=list)
    """Every `[train]` step record in the job's logs."""
    reason: str = ""
    """Why the job did not succeed: the last line of its logs, or the Jobs API's message."""
    gate: Optional[GateOutcome] = None
    logs: str = field(default="", repr=False)
    """The job's whole log."""

    @property
    def exit_code(self) -> int:
        passed = self.status == "SUCCEEDED" and (self.gate is None or self.gate.passed)
        return EXIT_OK if passed else EXIT_FAILED


def finish(client, job_id: str, status, *, expect: Literal["efa", "any"]) -> JobOutcome:
    logs = client.get_job_logs(job_id)
    records = train_records(logs.splitlines())
    if str(status) != "SUCCEEDED":
        last = next((line.strip() for line in reversed(logs.splitlines()) if line.strip()), "")
        message = client.get_job_info(job_id).message or ""
        return JobOutcome(job_id=job_id, status=str(status), records=records, reason=last or message, logs=logs)
    return JobOutcome(job_id=job_id, status=str(status), records=records,
                      gate=transport_check(logs, expect=expect), logs=logs)


def report_outcome(outcome: JobOutcome, console: Console) -> None:
    if outcome.status != "SUCCEEDED":
        console.print(f"[bold red]job {outcome.job_id} {outcome.status}[/]: {outcome.reason}", highlight=False)
        return
    gate = outcome.gate
    if gate is not None:
        style = "green" if gate.passed else "bold red"
        console.print(f"[{style}]{gate.message}[/]", highlight=False)
    verdict = "[bold green]SUCCEEDED[/]" if outcome.exit_code == EXIT_OK else "[bold red]FAILED the transport check[/]"
    console.print(f"job {outcome.job_id} {verdict}")


def reattach_hint(job_id: str, target_args: tuple[str, ...]) -> str:
    target = shlex.join(target_args)
    return (f"stopped following; job {job_id} keeps running.\n"
            f"  reattach: python -m workloads logs --follow {job_id} {target}\n"
            f"  stop:     python -m workloads stop {job_id} {target}")


@dataclass(frozen=True, kw_only=True)
class SubmitRequest:
    train: dict
    """TrainConfig.to_dict() of the run."""
    run_name: str
    """Ray Train run name; submitting again with the same name and storage resumes the run."""
    storage_path: str
    max_failures: int
    expect: Literal["efa", "any"]
    """Network required between nodes, for the in-band gate, the job env and the offline check."""
    quiet: bool
    """Print only progress, not every job log line."""


def submit_job(client, request: SubmitRequest) -> str:
    """Upload the staged package with the driver command; returns the job's submission id."""
    with staged_package() as working_dir:
        submission = build_submission(train=stage_data_file(request.train, working_dir), run_name=request.run_name,
                                      storage_path=request.storage_path, max_failures=request.max_failures,
                                      working_dir=str(working_dir), expect=request.expect)
        return client.submit_job(entrypoint=submission.entrypoint, runtime_env=submission.runtime_env,
                                 metadata=submission.metadata)


def submit_and_follow(conn: Connection, request: SubmitRequest, *, console: Console,
                      on_submitted: Callable[[str], None] = lambda job_id: None) -> JobOutcome:
    """Submit the driver, follow it to the end and judge it. KeyboardInterrupt propagates;
    `on_submitted` has had the job id by then."""
    client = job_client(conn)
    job_id = submit_job(client, request)
    on_submitted(job_id)
    console.print(f"[bold cyan]job[/] submitted {job_id} to {conn.address} (run {request.run_name})")
    printer = LogPrinter(console=console, quiet=request.quiet, total_steps=request.train.get("steps"))
    status = follow(client, job_id, printer)
    return finish(client, job_id, status, expect=request.expect)


# --- the commands -------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def _target_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster (one of)")
    group.add_argument("--stack", help="Pulumi stack whose RayCluster to use (port-forwarded with kubectl)")
    group.add_argument("--address", help="Ray Jobs API URL, e.g. http://127.0.0.1:8265 (skips the stack)")
    group.add_argument("--token", help="Ray auth token with --address (default: $RAY_AUTH_TOKEN)")


def _arg_parser(command: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=f"python -m workloads {command}")
    _target_options(parser)
    if command == "submit":
        parser.description = "Submit the fine-tune and follow it to the end."
        parser.add_argument("--preset", help="training preset (default: by the stack's GPU memory, "
                            "qwen2.5-1.5b on 80 GB GPUs, qwen2.5-1.5b-24gb on smaller ones)")
        parser.add_argument("--config", type=Path, help="a TrainConfig JSON file instead of a preset")
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="override a config field, e.g. --set steps=20 (repeatable)")
        parser.add_argument("--run-name", help="Ray Train run name; reuse one to resume that run")
        parser.add_argument("--storage-path", help="Ray Train storage (default: the stack's checkpoint bucket)")
        parser.add_argument("--max-failures", type=int, default=1, help="worker-group restarts (default: 1)")
        parser.add_argument("--expect", choices=("efa", "any"),
                            help="network between nodes (default: efa with --stack, any with --address)")
        parser.add_argument("--no-follow", action="store_true", help="print the job id and return")
        parser.add_argument("--quiet", action="store_true", help="show progress only, not every log line")
    elif command == "logs":
        parser.description = "Print a job's logs; --follow streams them until the job ends."
        parser.add_argument("job_id")
        parser.add_argument("--follow", action="store_true")
    elif command == "stop":
        parser.description = "Stop a job."
        parser.add_argument("job_id")
    elif command == "list":
        parser.description = "List the cluster's jobs."
    return parser


def _train_config(args: argparse.Namespace, *, expect: str, preset_name: str) -> dict:
    from workloads.train.config import TrainConfig, preset, with_overrides

    if args.config is not None:
        try:
            cfg = TrainConfig.from_json(args.config.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read --config {args.config}: {exc.strerror or exc}") from None
    else:
        cfg = preset(preset_name)
    cfg = with_overrides(cfg, [*args.set, f"transport.expect={expect}"])
    return cfg.to_dict()


def _submit(args: argparse.Namespace, console: Console) -> int:
    from workloads.train.config import preset_for_gpu

    expect = args.expect or ("efa" if args.stack and not args.address else "any")
    # Checked before reaching the cluster, so a mistake costs no port-forward.
    check_uploadable(_train_config(args, expect=expect, preset_name=args.preset or preset_for_gpu(None)))
    if args.max_failures < 0:
        raise ValueError(f"--max-failures must be >= 0, got {args.max_failures}")
    with connect(stack=args.stack, address=args.address, token=args.token) as conn:
        preset_name = args.preset or preset_for_gpu(conn.gpu_memory_gib)
        train = _train_config(args, expect=expect, preset_name=preset_name)
        config_name = preset_name if args.config is None else args.config.stem
        run_name = args.run_name or f"{config_name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
        storage_path = args.storage_path or conn.storage_path
        if not storage_path:
            raise ValueError("--storage-path is needed with --address (s3://bucket/prefix or an absolute folder)")
        if "://" not in storage_path and not storage_path.startswith("/"):
            raise ValueError(f"--storage-path {storage_path!r} must be a URI (s3://...) or an absolute folder "
                             "on the cluster's nodes")
        request = SubmitRequest(train=train, run_name=run_name, storage_path=storage_path,
                                max_failures=args.max_failures, expect=expect, quiet=args.quiet)
        if args.no_follow:
            print(submit_job(job_client(conn), request))
            return EXIT_OK
        submitted: list[str] = []
        try:
            outcome = submit_and_follow(conn, request, console=console, on_submitted=submitted.append)
        except KeyboardInterrupt:
            if submitted:
                console.print(reattach_hint(submitted[0], conn.target_args))
            return EXIT_INTERRUPTED
    report_outcome(outcome, console)
    return outcome.exit_code


def _logs(args: argparse.Namespace, console: Console) -> int:
    with connect(stack=args.stack, address=args.address, token=args.token) as conn:
        client = job_client(conn)
        if not args.follow:
            sys.stdout.write(client.get_job_logs(args.job_id))
            return EXIT_OK
        try:
            status = follow(client, args.job_id, LogPrinter(console=console, quiet=False))
        except KeyboardInterrupt:
            console.print(reattach_hint(args.job_id, conn.target_args))
            return EXIT_INTERRUPTED
    console.print(f"job {args.job_id} {status}")
    return EXIT_OK if str(status) == "SUCCEEDED" else EXIT_FAILED


def _stop(args: argparse.Namespace, console: Console) -> int:
    with connect(stack=args.stack, address=args.address, token=args.token) as conn:
        client = job_client(conn)
        stopped = client.stop_job(args.job_id)
        status = wait_terminal(client, args.job_id)
    console.print(f"job {args.job_id} {status}" + ("" if stopped else " (it had already ended)"))
    return EXIT_OK


def _list(args: argparse.Namespace, console: Console) -> int:
    with connect(stack=args.stack, address=args.address, token=args.token) as conn:
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
        return COMMANDS[command](args, console)
    except (_UsageError, ValueError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except UnreachableError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except AuthenticationError as exc:
        print(f"{command}: error: the cluster refused the Ray token: {first_line(str(exc))}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except RuntimeError as exc:  # the Jobs API refused a request (unknown job id, ...)
        print(f"{command}: error: {first_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
