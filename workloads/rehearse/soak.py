"""A soak: one long run on the local cluster in the EKS shape that meets a fault every few minutes,
at random points: `python -m workloads.rehearse.soak --minutes 30 --out DIR [--seed N]`.

The cluster is `workloads.local.run`'s (a head that runs no training worker, two worker nodes of
one CPU), checkpoints go to moto's S3 server and the run is tracked in a real `mlflow server`
(workloads/rehearse/services.py). The run is the user's command, `python -m workloads submit`, with the
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

A fault comes once the run trains again after the one before; after the last that restarts processes,
a hold is planned near the run's end: rank 0 pauses there until the memory of each role's newest
process can be judged, and goes on at once if by then it can (the training and the outages since
count towards it).
Checked and recorded in DIR: each step's loss against an uninterrupted run of the same settings
(torchrun, the same loop without Ray); the steps each fault cost against its allowance; the resident
memory of the driver, the head and the workers every few seconds, which must not grow beyond
warm-up; no process of the job left once it ended, nor of the cluster once it stopped, nor a new
shared-memory segment; the bytes in the bucket, bounded by the checkpoints kept; the run's MLflow
record (every step's loss, the end status).
A progress line every 30 s gives the step, the attempt, the memory per role and the bucket.
DIR/summary.json holds it all, DIR/soak.png plots the loss with the faults marked and the memory.
Exit 0 when every check passed; otherwise 1, after a line `FAILED <check>: <what>` for each check
that did not hold. docs/RELIABILITY.md, section 8, records a 30-minute soak.

Here: the run, its sampler and the hold before judging. Beside it: its settings and fault plan
(soak_plan.py), the faults (soak_faults.py), its view of the job logs (soak_watch.py, job_logs.py),
the checks (soak_checks.py) and the record (soak_record.py).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from workloads.periodic import Periodic
from workloads.rehearse.cluster_processes import ROLES, Process, alive, cluster_processes, shared_memory_left
from workloads.rehearse.job_logs import JobLogs
from workloads.rehearse.soak_checks import JUDGED_ROLES, failed_lines, judge, judgeable_at
from workloads.rehearse.soak_faults import Faults, RunEnded
from workloads.rehearse.soak_plan import (BUCKET, FAULT_KINDS, OUTAGES, PREFIX, WAIT_NODES_S, SoakSettings,
                                          plan_faults)
from workloads.rehearse.soak_record import Reference, write_record
from workloads.rehearse.soak_watch import RunWatch

if TYPE_CHECKING:
    from workloads.rehearse.services import MlflowServer, S3Server
    from workloads.local.run import LocalCluster

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
"""The hold is planned this many steps before the run's end: the job logs lag a few steps behind, and
a pause planned for a step the run has passed is never taken."""


def say(message: str) -> None:
    print(f"[soak] {message}", flush=True)


class Soak:
    """One soak on a running cluster, with its S3 server (bucket `bucket`) and MLflow server."""

    def __init__(self, cluster: "LocalCluster", *, storage: "S3Server", bucket: str, tracker: "MlflowServer",
                 plan: Path, out: Path, settings: SoakSettings, say: Callable[[str], None] = say) -> None:
        self.cluster, self.storage, self.bucket, self.tracker = cluster, storage, bucket, tracker
        self.plan, self.out, self.settings, self.say = plan, out, settings, say
        self.watch = RunWatch(cluster.temp_dir, settings.run_name)
        self.faults = Faults(self.watch, cluster=cluster, storage=storage, bucket=bucket, tracker=tracker, plan=plan,
                             settings=settings, say=say)
        self.memory: list[dict] = []
        self._hold: Optional[Periodic] = None
        """Releases the hold planned for the memory check (`_plan_the_hold`)."""
        self.storage_samples: list[dict] = []
        self.seen: dict[tuple[int, int], Process] = {}
        """Every process of the cluster sampled, by (pid, start time)."""
        self._said_at = 0.0
        """When the sampler last printed a progress line."""
        self.s3 = storage.client()
        self.record: dict = {}
        self.reference: dict[int, float] = {}
        """The uninterrupted run's loss at each step, once `judge` had it."""

    @property
    def logs(self) -> JobLogs:
        return self.watch.logs

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
                self.watch.submitter = submitter
                # The hold comes once the last fault that restarts processes is over: the outages after
                # it keep the same processes and would otherwise take the steps left for it.
                hold_after = max((i for i, p in enumerate(planned) if p.kind not in OUTAGES), default=len(planned) - 1)
                for index, fault in enumerate(planned):
                    if not self.watch.await_step(fault.step, submitter):
                        self.say(f"the run ended before step {fault.step}: {fault.kind} not brought")
                        break
                    try:
                        self.faults.bring(fault, submitter)
                    except RunEnded as ended:
                        self.faults.events.pop()
                        self.say(f"{ended}: {fault.kind} not brought")
                        break
                    if index == hold_after:
                        self._plan_the_hold()
                while submitter.poll() is None:
                    self.watch.read()
                    time.sleep(0.5)
                exit_code = submitter.wait()
            finally:
                if submitter.poll() is None:
                    submitter.kill()
                    submitter.wait()
                sampler.stop()
                if self._hold is not None:
                    self._hold.stop()
        self.watch.read()
        self.say(f"submit exited {exit_code}")
        left = self._job_processes_left()
        job = [p for p in self.seen.values() if p.role in JOB_ROLES]
        record = {"seed": self.settings.seed, "settings": asdict(self.settings), "exit_code": exit_code,
                  "wall_s": self.watch.now(), "trained_until_s": self.watch.last_step_s,
                  "attempts_trained_s": self.watch.attempts_trained_s, "planned": [asdict(p) for p in planned],
                  "sampler": sampler.record(),
                  "faults": [asdict(e) for e in self.faults.events],
                  "processes_left": [asdict(p) for p in left], "shared_memory_left": shared_memory_left(job)}
        (self.out / "job.log").write_text("\n".join(self.logs.lines) + "\n")
        self.record = record
        return record

    # -- the hold before judging -----------------------------------------------------------------

    def _plan_the_hold(self) -> None:
        """Once the last fault that restarts processes is over: the driver, the head and the train
        workers of the last attempt must live long enough to have their memory judged, and the run's
        length is in steps while that window is in seconds. Rank 0 is to pause after the report of a
        step near the run's end, at most as long as is missing now; a pass every 0.2 s releases it as
        soon as the processes can be judged, so the training and the outages until then count (on a
        machine slow enough, it does not wait at all)."""
        from workloads.launch.faults import Pause, read_plan, write_plan

        needs = judgeable_at(self.memory, settings=self.settings, attempts_trained_s=self.watch.attempts_trained_s)
        missing = [role for role in JUDGED_ROLES if role not in needs]
        if missing:
            self.say(f"no hold for the memory check: no {' or '.join(missing)} process in the latest samples")
            return
        ready_at = max(needs.values())
        hold_s = round(ready_at - self.watch.now(), 1)
        if hold_s <= 0:
            return
        step = self.settings.steps - HOLD_STEPS_LEFT
        if self.logs.latest_step() + 2 > step:
            self.say(f"no hold for the memory check: {self.settings.steps - self.logs.latest_step()} step(s) left")
            return
        pause = Pause(point="after-report", run=self.settings.run_name, step=step, rank=0, max_s=hold_s)
        write_plan(self.plan, [*read_plan(self.plan), pause])
        release = self.plan.parent / pause.release_name()
        marker = self.plan.parent / pause.marker_name()
        self.say(f"holding the run at step {step}, for at most {hold_s:g} s, until its processes' memory can "
                 f"be judged (t = {ready_at:.1f} s)")

        def release_when_judgeable() -> None:
            if self.watch.now() >= ready_at and not release.exists():
                release.touch()
                self.say(f"released the hold at step {step}: the processes can be judged"
                         + ("" if marker.exists() else " (rank 0 had not reached it)"))

        self._hold = Periodic(release_when_judgeable, every_s=0.2, name="soak-hold", clock=self.watch.now).start()

    # -- samples ---------------------------------------------------------------------------------

    def sampler(self) -> Periodic:
        """The sampler (not started): `_sample` every `sample_every_s`; a pass that fails is said and
        kept in the record, and the next one runs."""
        return Periodic(self._sample, every_s=self.settings.sample_every_s, name="soak-sampler", clock=self.watch.now,
                        on_error=lambda error: self.say(f"warning: the sampler's pass at t = {error.at_s} s failed "
                                                        f"({error.error}); the next one runs"))

    def _sample(self) -> None:
        """One pass of the sampler: each process's resident memory, the bucket, and now and then a
        progress line."""
        at = self.watch.now()
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
    parser = argparse.ArgumentParser(prog="python -m workloads.rehearse.soak",
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
    say(f"seed {settings.seed} (python -m workloads.rehearse.soak ... --seed {settings.seed} brings the same faults)")
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
