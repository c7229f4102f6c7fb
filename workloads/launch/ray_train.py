"""The Ray Train adapter: runs `workloads.train.loop.train` inside a TorchTrainer worker.

Ray Train has already formed the process group (gloo or NCCL) when `train_worker` starts; this
module maps the loop's TrainContext onto Ray: `report` becomes `ray.train.report` (with the loop's
checkpoint folder uploaded by every rank, reported once every rank's part is stored, skipped on
every rank when some part could not be: workloads/launch/uploads.py; deleted locally either way),
`latest_checkpoint`
becomes a local folder of `ray.train.get_checkpoint()`, which Ray Train sets after a worker-group
restart or when a run of the same name is started again on the same storage. Before training, every
worker proves it can write to the run's storage; a check that fails before step 1 (that one or the
loop's transport gate) ends the run on every rank without an error, so that Ray Train does not
retry what would fail again, and the driver reports it. Rank 0 then removes from storage the
checkpoints an earlier attempt left half-written (workloads/launch/checkpoints.py). The upload and the
end of each report are pause points for fault-injection tests (workloads/launch/faults.py, inert
unless its environment variable is set).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import ray.train
from filelock import FileLock
# Ray Train's controller hooks (a DeveloperAPI of the pinned Ray): the only way to see its retries.
from ray.train.v2._internal.execution.callback import ControllerCallback

from workloads.context import PREFLIGHT_FAILED_KEY, RESTORE_PREFIX, PreflightError, TrainContext
from workloads.files import path_inside
from workloads.launch.checkpoints import settle
from workloads.launch.credentials import load_credentials
from workloads.launch.faults import pause_point
from workloads.launch.storage import StorageNotWritableError, check_writable, marker_name
from workloads.launch.uploads import DEFAULT_POLICY, UnregisteredFolders, UploadPolicy, upload_patiently
from workloads.model_io.storage import Location
from workloads.transport.gate import nccl_log_env

if TYPE_CHECKING:
    from workloads.train.preemption import Notice

SCRATCH_ROOT = Path(tempfile.gettempdir()) / "ray-train-scratch"
"""Where each worker keeps checkpoints in flight, restored checkpoints and its NCCL log."""


SKIPPED = UnregisteredFolders()
"""Rank 0's skipped checkpoints whose folders are still to be deleted from storage."""
RESUMED_UNREGISTERED = UnregisteredFolders()
"""The complete, never registered checkpoint this attempt resumed from (`settled_context`): deleted once
the attempt has stored a newer one, which supersedes it. Ray Train's retention (num_to_keep) counts
registered checkpoints only, so it would stay in the bucket for good, one more than the run keeps."""


