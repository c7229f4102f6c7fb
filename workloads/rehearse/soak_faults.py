"""The faults a soak brings (workloads/rehearse/soak.py), each on the running local cluster, and what
it notes of each: when it came, where the run was, when what it took away was back and when the run
trained again. The kinds are soak_plan.FAULT_KINDS; the soak's docstring says what each does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from workloads.rehearse.cluster_processes import train_worker_pids
from workloads.rehearse.soak_checks import tracked_losses
from workloads.rehearse.soak_plan import OUTAGES, PREFIX, WAIT_NODES_S, PlannedFault, SoakSettings
from workloads.rehearse.soak_watch import RunWatch

if TYPE_CHECKING:
    from workloads.local.run import LocalCluster
    from workloads.rehearse.services import MlflowServer, S3Server

STORAGE_PAUSE_S = 2.0
"""Rank 0 waits this long after the step before a checkpoint while the storage goes down."""
NODE_WAIT = "waiting for a lost node"
"""The job's line while its workers cannot be placed (workloads/launch/ray_train.py WorkerGroupWait)."""
TRACKING_BACK = "answers again after"
"""Rank 0's tracker line once the tracker takes records again (workloads/train/tracking.py)."""


class RunEnded(Exception):
    """The run ended before a fault could be brought."""


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


class Faults:
    """Brings each planned fault to the cluster, its S3 server (bucket `bucket`) and its MLflow server,
    pausing ranks through the pause plan `plan` (workloads/launch/faults.py); `events` holds each
    fault brought."""

    def __init__(self, watch: RunWatch, *, cluster: "LocalCluster", storage: "S3Server", bucket: str,
                 tracker: "MlflowServer", plan: Path, settings: SoakSettings, say: Callable[[str], None]) -> None:
        self.watch, self.logs = watch, watch.logs
        self.cluster, self.storage, self.bucket, self.tracker = cluster, storage, bucket, tracker
        self.plan, self.settings, self.say = plan, settings, say
        self.events: list[FaultEvent] = []

    def bring(self, fault: PlannedFault, submitter: subprocess.Popen) -> None:
        """Bring `fault` (one that restarts the run once the tracker holds what rank 0 kept), note it
        in `events`, and wait until the run is past it."""
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
            self.watch.read()
            self._mark(event)
            getattr(self, "_" + fault.kind.replace("-", "_"))(fault, event)
        self.say(f"{fault.kind} after step {event.step} ({event.detail}); waiting for the run to train again")
        self._await_training(event, submitter)
        if event.trained_again_s is not None:
            self.say(f"training again {event.trained_again_s - event.at_s:.1f} s after the {fault.kind}")

    def _await_training(self, event: FaultEvent, submitter: subprocess.Popen, timeout_s: float = 900.0) -> None:
        """Wait until the run is past the fault, not beyond the run's end: after a restart, a step of
        the next attempt; after the tracker's outage, rank 0 saying that the tracker answers again;
        after the storage's, a checkpoint stored since."""
        deadline = time.monotonic() + timeout_s
        lines = len(self.logs.lines)
        after = self.logs.latest_step() + self.settings.checkpoint_every + 1
        while time.monotonic() < deadline and submitter.poll() is None:
            self.watch.read()
            if self._past(event, new_lines=self.logs.lines[lines:], after=after):
                event.trained_again_s = self.watch.now()
                return
            time.sleep(0.5)
        self.watch.read()
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

    def _await_the_tracker(self, submitter: subprocess.Popen, timeout_s: float = 300.0) -> None:
        """Wait until the tracker holds every step the run logged but the last two. Rank 0 keeps the
        records the tracker has not taken in its memory: a fault that restarts it would take them
        along (and with them the steps of an outage before its last checkpoint), which is a fault
        on top of another; each fault of the soak comes on its own."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and submitter.poll() is None:
            self.watch.read()
            tracked = tracked_losses(self.tracker.uri, run_name=self.settings.run_name)
            if set(range(1, self.logs.latest_step() - 1)) <= tracked.keys():
                return
            time.sleep(1.0)

    def _mark(self, event: FaultEvent) -> None:
        """Where the run is as the fault comes."""
        self.watch.read()
        event.step, event.at_s = self.logs.latest_step(), self.watch.now()
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
        self.watch.read_for(self.settings.drain_timeout_s + 90, until=lambda: gone.poll() is not None)
        if gone.poll() is None:
            raise RuntimeError(f"worker node {node} did not stop within {self.settings.drain_timeout_s + 90:g} s of "
                               "its SIGTERM")
        gone_s = self.watch.now()
        deadline = time.monotonic() + 4 * WAIT_NODES_S
        while not any(NODE_WAIT in line for line in self.logs.lines[seen:]) and time.monotonic() < deadline:
            time.sleep(0.5)
            self.watch.read()
        said_s = self.watch.now()
        self.cluster.nodes.start(node)
        event.back_s = self.watch.now()
        event.detail = (f"SIGTERM to worker node {node}: gone after {gone_s - event.at_s:.1f} s, the job said it "
                        f"waits for it {said_s - gone_s:.1f} s later, back {event.back_s - event.at_s:.1f} s after "
                        "the SIGTERM")

    def _head_restart(self, fault: PlannedFault, event: FaultEvent) -> None:
        self.cluster.nodes.restart_head()
        event.back_s = self.watch.now()
        event.detail = f"head and worker nodes killed and started again in {event.back_s - event.at_s:.1f} s"

    def _tracker_down(self, fault: PlannedFault, event: FaultEvent) -> None:
        self.tracker.kill()
        self.watch.read_for(self.settings.tracker_down_s)
        self.tracker.start()
        event.back_s = self.watch.now()
        event.detail = f"MLflow server down {event.back_s - event.at_s:.1f} s"

    def _storage_down(self, fault: PlannedFault, event: FaultEvent) -> None:
        self.storage.stop()  # rank 0 waits after the step before a checkpoint: the outage meets it
        self.watch.read_for(self.settings.storage_down_s)
        self.storage.start()
        event.back_s = self.watch.now()
        event.detail = f"S3 server down {event.back_s - event.at_s:.1f} s"

    def _pause_at_the_next_checkpoint(self, fault: PlannedFault, *, point: str, rank: Optional[int] = None,
                                      before: int = 0, max_s: float = 600.0) -> tuple[int, int]:
        """Rank `rank` (default: the fault's target) pauses at `point` of a checkpoint's step at or
        after the fault's step, or `before` steps before it, for at most `max_s`; (that step, the
        paused process's pid) once it has."""
        return self.pause(point=point, step=fault.step, rank=fault.target if rank is None else rank,
                          every=self.settings.checkpoint_every, before=before, max_s=max_s)

    def pause(self, *, point: str, step: int, rank: int, every: int, before: int = 0,
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
                if self.watch.submitter is not None and self.watch.submitter.poll() is not None:
                    raise RunEnded(f"the run ended before rank {rank} paused at {point} of step {step}")
                time.sleep(0.2)
                self.watch.read()
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
