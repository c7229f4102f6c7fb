"""A soak: one long run on the local cluster in the EKS shape that meets a fault every few minutes,
at random points: `python -m workloads.bench.soak --minutes 30 --out DIR [--seed N]`.

The cluster is `workloads.client.local`'s (a head that runs no training worker, two worker nodes of
one CPU), checkpoints go to moto's S3 server and the run is tracked in a real `mlflow server`
(workloads/bench/services.py). The run is the user's command, `python -m workloads submit`, with the
demo-cpu preset on two gloo workers; the faults come in a seeded random order, each at a seeded
random step (the seed is printed):

  worker-kill       a Ray Train worker SIGKILLed, a random moment after the step
  node-drain        a worker node's `ray start --block` SIGTERMed, as the kubelet does on EKS's drain
                    of a Spot node: the loop checkpoints on the notice; once the node is gone it is
                    started again, as the node group replaces it (the run is not elastic: it waits)
  head-restart      every process of the head (and, without GCS fault tolerance, of the worker
                    nodes) killed and started again: `submit` submits the run again
  tracker-down      the MLflow server killed, and started again after the outage
  storage-down      the S3 server stopped, and started again after the outage; it stops as the run
                    reaches a checkpoint, so that the outage always meets one
  save-interrupted  a rank SIGKILLed while it uploads its part of a checkpoint (the pause point
                    `checkpoint-upload`, workloads/launch/faults.py)

A fault comes once the run trains again after the one before; after the last, the run is held (rank 0
paused) until the memory of each role's newest process can be judged, if it could not be yet. Checked and recorded in DIR: each
step's loss against an uninterrupted run of the same settings (torchrun, the same loop without Ray);
the steps each fault cost against its allowance; the resident memory of the driver, the head and the
workers every few seconds, which must not grow beyond warm-up; no process of the job left once it
ended, nor of the cluster once it stopped, nor a new shared-memory segment; the bytes in the bucket,
bounded by the checkpoints kept; the run's MLflow record (every step's loss, the end status).
A progress line every 30 s gives the step, the attempt, the memory per role and the bucket.
DIR/summary.json holds it all, DIR/soak.png plots the loss with the faults marked and the memory.
Exit 0 when every check passed; otherwise 1, after a line `FAILED <check>: <what>` for each check
that did not hold. docs/RELIABILITY.md, section 8, records a 30-minute soak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from workloads.rehearse.cluster_processes import (ROLES, Process, alive, cluster_processes, shared_memory_left,
                                                  train_worker_pids)
from workloads.rehearse.soak_checks import JUDGED_ROLES, OUTAGES, failed_lines, judge, judgeable_at, tracked_losses
from workloads.rehearse.soak_record import Reference, write_record
from workloads.client.report import WORKER_PID, parse_prefixed, parse_train_line
from workloads.periodic import Periodic

if TYPE_CHECKING:
    from workloads.rehearse.services import MlflowServer, S3Server
    from workloads.local.run import LocalCluster

FAULT_KINDS = ("worker-kill", "node-drain", "head-restart", "tracker-down", "storage-down", "save-interrupted")
STORAGE_PAUSE_S = 2.0
"""Rank 0 waits this long after the step before a checkpoint while the storage goes down."""
NODE_WAIT = "waiting for a lost node"
"""The job's line while its workers cannot be placed (workloads/launch/ray_train.py WorkerGroupWait)."""
WAIT_NODES_S = 60.0
"""The run's --wait-nodes-s: its first wait line comes after a sixth of it (one start of the group)."""
TRACKING_BACK = "answers again after"
"""Rank 0's tracker line once the tracker takes records again (workloads/train/tracking.py)."""
BUCKET, PREFIX = "soak", "runs"
"""The run's checkpoints are under s3://BUCKET/PREFIX/<run name>/ (the CLI's bucket)."""

CLUSTER_ENV = {
    # A lost raylet is declared dead after 5 failed checks of its health, 0.5 s apart (Ray's default: ~30 s).
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_initial_delay_ms": "1000",
    # A SIGTERMed worker node drains for this long (95 s on EKS Spot nodes, infra/spot.py; Ray's
    # default 30 s), and Ray Train's watcher looks for a drain every second (5 s by default).
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "20",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
}
"""The Ray settings of a local cluster that meets faults (tests/test_cluster_faults.py's too): set in
the environment before its nodes start."""
POLL_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
"""Ray Train's controller takes a worker's report when it polls, every 2 s by default, and a worker
holds one report: a run that reports every step, as this one does, would train a step per 2 s."""


HOLD_STEPS_LEFT = 6
"""Steps the run must have left for the hold before its end (the job logs lag a few steps behind)."""