def report(metrics: dict, checkpoint_dir: Optional[Path] = None, *, final_step: int = 0,
           policy: UploadPolicy = DEFAULT_POLICY) -> None:
    """The loop's report (every rank calls it at the same steps). `final_step`: the run's last step,
    whose checkpoint must be stored."""
    ray_ctx = ray.train.get_context()
    where = dict(run=ray_ctx.get_experiment_name(), step=metrics.get("step"), rank=ray_ctx.get_world_rank())
    stored = None
    if checkpoint_dir is not None:
        stored = store_checkpoint(checkpoint_dir, where=where, final=bool(final_step) and where["step"] == final_step,
                                  policy=policy)
    if stored is None:
        ray.train.report(metrics)
    else:
        # Uploaded here, not by Ray: its upload raises after three quick tries (Ray 2.58's
        # `_upload_checkpoint`), which ends the attempt, and a rank that reports a checkpoint gets
        # it registered even when another rank's part is missing (its ReportCallbackHandler takes
        # the first rank's checkpoint).
        ray.train.report(metrics, checkpoint=stored, checkpoint_dir_name=Path(stored.path).name,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
    pause_point("after-report", **where)


def store_checkpoint(checkpoint_dir: Path, *, where: dict, final: bool,
                     policy: UploadPolicy) -> Optional[ray.train.Checkpoint]:
    """Upload this rank's part of the checkpoint into the folder rank 0 names; the persisted
    checkpoint once every rank's part is stored, else None on every rank (a warning from rank 0;
    for the final checkpoint, CheckpointNotStoredError). The local folder is deleted either way: tens
    of GB per checkpoint on a node's root volume would end in disk-pressure eviction."""
    import torch.distributed as dist

    storage = ray.train.get_context().get_storage()
    name = [storage.make_default_checkpoint_dir_name()]
    dist.broadcast_object_list(name, src=0)
    local = ray.train.Checkpoint.from_directory(str(checkpoint_dir))

    def upload() -> ray.train.Checkpoint:
        # Ray's own copy, between the points where a test can stop this rank with its part unsent,
        # and sent but not yet reported to the controller.
        pause_point("checkpoint-upload", **where)
        persisted = storage.persist_current_checkpoint(local, name[0])
        pause_point("checkpoint-uploaded", **where)
        return persisted

    outcome = upload_patiently(upload, final=final, policy=policy)
    errors: list[Optional[str]] = [None] * dist.get_world_size()
    mine = f"rank {where['rank']} after {outcome.tries} tries: {outcome.error}" if outcome.stored is None else None
    dist.all_gather_object(errors, mine)
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    failed = [error for error in errors if error]
    rank0 = where["rank"] == 0
    if not failed:
        if rank0 and SKIPPED.names:
            deleted = SKIPPED.remove(storage.storage_filesystem, storage.experiment_fs_path)
            if deleted:
                print(f"[checkpoints] storage answers again: removed the folder(s) of {len(deleted)} skipped "
                      f"checkpoint(s): {', '.join(deleted)}", flush=True)
        if rank0 and RESUMED_UNREGISTERED.names:
            deleted = RESUMED_UNREGISTERED.remove(storage.storage_filesystem, storage.experiment_fs_path)
            if deleted:
                print(f"[checkpoints] removed {', '.join(deleted)}, the never registered checkpoint this attempt "
                      f"resumed from: the checkpoint of step {where['step']} supersedes it", flush=True)
        return outcome.stored
    problem = (f"the checkpoint of step {where['step']} could not be stored in {storage_uri(storage)} "
               f"({len(failed)} of {len(errors)} ranks; {failed[0]})")
    if final:
        raise CheckpointNotStoredError(f"{problem}; the final checkpoint holds the trained model, so this attempt "
                                       "fails and the run is retried from its last stored checkpoint")
    if rank0:
        SKIPPED.add(name[0])
        print(f"[checkpoints] warning: {problem}; skipped: training goes on, and a restart resumes from the last "
              "checkpoint stored", flush=True)
    return None


class CheckpointNotStoredError(RuntimeError):
    """The final checkpoint could not be stored within UploadPolicy.final_wait_s."""


def preemption_notice() -> Optional["Notice"]:
    """Ray Train's view of a drain of the run's nodes (`ray.train.get_preemption_info()`, a
    broadcast from rank 0 that every rank must call at the same steps), as the loop's Notice."""
    from workloads.train.preemption import Notice

    info = ray.train.get_preemption_info()
    if info is None:
        return None
    return Notice(deadline_unix_s=None if info.deadline_ms is None else info.deadline_ms / 1000,
                  ranks=tuple(info.preempted_ranks), nodes=tuple(info.preempted_node_ids))


def restore_once_per_node(checkpoint, *, restore_root: Path, rank: int = 0) -> Path:
    """A local copy of a persisted checkpoint, downloaded by the first rank of this node to get
    here and used by the others: one download per node, not per rank (a 1.5B model's checkpoint is
    about 18.5 GB). Copies of other checkpoints from earlier attempts are removed. Every rank of an
    HSDP run holds a shard of a whole replica, so a node's ranks together need the whole checkpoint:
    there is nothing a node could leave out of the download under the default two-node mesh."""
    restore_root.mkdir(parents=True, exist_ok=True)
    target = path_inside(restore_root, Path(checkpoint.path).name)
    with FileLock(str(restore_root / ".lock")):
        if not target.is_dir():
            for stale in restore_root.iterdir():
                if stale.is_dir() and stale != target:
                    shutil.rmtree(stale, ignore_errors=True)
            partial = restore_root / f".{target.name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            started = time.perf_counter()
            checkpoint.to_directory(str(partial))
            seconds = time.perf_counter() - started
            files = [f.stat().st_size for f in partial.rglob("*") if f.is_file()]
            partial.rename(target)  # complete or absent, never half there
            size = sum(files)
            print(RESTORE_PREFIX + json.dumps({"checkpoint": target.name, "rank": rank, "node": socket.gethostname(),
                                               "files": len(files), "bytes": size, "seconds": round(seconds, 3),
                                               "mb_per_s": round(size / 1e6 / seconds, 1) if seconds else None},
                                              sort_keys=True), flush=True)
    return target


def checkpoint_loader(*, restore_root: Path, rank: int = 0,
                      newer: Optional[ray.train.Checkpoint] = None) -> Callable[[], Optional[Path]]:
    """Return a function giving the newest persisted checkpoint as a local folder (or None): Ray
    Train's, or `newer`, a complete one it never registered (`settle`).

    On local storage the checkpoint is used in place; from S3 it is downloaded once per node."""

    def latest_checkpoint() -> Optional[Path]:
        checkpoint = newer or ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        if checkpoint.filesystem.type_name == "local":
            return Path(checkpoint.path)
        # Ray's download writes each key below the folder as it is: its listing is checked first.
        Location(path=checkpoint.path, uri=checkpoint.path, fs=checkpoint.filesystem).files()
        return restore_once_per_node(checkpoint, restore_root=restore_root, rank=rank)

    return latest_checkpoint


def ray_train_context(*, scratch_root: Path = SCRATCH_ROOT, planned_world_size: int = 0,
                      final_step: int = 0) -> TrainContext:
    """The TrainContext of the calling Ray Train worker; `final_step` is the run's last step."""
    ray_ctx = ray.train.get_context()
    rank = ray_ctx.get_world_rank()
    run_dir = scratch_root / ray_ctx.get_experiment_name()
    scratch_dir = run_dir / f"rank-{rank}"
    scratch_dir.mkdir(parents=True, exist_ok=True)
    return TrainContext(
        rank=rank,
        world_size=ray_ctx.get_world_size(),
        local_rank=ray_ctx.get_local_rank(),
        local_world_size=ray_ctx.get_local_world_size(),
        node_rank=ray_ctx.get_node_rank(),
        report=functools.partial(report, final_step=final_step),
        latest_checkpoint=checkpoint_loader(restore_root=run_dir / "restored", rank=rank),
        scratch_dir=scratch_dir,
        preemption_notice=preemption_notice,
        planned_world_size=planned_world_size,
    )


class PreflightRecorder(ray.train.UserCallback):
    """Runs in Ray Train's controller, on the driver's node: writes the first preflight failure any
    rank reported to `path`, where the driver reads it. (Ray Train's Result carries the metrics of
    checkpoints only, and a preflight failure comes without one.)"""

    def __init__(self, path: str) -> None:
        self.path = path

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        failed = next((m[PREFLIGHT_FAILED_KEY] for m in metrics if m and m.get(PREFLIGHT_FAILED_KEY)), None)
        if failed and not Path(self.path).exists():
            Path(self.path).write_text(failed)


class NodesNotBackError(RuntimeError):
    """The worker group could not be placed again within the wait: a lost node did not come back."""


def _say_from_controller(message: str) -> None:
    # The controller's stdout reaches the job logs; the submitter shows `[driver] waiting` lines.
    print(f"[driver] {message}", flush=True)


class WorkerGroupWait(ControllerCallback):
    """Runs in Ray Train's controller. When a node is lost, Ray Train restarts the worker group; while
    the node's resources are missing, each start times out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S)
    and is retried without limit (`FailureConfig.controller_failure_limit` is -1): a run that waits
    in silence, for ever. This says in the job's log, at every retry, that the run is waiting for a
    node and for how long, says when the group is placed again, and fails the run with the reason
    once it has waited `limit_s`."""

    def __init__(self, *, limit_s: float, num_workers: int, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] = _say_from_controller, elastic: bool = False) -> None:
        self.limit_s = limit_s
        self.num_workers = num_workers
        self.elastic = elastic
        """An elastic run is placed again on as many workers as fit (the ResizeReporter's line says)."""
        self.clock = clock
        self.say = say
        self.waiting_since: Optional[float] = None
        """When the worker group stopped running (a restart began, or the first start failed)."""
        self.announced = False

    def after_controller_state_update(self, previous_state, current_state) -> None:
        from ray.train.v2._internal.execution.controller.state import (
            ReschedulingState,
            RestartingState,
            RunningState,
        )

        if isinstance(current_state, (RestartingState, ReschedulingState)) and self.waiting_since is None:
            self.waiting_since = self.clock()
        if isinstance(current_state, ReschedulingState):
            self.start_failed()
        elif isinstance(current_state, RunningState):
            if self.announced:
                which = "the workers" if self.elastic else f"the {self.num_workers} workers"
                self.say(f"{which} are placed again after {self.waited_s():.0f} s; the run "
                         "resumes from its latest checkpoint")
            self.waiting_since, self.announced = None, False

    def waited_s(self) -> float:
        return 0.0 if self.waiting_since is None else self.clock() - self.waiting_since

    def start_failed(self) -> None:
        """A start of the worker group timed out: its resources (a node's) are missing."""
        waited = self.waited_s()
        if waited >= self.limit_s:
            raise NodesNotBackError(
                f"the {self.num_workers} workers could not be placed for {waited:.0f} s (--wait-nodes-s "
                f"{self.limit_s:.0f}): a lost node did not come back. `kubectl -n ray get pods` and `kubectl get "
                "nodes` show what is missing; resubmitting with the same --run-name resumes from the latest "
                "checkpoint")
        self.announced = True
        self.say(f"waiting for a lost node: the {self.num_workers} workers cannot be placed until its resources "
                 f"come back (on EKS the node group replaces the instance, KubeRay the pod); waited {waited:.0f} s "
                 f"of {self.limit_s:.0f} s")


