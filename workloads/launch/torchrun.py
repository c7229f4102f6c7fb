"""Run the training loop under torchrun, without Ray (GPU benchmarks, quick multi-GPU checks).

    torchrun --nproc-per-node 2 -m workloads.launch.torchrun --preset qwen2.5-1.5b-synthetic --steps 20 \
        [--set key=value ...] [--out DIR] [--resume]

Each rank appends its reports to DIR/metrics/rank-N.jsonl, checkpoints go to DIR/checkpoint-*,
NCCL writes one log per process under DIR/nccl (read by the transport gate), and rank 0 writes
DIR/config.json and DIR/summary.json. Exit codes: 0 trained; 1 the transport gate or training
failed; 2 bad arguments or configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from workloads.train.config import PRESETS, TrainConfig, preset, with_overrides
from workloads.context import TrainContext
from workloads.transport.gate import TransportGateError, nccl_log_env


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="torchrun ... -m workloads.launch.torchrun", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", default="qwen2.5-1.5b-synthetic", help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--steps", type=int, help="override the preset's number of steps")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (dotted for nested ones: model.name_or_path=...); repeatable",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/torchrun"), help="folder for reports, checkpoints, NCCL logs"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> TrainConfig:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    return with_overrides(preset(args.preset), overrides)


def newest_checkpoint(out: Path) -> Path | None:
    done = [p.parent for p in out.glob("checkpoint-*/.metadata")]
    return max(done, key=lambda p: p.name) if done else None


def jsonl_reporter(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)

    def report(metrics: dict, checkpoint_dir: Path | None = None) -> None:
        record = {
            "metrics": metrics,
            "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir),
        }
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    return report


def torchrun_context(*, out: Path, resume: bool) -> TrainContext:
    import torch.distributed as dist

    rank = dist.get_rank()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return TrainContext(
        rank=rank,
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=local_world_size,
        node_rank=int(os.environ.get("GROUP_RANK", rank // local_world_size)),
        report=jsonl_reporter(out / "metrics" / f"rank-{rank}.jsonl"),
        latest_checkpoint=(lambda: newest_checkpoint(out)) if resume else (lambda: None),
        scratch_dir=out,
    )


def init_process_group() -> None:
    """NCCL on GPUs, gloo on CPU; a lone process (no torchrun environment) becomes a group of one."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = build_config(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # torch (seconds of start-up) only once the arguments and the config are known to be good.
    import torch
    import torch.distributed as dist

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        # NCCL reads these when it creates its first communicator; an explicit setting wins.
        for key, value in nccl_log_env(log_dir=out / "nccl").items():
            os.environ.setdefault(key, value)
        (out / "nccl").mkdir(exist_ok=True)

    from workloads.train import tracking
    from workloads.train.loop import train

    init_process_group()
    try:
        ctx = torchrun_context(out=out, resume=args.resume)
        if ctx.rank == 0:
            (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        with tracking.ends_with_the_run():  # FAILED or KILLED in the tracker, not RUNNING, when it raises
            summary = train(cfg, ctx)
        if ctx.rank == 0:
            (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    except TransportGateError as e:
        # Every rank raises the same all-gathered verdict; one copy of it is enough.
        if dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