class RunEnded(Exception):
    """The run ended before a fault could be brought."""


def say(message: str) -> None:
    print(f"[soak] {message}", flush=True)


@dataclass(frozen=True, kw_only=True)
class SoakSettings:
    steps: int
    """Training steps of the run."""
    faults: int
    """Faults it meets, spread over its steps; the first six are one of each kind."""
    seed: int
    """Chooses the faults' order, steps, targets and moments."""
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    tracker_down_s: float = 60.0
    """How long the tracker is down."""
    storage_down_s: float = 60.0
    """How long the storage is down: beyond about 15 s (two tries of each rank's part, each with
    pyarrow's own retries) the checkpoint it meets is skipped rather than stored late."""
    warmup_steps: int = 20
    """Steps trained before the first fault."""
    run_name: str = "soak"
    sample_every_s: float = 5.0
    """How often memory and the bucket are read."""
    progress_every_s: float = 30.0
    """How often a progress line is printed (the step, the memory per role, the bucket)."""
    drain_timeout_s: float = 20.0
    """The worker nodes' drain on SIGTERM (CLUSTER_ENV)."""
    memory_warmup_s: float = 60.0
    """A process's first seconds (imports, the model, the first steps, the allocator's pools) are
    left out of its memory growth; a train worker's count from its attempt's first step, since
    starting a worker group can take a minute when the cluster was just restarted."""
    memory_judged_after_s: float = 90.0
    """A process's memory is judged when it lived this long after its warm-up (shorter lives show no
    trend)."""
    memory_growth_limit_mib: float = 64.0
    """Growth allowed to a process's resident memory after its warm-up, over its life."""

    def __post_init__(self) -> None:
        if self.steps < self.warmup_steps + 2 * max(self.faults, 1):
            raise ValueError(f"steps={self.steps} leaves too few steps for {self.faults} faults after "
                             f"{self.warmup_steps} warm-up steps: give more steps or fewer faults")
        if self.faults < 1:
            raise ValueError(f"faults must be at least 1, got {self.faults}")

    def overrides(self) -> list[str]:
        """The run's config over the demo-cpu preset (the reference's too)."""
        return [f"steps={self.steps}", f"checkpoint_every={self.checkpoint_every}", "log_every=1",
                "preemption_check_every=1", "eval_every=0", "transport.expect=any"]


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    kind: str
    step: int
    """It comes once the run has trained this step (or at once, if it is past it by then)."""
    target: int
    """The worker (by its place in the State API's list), node (1 or 2) or rank it hits."""
    delay_s: float
    """How long after the step it comes, for the faults that land at any moment."""
    in_window: bool = False
    """A head restart in the registration window of a checkpoint: every rank's part uploaded, the
    head not yet told (a rank waits at the pause point `checkpoint-uploaded`), rather than at any
    moment."""


def plan_faults(settings: SoakSettings) -> list[PlannedFault]:
    """Each kind once, in a random order, then random kinds; each in its own stretch of the steps
    after warm-up (the last tenth left fault-free), at a random step of it."""
    rng = random.Random(settings.seed)
    kinds = rng.sample(FAULT_KINDS, len(FAULT_KINDS))[:settings.faults]
    kinds += [rng.choice(FAULT_KINDS) for _ in range(settings.faults - len(kinds))]
    first, last = settings.warmup_steps, int(settings.steps * 0.9)
    width = (last - first) / settings.faults
    planned = []
    for index, kind in enumerate(kinds):
        start = int(first + index * width)
        step = rng.randint(start, max(start, int(first + (index + 1) * width) - 1))
        target = rng.randint(1, 2) if kind == "node-drain" else rng.randint(0, 1)
        planned.append(PlannedFault(kind=kind, step=step, target=target, delay_s=round(rng.uniform(0.0, 2.0), 2),
                                    in_window=kind == "head-restart" and rng.random() < 0.5))
    return planned


