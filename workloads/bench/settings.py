"""The training benchmark's settings and their command line, apart from the benchmark itself so that
`python -m workloads.bench` refuses a bad option before it imports torch and the loop."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from workloads.train.config import DataConfig, TrainConfig, preset, with_overrides

REFERENCE, TUNED = "reference", "tuned"
HF_TRAINER, HF_TRAINER_PADDED = "hf-trainer", "hf-trainer-padded"
TRL_DPO = "trl-dpo"
STRATEGY_NAMES = (REFERENCE, TUNED, HF_TRAINER, HF_TRAINER_PADDED, TRL_DPO)
"""The strategies the benchmark runs (train_bench.STRATEGIES holds their functions): the seed-style
reference, the project's loop, and Hugging Face's Trainer (peft for LoRA) padding-free and padded
(workloads/bench/hf_trainer.py)."""
CHATS_ONLY = (HF_TRAINER, HF_TRAINER_PADDED)
"""Strategies that train on the generated chats only (they read conversations, not token rows)."""
PAIRS_ONLY = (TRL_DPO,)
"""Strategies that train on generated preference pairs only (workloads/bench/trl_dpo.py)."""
DATA_KINDS = ("synthetic", "chats", "pairs")
CHATS_SUFFIX = "-chats"
PAIRS_SUFFIX = "-pairs"
PLACEHOLDER_CHATS = (Path("chats.jsonl"), Path("tokenizer"))
"""Stands for the generated chats where a config is only checked or read for its shape."""

@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    preset: str = "qwen2.5-1.5b-synthetic"
    """The loop's config preset both strategies start from (`workloads.train.config.PRESETS`)."""
    steps: int = 30
    """Optimizer steps per run."""
    warmup: int = 5
    """Steps left out of the step-time statistics (compilation, allocator and NCCL warm-up)."""
    seq_len: int = 2048
    micro_batches: tuple[int, ...] = (16, 8)
    """Micro-batches to run, in this order; each strategy runs at each of them."""
    strategies: tuple[str, ...] = (REFERENCE, TUNED)
    matmul_size: int = 8192
    """n of the n^3 bf16 matmul whose rate is the second MFU denominator; 0 skips it."""
    seed: int = 0
    out: Optional[Path] = None
    """Folder for bench.json (rewritten after every run) and table.txt; rank 0 writes."""
    profile_steps: Optional[tuple[int, int]] = None
    """(first, last) optimizer steps of every run to record with torch.profiler; rank 0 writes
    profile-<strategy>-mb<N>.txt. Profiled steps run slower: keep them out of the timed steps'
    majority (the median is robust to a few)."""
    memory_steps: Optional[tuple[int, int]] = None
    """(first, last) optimizer steps of every CUDA run whose allocations to record and replay to their
    peak (workloads/bench/memory_window.py); rank 0 writes memory-<strategy>-mb<N>.txt and .json.
    Recorded steps run slower, as profiled ones do."""
    allow_cpu: bool = False
    """Run without CUDA (gloo on the CPU) to check the harness; only with the tiny model."""
    data: tuple[str, ...] = ("synthetic",)
    """"synthetic" (every strategy) and/or "chats" (the loop on generated chats) and/or "pairs"
    (generated preference pairs: the loop with a preset of objective "dpo", and TRL's DPOTrainer)."""
    overrides: tuple[str, ...] = ()
    """`--set key=value` overrides of the preset, for every run (e.g. model.attn_implementation=sdpa)."""
    memory_cap_gib: Optional[float] = None
    """Cap each process's CUDA memory at this many GiB (torch.cuda.set_per_process_memory_fraction),
    to check that a preset fits a smaller GPU."""
    peer_micro_batch: Optional[int] = None
    """Pairs in each of trl-dpo's micro-batches (accumulation makes the loop's pairs per step); None:
    as many as the loop's micro-batch holds, at most workloads/bench/trl_dpo.py's default."""

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.steps <= self.warmup:
            raise ValueError(
                f"--steps {self.steps} --warmup {self.warmup}: need warmup >= 1 (the first step has no "
                "start mark) and steps > warmup so that some steps are timed"
            )
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise ValueError(f"--micro-batches {self.micro_batches}: give positive integers, e.g. 16,8")
        bad_data = [d for d in self.data if d not in DATA_KINDS]
        if bad_data or not self.data:
            raise ValueError(f"--data {','.join(bad_data) or '(empty)'}: choose from {', '.join(DATA_KINDS)}")
        if self.peer_micro_batch is not None and self.peer_micro_batch < 1:
            raise ValueError(f"--peer-micro-batch {self.peer_micro_batch}: give a positive number of pairs")
        if self.memory_cap_gib is not None and self.memory_cap_gib <= 0:
            raise ValueError(f"--memory-cap-gib {self.memory_cap_gib}: give a positive number of GiB")
        unknown = [s for s in self.strategies if s not in STRATEGY_NAMES]
        if unknown or not self.strategies:
            raise ValueError(f"--strategies {','.join(unknown) or '(empty)'}: choose from {', '.join(STRATEGY_NAMES)}")
        if any(s in CHATS_ONLY for s in self.strategies) and "chats" not in self.data:
            raise ValueError(f"--strategies {','.join(self.strategies)}: {' and '.join(CHATS_ONLY)} train on "
                             "conversations: add --data chats")
        if any(s in PAIRS_ONLY for s in self.strategies) and "pairs" not in self.data:
            raise ValueError(f"--strategies {','.join(self.strategies)}: {' and '.join(PAIRS_ONLY)} trains on "
                             "preference pairs: add --data pairs")
        if ("pairs" in self.data) != (preset(self.preset).objective == "dpo"):
            raise ValueError(f"--data {','.join(self.data)} with --preset {self.preset}: generated preference pairs "
                             'go with a preset of objective "dpo" (e.g. qwen2.5-1.5b-dpo), and only they')
        if self.seq_len < 1 or self.matmul_size < 0:
            raise ValueError(
                f"--seq-len must be >= 1 and --matmul-size >= 0, got {self.seq_len} and {self.matmul_size}"
            )
        for flag, window in (("--profile-steps", self.profile_steps), ("--memory-steps", self.memory_steps)):
            if window is not None and not 1 <= window[0] <= window[1] <= self.steps:
                raise ValueError(f"{flag} {window[0]}:{window[1]}: need 1 <= first <= last <= --steps {self.steps}")
        if self.memory_steps is not None and self.memory_steps[0] <= self.warmup:
            # The warm-up's end resets the allocator's peak, which the window's replay is checked against.
            raise ValueError(f"--memory-steps {self.memory_steps[0]}:{self.memory_steps[1]}: the window starts after "
                             f"the {self.warmup} warm-up step(s)")
        for data in self.data:  # the overrides must make a valid config with each kind of data
            preset_config(self, data=None if data == "synthetic" else chat_data(*PLACEHOLDER_CHATS))


