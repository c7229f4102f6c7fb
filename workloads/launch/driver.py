"""The job's entrypoint: `python -m workloads.launch.driver --config-json JSON --run-name NAME --storage-path P`.

Runs on the Ray cluster (submitted through the Jobs API). It sizes the worker group from the alive
nodes' resources (one worker per GPU, or one per CPU slot when the cluster has no GPU), so the same
command runs on 1 or N nodes; a job that expects GPUs (`--gpus N`, or an EFA transport) first waits
for them, saying what is missing, and fails rather than train on fewer or on the CPU. Then it starts
a TorchTrainer whose run is named, stored and retried as asked. Starting a run again under the same
name and storage resumes it from its latest checkpoint. A run that loses a node waits for it to come
back (`--wait-nodes-s`), saying so in its log, and then fails with the reason rather than wait for
ever. A check that fails before step 1 (the transport gate, the storage write check) stops the run
without a retry. A failed run exits non-zero
with the reason on its last line.

On a cluster whose workers scale to zero there is nothing to size the job by until they come, and
Ray's autoscaler adds workers only for demand it can see: while the driver waits for its GPUs (or
CPU workers) it holds a placement group of what it waits for (`ask_for`), the demand that brings
the workers (and, on EKS, their nodes) back, and removes it before Ray Train reserves them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

DRIVER_PREFIX = "[driver] "
"""Prefix of the driver's machine-readable lines in the job logs (see `parse_driver_line`)."""


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    num_workers: int
    """Ray Train workers (= torch.distributed ranks)."""
    use_gpu: bool
    """One GPU per worker (NCCL) when true; CPU workers with gloo otherwise."""
    cpus_per_worker: float
    """Logical CPUs each worker reserves (Ray sets OMP_NUM_THREADS to it)."""
    nodes: int
    """Nodes that host training workers: the GPU nodes, or the nodes with room for a CPU worker.
    The head pod (no GPU on EKS, no CPU for workers locally) is not one of them."""


def node_resources(ray_nodes: list[dict]) -> list[dict[str, float]]:
    """The resources of each alive node, from `ray.nodes()`."""
    return [dict(node.get("Resources") or {}) for node in ray_nodes if node.get("Alive")]


def plan_workers(nodes: list[Mapping[str, float]], *, cpus_per_worker: Optional[float] = None) -> WorkerPlan:
    """Size the worker group from each alive node's resources: one worker per GPU, or, on a
    cluster without GPUs, one per `cpus_per_worker` CPUs (default 1) of each node.

    GPU workers get the CPUs of their node shared out evenly (whole CPUs where there are enough)
    unless `cpus_per_worker` says otherwise: Ray sets OMP_NUM_THREADS to a worker's CPU count, and 1
    would starve the data loader and the host-side work of an 11-vCPU-per-GPU g6.12xlarge."""
    if cpus_per_worker is not None and cpus_per_worker <= 0:
        raise ValueError(f"cpus_per_worker must be positive, got {cpus_per_worker}")
    gpu_nodes = [n for n in nodes if n.get("GPU", 0) >= 1]
    if gpu_nodes:
        if cpus_per_worker is None:
            share = min(n.get("CPU", 0) / int(n["GPU"]) for n in gpu_nodes)
            cpus_per_worker = float(math.floor(share)) if share >= 1 else share
        short = [n for n in gpu_nodes if n.get("CPU", 0) + 1e-9 < int(n["GPU"]) * cpus_per_worker]
        if short:
            raise ValueError(f"a GPU node offers {short[0].get('CPU', 0):g} CPUs for {int(short[0]['GPU'])} GPU "
                             f"workers of {cpus_per_worker:g} CPUs each: lower --cpus-per-worker")
        return WorkerPlan(num_workers=sum(int(n["GPU"]) for n in gpu_nodes), use_gpu=True,
                          cpus_per_worker=cpus_per_worker, nodes=len(gpu_nodes))
    per_worker = cpus_per_worker or 1.0
    slots = [math.floor(n.get("CPU", 0) / per_worker + 1e-9) for n in nodes]
    if sum(slots) < 1:
        total = sum(n.get("CPU", 0) for n in nodes)
        raise ValueError(f"the cluster has no GPU and {total:g} CPUs, no node with room for one worker's "
                         f"{per_worker:g}")
    return WorkerPlan(num_workers=sum(slots), use_gpu=False, cpus_per_worker=per_worker,
                      nodes=sum(1 for s in slots if s > 0))


