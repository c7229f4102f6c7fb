"""A run's jobs on a cluster: one at a time, under submission ids derived from the run name.

`submit` of a run whose job is already running attaches to that job, and a submission whose answer
was lost is looked up before it is sent again. A job that the cluster lost with a restarted head is
submitted again, and resumes from its latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

from rich.console import Console

from workloads.client.cluster import Connection, UnreachableError, client_factory, first_line, job_client
from workloads.client.follow import JobGoneError, LogPrinter, connection_errors, follow
from workloads.client.outcome import JobOutcome, finish
from workloads.client.submission import SubmitRequest, submit_job


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


NO_AGENT = "No available agent to submit job"
"""The Jobs API's answer (HTTP 500) while the head's job agent has not registered yet: the head's
dashboard answers before its agent does, for seconds on a busy machine."""
AGENT_WAIT_S = 120.0
"""How long a submission waits for the head's job agent, as the client waits for the head itself."""


def submit_or_attach(new_client: Callable[[], object], request: SubmitRequest, *, first_index: int = 1,
                     attempts: int = 5, backoff_s: float = 2.0, sleep: Callable[[float], None] = time.sleep,
                     say: Callable[[str], None] = lambda message: None, agent_wait_s: float = AGENT_WAIT_S,
                     clock: Callable[[], float] = time.monotonic) -> Submitted:
    """The run's job on the cluster: the one already running (attached), else a new one under the
    next submission id of the run. A submission whose answer is lost to a network error is looked
    up by its id before it is sent again, so that one run never has two jobs; one the head refuses
    because its job agent is not up yet is sent again once it is, for `agent_wait_s` at most."""
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
    agent_since: Optional[float] = None
    while True:
        job_id = submission_id(run, index)
        resend = job_id in sent  # an earlier request for this id got no answer
        try:
            if resend and _job_exists(client, job_id):
                return Submitted(job_id=job_id, attached=True, index=index)
            sent.add(job_id)
            submit_job(client, request, submission_id=job_id)
            return Submitted(job_id=job_id, attached=False, index=index)
        except connection_errors() as exc:
            if "already exists" in str(exc):
                if resend:  # that earlier request arrived after all
                    return Submitted(job_id=job_id, attached=True, index=index)
                other = client.get_job_info(job_id)
                if (other.metadata or {}).get("run_name") == run and not other.status.is_terminal():
                    return Submitted(job_id=job_id, attached=True, index=index)
                index += 1  # another submitter's job took the id since the list was read
                continue
            if NO_AGENT in str(exc):  # it never reached a job agent: the same id is free
                if agent_since is None:
                    agent_since = clock()
                    say("the cluster's job agent is not up yet; waiting for it")
                if clock() - agent_since >= agent_wait_s:
                    raise UnreachableError(f"the cluster's head answers but its job agent did not come up within "
                                           f"{agent_wait_s:.0f} s ({first_line(str(exc))}): see the head's "
                                           "dashboard_agent.log") from None
                sleep(backoff_s)
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
            except connection_errors() as again:
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