def chat_data(jsonl: Path, tokenizer: Path) -> DataConfig:
    return DataConfig(kind="jsonl", path=str(jsonl), tokenizer=str(tokenizer), eval_fraction=0.0)


def preset_config(settings: BenchSettings, *, data: Optional[DataConfig] = None) -> TrainConfig:
    """The preset, on `data` when given (without evaluations), then the `--set` overrides."""
    base = preset(settings.preset)
    if data is not None:
        base = dataclasses.replace(base, data=data, eval_every=0)
    return with_overrides(base, list(settings.overrides))



def parse_args(argv: Sequence[str]) -> BenchSettings:
    defaults = BenchSettings()
    parser = argparse.ArgumentParser(
        prog="python -m workloads.bench",
        description="Reference strategy vs the project's loop, side by side (run under torchrun). "
        "`python -m workloads.bench nccl --help` for the bandwidth benchmark.",
    )
    parser.add_argument("--preset", default=defaults.preset, help=f"loop config preset (default {defaults.preset})")
    parser.add_argument("--steps", type=int, default=defaults.steps, help=f"steps per run (default {defaults.steps})")
    parser.add_argument("--warmup", type=int, default=defaults.warmup,
                        help=f"untimed first steps (default {defaults.warmup})")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help=f"default {defaults.seq_len}")
    parser.add_argument("--micro-batches", default=",".join(map(str, defaults.micro_batches)), help="e.g. 16,8")
    parser.add_argument("--strategies", default=",".join(defaults.strategies), help="e.g. reference,tuned")
    parser.add_argument("--matmul-size", type=int, default=defaults.matmul_size, help="0 skips the matmul rate")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", type=Path, default=None, help="folder for bench.json and table.txt")
    parser.add_argument("--profile-steps", default=None, metavar="FIRST:LAST",
                        help="record these optimizer steps of every run with torch.profiler (e.g. 10:12)")
    parser.add_argument("--memory-steps", default=None, metavar="FIRST:LAST",
                        help="record the GPU allocations of these optimizer steps of every run and write what "
                             "was alive at their peak, by where it was allocated (e.g. 3:4)")
    parser.add_argument("--data", default=",".join(defaults.data),
                        help="synthetic and/or chats (the loop on generated chats), e.g. synthetic,chats")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a preset field for every run (repeatable), e.g. model.attn_implementation=sdpa")
    parser.add_argument("--memory-cap-gib", type=float, default=None,
                        help="cap each process's CUDA memory, e.g. 22 for a 24 GB GPU")
    parser.add_argument("--peer-micro-batch", type=int, default=None,
                        help="pairs per micro-batch of trl-dpo (accumulation makes the loop's pairs per step)")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run without CUDA (gloo on the CPU) to check the harness, "
                             "with --preset demo-cpu")
    args = parser.parse_args(argv)
    try:
        micro_batches = tuple(int(v) for v in args.micro_batches.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--micro-batches {args.micro_batches!r}: give comma-separated integers, e.g. 16,8") from None
    return BenchSettings(
        preset=args.preset,
        steps=args.steps,
        warmup=args.warmup,
        seq_len=args.seq_len,
        micro_batches=micro_batches,
        strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
        matmul_size=args.matmul_size,
        seed=args.seed,
        out=args.out,
        profile_steps=_step_window("--profile-steps", args.profile_steps, example="10:12"),
        memory_steps=_step_window("--memory-steps", args.memory_steps, example="3:4"),
        allow_cpu=args.allow_cpu,
        data=tuple(d.strip() for d in args.data.split(",") if d.strip()),
        overrides=tuple(args.overrides),
        memory_cap_gib=args.memory_cap_gib,
        peer_micro_batch=args.peer_micro_batch,
    )


def _step_window(flag: str, text: Optional[str], *, example: str) -> Optional[tuple[int, int]]:
    if not text:
        return None
    first, sep, last = text.partition(":")
    if not (sep and first.isdigit() and last.isdigit()):
        raise ValueError(f"{flag} {text!r}: use FIRST:LAST, e.g. {example}")
    return int(first), int(last)