class ResizeReporter(ControllerCallback):
    """Runs in Ray Train's controller: says in the job's log, as a `[driver] {...}` line, on how
    many workers each start of the worker group runs and why it was restarted (a preempted node,
    a failure, capacity back), so that an elastic run's resizes are in its log and its report."""

    def __init__(self, *, planned_workers: int, say: Callable[[str], None] = _say_from_controller) -> None:
        self.planned_workers = planned_workers
        self.say = say
        self.why = "start"
        self.started = 0

    def after_controller_state_update(self, previous_state, current_state) -> None:
        from ray.train.v2._internal.execution.controller.state import (
            PreemptingState,
            ResizingState,
            RestartingState,
            RunningState,
        )

        # The cause holds over the starts that time out (a lost node's resources still counted)
        # until the group runs again.
        if isinstance(current_state, PreemptingState):
            self.why = "preemption"
        elif isinstance(current_state, RestartingState) and self.why != "preemption":
            self.why = "failure"
        elif isinstance(current_state, ResizingState):
            self.why = "capacity back"
        elif isinstance(current_state, RunningState):
            self.why = "restart"

    def on_controller_start_worker_group(self, *, scaling_config, num_workers: int):
        import json

        self.started += 1
        self.say(json.dumps({"event": "workers", "workers": num_workers, "planned_workers": self.planned_workers,
                             "start": self.started, "why": self.why}, sort_keys=True))
        return None


