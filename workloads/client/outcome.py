"""A finished job judged: its status, then the placement and transport checks of a succeeded job,
and the exit code the commands return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from rich.console import Console

from workloads.client.report import loop_summary, parse_prefixed, train_records
from workloads.context import GATE_PREFIX
from workloads.train.evaluation_config import EXIT_GATE_FAILED
from workloads.launch.driver import parse_driver_line

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_DETACHED, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
EXIT_EVALUATION_GATE = EXIT_GATE_FAILED
"""5: trained and checkpointed, but the tuned model missed its evaluation gate (evaluate.gate)."""


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
    transport check expects): the loop's summary counts the nodes its last attempt's ranks ran on.
    An elastic run (--min-nodes) passes on any node count from its minimum to the plan's: it may
    rightly end on fewer nodes after a node was lost."""
    plan, summary = _plan(logs), loop_summary(logs.splitlines())
    if plan is None or summary is None or "nodes" not in summary:
        return GateOutcome(applies=False, passed=True, name="placement",
                           message="placement check skipped: the job logged no plan or no summary")
    planned, trained = int(plan["nodes"]), int(summary["nodes"])
    workers, min_workers = int(plan.get("num_workers") or 0), int(plan.get("min_workers") or 0)
    fewest = planned * min_workers // workers if workers and 0 < min_workers < workers else planned
    ranks = summary.get("world_size", "?")
    if not fewest <= trained <= planned:
        allowed = f"{fewest} to {planned}" if fewest < planned else f"{planned}"
        return GateOutcome(applies=True, passed=False, name="placement",
                           message=f"placement check failed: the driver planned {allowed} node(s), "
                                   f"the ranks trained on {trained}")
    if trained < planned:
        return GateOutcome(applies=True, passed=True, name="placement",
                           message=f"placement check passed: {ranks} ranks trained on {trained} node(s) at the end, "
                                   f"within the elastic run's {fewest} to {planned}")
    return GateOutcome(applies=True, passed=True, name="placement",
                       message=f"placement check passed: {ranks} ranks trained on {trained} node(s), as planned")


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
    summary = loop_summary(logs.splitlines())
    if summary is not None and int(summary.get("world_size") or 0) == 1 < int(plan.get("num_workers") or 0):
        return _ended_on_one_rank(logs, expect=expect)
    verdict = verify.verify_transport(logs, expect=expect, nodes=plan["nodes"])
    return GateOutcome(applies=True, passed=verdict.status == verify.Status.PASS,
                       message=verify.render(verdict))


def _ended_on_one_rank(logs: str, *, expect: Literal["efa", "any"]) -> GateOutcome:
    """An elastic run whose last attempt trained on one rank: NCCL made no connection then, and the
    ranks print their NCCL logs only when an attempt ends, which a drained or lost node's attempts
    never do, so the job log holds no connection to judge. Each start of more than one rank ran the
    in-band gate with the job's expectation, which stops the run when it fails: its verdicts are the
    run's, if they judged this expectation."""
    gates = [g for g in (parse_prefixed(line, GATE_PREFIX) for line in logs.splitlines()) if g and g.get("applies")]
    if not gates:
        return GateOutcome(applies=True, passed=False,
                           message="transport check failed: the run ended on one rank, and no start of more than one "
                                   "rank logged a transport gate verdict")
    wrong = [g for g in gates if not g.get("passed") or f"(expect {expect};" not in str(g.get("message"))]
    if wrong:
        return GateOutcome(applies=True, passed=False,
                           message=f"transport check failed: the run ended on one rank, and a start's in-band gate "
                                   f"did not pass expecting {expect}: {wrong[0].get('message')}")
    return GateOutcome(applies=True, passed=True,
                       message=f"transport check passed: the run ended on one rank (no NCCL connection to log); the "
                               f"in-band gate passed at every start of more than one rank, the last: "
                               f"{gates[-1].get('message')}")


def evaluation_check(logs: str) -> GateOutcome:
    """The stage after training (workloads/evaluate): its gate, when the run set one."""
    from workloads.evaluate.report import evaluation_from_logs, gate_summary

    record = evaluation_from_logs(logs)
    if record is None:
        return GateOutcome(applies=False, passed=True, name="evaluation",
                           message="evaluation: none (evaluate.tasks is empty, or nothing could be evaluated)")
    return GateOutcome(applies=bool(record.get("gate")), passed=bool(record.get("passed", True)), name="evaluation",
                       message=gate_summary(record))


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
        if not passed and self.status == "SUCCEEDED" and all(
                check.passed for check in self.checks if check.name != "evaluation"):
            return EXIT_EVALUATION_GATE
        return EXIT_OK if passed else EXIT_FAILED


def finish(client, job_id: str, status, *, expect: Literal["efa", "any"]) -> JobOutcome:
    logs = client.get_job_logs(job_id)
    records = train_records(logs.splitlines())
    if str(status) != "SUCCEEDED":
        last = next((line.strip() for line in reversed(logs.splitlines()) if line.strip()), "")
        message = client.get_job_info(job_id).message or ""
        return JobOutcome(job_id=job_id, status=str(status), records=records, reason=last or message, logs=logs)
    return JobOutcome(job_id=job_id, status=str(status), records=records, logs=logs,
                      checks=(placement_check(logs), transport_check(logs, expect=expect), evaluation_check(logs)))


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

