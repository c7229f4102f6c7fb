"""The job's entrypoint: `python -m workloads.launch.driver --config-json JSON --run-name NAME --storage-path P`.

Runs on the Ray cluster (submitted through the Jobs API). It sizes the worker group from
`ray.cluster_resources()` (one worker per GPU, or one per CPU slot when the cluster has no GPU), so
the same command runs on 1 or N nodes, and starts a TorchTrainer whose run is named, stored and
retried as asked. Starting a run again under the same name and storage resumes it from its latest
checkpoint. A failed run exits non-zero with the reason on its last line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

if TYPE_CHECKING:
    import pyarrow.fs

DRIVER_PREFIX = "[driver] "
"""Prefix of the driver's machine-readable lines in the job logs (see `parse_driver_line`)."""


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    num_workers: int
    """Ray Train workers (= torch.distributed ranks)."""
    use_gpu: bool
    """One GPU per worker (NCCL) when true; CPU workers with gloo otherwise."""
    cpus_per_worker: float
    """Logical CPUs each worker reserves."""


def plan_workers(resources: Mapping[str, float], *, cpus_per_worker: float = 1.0) -> WorkerPlan:
    """Size the worker group from `ray.cluster_resources()`: every GPU, or else every CPU slot."""
    if cpus_per_worker <= 0:
        raise ValueError(f"cpus_per_worker must be positive, got {cpus_per_worker}")
    gpus = int(resources.get("GPU", 0))
    if gpus > 0:
        return WorkerPlan(num_workers=gpus, use_gpu=True, cpus_per_worker=cpus_per_worker)
    cpu_slots = math.floor(resources.get("CPU", 0) / cpus_per_worker + 1e-9)
    if cpu_slots < 1:
        raise ValueError(
            f"the cluster has no GPU and {resources.get('CPU', 0):g} CPUs, "
            f"fewer than one worker's {cpus_per_worker:g}"
        )
    return WorkerPlan(num_workers=cpu_slots, use_gpu=False, cpus_per_worker=cpus_per_worker)


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
    cpus_per_worker: float
    """Logical CPUs each worker reserves."""
    keep_checkpoints: int
    """Newest checkpoints kept in storage; older ones are deleted."""


def parse_args(argv: list[str]) -> DriverArgs:
    """Parse and validate the command line; ValueError names the bad value."""
    parser = argparse.ArgumentParser(prog="python -m workloads.launch.driver", description=__doc__.splitlines()[0])
    parser.add_argument("--config-json", required=True, help="TrainConfig as JSON")
    parser.add_argument("--run-name", required=True)
    parser.add_argument("--storage-path", required=True, help="s3://bucket/prefix or an absolute folder")
    parser.add_argument("--max-failures", type=int, default=1)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--keep-checkpoints", type=int, default=2)
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
    if ns.keep_checkpoints < 1:
        raise ValueError(f"--keep-checkpoints must be >= 1, got {ns.keep_checkpoints}")
    return DriverArgs(
        train=train,
        run_name=ns.run_name,
        storage_path=storage,
        max_failures=ns.max_failures,
        cpus_per_worker=ns.cpus_per_worker,
        keep_checkpoints=ns.keep_checkpoints,
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
    """One line saying why training failed: the first failing rank and its exception's last line."""
    worker_failures = getattr(error, "worker_failures", None)
    if worker_failures:
        rank = min(worker_failures)
        return f"rank {rank}: {_last_line(str(worker_failures[rank]))}"
    cause = getattr(error, "controller_failure", None) or error
    return _last_line(str(cause)) or type(cause).__name__


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def resolve_storage(storage_path: str) -> tuple[Optional["pyarrow.fs.FileSystem"], str]:
    """Ray Train's storage as (filesystem, path on it), resolved once here, in the job's entrypoint.

    A URI goes through pyarrow, whose S3 filesystem honours the standard AWS environment
    (credentials, AWS_REGION, and AWS_ENDPOINT_URL_S3 before AWS_ENDPOINT_URL), so `s3://bucket/prefix`
    reaches the real bucket or any S3-compatible endpoint the same way. The resolved filesystem
    carries its endpoint to the TrainController and every worker, whatever their own node's
    environment says. A local folder is left to Ray as it is: (None, the folder).
    """
    if "://" not in storage_path:
        return None, storage_path
    import pyarrow.fs

    try:
        return pyarrow.fs.FileSystem.from_uri(storage_path)
    except OSError as exc:  # pyarrow.ArrowInvalid (a bad URI) is already a ValueError
        raise ValueError(f"cannot open storage {storage_path}: {_last_line(str(exc))}") from None


def _emit(record: dict) -> None:
    print(DRIVER_PREFIX + json.dumps(record, sort_keys=True), flush=True)


def run(args: DriverArgs) -> int:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.exceptions import TrainingFailedError

    from workloads.train.config import TrainConfig
    from workloads.launch.ray_train import train_worker

    train = TrainConfig.from_dict(args.train).to_dict()
    storage_filesystem, storage_path = resolve_storage(args.storage_path)
    ray.init(address="auto", log_to_driver=True)
    try:
        plan = plan_workers(ray.cluster_resources(), cpus_per_worker=args.cpus_per_worker)
        nodes = sum(1 for node in ray.nodes() if node["Alive"])
        _emit({"event": "plan", "nodes": nodes, "run_name": args.run_name, **asdict(plan)})
        trainer = TorchTrainer(
            train_worker,
            train_loop_config={"train": train},
            scaling_config=ScalingConfig(
                num_workers=plan.num_workers,
                use_gpu=plan.use_gpu,
                resources_per_worker={"CPU": plan.cpus_per_worker, **({"GPU": 1} if plan.use_gpu else {})},
            ),
            run_config=RunConfig(
                name=args.run_name,
                storage_path=storage_path,
                storage_filesystem=storage_filesystem,
                failure_config=FailureConfig(max_failures=args.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=args.keep_checkpoints),
            ),
        )
        try:
            result = trainer.fit()
        except TrainingFailedError as exc:
            reason = failure_reason(exc)
        else:
            checkpoint = result.checkpoint.path if result.checkpoint else None
            _emit({"event": "finished", "metrics": result.metrics, "checkpoint": checkpoint})
            return 0
    finally:
        ray.shutdown()
    print(f"error: training failed: {reason}", flush=True)
    return 1


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        return run(args)
    except ValueError as exc:
        print(f"error: {exc}", flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