def echo_nccl_logs(log_dir: Path) -> None:
    """Print this rank's NCCL log files so they reach the job logs (the submitter's offline gate)."""
    for path in sorted(log_dir.glob("*")):
        print(path.read_text(errors="replace"), end="", flush=True)


def check_storage_on_every_rank(ctx: TrainContext) -> None:
    """Each rank writes and deletes a marker under the run's storage folder; the outcomes are
    all-gathered, so that every rank raises the same StorageNotWritableError or none does."""
    import torch
    import torch.distributed as dist

    storage = ray.train.get_context().get_storage()
    problem = None
    try:
        check_writable(storage.storage_filesystem, storage.experiment_fs_path, uri=storage_uri(storage),
                       marker=marker_name(host=socket.gethostname(), pid=os.getpid()))
    except StorageNotWritableError as exc:
        problem = f"rank {ctx.rank}: {exc}"
    if torch.cuda.is_available():
        torch.cuda.set_device(ctx.local_rank)  # all_gather_object over NCCL stages on this device
    problems: list[Optional[str]] = [None] * ctx.world_size
    dist.all_gather_object(problems, problem)
    failed = [p for p in problems if p]
    if failed:
        raise StorageNotWritableError(f"{len(failed)} of {ctx.world_size} ranks cannot write checkpoints:\n"
                                      + "\n".join(failed))


