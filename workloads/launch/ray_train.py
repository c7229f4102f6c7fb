"""The Ray Train adapter: runs `workloads.train.loop.train` inside a TorchTrainer worker.

Ray Train has already formed the process group (gloo or NCCL) when `train_worker` starts; this
module only maps the loop's TrainContext onto Ray: `report` becomes `ray.train.report` (with the
loop's checkpoint folder wrapped as a Checkpoint), `latest_checkpoint` becomes the local folder
of `ray.train.get_checkpoint()`, which Ray Train sets after a worker-group restart or when a run
of the same name is started again on the same storage.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

import ray.train

from workloads.context import TrainContext
from workloads.transport.gate import nccl_log_env

SCRATCH_ROOT = Path(tempfile.gettempdir()) / "ray-train-scratch"
"""Where each worker keeps checkpoints in flight, restored checkpoints and its NCCL log."""


def report(metrics: dict, checkpoint_dir: Optional[Path] = None) -> None:
    checkpoint = None if checkpoint_dir is None else ray.train.Checkpoint.from_directory(str(checkpoint_dir))
    ray.train.report(metrics, checkpoint=checkpoint)


def checkpoint_loader(*, restore_root: Path) -> Callable[[], Optional[Path]]:
    """Return a function giving the newest persisted checkpoint as a local folder (or None).

    On local storage the checkpoint is used in place; from S3 it is downloaded once per attempt.
    """
    restored: dict[str, Path] = {}

    def latest_checkpoint() -> Optional[Path]:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        if checkpoint.filesystem.type_name == "local":
            return Path(checkpoint.path)
        if checkpoint.path not in restored:
            target = restore_root / Path(checkpoint.path).name
            checkpoint.to_directory(str(target))
            restored[checkpoint.path] = target
        return restored[checkpoint.path]

    return latest_checkpoint


def ray_train_context(*, scratch_root: Path = SCRATCH_ROOT) -> TrainContext:
    """The TrainContext of the calling Ray Train worker."""
    ray_ctx = ray.train.get_context()
    rank = ray_ctx.get_world_rank()
    scratch_dir = scratch_root / ray_ctx.get_experiment_name() / f"rank-{rank}"
    scratch_dir.mkdir(parents=True, exist_ok=True)
    return TrainContext(
        rank=rank,
        world_size=ray_ctx.get_world_size(),
        local_rank=ray_ctx.get_local_rank(),
        local_world_size=ray_ctx.get_local_world_size(),
        node_rank=ray_ctx.get_node_rank(),
        report=report,
        latest_checkpoint=checkpoint_loader(restore_root=scratch_dir / "restored"),
        scratch_dir=scratch_dir,
    )


def echo_nccl_logs(log_dir: Path) -> None:
    """Print this rank's NCCL log files so they reach the job logs (the submitter's offline gate)."""
    for path in sorted(log_dir.glob("*")):
        print(path.read_text(errors="replace"), end="", flush=True)


def train_worker(config: dict) -> None:
    """`train_loop_per_worker` of the TorchTrainer: config is {"train": TrainConfig.to_dict()}."""
    from workloads.train.config import TrainConfig
    from workloads.train.loop import train

    cfg = TrainConfig.from_dict(config["train"])
    ctx = ray_train_context()
    # Ray Train creates the process group without a device, so NCCL starts (and reads its
    # environment) only at the first collective, inside the loop: setting the log file here works.
    nccl_dir = ctx.scratch_dir / "nccl"
    nccl_dir.mkdir(exist_ok=True)
    for stale in nccl_dir.glob("*"):  # from an earlier attempt of this run
        stale.unlink()
    os.environ.update(nccl_log_env(log_dir=nccl_dir))
    try:
        train(cfg, ctx)
    finally:
        echo_nccl_logs(nccl_dir)