class JobLogs:
    """The run's job logs as Ray writes them on the head (job-driver-<submission id>.log in each
    session's logs folder; a restarted head starts a new session, and the files of the old one
    stay on this machine's disk), read as they grow. Each training attempt is known by its rank 0's
    process (workloads.client.report.attempts)."""

    def __init__(self, temp_dir: Path, run: str) -> None:
        self.temp_dir, self.run = temp_dir, run
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, str] = {}
        self.lines: list[str] = []
        self.attempt_pids: list[int] = []
        """Rank 0's process of each attempt that trained a step, in order."""
        self.steps: dict[int, list[int]] = {}
        """The steps each attempt (by its pid) logged, in order."""

    def _session_logs(self, pattern: str) -> list[Path]:
        """The files of each head's session that match, never through `session_latest`: that link
        names the newest session, so a file would be read twice (under two paths), and a restarted
        head moves it between a glob and an open (a soak in a full test run failed on that, reading
        job1's log where the new session had none)."""
        return [path for path in self.temp_dir.glob(f"session_*/logs/{pattern}")
                if not path.parent.parent.is_symlink()]

    def files(self) -> list[Path]:
        found = self._session_logs(f"job-driver-{self.run}-job*.log")
        return sorted(found, key=lambda p: int(p.stem.rsplit("-job", 1)[1]))

    def read(self) -> None:
        for path in self.files():
            with path.open("rb") as stream:
                stream.seek(self.offsets.get(path, 0))
                chunk = stream.read()
            self.offsets[path] = self.offsets.get(path, 0) + len(chunk)
            *complete, rest = (self.partial.get(path, "") + chunk.decode(errors="replace")).split("\n")
            self.partial[path] = rest
            for line in complete:
                self._add(line)

    def _add(self, line: str) -> None:
        self.lines.append(line)
        record = parse_train_line(line)
        process = WORKER_PID.search(line)
        if record is None or process is None:
            return
        pid = int(process.group(1))
        if pid not in self.steps:
            self.attempt_pids.append(pid)
            self.steps[pid] = []
        if int(record["step"]) not in self.steps[pid]:
            self.steps[pid].append(int(record["step"]))

    def latest_step(self) -> int:
        return self.steps[self.attempt_pids[-1]][-1] if self.attempt_pids else 0

    def last_trained(self, pid: int) -> int:
        """The last step attempt `pid` logged, read from its rank 0's own output file on its node
        (worker-<id>-<job>-<pid>.out in the session's logs), which keeps the lines that the head's
        log monitor had not yet forwarded into the job log when a fault took the head down."""
        found = [int(record["step"]) for path in self._session_logs(f"worker-*-{pid}.out")
                 for line in path.read_text(errors="replace").splitlines()
                 if (record := parse_train_line(line)) is not None]
        return max([*found, *self.steps.get(pid, [0])])

    def records(self, prefix: str) -> list[dict]:
        """The JSON records after `prefix` in the lines, once each (Ray forwards a worker line twice)."""
        seen, found = set(), []
        for line in self.lines:
            record = parse_prefixed(line, prefix)
            key = json.dumps(record, sort_keys=True)
            if record is not None and key not in seen:
                seen.add(key)
                found.append(record)
        return found


@dataclass
class FaultEvent:
    kind: str
    planned_step: int
    target: int
    step: int = 0
    """The latest step the run had logged when the fault came."""
    at_s: float = 0.0
    """When it came, seconds from the start of the run."""
    back_s: Optional[float] = None
    """When what it took away was back (a service, a node, the head)."""
    trained_again_s: Optional[float] = None
    """When the run logged a step again after it."""
    attempt_before: Optional[int] = None
    """The attempt it hit (its rank 0's pid)."""
    attempts_seen: int = 0
    """How many attempts had trained a step when it came."""
    attempt_after: Optional[int] = None
    """The attempt that followed (None for an outage the run trained through)."""
    trained_to: Optional[int] = None
    """The last step the attempt it hit trained (JobLogs.last_trained), read once the next one trains."""
    detail: str = ""


