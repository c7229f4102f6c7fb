"""`python -m workloads submit|logs|stop|list`: run the fine-tune on a RayCluster through the Jobs API.

`--stack NAME` or `--address URL` names the cluster (workloads/client/cluster.py reaches it). A GPU run on
EKS (`--expect efa`, the default with --stack) gets the EFA transport env and the GPU-only packages
in its runtime_env; a CPU run installs nothing at job start.

A run has one job on a cluster at a time: its submission id is derived from the run name, so
`submit` of a run whose job is already running attaches to that job, and a submission whose answer
was lost is looked up before it is sent again. While following, a dropped connection is restored;
a job that the cluster lost with a restarted head is submitted again (`--resubmits`), and resumes
from its latest checkpoint.

Exit codes: 0 the job succeeded (its ranks ran on the nodes the driver planned and, on GPUs, its
NCCL connections passed the transport check); 1 it failed, was stopped, or failed a check; 2 bad
input; 3 the cluster could not be reached or refused the token; 4 the connection was lost while
following and could not be restored (the job keeps running; the message says how to reattach);
130 interrupted (the job keeps running).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
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
    client_factory,
    connect,
    first_line,
    job_client,
)
from workloads.client.datapaths import files_for_job, stage_files
from workloads.context import GATE_PREFIX
from workloads.launch.driver import DRIVER_PREFIX, parse_driver_line
from workloads.client.report import format_record, loop_summary, parse_prefixed, parse_train_line, train_records
from workloads.transport.gate import EFA_TRANSPORT_ENV

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_DETACHED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
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


def runtime_env(*, working_dir: str, expect: Literal["efa", "any"], install: bool = True) -> dict:
    """The job's pinned runtime_env. Only an EFA (GPU) run declares the transport and installs
    GPU_PACKAGES, unless `install` is off (a cluster that cannot reach PyPI: the loop then uses its
    chunked loss); a CPU run needs no network at job start."""
    if expect != "efa":
        return {"working_dir": working_dir, "env_vars": dict(JOB_ENV)}
    env = {"working_dir": working_dir, "env_vars": {**JOB_ENV, **EFA_TRANSPORT_ENV}}
    if install:
        # pip_check off: `pip check` would also judge the image's own packages, not just these.
        env["pip"] = {"packages": list(GPU_PACKAGES), "pip_check": False}
    return env


def build_submission(*, train: dict, run_name: str, storage_path: str, max_failures: int,
                     working_dir: str, expect: Literal["efa", "any"], gpus: int = 0,
                     install: bool = True, wait_nodes_s: Optional[float] = None, workers: int = 0) -> Submission:
    """The Jobs API request: the driver command, a pinned runtime_env and searchable metadata."""
    driver_args = ["python", "-m", "workloads.launch.driver", "--config-json", json.dumps(train, separators=(",", ":")),
                   "--run-name", run_name, "--storage-path", storage_path, "--max-failures", str(max_failures)]
    if gpus:
        driver_args += ["--gpus", str(gpus)]
    if wait_nodes_s is not None:
        driver_args += ["--wait-nodes-s", f"{wait_nodes_s:g}"]
    if workers:
        driver_args += ["--workers", str(workers)]
    return Submission(
        entrypoint=shlex.join(driver_args),
        runtime_env=runtime_env(working_dir=working_dir, expect=expect, install=install),
        metadata={"run_name": run_name, "storage_path": storage_path},
    )


@contextmanager
def staged_package(files: tuple[tuple[str, Path], ...] = ()) -> Iterator[Path]:
    """A temporary folder holding only the `workloads` package and the local `files` the config
    names, each at its place: what the job's working_dir uploads."""
    with tempfile.TemporaryDirectory(prefix="workloads-job-") as tmp:
        shutil.copytree(PACKAGE_DIR, Path(tmp) / "workloads",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        stage_files(Path(tmp), files)
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
        self.plan: Optional[dict] = None
        """The driver's plan record, once the job has logged it."""
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
            self.plan = plan
            kind = "GPU" if plan["use_gpu"] else "CPU"
            self.console.print(f"[bold cyan]job[/] {plan['num_workers']} {kind} workers on {plan['nodes']} node(s), "
                               f"run {plan['run_name']}")
            return
        said = line.find(DRIVER_PREFIX)
        if said >= 0 and plan is None:  # a message of the driver, not one of its records
            self.console.print(f"[bold cyan]job[/] {line[said + len(DRIVER_PREFIX):]}")
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


class FollowLostError(Exception):
    """Following a job failed for longer than the patience allowed (a port-forward that cannot be
    restored, say); the job runs on."""


class JobGoneError(Exception):
    """The cluster no longer knows a job it was running: its head restarted, and a head without GCS
    fault tolerance keeps no job, actor or node across a restart (the checkpoints in S3 remain)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id} is gone from the cluster: its Ray head restarted and kept no job")
        self.job_id = job_id


@dataclass
class _Shown:
    chars: int = 0
    """How much of the job's log the printer has had."""


async def _tail(client, job_id: str, printer: LogPrinter, shown: _Shown) -> None:
    """Feed the job's log to printer, leaving out what it has had already (the Jobs API streams a
    log from its start)."""
    seen = 0
    async for chunk in client.tail_job_logs(job_id):
        fresh = chunk[max(0, shown.chars - seen):]
        seen += len(chunk)
        if fresh:
            printer.feed(fresh)
            shown.chars = seen


def wait_terminal(client, job_id: str, *, poll_s: float = 0.5):
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        time.sleep(poll_s)


def _connection_errors() -> tuple[type[BaseException], ...]:
    """What the Jobs SDK raises when the way to the cluster breaks (a dropped port-forward, a head
    that restarts): its RuntimeErrors, requests' and aiohttp's connection errors."""
    import aiohttp

    return (RuntimeError, OSError, UnreachableError, aiohttp.ClientError)


def follow(client_factory: Callable[[], object], job_id: str, printer: LogPrinter, *, patience_s: float = 300.0,
           backoff_s: float = 2.0, sleep: Callable[[float], None] = time.sleep,
           clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = lambda message: None):
    """Stream the job's logs through printer until it ends; returns its terminal JobStatus.

    The log stream can break while the job runs on (the SDK's "WebSocket connection closed
    unexpectedly" when a port-forward drops, a head that restarts): fresh clients from
    `client_factory` (which may restart the port-forward) pick the stream up where it broke, for
    `patience_s` at most, then FollowLostError. When the cluster answers again but no longer knows the
    job, JobGoneError."""
    shown, attempt = _Shown(), 0
    lost_at: Optional[float] = None
    shown_when_lost = 0
    client = client_factory()
    client.get_job_status(job_id)  # a job id the cluster never had is the caller's mistake
    while True:
        try:
            if lost_at is not None:
                client.get_job_status(job_id)  # the cluster answers: does it still have the job?
            asyncio.run(_tail(client, job_id, printer, shown))
            status = wait_terminal(client, job_id)
            printer.flush()
            return status
        except _connection_errors() as exc:
            if "does not exist" in str(exc):
                raise JobGoneError(job_id) from None
            if lost_at is None or shown.chars > shown_when_lost:  # lost anew, after some progress
                lost_at, shown_when_lost, attempt = clock(), shown.chars, 0
            if clock() - lost_at >= patience_s:
                raise FollowLostError(first_line(str(exc)) or type(exc).__name__) from None
            attempt += 1
            say(f"lost the job's log stream ({first_line(str(exc)) or type(exc).__name__}); reconnecting "
                f"(attempt {attempt}, for up to {patience_s:.0f} s)")
            sleep(min(backoff_s * attempt, 15.0))
            try:
                client = client_factory()
            except _connection_errors() as again:
                say(f"could not reconnect yet: {first_line(str(again))}")


# --- the outcome --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GateOutcome:
    applies: bool
    passed: bool
    message: str
    name: str = "transport"
    """Which post-run check this is ("placement" or "transport")."""


def _plan(logs: str) -> Optional[dict]:
    return next((p for p in map(parse_driver_line, logs.splitlines()) if p and p.get("event") == "plan"), None)


def placement_check(logs: str) -> GateOutcome:
    """The ranks trained on the nodes the driver planned for (its node count is what the
    transport check expects): the loop's summary counts the nodes its ranks ran on."""
    plan, summary = _plan(logs), loop_summary(logs.splitlines())
    if plan is None or summary is None or "nodes" not in summary:
        return GateOutcome(applies=False, passed=True, name="placement",
                           message="placement check skipped: the job logged no plan or no summary")
    planned, trained = int(plan["nodes"]), int(summary["nodes"])
    if planned != trained:
        return GateOutcome(applies=True, passed=False, name="placement",
                           message=f"placement check failed: the driver planned {planned} node(s), "
                                   f"the ranks trained on {trained}")
    return GateOutcome(applies=True, passed=True, name="placement",
                       message=f"placement check passed: {summary.get('world_size', '?')} ranks trained on "
                               f"{trained} node(s), as planned")


def transport_check(logs: str, *, expect: Literal["efa", "any"]) -> GateOutcome:
    """The second gate: NCCL's connections as the job logs show them, judged offline."""
    from workloads.transport import verify

    plan = _plan(logs)
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
    checks: tuple[GateOutcome, ...] = ()
    """The post-run checks of a succeeded job: placement, then transport."""
    logs: str = field(default="", repr=False)
    """The job's whole log."""

    @property
    def exit_code(self) -> int:
        passed = self.status == "SUCCEEDED" and all(check.passed for check in self.checks)
        return EXIT_OK if passed else EXIT_FAILED


def finish(client, job_id: str, status, *, expect: Literal["efa", "any"]) -> JobOutcome:
    logs = client.get_job_logs(job_id)
    records = train_records(logs.splitlines())
    if str(status) != "SUCCEEDED":
        last = next((line.strip() for line in reversed(logs.splitlines()) if line.strip()), "")
        message = client.get_job_info(job_id).message or ""
        return JobOutcome(job_id=job_id, status=str(status), records=records, reason=last or message, logs=logs)
    return JobOutcome(job_id=job_id, status=str(status), records=records, logs=logs,
                      checks=(placement_check(logs), transport_check(logs, expect=expect)))


def report_outcome(outcome: JobOutcome, console: Console) -> None:
    if outcome.status != "SUCCEEDED":
        console.print(f"[bold red]job {outcome.job_id} {outcome.status}[/]: {outcome.reason}", highlight=False)
        return
    for check in outcome.checks:
        style = "bold red" if not check.passed else "green" if check.applies else "dim"
        console.print(f"[{style}]{check.message}[/]", highlight=False)
    failed = [check.name for check in outcome.checks if not check.passed]
    verdict = ("[bold green]SUCCEEDED[/]" if outcome.exit_code == EXIT_OK
               else f"[bold red]FAILED the {' and '.join(failed)} check[/]")
    console.print(f"job {outcome.job_id} {verdict}")


def reattach_hint(job_id: str, target_args: tuple[str, ...], *, why: str = "stopped following") -> str:
    target = shlex.join(target_args)
    return (f"{why}; job {job_id} keeps running.\n"
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
    gpus: int = 0
    """GPUs the job waits for before training (the stack's worker GPUs); 0: not known."""
    install: bool = True
    """Install GPU_PACKAGES into a GPU job's runtime_env (off for clusters that cannot reach PyPI)."""
    files: tuple[tuple[str, Path], ...] = ()
    """Local files and folders uploaded with the job: (place in its working_dir, local path)."""
    wait_nodes_s: Optional[float] = None
    """How long the job waits for a lost node to come back (None: the driver's default)."""
    resubmits: int = 3
    """How many times a job that the cluster lost with its head is submitted again."""
    workers: int = 0
    """CPU workers a run without GPUs waits for (set on a resubmission: the world size it had)."""


def submit_job(client, request: SubmitRequest, *, submission_id: Optional[str] = None) -> str:
    """Upload the staged package with the driver command; returns the job's submission id."""
    with staged_package(request.files) as working_dir:
        submission = build_submission(train=request.train, run_name=request.run_name,
                                      storage_path=request.storage_path, max_failures=request.max_failures,
                                      working_dir=str(working_dir), expect=request.expect, gpus=request.gpus,
                                      install=request.install, wait_nodes_s=request.wait_nodes_s,
                                      workers=request.workers)
        return client.submit_job(entrypoint=submission.entrypoint, runtime_env=submission.runtime_env,
                                 metadata=submission.metadata, submission_id=submission_id)


def _id_prefix(run_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", run_name) + "-job"


def submission_id(run_name: str, index: int) -> str:
    """The Jobs API submission id of the `index`-th job of a run on a cluster. Derived from the run
    name, so that a submitter finds its run's job again after a lost answer or connection."""
    return f"{_id_prefix(run_name)}{index}"


def _index_in(job_id: str, run_name: str) -> Optional[int]:
    prefix = _id_prefix(run_name)
    rest = job_id[len(prefix):] if job_id.startswith(prefix) else ""
    return int(rest) if rest.isdigit() else None


@dataclass(frozen=True, kw_only=True)
class Submitted:
    job_id: str
    attached: bool
    """The run's job was on the cluster already: running, or created by a request whose answer
    was lost. No second job was started."""
    index: int
    """Its place among the run's jobs on this cluster (the `jobN` of its id)."""


def submit_or_attach(new_client: Callable[[], object], request: SubmitRequest, *, first_index: int = 1,
                     attempts: int = 5, backoff_s: float = 2.0, sleep: Callable[[float], None] = time.sleep,
                     say: Callable[[str], None] = lambda message: None) -> Submitted:
    """The run's job on the cluster: the one already running (attached), else a new one under the
    next submission id of the run. A submission whose answer is lost to a network error is looked
    up by its id before it is sent again, so that one run never has two jobs."""
    client = new_client()
    run = request.run_name
    jobs = [job for job in client.list_jobs() if (job.metadata or {}).get("run_name") == run]
    live = sorted((job for job in jobs if not job.status.is_terminal()), key=lambda job: job.start_time or 0)
    if live:
        job_id = live[-1].submission_id
        return Submitted(job_id=job_id, attached=True, index=_index_in(job_id, run) or first_index)
    taken = [i for i in (_index_in(job.submission_id or "", run) for job in jobs) if i is not None]
    index = max([first_index, *(i + 1 for i in taken)])
    sent: set[str] = set()
    failures = 0
    while True:
        job_id = submission_id(run, index)
        resend = job_id in sent  # an earlier request for this id got no answer
        try:
            if resend and _job_exists(client, job_id):
                return Submitted(job_id=job_id, attached=True, index=index)
            sent.add(job_id)
            submit_job(client, request, submission_id=job_id)
            return Submitted(job_id=job_id, attached=False, index=index)
        except _connection_errors() as exc:
            if "already exists" in str(exc):
                if resend:  # that earlier request arrived after all
                    return Submitted(job_id=job_id, attached=True, index=index)
                other = client.get_job_info(job_id)
                if (other.metadata or {}).get("run_name") == run and not other.status.is_terminal():
                    return Submitted(job_id=job_id, attached=True, index=index)
                index += 1  # another submitter's job took the id since the list was read
                continue
            if isinstance(exc, RuntimeError) and not isinstance(exc, UnreachableError):
                raise  # the cluster answered and refused the job
            failures += 1
            if failures >= attempts:
                raise UnreachableError(f"could not submit run {run}: {first_line(str(exc))}") from None
            say(f"no answer to the submission of {job_id} ({first_line(str(exc)) or type(exc).__name__}); "
                f"asking the cluster whether it arrived ({failures}/{attempts - 1})")
            sleep(backoff_s * failures)
            try:
                client = new_client()
            except _connection_errors() as again:
                say(f"could not reconnect yet: {first_line(str(again))}")


def _job_exists(client, job_id: str) -> bool:
    try:
        client.get_job_info(job_id)
    except RuntimeError as exc:
        if "does not exist" in str(exc):
            return False
        raise
    return True


def same_world_size(request: SubmitRequest, plan: Optional[dict]) -> SubmitRequest:
    """The request of a run submitted again: its job waits for as many GPUs or CPU workers as its
    lost job had planned, so that it does not resume on the part of the cluster that is back first
    (the worker pods rejoin a restarted head after it)."""
    if plan is None:
        return request
    if plan["use_gpu"]:
        return dataclasses.replace(request, gpus=max(request.gpus, int(plan["num_workers"])))
    return dataclasses.replace(request, workers=int(plan["num_workers"]))


def submit_and_follow(conn: Connection, request: SubmitRequest, *, console: Console,
                      on_submitted: Callable[[str], None] = lambda job_id: None) -> JobOutcome:
    """Submit the driver (or attach to the run's job already on the cluster), follow it to the end
    and judge it. A job that the cluster loses with its head is submitted again, up to
    `request.resubmits` times: under the same run name it resumes from its latest checkpoint.
    KeyboardInterrupt propagates; `on_submitted` has had each job id by then."""
    new_client = client_factory(conn)
    say = lambda message: console.print(f"[yellow]{message}[/]")  # noqa: E731
    index, resubmitted = 1, 0
    while True:
        submitted = submit_or_attach(new_client, request, first_index=index, say=say)
        on_submitted(submitted.job_id)
        verb = "attached to" if submitted.attached else "submitted"
        console.print(f"[bold cyan]job[/] {verb} {submitted.job_id} on {conn.address} (run {request.run_name})")
        printer = LogPrinter(console=console, quiet=request.quiet, total_steps=request.train.get("steps"))
        try:
            status = follow(new_client, submitted.job_id, printer, say=say)
        except JobGoneError as gone:
            if resubmitted >= request.resubmits:
                raise
            resubmitted += 1
            index = submitted.index + 1
            request = same_world_size(request, printer.plan)
            say(f"{gone}; submitting run {request.run_name} again ({resubmitted} of {request.resubmits}), "
                "to resume from its latest checkpoint")
            continue
        return finish(job_client(conn, address=conn.current_address()), submitted.job_id, status,
                      expect=request.expect)


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
        parser.add_argument("--max-failures", type=int, default=1,
                            help="worker-group restarts after a lost worker or node (default: 1)")
        parser.add_argument("--wait-nodes-s", type=float,
                            help="how long the job waits for a lost node to come back before it fails "
                            "(default: 1200)")
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
    upload_absolute = bool(args.stack)  # the stack's nodes cannot see this machine's files
    files_for_job(_train_config(args, expect=expect, preset_name=args.preset or preset_for_gpu(None)),
                  cwd=Path.cwd(), upload_absolute=upload_absolute)
    if args.max_failures < 0:
        raise ValueError(f"--max-failures must be >= 0, got {args.max_failures}")
    if args.gpus is not None and args.gpus < 0:
        raise ValueError(f"--gpus must be >= 0, got {args.gpus}")
    if args.wait_nodes_s is not None and args.wait_nodes_s <= 0:
        raise ValueError(f"--wait-nodes-s must be > 0, got {args.wait_nodes_s:g}")
    if args.resubmits < 0:
        raise ValueError(f"--resubmits must be >= 0, got {args.resubmits}")
    with connect(stack=args.stack, address=args.address, token=args.token) as conn:
        preset_name = args.preset or preset_for_gpu(conn.gpu_memory_gib)
        train, files = files_for_job(_train_config(args, expect=expect, preset_name=preset_name),
                                     cwd=Path.cwd(), upload_absolute=upload_absolute)
        config_name = preset_name if args.config is None else args.config.stem
        run_name = args.run_name or f"{config_name}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
        storage_path = args.storage_path or conn.storage_path
        if not storage_path:
            raise ValueError("--storage-path is needed with --address (s3://bucket/prefix or an absolute folder)")
        if "://" not in storage_path and not storage_path.startswith("/"):
            raise ValueError(f"--storage-path {storage_path!r} must be a URI (s3://...) or an absolute folder "
                             "on the cluster's nodes")
        gpus = args.gpus if args.gpus is not None else conn.ray_worker_gpus or 0
        request = SubmitRequest(train=train, run_name=run_name, storage_path=storage_path,
                                max_failures=args.max_failures, expect=expect, quiet=args.quiet, gpus=gpus,
                                install=not args.offline, files=files, wait_nodes_s=args.wait_nodes_s,
                                resubmits=args.resubmits)
        if args.no_follow:
            submitted = submit_or_attach(client_factory(conn), request, say=lambda m: print(m, file=sys.stderr))
            if submitted.attached:
                print(f"run {run_name} is already on the cluster as job {submitted.job_id}", file=sys.stderr)
            print(submitted.job_id)
            return EXIT_OK
        job_ids: list[str] = []
        try:
            outcome = submit_and_follow(conn, request, console=console, on_submitted=job_ids.append)
        except KeyboardInterrupt:
            if job_ids:
                console.print(reattach_hint(job_ids[-1], conn.target_args))
            return EXIT_INTERRUPTED
        except FollowLostError as exc:
            console.print(reattach_hint(job_ids[-1], conn.target_args, why=f"lost the connection ({exc})"))
            return EXIT_DETACHED
        except JobGoneError as exc:
            console.print(f"[bold red]{exc}[/], {request.resubmits} time(s): giving up. Submitting again with "
                          f"--run-name {run_name} resumes the run from its latest checkpoint")
            return EXIT_FAILED
    report_outcome(outcome, console)
    return outcome.exit_code


def _logs(args: argparse.Namespace, console: Console) -> int:
    with connect(stack=args.stack, address=args.address, token=args.token) as conn:
        client = job_client(conn)
        if not args.follow:
            sys.stdout.write(client.get_job_logs(args.job_id))
            return EXIT_OK
        try:
            status = follow(client_factory(conn), args.job_id, LogPrinter(console=console, quiet=False),
                            say=lambda m: console.print(f"[yellow]{m}[/]"))
        except KeyboardInterrupt:
            console.print(reattach_hint(args.job_id, conn.target_args))
            return EXIT_INTERRUPTED
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
