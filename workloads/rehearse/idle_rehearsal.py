"""Idle to zero, rehearsed on this machine: `python -m workloads.rehearse.idle_rehearsal [--idle-s S]
[--steps N] [--out DIR]`.

A local Ray cluster with Ray's own autoscaler (v2) and no worker node
(workloads/local/autoscaling.py) takes the demo's job, the `demo-cpu` preset for a few steps
on two 1-CPU workers, through the same client code as `python -m workloads submit`. The job's driver
asks for its two workers, the autoscaler starts two worker nodes, the job trains and ends, and once
the nodes have been idle for `--idle-s` the autoscaler removes them again. The timeline says when
each of that happened, from the submission; DIR/summary.json keeps it. Exit 0 when the cluster
went from no worker to two, trained, passed the post-run checks and went back to no worker.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from rich.console import Console

from workloads.periodic import Periodic

DEMO_WORKERS = 2


@dataclass
class Timeline:
    """Seconds from the submission to each event, as the watcher saw it (polling every 0.5 s)."""

    events: list[tuple[float, str]] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)

    def mark(self, what: str) -> float:
        at = time.monotonic() - self.start
        self.events.append((round(at, 1), what))
        return at

    def first(self, prefix: str) -> Optional[float]:
        return next((at for at, what in self.events if what.startswith(prefix)), None)


@dataclass(frozen=True, kw_only=True)
class RehearsalResult:
    status: str
    exit_code: int
    idle_s: float
    workers_at_start: int
    most_workers: int
    workers_at_end: int
    idle_to_training_s: Optional[float]
    """From the submission to the first training step."""
    training_to_idle_s: Optional[float]
    """From the end of training (Ray Train's worker group ended: the nodes are idle from then) to no
    worker node left."""
    events: list[tuple[float, str]]
    checks: list[str]
    gcs_port: int
    """The rehearsal cluster's GCS port: every process of its nodes names 127.0.0.1:<port>."""
    watcher: dict = field(default_factory=dict)
    """What the watcher did (workloads/periodic.py's record): its timeline stops where it stopped."""


class Watcher:
    """One look at the cluster per pass (workloads/periodic.py runs it every 0.5 s): marks the worker
    nodes' count and the job's first plan and step lines as they appear."""

    def __init__(self, cluster, timeline: Timeline, job: list[str], client_factory) -> None:
        self.cluster, self.timeline, self.job, self.client_factory = cluster, timeline, job, client_factory
        self.count, self.seen, self.client = 0, set(), None

    def look(self) -> None:
        from workloads.client.report import parse_train_line
        from workloads.launch.driver import parse_driver_line

        now = len(self.cluster.workers())
        if now != self.count:
            self.timeline.mark(f"worker nodes: {now}")
            self.count = now
        if self.job and "finished" not in self.seen:
            try:
                self.client = self.client or self.client_factory()
                lines = self.client.get_job_logs(self.job[0]).splitlines()
            except Exception:  # the watcher only looks: a failed read waits for the next
                lines = []
            events = {(parse_driver_line(line) or {}).get("event") for line in lines}
            for event, what in (("plan", "the driver planned its workers"), ("step", "first training step"),
                                ("finished", "training finished (the workers' group ended)")):
                if event not in self.seen and (event in events if event != "step"
                                               else any(parse_train_line(line) for line in lines)):
                    self.timeline.mark(what)
                    self.seen.add(event)


def rehearse(*, out: Path, idle_s: float = 20.0, steps: int = 6, console: Optional[Console] = None,
             back_to_zero_s: Optional[float] = None, say: Callable[[str], None] = print) -> RehearsalResult:
    """Run the rehearsal; `back_to_zero_s` bounds the wait for the nodes to go (default: the idle
    time plus 90 s)."""
    from workloads.client import submit
    from workloads.client.cluster import client_factory, connect
    from workloads.local import demo
    from workloads.local.run import local_train_config
    from workloads.local.autoscaling import AutoscalingSpec, local_autoscaling_cluster
    from workloads.client.submission import SubmitRequest

    console = console or Console(highlight=False, soft_wrap=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = (out / stamp).resolve()
    overrides = [f"steps={steps}", "log_every=1", "eval_every=0", "checkpoint_every=0", "export_model=false"]
    train, inputs = local_train_config(argparse.Namespace(preset="demo-cpu", set=overrides, nodes=DEMO_WORKERS,
                                                          cpus_per_node=1), run_dir)
    demo.write_demo_inputs(inputs)  # the toy model and chats, as `make demo` makes them
    spec = AutoscalingSpec(max_nodes=DEMO_WORKERS, cpus_per_node=1, idle_timeout_s=idle_s)
    with local_autoscaling_cluster(spec, log_dir=run_dir / "ray", say=say) as cluster:
        gcs_port = cluster.nodes.gcs_port
        at_start = len(cluster.workers())
        say(f"Jobs API at {cluster.address}; worker nodes: {at_start}")
        with connect(stack=None, address=cluster.address, token=cluster.token) as conn:
            request = SubmitRequest(train=train, run_name=f"idle-{stamp}", storage_path=str(run_dir / "checkpoints"),
                                    max_failures=0, expect="any", quiet=True, workers=DEMO_WORKERS)
            timeline, job = Timeline(), []
            watcher = Periodic(Watcher(cluster, timeline, job, client_factory(conn)).look, every_s=0.5,
                               name="idle-watch", clock=lambda: round(time.monotonic() - timeline.start, 1),
                               on_error=lambda error: say(f"warning: the watcher's look at {error.at_s} s failed "
                                                          f"({error.error}); the next one runs")).start()

            def submitted(job_id: str) -> None:
                job.append(job_id)
                timeline.mark(f"submitted {job_id}")

            try:
                outcome = submit.submit_and_follow(conn, request, console=console, on_submitted=submitted)
                ended = timeline.mark(f"job {outcome.status}")
                deadline = time.monotonic() + (back_to_zero_s or idle_s + 90)
                while cluster.workers() and time.monotonic() < deadline:
                    time.sleep(0.5)
                time.sleep(1.0)  # the watcher's last look
            finally:
                watcher.stop(timeout_s=10)
            at_end = len(cluster.workers())
    counts = [int(what.split(": ")[1]) for _, what in timeline.events if what.startswith("worker nodes: ")]
    zero = next((at for at, what in reversed(timeline.events) if what == "worker nodes: 0"), None)
    first_step = timeline.first("first training step")
    idle_from = timeline.first("training finished") or ended
    result = RehearsalResult(
        status=outcome.status, exit_code=outcome.exit_code, idle_s=idle_s, workers_at_start=at_start,
        most_workers=max([at_start, *counts]), workers_at_end=at_end,
        idle_to_training_s=round(first_step, 1) if first_step is not None else None,
        training_to_idle_s=round(zero - idle_from, 1) if zero is not None and zero >= ended else None,
        events=timeline.events, checks=[check.message for check in outcome.checks], gcs_port=gcs_port,
        watcher=watcher.record())
    (run_dir / "summary.json").write_text(json.dumps(asdict(result), indent=1))
    (run_dir / "job.log").write_text(outcome.logs)
    return result


def format_result(result: RehearsalResult) -> str:
    lines = [f"{at:7.1f} s  {what}" for at, what in result.events]
    lines.append(f"idle to training: {result.idle_to_training_s} s (submission to the first step, from "
                 f"{result.workers_at_start} worker nodes)")
    lines.append(f"training to idle: {result.training_to_idle_s} s (the end of training to no worker node; "
                 f"idle timeout {result.idle_s:g} s)")
    lines.extend(result.checks)
    if (stopped := result.watcher.get("stopped")) is not None:
        lines.append(f"the watcher stopped at {stopped['at_s']} s: {stopped['error']} (the timeline ends there)")
    return "\n".join(lines)


def passed(result: RehearsalResult) -> bool:
    return (result.exit_code == 0 and result.watcher.get("stopped") is None
            and result.workers_at_start == 0 and result.most_workers == DEMO_WORKERS
            and result.workers_at_end == 0 and result.idle_to_training_s is not None
            and result.training_to_idle_s is not None)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.rehearse.idle_rehearsal",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-s", type=float, default=20.0, help="the autoscaler's idle timeout (default 20)")
    parser.add_argument("--steps", type=int, default=6, help="training steps of the demo-cpu job (default 6)")
    parser.add_argument("--out", type=Path, default=Path("runs/idle-rehearsal"), help="where the runs go")
    args = parser.parse_args(argv)
    result = rehearse(out=args.out, idle_s=args.idle_s, steps=args.steps)
    print(format_result(result))
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())