class Soak:
    """One soak on a running cluster, with its S3 server (bucket `bucket`) and MLflow server."""

    def __init__(self, cluster: "LocalCluster", *, storage: "S3Server", bucket: str, tracker: "MlflowServer",
                 plan: Path, out: Path, settings: SoakSettings, say: Callable[[str], None] = say) -> None:
        self.cluster, self.storage, self.bucket, self.tracker = cluster, storage, bucket, tracker
        self.plan, self.out, self.settings, self.say = plan, out, settings, say
        self.logs = JobLogs(cluster.temp_dir, settings.run_name)
        self.started = time.monotonic()
        self.events: list[FaultEvent] = []
        self.memory: list[dict] = []
        self.storage_samples: list[dict] = []
        self.seen: dict[tuple[int, int], Process] = {}
        """Every process of the cluster sampled, by (pid, start time)."""
        self._said_at = 0.0
        """When the sampler last printed a progress line."""
        self.s3 = storage.client()
        self.record: dict = {}
        self.last_step_s = 0.0
        """When the job logs last showed a new step: training ended then."""
        self.submitter: Optional[subprocess.Popen] = None
        """The user's command, `python -m workloads submit`, while it runs."""
        self.reference: dict[int, float] = {}
        """The uninterrupted run's loss at each step, once `judge` had it."""
        self.attempts_trained_s: list[float] = []
        """When each attempt's first step showed in the job logs."""

    def now(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def _read(self) -> None:
        """Read what the job logs say since the last read, and note when a new step showed."""
        latest, attempts = self.logs.latest_step(), len(self.logs.attempt_pids)
        self.logs.read()
        if self.logs.latest_step() != latest:
            self.last_step_s = self.now()
        self.attempts_trained_s += [self.now()] * (len(self.logs.attempt_pids) - attempts)

    # -- the run ---------------------------------------------------------------------------------

    def submit_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "workloads", "submit", "--address", self.cluster.address,
                "--storage-path", f"s3://{self.bucket}/{PREFIX}", "--offline",
                "--run-name", self.settings.run_name, "--preset", "demo-cpu",
                "--max-failures", str(4 * self.settings.faults), "--resubmits", str(self.settings.faults),
                "--wait-nodes-s", f"{WAIT_NODES_S:g}", "--set", f"tracking.uri={self.tracker.uri}"]
        return argv + [arg for override in self.settings.overrides() for arg in ("--set", override)]

    def run(self) -> dict:
        """Run the soak; its record (also DIR/summary.json without the samples)."""
        self.out.mkdir(parents=True, exist_ok=True)
        planned = plan_faults(self.settings)
        self.say(f"seed {self.settings.seed}: {len(planned)} faults: "
                 + ", ".join(f"{p.kind} at step {p.step}" for p in planned))
        sampler = self.sampler().start()
        env = {**os.environ, "RAY_AUTH_TOKEN": self.cluster.token}
        with (self.out / "submit.txt").open("w") as output:
            submitter = subprocess.Popen(self.submit_argv(), stdout=output, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL)
            try:
                self.submitter = submitter
                for fault in planned:
                    if not self._await_step(fault.step, submitter):
                        self.say(f"the run ended before step {fault.step}: {fault.kind} not brought")
                        break
                    try:
                        self._bring(fault, submitter)
                    except RunEnded as ended:
                        self.events.pop()
                        self.say(f"{ended}: {fault.kind} not brought")
                        break
                if len(self.events) == len(planned):
                    self._hold_until_judged()
                while submitter.poll() is None:
                    self._read()
                    time.sleep(0.5)
                exit_code = submitter.wait()
            finally:
                if submitter.poll() is None:
                    submitter.kill()
                    submitter.wait()
                sampler.stop()
        self._read()
        self.say(f"submit exited {exit_code}")
        left = self._job_processes_left()
        job = [p for p in self.seen.values() if p.role in JOB_ROLES]
        record = {"seed": self.settings.seed, "settings": asdict(self.settings), "exit_code": exit_code,
                  "wall_s": self.now(), "trained_until_s": self.last_step_s,
                  "attempts_trained_s": self.attempts_trained_s, "planned": [asdict(p) for p in planned],
                  "sampler": sampler.record(),
                  "faults": [asdict(e) for e in self.events],
                  "processes_left": [asdict(p) for p in left], "shared_memory_left": shared_memory_left(job)}
        (self.out / "job.log").write_text("\n".join(self.logs.lines) + "\n")
        self.record = record
        return record

    def _await_step(self, step: int, submitter: subprocess.Popen) -> bool:
        """Wait until the run has logged `step` or later; False when the run ended first."""
        while submitter.poll() is None:
            self._read()
            if self.logs.latest_step() >= step:
                return True
            time.sleep(0.2)
        return False

    def _await_training(self, event: FaultEvent, submitter: subprocess.Popen, timeout_s: float = 900.0) -> None:
        """Wait until the run is past the fault, not beyond the run's end: after a restart, a step of
        the next attempt; after the tracker's outage, rank 0 saying that the tracker answers again;
        after the storage's, a checkpoint stored since."""
        deadline = time.monotonic() + timeout_s
        lines = len(self.logs.lines)
        after = self.logs.latest_step() + self.settings.checkpoint_every + 1
        while time.monotonic() < deadline and submitter.poll() is None:
            self._read()
            if self._past(event, new_lines=self.logs.lines[lines:], after=after):
                event.trained_again_s = self.now()
                return
            time.sleep(0.5)
        self._read()
        self._past(event, new_lines=self.logs.lines[lines:], after=after)  # the run ended meanwhile

    def _past(self, event: FaultEvent, *, new_lines: list[str], after: int) -> bool:
        if event.kind == "tracker-down":
            return any(TRACKING_BACK in line for line in new_lines)
        if event.kind == "storage-down":
            return self.logs.latest_step() >= after
        if len(self.logs.attempt_pids) > event.attempts_seen:
            event.attempt_after = self.logs.attempt_pids[event.attempts_seen]
            if event.attempt_before is not None:
                event.trained_to = self.logs.last_trained(event.attempt_before)
            return True
        return False

    # -- the faults ------------------------------------------------------------------------------

    def _await_the_tracker(self, submitter: subprocess.Popen, timeout_s: float = 300.0) -> None:
        """Wait until the tracker holds every step the run logged but the last two. Rank 0 keeps the
        records the tracker has not taken in its memory: a fault that restarts it would take them
        along (and with them the steps of an outage before its last checkpoint), which is a fault
        on top of another; each fault of the soak comes on its own."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and submitter.poll() is None:
            self._read()
            tracked = tracked_losses(self.tracker.uri, run_name=self.settings.run_name)
            if set(range(1, self.logs.latest_step() - 1)) <= tracked.keys():
                return
            time.sleep(1.0)

    def _bring(self, fault: PlannedFault, submitter: subprocess.Popen) -> None:
        if fault.kind not in OUTAGES:
            self._await_the_tracker(submitter)
        event = FaultEvent(kind=fault.kind, planned_step=fault.step, target=fault.target)
        self.events.append(event)
        if fault.kind == "save-interrupted":
            self._interrupt_a_save(fault, event)
        elif fault.kind == "storage-down":
            self._pause_at_the_next_checkpoint(fault, point="after-report", rank=0, before=1, max_s=STORAGE_PAUSE_S)
            self._mark(event)
            self._storage_down(fault, event)
        elif fault.in_window:
            self._restart_the_head_in_the_window(fault, event)
        else:
            time.sleep(fault.delay_s if fault.kind in ("worker-kill", "head-restart") else 0.0)
            self._read()
            self._mark(event)
            getattr(self, "_" + fault.kind.replace("-", "_"))(fault, event)
        self.say(f"{fault.kind} after step {event.step} ({event.detail}); waiting for the run to train again")
        self._await_training(event, submitter)
        if event.trained_again_s is not None:
            self.say(f"training again {event.trained_again_s - event.at_s:.1f} s after the {fault.kind}")

    def _hold_until_judged(self) -> None:
        """Once the faults are over, hold the run (rank 0 paused after a step's report) until the
        driver, the head and the train workers of its last attempt have lived long enough to have
        their memory judged. The run's length is in steps and the judging window in seconds: on a
        fast machine the last attempt could end before its window; on a slow one no hold is needed."""
        needs = judgeable_at(self.memory, settings=self.settings, attempts_trained_s=self.attempts_trained_s)
        missing = [role for role in JUDGED_ROLES if role not in needs]
        if missing:
            self.say(f"no hold for the memory check: no {' or '.join(missing)} process in the latest samples")
            return
        hold_s = round(max(needs.values()) - self.now(), 1)
        if hold_s <= 0:
            return
        left = self.settings.steps - self.logs.latest_step()
        if left < HOLD_STEPS_LEFT:
            self.say(f"no hold for the memory check: {left} step(s) left")
            return
        try:
            step, _ = self._pause(point="after-report", step=self.logs.latest_step() + 2, rank=0, every=1,
                                  max_s=hold_s)
        except RunEnded as ended:
            self.say(f"{ended}: no hold for the memory check")
            return
        self.say(f"holding the run at step {step} for {hold_s:g} s, until its processes' memory can be judged")

    def _read_for(self, seconds: float, *, until: Callable[[], bool] = lambda: False) -> None:
        """Wait `seconds` (or until `until()`), reading the job logs meanwhile: the progress lines
        and the time of the last step come from them."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not until():
            self._read()
            time.sleep(0.5)

    def _mark(self, event: FaultEvent) -> None:
        """Where the run is as the fault comes."""
        self._read()
        event.step, event.at_s = self.logs.latest_step(), self.now()
        event.attempt_before = self.logs.attempt_pids[-1] if self.logs.attempt_pids else None
        event.attempts_seen = len(self.logs.attempt_pids)

    def _worker_kill(self, fault: PlannedFault, event: FaultEvent) -> None:
        pids = train_worker_pids(address=self.cluster.address, token=self.cluster.token)
        victim = pids[fault.target % len(pids)]
        os.kill(victim, signal.SIGKILL)
        event.detail = f"SIGKILL to Ray Train worker pid {victim}"

    def _node_drain(self, fault: PlannedFault, event: FaultEvent) -> None:
        """SIGTERM to the node's `ray start`; once the node is gone and the job says that it waits
        for it, the node is started again, as the node group's replacement joins."""
        node = fault.target
        seen = len(self.logs.lines)
        gone = self.cluster.nodes.procs.pop(node)
        gone.send_signal(signal.SIGTERM)  # the kubelet, on EKS's drain of a Spot node
        self._read_for(self.settings.drain_timeout_s + 90, until=lambda: gone.poll() is not None)
        if gone.poll() is None:
            raise RuntimeError(f"worker node {node} did not stop within {self.settings.drain_timeout_s + 90:g} s of "
                               "its SIGTERM")
        gone_s = self.now()
        deadline = time.monotonic() + 4 * WAIT_NODES_S
        while not any(NODE_WAIT in line for line in self.logs.lines[seen:]) and time.monotonic() < deadline:
            time.sleep(0.5)
            self._read()
        said_s = self.now()
        self.cluster.nodes.start(node)
        event.back_s = self.now()
        event.detail = (f"SIGTERM to worker node {node}: gone after {gone_s - event.at_s:.1f} s, the job said it "
                        f"waits for it {said_s - gone_s:.1f} s later, back {event.back_s - event.at_s:.1f} s after "
                        "the SIGTERM")

    def _head_restart(self, fault: PlannedFault, event: FaultEvent) -> None:
        self.cluster.nodes.restart_head()
        event.back_s = self.now()
        event.detail = f"head and worker nodes killed and started again in {event.back_s - event.at_s:.1f} s"

    def _tracker_down(self, fault: PlannedFault, event: FaultEvent) -> None:
        self.tracker.kill()
        self._read_for(self.settings.tracker_down_s)
        self.tracker.start()
        event.back_s = self.now()
        event.detail = f"MLflow server down {event.back_s - event.at_s:.1f} s"

    def _storage_down(self, fault: PlannedFault, event: FaultEvent) -> None:
        self.storage.stop()  # rank 0 waits after the step before a checkpoint: the outage meets it
        self._read_for(self.settings.storage_down_s)
        self.storage.start()
        event.back_s = self.now()
        event.detail = f"S3 server down {event.back_s - event.at_s:.1f} s"

    def _pause_at_the_next_checkpoint(self, fault: PlannedFault, *, point: str, rank: Optional[int] = None,
                                      before: int = 0, max_s: float = 600.0) -> tuple[int, int]:
        """Rank `rank` (default: the fault's target) pauses at `point` of a checkpoint's step at or
        after the fault's step, or `before` steps before it, for at most `max_s`; (that step, the
        paused process's pid) once it has."""
        return self._pause(point=point, step=fault.step, rank=fault.target if rank is None else rank,
                           every=self.settings.checkpoint_every, before=before, max_s=max_s)

    def _pause(self, *, point: str, step: int, rank: int, every: int, before: int = 0,
               max_s: float = 600.0) -> tuple[int, int]:
        """Rank `rank` pauses at `point` of the first step at or after `step` that is a multiple of
        `every`, or `before` steps before it, for at most `max_s`; (that step, the paused process's
        pid) once it has. The job logs run behind the run: a step it passed before the pause was
        planned is given up for the next one."""
        from workloads.launch.faults import Pause, read_plan, write_plan

        deadline = time.monotonic() + 600
        start = max(step, self.logs.latest_step() + 2)
        while time.monotonic() < deadline:
            step = (start + before + every - 1) // every * every - before
            pause = Pause(point=point, run=self.settings.run_name, step=step, rank=rank, max_s=max_s)
            others = [p for p in read_plan(self.plan) if p != pause]
            write_plan(self.plan, [*others, pause])
            marker = self.plan.parent / pause.marker_name()
            while not marker.exists() and self.logs.latest_step() <= step and time.monotonic() < deadline:
                if self.submitter is not None and self.submitter.poll() is not None:
                    raise RunEnded(f"the run ended before rank {rank} paused at {point} of step {step}")
                time.sleep(0.2)
                self._read()
            if marker.exists():
                return step, json.loads(marker.read_text())["pid"]
            # Passed: a restart that trains that step again must not pause there later.
            write_plan(self.plan, others)
            start = self.logs.latest_step() + every
        raise RuntimeError(f"rank {rank} did not pause at {point} within 600 s")

    def _interrupt_a_save(self, fault: PlannedFault, event: FaultEvent) -> None:
        """Rank `target` pauses as it starts to upload its part of the next checkpoint, and is killed there."""
        step, pid = self._pause_at_the_next_checkpoint(fault, point="checkpoint-upload")
        time.sleep(fault.delay_s)  # the other rank's part goes on uploading meanwhile
        self._mark(event)
        os.kill(pid, signal.SIGKILL)
        event.detail = f"rank {fault.target} SIGKILLed uploading its part of the step-{step} checkpoint (pid {pid})"

    def _restart_the_head_in_the_window(self, fault: PlannedFault, event: FaultEvent) -> None:
        """Rank `target` has uploaded its part of the next checkpoint and waits before it reports it;
        once every part is in storage (complete, not registered), the head restarts."""
        step, _ = self._pause_at_the_next_checkpoint(fault, point="checkpoint-uploaded")
        deadline = time.monotonic() + 120
        while not (complete := self._complete_unregistered()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the step-{step} checkpoint was not complete in storage within 120 s")
            time.sleep(0.2)
        self._mark(event)
        self._head_restart(fault, event)
        event.detail += f", with {complete[0]} (step {step}) complete in storage and not registered"

    def _complete_unregistered(self) -> list[str]:
        """The run's checkpoint folders that are complete in storage but not registered by Ray Train."""
        import pyarrow.fs

        from workloads.launch.checkpoints import SNAPSHOT_NAME, complete_step, registered_names, unregistered

        filesystem = self.storage.filesystem()
        run = f"{self.bucket}/{PREFIX}/{self.settings.run_name}"
        listing = filesystem.get_file_info(pyarrow.fs.FileSelector(run, allow_not_found=True))
        folders = [info.base_name for info in listing if info.type == pyarrow.fs.FileType.Directory]
        snapshot = filesystem.get_file_info(f"{run}/{SNAPSHOT_NAME}")
        text = None
        if snapshot.type == pyarrow.fs.FileType.File:
            with filesystem.open_input_stream(f"{run}/{SNAPSHOT_NAME}") as stream:
                text = stream.read().decode()
        registered = registered_names(text) or set()
        return [name for name in unregistered(folders, registered) if complete_step(filesystem, f"{run}/{name}")]

    # -- samples ---------------------------------------------------------------------------------

    def sampler(self) -> Periodic:
        """The sampler (not started): `_sample` every `sample_every_s`; a pass that fails is said and
        kept in the record, and the next one runs."""
        return Periodic(self._sample, every_s=self.settings.sample_every_s, name="soak-sampler", clock=self.now,
                        on_error=lambda error: self.say(f"warning: the sampler's pass at t = {error.at_s} s failed "
                                                        f"({error.error}); the next one runs"))

    def _sample(self) -> None:
        """One pass of the sampler: each process's resident memory, the bucket, and now and then a
        progress line."""
        at = self.now()
        processes = cluster_processes(self.cluster.nodes)
        for process in processes:
            self.seen[(process.pid, process.started)] = process
            self.memory.append({"t": at, "pid": process.pid, "role": process.role, "rss_mib": process.rss_mib})
        if self.storage.up:
            try:
                prefix = f"{PREFIX}/{self.settings.run_name}/"
                objects = bucket_objects(self.s3, self.bucket, prefix)
                self.storage_samples.append({"t": at, **storage_figures(objects, prefix=prefix)})
            except Exception:  # the server went down between the check and the call
                pass
        if at - self._said_at >= self.settings.progress_every_s:
            self._said_at = at
            self.say(progress_line(at_s=at, step=self.logs.latest_step(), steps=self.settings.steps,
                                   attempts=len(self.logs.attempt_pids), processes=processes,
                                   storage=self.storage_samples[-1] if self.storage_samples else None))

    def _job_processes_left(self, grace_s: float = 60.0) -> list[Process]:
        """The job's processes (driver, controller, train workers) still alive `grace_s` after it ended."""
        deadline = time.monotonic() + grace_s
        while True:
            left = [p for p in cluster_processes(self.cluster.nodes) if p.role in JOB_ROLES]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1.0)

    def after_the_cluster(self) -> None:
        """Once the cluster has stopped: add to the record any process of it, and any shared memory
        they made or mapped, that is still there."""
        seen = list(self.seen.values())
        self.record["processes_left"] += [asdict(p) for p in seen if alive(p)]
        self.record["shared_memory_left"] = sorted({*self.record["shared_memory_left"], *shared_memory_left(seen)})
        self.record["cluster_stopped"] = True


JOB_ROLES = ("driver", "controller", "train worker")


def progress_line(*, at_s: float, step: int, steps: int, attempts: int, processes: list[Process],
                  storage: Optional[dict]) -> str:
    """One line of where the soak is: the step, the attempts so far, the resident memory summed
    per role, the bucket."""
    totals: dict[str, float] = {}
    for process in processes:
        totals[process.role] = totals.get(process.role, 0.0) + process.rss_mib
    memory = ", ".join(f"{role} {totals[role]:.0f}" for role in ROLES if role in totals)
    bucket = (f"{storage['bytes'] / 2**20:.1f} MiB in {storage['checkpoint_folders']} checkpoint folder(s)"
              if storage else "not read yet")
    return f"{at_s / 60:5.1f} min  step {step}/{steps}, attempt {attempts}; RSS MiB: {memory}; bucket {bucket}"


def bucket_objects(client, bucket: str, prefix: str) -> list[dict]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [{"key": obj["Key"], "bytes": obj["Size"]} for page in pages for obj in page.get("Contents", [])]


def storage_figures(objects: list[dict], *, prefix: str) -> dict:
    """Bytes under the run's `prefix`, and in each checkpoint folder there."""
    folders: dict[str, int] = {}
    for obj in objects:
        parts = obj["key"][len(prefix):].split("/")
        if len(parts) == 2 and parts[0].startswith("checkpoint_"):
            folders[parts[0]] = folders.get(parts[0], 0) + obj["bytes"]
    return {"bytes": sum(obj["bytes"] for obj in objects), "checkpoint_folders": len(folders),
            "checkpoint_bytes": sorted(folders.values())}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.soak",
                                     description=__doc__.split(": `", 1)[0] + ".")
    parser.add_argument("--minutes", type=float, required=True,
                        help="about how long the run trains: sets --steps and --faults (a fault every 3 minutes)")
    parser.add_argument("--out", type=Path, required=True,
                        help="the record's folder: summary.json, soak.png, the samples, the job log")
    parser.add_argument("--seed", type=int, help="default: a random one (printed)")
    parser.add_argument("--steps", type=int, help=f"override the steps (default: {STEPS_PER_MINUTE} a minute)")
    parser.add_argument("--faults", type=int,
                        help="override the number of faults (default: one every 3 minutes and at least 6, so that "
                        "each kind comes; fewer bring the first kinds of the seeded order)")
    parser.add_argument("--outage-s", type=float, default=60.0, help="how long the tracker and the storage are down")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    try:
        settings = SoakSettings(steps=args.steps or int(args.minutes * STEPS_PER_MINUTE),
                                faults=args.faults or max(len(FAULT_KINDS), round(args.minutes / 3)), seed=seed,
                                tracker_down_s=args.outage_s, storage_down_s=args.outage_s)
    except ValueError as exc:
        parser.error(str(exc))
    # SIGTERM ends the soak as Ctrl-C does: through the cleanup that stops the cluster and the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return soak_on_a_local_cluster(settings, out=args.out.resolve())


