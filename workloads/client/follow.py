"""Following a submitted job: its log printed as progress, a dropped connection restored, a job the
cluster lost with its head told apart from a lost connection."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import shlex
import time
from dataclasses import dataclass
from typing import Callable, Optional

from rich.console import Console
from rich.markup import escape

from workloads.client.cluster import UnreachableError, first_line
from workloads.client.report import format_data, format_method, format_record, parse_prefixed, parse_train_line
from workloads.context import DATA_PREFIX, GATE_PREFIX, METHOD_PREFIX, TRACKING_PREFIX
from workloads.launch.driver import DRIVER_PREFIX, parse_driver_line

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
        # Ray Train forwards each worker line to the job logs twice, and two records' copies may
        # interleave (A, B, A, B): a record is shown once however far its copy comes after it.
        self._shown_records: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tracking_shown: set[str] = set()

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
        if self._tracking(line):
            return
        method = parse_prefixed(line, METHOD_PREFIX)
        if method is not None:
            self.console.print(f"[bold cyan]method[/] {format_method(method)}", highlight=False)
            return
        data = parse_prefixed(line, DATA_PREFIX)
        if data is not None and self._data(data):
            return
        plan = parse_driver_line(line)
        if plan is not None and plan.get("event") == "plan":
            self.plan = plan
            kind = "GPU" if plan["use_gpu"] else "CPU"
            self.console.print(f"[bold cyan]job[/] {plan['num_workers']} {kind} workers on {plan['nodes']} node(s), "
                               f"run {plan['run_name']}")
            # What the next tens of seconds go to, which print nothing until the gate's verdict.
            self.console.print("[bold cyan]job[/] starting the workers: each imports torch and joins the process "
                               "group, then the transport gate runs")
            return
        said = line.find(DRIVER_PREFIX)
        if said >= 0 and plan is None:  # a message of the driver, not one of its records
            self.console.print(f"[bold cyan]job[/] {line[said + len(DRIVER_PREFIX):]}")
            return
        if not self.quiet:
            self.console.out(line, highlight=False)

    def _data(self, data: dict) -> bool:
        """The loop's `[data]` record: what the records became, and a note when the run reads them more
        than once (both shown also when quiet). False for synthetic tokens, which it says nothing of."""
        text, note = format_data(data), data.get("note")
        if text is not None:
            style = "yellow" if data.get("truncated") or data.get("dropped") else "default"
            self.console.print(f"[bold cyan]data[/] [{style}]{text}[/]", highlight=False)
        if note:
            self.console.print(f"[bold cyan]data[/] [yellow]{escape(str(note))}[/]", highlight=False)
        return text is not None or bool(note)

    def _tracking(self, line: str) -> bool:
        """Rank 0's tracker lines: the run it logs to, and its warnings (shown also when quiet)."""
        at = line.find(TRACKING_PREFIX)
        if at < 0:
            return False
        if line[at:] in self._tracking_shown:
            return True
        self._tracking_shown.add(line[at:])
        run = parse_prefixed(line, TRACKING_PREFIX)
        if run is not None:
            again = " (continued)" if run.get("continued") else ""
            self.console.print(f"[bold cyan]tracking[/] run {run.get('run_id')}{again} in experiment "
                               f"{run.get('experiment')} at {run.get('uri')}", highlight=False)
        else:
            self.console.print(f"[bold cyan]tracking[/] [yellow]{line[at + len(TRACKING_PREFIX):]}[/]",
                               highlight=False)
        return True

    def _is_repeat(self, line: str) -> bool:
        keyed = (parse_train_line(line) is not None or self._gate_prefix in line or DATA_PREFIX in line
                 or METHOD_PREFIX in line)
        if not keyed:
            return False
        if line in self._shown_records:
            return True
        self._shown_records[line] = None
        if len(self._shown_records) > SHOWN_RECORDS_KEPT:
            self._shown_records.popitem(last=False)
        return False


SHOWN_RECORDS_KEPT = 4096
"""Records a printer remembers to drop their forwarded copies: far more than come between a line
and its copy, few enough that following a long run holds little."""


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
    log from its start). The stream is closed here, on this loop, however the feeding ends: an
    interruption raised while a chunk is printed would otherwise leave it to the generator's
    finalizer, which schedules its closing on a loop about to be closed."""
    seen = 0
    async with contextlib.aclosing(client.tail_job_logs(job_id)) as chunks:
        async for chunk in chunks:
            fresh = chunk[max(0, shown.chars - seen):]
            seen += len(chunk)
            if fresh:
                printer.feed(fresh)
                shown.chars = seen


def _run_interruptibly(coro) -> None:
    """Run `coro` to its end on an event loop of its own, where Ctrl-C raises KeyboardInterrupt at
    once. `asyncio.run` would only cancel the task on a first Ctrl-C, and a task that ends without the
    cancellation reaching it (a library's cleanup that swallows it) returns normally: the interrupt
    would be lost and following would go on (tests/test_submit.py has such a stream).

    An interruption arrives while the task waits inside the log stream (Ray's `tail_job_logs`, an
    async generator over an aiohttp session): the task is cancelled and run to its end on this loop
    first, which closes the generator and its session, before the interruption goes on. Left to
    `shutdown_asyncgens`, the generator, still running, cannot be closed ("aclose(): asynchronous
    generator is already running"), and the session's transports are closed after the loop ("Event
    loop is closed", "Unclosed client session")."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    try:
        loop.run_until_complete(task)
    except BaseException:
        _cancel_and_wait(loop, task)
        raise
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


CLOSE_WAIT_S = 5.0
"""How long an interrupted log stream may take to close its connection."""


def _cancel_and_wait(loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
        loop.run_until_complete(asyncio.wait({task}, timeout=CLOSE_WAIT_S))
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: the interruption is what goes on, not the stream's own ending


def wait_terminal(client, job_id: str, *, poll_s: float = 0.5):
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status
        time.sleep(poll_s)


def connection_errors() -> tuple[type[BaseException], ...]:
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
            _run_interruptibly(_tail(client, job_id, printer, shown))
            status = wait_terminal(client, job_id)
            printer.flush()
            return status
        except connection_errors() as exc:
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
            except connection_errors() as again:
                say(f"could not reconnect yet: {first_line(str(again))}")



def reattach_hint(job_id: str, target_args: tuple[str, ...], *, why: str = "stopped following") -> str:
    target = shlex.join(target_args)
    return (f"{why}; job {job_id} keeps running.\n"
            f"  reattach: python -m workloads logs --follow {job_id} {target}\n"
            f"  stop:     python -m workloads stop {job_id} {target}")