class GpusMissingError(RuntimeError):
    """The GPUs (or, without GPUs, the CPU workers) the job waits for did not register with the Ray
    cluster in time."""


def wait_for_gpus(
    expected: int,
    *,
    read_nodes: Callable[[], list[Mapping[str, float]]],
    timeout_s: float,
    say: Callable[[str], None],
    poll_s: float = 5.0,
    every_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Mapping[str, float]]:
    """Wait until the cluster's alive nodes hold at least `expected` GPUs (at least 1 when
    `expected` is 0, the count unknown), saying what is missing every `every_s`; returns the nodes.
    Never downgrades: GpusMissingError after `timeout_s`."""

    def missing(nodes: list[Mapping[str, float]], have: int, want: int) -> str:
        return (f"{have} of {want} GPU(s) registered with the Ray cluster within {timeout_s:.0f} s "
                f"({sum(1 for n in nodes if n.get('GPU', 0) >= 1)} GPU node(s)): the GPU worker pods are not "
                "up; `kubectl -n ray get pods` shows them, and `kubectl -n ray describe pod` a Pending "
                "pod's scheduling reason. Not training on fewer GPUs or on the CPU.")

    return _wait_for(max(1, expected), "GPU(s)", count=lambda nodes: int(sum(n.get("GPU", 0) for n in nodes)),
                     missing=missing, read_nodes=read_nodes, timeout_s=timeout_s, say=say, poll_s=poll_s,
                     every_s=every_s, clock=clock, sleep=sleep)


def wait_for_cpu_workers(expected: int, *, read_nodes: Callable[[], list[Mapping[str, float]]], timeout_s: float,
                         say: Callable[[str], None], cpus_per_worker: Optional[float] = None,
                         **timing) -> list[Mapping[str, float]]:
    """Wait until a cluster without GPUs has room for `expected` CPU workers (a resubmitted run's
    earlier world size, while its worker nodes rejoin a restarted head); GpusMissingError after
    `timeout_s`, rather than resume the run with fewer ranks."""

    def room(nodes: list[Mapping[str, float]]) -> int:
        try:
            return plan_workers(nodes, cpus_per_worker=cpus_per_worker).num_workers
        except ValueError:
            return 0

    def missing(nodes: list[Mapping[str, float]], have: int, want: int) -> str:
        return (f"room for {have} of {want} CPU worker(s) within {timeout_s:.0f} s: a worker node has not "
                "(re)joined the Ray cluster. Not resuming the run with fewer ranks than it had.")

    return _wait_for(expected, "CPU worker slot(s)", count=room, missing=missing, read_nodes=read_nodes,
                     timeout_s=timeout_s, say=say, **timing)