def storage_uri(storage) -> str:
    """How the run's storage folder is named for people: `s3://bucket/prefix/run` or a local path."""
    type_name = storage.storage_filesystem.type_name
    path = storage.experiment_fs_path
    return path if type_name == "local" else f"{type_name}://{path}"


def remove_local_checkpoints(scratch_dir: Path) -> None:
    """Delete this rank's checkpoint folders in flight from an earlier attempt (a rank killed during a
    save leaves one on the node's disk; persisted ones are already deleted after their upload)."""
    for stale in scratch_dir.glob("checkpoint-*"):
        shutil.rmtree(stale, ignore_errors=True)


def settled_context(ctx: TrainContext) -> TrainContext:
    """Rank 0 settles the run's checkpoints in storage (no rank of this attempt has written one yet:
    what is unregistered was left by a rank that died writing it, or by a head lost before it
    registered a complete one) and every rank resumes from the checkpoint it chose: Ray Train's, or
    a newer complete one (workloads/launch/checkpoints.py)."""
    import torch.distributed as dist

    storage = ray.train.get_context().get_storage()
    chosen: list[Optional[str]] = [None]
    if ctx.rank == 0:
        chosen[0] = settle(storage.storage_filesystem, storage.experiment_fs_path,
                           say=lambda message: print(f"[checkpoints] {message}", flush=True)).resume_from
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return ctx
    if ctx.rank == 0:
        RESUMED_UNREGISTERED.add(chosen[0])
    newer = ray.train.Checkpoint(path=f"{storage.experiment_fs_path.rstrip('/')}/{chosen[0]}",
                                 filesystem=storage.storage_filesystem)
    restore_root = SCRATCH_ROOT / ray.train.get_context().get_experiment_name() / "restored"
    return dataclasses.replace(ctx, latest_checkpoint=checkpoint_loader(restore_root=restore_root, rank=ctx.rank,
                                                                        newer=newer))


def train_worker(config: dict) -> None:
    """`train_loop_per_worker` of the TorchTrainer: config is {"train": TrainConfig.to_dict()}."""
    from workloads.train import tracking
    from workloads.train.config import TrainConfig
    from workloads.train.loop import train

    load_credentials()  # MLflow's and the hub's, from the pod's Secret (workloads/launch/credentials.py)
    cfg = TrainConfig.from_dict(config["train"])
    # An elastic run: the world size grad_accum_steps is meant for (workloads/train/elastic.py).
    ctx = ray_train_context(planned_world_size=int(config.get("planned_world_size", 0)), final_step=cfg.steps)
    # Ray Train creates the process group without a device, so NCCL starts (and reads its
    # environment) only at the first collective: setting the log file here works. This is the one
    # place that sets it (the worker pods do not), so each rank's log lands in its scratch folder.
    nccl_dir = ctx.scratch_dir / "nccl"
    nccl_dir.mkdir(exist_ok=True)
    for stale in nccl_dir.glob("*"):  # from an earlier attempt of this run
        stale.unlink()
    remove_local_checkpoints(ctx.scratch_dir)
    os.environ.update(nccl_log_env(log_dir=nccl_dir))
    try:
        check_storage_on_every_rank(ctx)
        ctx = settled_context(ctx)
        with tracking.ends_with_the_run():  # FAILED or KILLED in the tracker, not RUNNING, when it raises
            train(cfg, ctx)
    except PreflightError as exc:
        # Raised on every rank together; each returns after one report, as Ray Train requires.
        ray.train.report({PREFLIGHT_FAILED_KEY: str(exc)})
    finally:
        echo_nccl_logs(nccl_dir)