STEPS_PER_MINUTE = 200
"""How many steps of the soak's run a minute holds on the 2-core machine of docs/RELIABILITY.md, faults
and their recovery included."""


def soak_on_a_local_cluster(settings: SoakSettings, *, out: Path) -> int:
    """Start the services and the cluster, run the soak, stop them, check and record."""
    from workloads.rehearse.services import UNSET_FOR_S3, MlflowServer, S3Server, s3_environment
    from workloads.client.cluster import free_port
    from workloads.local.run import LocalClusterSpec, local_ray_cluster
    from workloads.launch.faults import PAUSE_PLAN_ENV

    out.mkdir(parents=True, exist_ok=True)
    say(f"seed {settings.seed} (python -m workloads.bench.soak ... --seed {settings.seed} brings the same faults)")
    storage = S3Server(port=free_port())
    storage.start()
    for name in UNSET_FOR_S3:
        os.environ.pop(name, None)
    plan = out / "pause-plan.json"
    plan.unlink(missing_ok=True)
    os.environ.update({**s3_environment(storage.endpoint), **CLUSTER_ENV, **POLL_ENV, PAUSE_PLAN_ENV: str(plan),
                       "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": f"{settings.drain_timeout_s:g}"})
    storage.client().create_bucket(Bucket=BUCKET)
    tracker = MlflowServer(root=out / "mlflow", port=free_port())
    tracker.start()
    try:
        with local_ray_cluster(LocalClusterSpec(nodes=2, cpus_per_node=1), log_dir=out / "ray", say=say) as cluster:
            soak = Soak(cluster, storage=storage, bucket=BUCKET, tracker=tracker, plan=plan, out=out,
                        settings=settings)
            soak.run()
        time.sleep(5)  # the last `ray start` processes reap their children
        soak.after_the_cluster()
        say("the uninterrupted reference run")
        record = judge(soak, reference=Reference(settings, out=out / "reference").losses())
    finally:
        tracker.kill()
        storage.stop()
    write_record(soak, out=out)
    for line in failed_lines(record["checks"]):
        print(line, flush=True)
    passed = [name for name, check in record["checks"].items() if check["within"]]
    say(f"{len(passed)} of {len(record['checks'])} checks passed ({', '.join(passed)}); record in {out}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