def _wait_for(want: int, unit: str, *, count: Callable[[list[Mapping[str, float]]], int],
              missing: Callable[[list[Mapping[str, float]], int, int], str],
              read_nodes: Callable[[], list[Mapping[str, float]]], timeout_s: float, say: Callable[[str], None],
              poll_s: float = 5.0, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> list[Mapping[str, float]]:
    deadline = clock() + timeout_s
    next_say = clock()
    while True:
        nodes = read_nodes()
        have = count(nodes)
        if have >= want:
            return nodes
        left = deadline - clock()
        if left <= 0:
            raise GpusMissingError(missing(nodes, have, want))
        if clock() >= next_say:
            say(f"waiting for {want} {unit}: {have} registered; {left:.0f} s left")
            next_say = clock() + every_s
        sleep(min(poll_s, max(left, 0.0)))


def demand_bundles(*, require_gpus: bool, gpus: int, workers: int,
                   cpus_per_worker: Optional[float]) -> list[dict[str, float]]:
    """What a job that waits asks the autoscaler for: one bundle per GPU it waits for (one when it
    requires GPUs without knowing how many: the wait's own floor), else one per CPU worker."""
    if require_gpus:
        return [{"GPU": 1.0}] * max(1, gpus)
    return [{"CPU": float(cpus_per_worker or 1.0)}] * workers


DEMAND_SETTLE_S = 30.0
"""How long the driver lets its placement group of the demand finish being placed, once what it
waited for is there, before it removes the group."""


@contextmanager
def ask_for(bundles: list[dict[str, float]], *, placement_group: Callable[..., Any],
            remove: Callable[[Any], None], settle_s: float = DEMAND_SETTLE_S) -> Iterator[None]:
    """Hold a placement group of `bundles` while the block waits: on a cluster that autoscales,
    the pending group is the demand that adds the nodes; elsewhere it is placed or stays pending,
    and changes nothing. Soft packing: the bundles may spread over as many nodes as they need.
    Removed on the way out (the group also ends with the job, should the driver be killed), so
    that Ray Train can reserve what it brought and an idle cluster can shrink again.

    Once the wait is over the resources are there and the group is being placed: it is removed
    only once placed (or after `settle_s`). Removed while Ray 2.58 was still placing it, its GPUs
    stayed reserved on the nodes, and every start of the worker group then timed out waiting for
    them (seen on two GPU nodes: `ray status` showed 2.0/2.0 GPU used, no placement group left).
    A wait that failed removes the pending group at once."""
    group = placement_group(bundles, strategy="PACK")
    try:
        yield
    except BaseException:
        remove(group)
        raise
    group.wait(timeout_seconds=settle_s)
    remove(group)


@dataclass(frozen=True, kw_only=True)
class DriverArgs:
    train: dict
    """The training config as `TrainConfig.to_dict()` gives it."""
    run_name: str
    """Ray Train run name; a run started again under the same name and storage resumes."""
    storage_path: str
    """Where Ray Train persists checkpoints: `s3://bucket/prefix` on EKS, an absolute folder locally."""
    max_failures: int
    """Worker-group restarts (from the latest checkpoint) before the run fails."""
    max_preemptions: int = -1
    """Restarts after a node preemption (a drained node: a Spot interruption), counted apart from
    `max_failures`; -1: every preemption is retried."""
    cpus_per_worker: Optional[float]
    """Logical CPUs each worker reserves; None shares each GPU node's CPUs out among its GPUs."""
    keep_checkpoints: int
    """Newest checkpoints kept in storage; older ones are deleted."""
    gpus: int
    """GPUs the job waits for before it trains (the stack's worker GPUs); 0: not known."""
    workers: int
    """CPU workers a run without GPUs waits for room for before it trains (a resubmitted run's
    earlier world size); 0: none, the plan takes what the cluster has."""
    require_gpus: bool
    """Train on GPUs or not at all: wait for `gpus` (or at least one) instead of falling back to CPU
    workers. Set by --gpus, and by an EFA transport expectation."""
    wait_gpus_s: float
    """How long to wait for the GPUs before failing."""
    min_nodes: int = 0
    """An elastic run: it goes on (restarting from its latest checkpoint) with as few as this many
    of its nodes, and grows back when the others return; 0: all of them, a fixed world size."""
    wait_nodes_s: float
    """How long a run that lost a node waits for it to come back before failing (on EKS the node group
    starts a new instance and KubeRay a new pod on it: boot, image pull and Ray start take minutes)."""


def parse_args(argv: list[str]) -> DriverArgs:
    """Parse and validate the command line; ValueError names the bad value."""
    parser = argparse.ArgumentParser(prog="python -m workloads.launch.driver", description=__doc__.splitlines()[0])
    parser.add_argument("--config-json", required=True, help="TrainConfig as JSON")
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--storage-path", required=True, help="s3://bucket/prefix or an absolute folder")
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--max-preemptions", type=int, default=-1,
                        help="restarts after a node preemption, apart from --max-failures (-1: unlimited)")
    parser.add_argument("--cpus-per-worker", type=float,
                        help="CPUs per worker (default: a GPU node's CPUs shared among its GPUs; 1 without GPUs)")
    parser.add_argument("--keep-checkpoints", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=0, help="wait for this many GPUs before training")
    parser.add_argument("--workers", type=int, default=0,
                        help="without GPUs: wait for room for this many CPU workers before training")
    parser.add_argument("--wait-gpus-s", type=float, default=900.0,
                        help="how long to wait for the GPUs or workers (default 900)")
    parser.add_argument("--min-nodes", type=int, default=0,
                        help="go on with at least this many nodes after a node loss (default 0: all of them)")
    parser.add_argument("--wait-nodes-s", type=float, default=1200.0,
                        help="how long a run that lost a node waits for it to come back (default 1200)")
    ns = parser.parse_args(argv)
    try:
        train = json.loads(ns.config_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config-json is not valid JSON: {exc}") from None
    if not isinstance(train, dict):
        raise ValueError("--config-json must be a JSON object")
    storage = ns.storage_path
    if "://" not in storage and not Path(storage).is_absolute():
        raise ValueError(f"--storage-path {storage!r} must be a URI (s3://...) or an absolute folder")
    if ns.max_failures < 0:
        raise ValueError(f"--max-failures must be >= 0, got {ns.max_failures}")
    if ns.max_preemptions < -1:
        raise ValueError(f"--max-preemptions must be -1 (unlimited) or more, got {ns.max_preemptions}")
    if ns.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be >= 1, got {ns.keep_checkpoints}")
    if ns.gpus < 0 or ns.workers < 0 or ns.wait_gpus_s < 0:
        raise ValueError(f"--gpus, --workers and --wait-gpus-s must be >= 0, got {ns.gpus}, {ns.workers} and "
                         f"{ns.wait_gpus_s:g}")
    if ns.min_nodes < 0:
        raise ValueError(f"--min-nodes must be >= 1 (or 0 for all nodes), got {ns.min_nodes}")
    if ns.wait_nodes_s <= 0:
        raise ValueError(f"--wait-nodes-s must be > 0, got {ns.wait_nodes_s:g}")
    expects_efa = (train.get("transport") or {}).get("expect", "efa") == "efa"
    return DriverArgs(
        train=train,
        run_name=ns.run_name,
        storage_path=storage,
        max_failures=ns.max_failures,
        max_preemptions=ns.max_preemptions,
        cpus_per_worker=ns.cpus_per_worker,
        keep_checkpoints=ns.keep_checkpoints,
        gpus=ns.gpus,
        workers=ns.workers,
        require_gpus=ns.gpus > 0 or expects_efa,
        wait_gpus_s=ns.wait_gpus_s,
        wait_nodes_s=ns.wait_nodes_s,
        min_nodes=ns.min_nodes,
    )


def parse_driver_line(line: str) -> Optional[dict]:
    """The JSON of a `[driver] {...}` line (as the job logs show it), or None for any other line."""
    start = line.find(DRIVER_PREFIX + "{")
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(DRIVER_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def failure_reason(error: BaseException) -> str:
    """One line saying why training failed: each failing rank's error (`error_line`), ranks that
    failed alike together; without ranks, the controller's error's last line (a traceback's)."""
    worker_failures = getattr(error, "worker_failures", None)
    if worker_failures:
        by_line: dict[str, list[int]] = {}
        for rank in sorted(worker_failures):
            by_line.setdefault(error_line(worker_failures[rank]), []).append(rank)
        parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {line}"
                 for line, ranks in by_line.items()]
        shown = parts[:MAX_RANK_ERRORS_SHOWN]
        more = len(parts) - len(shown)
        return "; ".join(shown) + (f"; and {more} other error(s) in the job's log" if more else "")
    cause = getattr(error, "controller_failure", None) or error.__cause__ or error
    return _last_line(str(cause)) or type(cause).__name__


MAX_RANK_ERRORS_SHOWN = 4
"""Distinct rank errors the failure line names; the job's log has every rank's traceback."""


def error_line(exc: BaseException) -> str:
    """A rank's error in one line: its type and the first line of its message (`MemoryError`,
    `OSError: no model`), never empty: some errors carry no message (a MemoryError has none)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def training_failed_errors() -> tuple[type[BaseException], ...]:
    """What `TorchTrainer.fit` raises when training fails: Ray Train V2's error, and V1's for
    images that turn V2 off (RAY_TRAIN_V2_ENABLED=0)."""
    from ray.train.base_trainer import TrainingFailedError as V1Error
    from ray.train.v2.api.exceptions import TrainingFailedError as V2Error

    return (V2Error, V1Error)


def _emit(record: dict) -> None:
    print(DRIVER_PREFIX + json.dumps(record, sort_keys=True), flush=True)


def _say(message: str) -> None:
    print(f"{DRIVER_PREFIX}{message}", flush=True)


START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
"""Ray Train's wait for a worker group's resources before it retries the start (default 60 s)."""


ELASTIC_START_TIMEOUT_S = 20.0
"""An elastic run's wait for a worker group's resources: just after a node is lost Ray may still
count its resources and start the old size, which times out; the run then goes on with fewer."""


def start_timeout_s(wait_nodes_s: float, *, elastic: bool = False) -> float:
    """How long each start of the worker group waits for its resources: a sixth of the whole wait
    for a lost node, between 5 and 60 s, so that the job's log says how the wait goes at that pace;
    at most ELASTIC_START_TIMEOUT_S for an elastic run, which need not wait for the node."""
    timeout = min(60.0, max(5.0, wait_nodes_s / 6))
    return min(timeout, ELASTIC_START_TIMEOUT_S) if elastic else timeout


ELASTIC_MONITOR_S = 10.0
"""How often an elastic run that lost nodes looks for them back (Ray's default is 60 s)."""


def worker_range(plan: WorkerPlan, *, min_nodes: int) -> int | tuple[int, int]:
    """ScalingConfig's num_workers: the plan's workers, or (min, max) for an elastic run that goes
    on with `min_nodes` of the plan's nodes (each node hosting the same number of workers);
    ValueError for more nodes than the plan has or nodes of unequal size."""
    if not min_nodes or min_nodes == plan.nodes:
        return plan.num_workers
    if min_nodes > plan.nodes:
        raise ValueError(f"--min-nodes {min_nodes} is more than the {plan.nodes} node(s) the run trains on")
    if plan.num_workers % plan.nodes:
        raise ValueError(f"--min-nodes needs nodes of one size: {plan.num_workers} workers on {plan.nodes} nodes")
    return (min_nodes * plan.num_workers // plan.nodes, plan.num_workers)


def tell_tracker_where(train: dict, *, filesystem, path: str, model: bool = True) -> bool:
    """Tag the run's tracker run (its id kept in the final checkpoint) with where that checkpoint and
    the exported model are, when the run is tracked (not the model's when `model` is off: it missed
    its evaluation gate). Waits a bounded time; never fails the job."""
    from workloads.train import tracking
    from workloads.train.checkpoint import PROGRESS_FILE
    from workloads.train.config import TrainConfig

    settings = TrainConfig.from_dict(train).tracking
    if not tracking.tracking_uri(settings):
        return False
    _leave_a_removed_folder()
    try:
        with filesystem.open_input_stream(f"{path}/{PROGRESS_FILE}") as stream:
            run_id = str(json.loads(stream.read()).get("tracking_run_id") or "")
        exported = any(filesystem.get_file_info(f"{path}/model/{name}").is_file
                       for name in ("model.safetensors", "model.safetensors.index.json"))
    except (OSError, ValueError) as exc:
        _say(f"tracking: the final checkpoint names no tracker run ({exc})")
        return False
    location = path if filesystem.type_name == "local" else f"{filesystem.type_name}://{path}"
    tags = {"checkpoint": location, **({"model_location": f"{location}/model"} if exported and model else {})}
    if tracking.annotate_run(settings, run_id=run_id, tags=tags, say=print):
        _say(f"tracking: run {run_id or settings.run_name} tagged with "
             f"{', '.join(f'{k}={v}' for k, v in tags.items())}")
        return True
    return False


def _leave_a_removed_folder() -> None:
    try:
        os.getcwd()
    except FileNotFoundError:
        # The job's working_dir, this process's folder, can be gone by now: on one machine the local
        # cluster's nodes share one runtime_resources folder, and the workers' runtime env removes it
        # as they exit. MLflow's plugin discovery reads the current folder.
        os.chdir(tempfile.gettempdir())


def tell_tracker_it_failed(train: dict) -> bool:
    """End the run's tracker run FAILED when it is still RUNNING: its rank 0 did when the loop
    raised, but not when it was killed (a lost worker, a node) before Ray Train gave up. Found by
    its run name; a bounded wait; never fails the job further."""
    from workloads.train import tracking
    from workloads.train.config import TrainConfig

    settings = TrainConfig.from_dict(train).tracking
    uri = tracking.tracking_uri(settings)
    if not uri or not settings.run_name:
        return False
    _leave_a_removed_folder()
    if tracking.end_run(uri, experiment=settings.experiment_name, run_name=settings.run_name, status="FAILED",
                        say=print):
        _say(f"tracking: run {settings.run_name} ended FAILED")
        return True
    return False


def check_evaluation(train: dict) -> None:
    """The evaluation the run asks for is possible, before any training (ValueError otherwise):
    workloads/evaluate/stage.py."""
    from workloads.evaluate.stage import check_before_training

    for line in check_before_training(train):
        _say(f"evaluate: {line}")


def evaluate_trained(train: dict, *, checkpoint, plan: WorkerPlan) -> Optional[dict]:
    """The stage after training on the workers the run held (workloads/evaluate/stage.py); its
    `[evaluate] {...}` line tells the client the comparison and the gate. Never fails the job."""
    from workloads.evaluate.stage import evaluate_after_training

    location = checkpoint.path if checkpoint.filesystem.type_name == "local" else \
        f"{checkpoint.filesystem.type_name}://{checkpoint.path}"
    storage = location.rstrip("/").rpartition("/")[0].rpartition("/")[0]  # <storage>/<run>/<checkpoint>
    _leave_a_removed_folder()
    return evaluate_after_training(train, checkpoint_uri=location, storage_path=storage, use_gpu=plan.use_gpu,
                                   cpus_per_unit=plan.cpus_per_worker, say=lambda line: _say(f"evaluate: {line}"))


def checkpoint_config(train: dict, *, keep: int):
    """Ray Train's checkpoint retention: the `keep` newest, or with `checkpoint.keep_best` the `keep`
    of the lowest eval loss (Ray Train keeps the latest besides, for a resume)."""
    from ray.train import CheckpointConfig

    if (train.get("checkpoint") or {}).get("keep_best"):
        return CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute="eval_loss", checkpoint_score_order="min")
    return CheckpointConfig(num_to_keep=keep)


def run(args: DriverArgs) -> int:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from workloads.evaluate.stage import preload as preload_the_evaluation_stage
    from workloads.launch.credentials import load_credentials
    from workloads.launch.ray_train import PreflightRecorder, ResizeReporter, WorkerGroupWait, train_worker
    from workloads.launch.storage import resolve_storage
    from workloads.train.config import TrainConfig

    preload_the_evaluation_stage()  # before the job's folder can go (workloads/evaluate/stage.py)
    load_credentials()  # MLflow's and the hub's, from the pod's Secret (workloads/launch/credentials.py)
    train = TrainConfig.from_dict(args.train).to_dict()
    storage_filesystem, storage_path = resolve_storage(args.storage_path)
    preflight_file = Path(tempfile.mkdtemp(prefix="preflight-")) / "failed.txt"
    # Read by Ray Train's controller, which inherits the variables it knows from this process.
    os.environ.setdefault(START_TIMEOUT_ENV, f"{start_timeout_s(args.wait_nodes_s, elastic=args.min_nodes > 0):g}")
    ray.init(address="auto", log_to_driver=True)
    try:
        read_nodes = lambda: node_resources(ray.nodes())  # noqa: E731
        if args.require_gpus or args.workers:
            bundles = demand_bundles(require_gpus=args.require_gpus, gpus=args.gpus, workers=args.workers,
                                     cpus_per_worker=args.cpus_per_worker)
            with ask_for(bundles, placement_group=ray.util.placement_group,
                         remove=ray.util.remove_placement_group):
                if args.require_gpus:
                    nodes = wait_for_gpus(args.gpus, read_nodes=read_nodes, timeout_s=args.wait_gpus_s, say=_say)
                else:
                    nodes = wait_for_cpu_workers(args.workers, read_nodes=read_nodes, timeout_s=args.wait_gpus_s,
                                                 say=_say, cpus_per_worker=args.cpus_per_worker, poll_s=1.0,
                                                 every_s=10.0)
        else:
            nodes = read_nodes()
        check_evaluation(train)
        plan = plan_workers(nodes, cpus_per_worker=args.cpus_per_worker)
        workers = worker_range(plan, min_nodes=args.min_nodes)
        _emit({"event": "plan", "run_name": args.run_name, **asdict(plan),
               "min_workers": workers[0] if isinstance(workers, tuple) else plan.num_workers})
        elastic = {"elastic_resize_monitor_interval_s": ELASTIC_MONITOR_S} if isinstance(workers, tuple) else {}
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={"train": train, "planned_world_size": plan.num_workers if elastic else 0},
            scaling_config=ScalingConfig(
                num_workers=workers,
                **elastic,
                use_gpu=plan.use_gpu,
                resources_per_worker={"CPU": plan.cpus_per_worker, **({"GPU": 1} if plan.use_gpu else {})},
            ),
            run_config=RunConfig(
                name=args.run_name,
                storage_path=storage_path,
                storage_filesystem=storage_filesystem,
                # A preemption (a drained node) has its own budget: it does not use up --max-failures.
                failure_config=FailureConfig(max_failures=args.max_failures,
                                             max_preemption_failures=args.max_preemptions),
                checkpoint_config=checkpoint_config(train, keep=args.keep_checkpoints),
                callbacks=[PreflightRecorder(str(preflight_file)),
                           WorkerGroupWait(limit_s=args.wait_nodes_s, num_workers=plan.num_workers,
                                           elastic=bool(elastic)),
                           ResizeReporter(planned_workers=plan.num_workers)],
            ),
        )
        try:
            result = trainer.fit()
        except training_failed_errors() as exc:
            reason = failure_reason(exc)
        else:
            preflight = preflight_file.read_text() if preflight_file.is_file() else None
            if preflight:
                # Every rank stopped before step 1 and returned: nothing was retried.
                print(preflight, flush=True)
                # The whole of it on the one line a follower shows: the count, and each rank's reason.
                reason = "stopped before step 1, not retried: " + " ".join(
                    line.strip() for line in preflight.splitlines() if line.strip())
            else:
                checkpoint = result.checkpoint.path if result.checkpoint else None
                _emit({"event": "finished", "metrics": result.metrics, "checkpoint": checkpoint})
                if result.checkpoint is not None:
                    evaluation = evaluate_trained(train, checkpoint=result.checkpoint, plan=plan)
                    tell_tracker_where(train, filesystem=result.checkpoint.filesystem, path=result.checkpoint.path,
                                       model=(evaluation or {}).get("passed", True))
                return 0
    finally:
        ray.shutdown()
        shutil.rmtree(preflight_file.parent, ignore_errors=True)
    tell_tracker_it_failed(train)
    print(f"error: training failed: {reason}", flush=True)
    return 1


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    except GpusMissingError as exc:
        print(f"error: {exc}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
