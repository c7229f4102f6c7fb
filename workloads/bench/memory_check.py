"""`python -m workloads.bench.memory_check`: the memory model against peaks measured on one GPU.

    python -m workloads.bench.memory_check --out DIR [--points 1.5b-full,7b-lora,...] [--margin 0.10]

Each point is a preset and overrides at world size 1 (NCCL puts one rank on a GPU, so one GPU
measures one rank). For each, the memory model predicts the peak (workloads/sizing/memory.py); the
loop then trains a few steps on generated chats through the training benchmark, in a process of its
own whose CUDA memory is capped at the prediction plus `--margin` (torch's
set_per_process_memory_fraction): a point that needs more than that fails with an out-of-memory,
and one that fits reports the peak it allocated. DIR/memory.json and DIR/table.txt hold predicted
against measured; a point's own benchmark files are in DIR/<point>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from workloads.sizing.memory import Architecture, MemoryPrediction, predict, settings_for
from workloads.bench.settings import PLACEHOLDER_CHATS, chat_data
from workloads.train.loss_chunks import LIGER_CHUNK_MEM_CONST
from workloads.train.config import TrainConfig, preset, with_overrides


@dataclass(frozen=True, kw_only=True)
class Point:
    name: str
    preset: str
    overrides: tuple[str, ...]

    def config(self) -> TrainConfig:
        """As the benchmark builds it: the preset on the generated chats, then the overrides."""
        on_chats = dataclasses.replace(preset(self.preset), data=chat_data(*PLACEHOLDER_CHATS), eval_every=0)
        return with_overrides(on_chats, list(self.overrides))


SHAPE_7B = "model.name_or_path=qwen2.5-7b"
AC, NO_AC = "model.activation_checkpointing=true", "model.activation_checkpointing=false"
# One micro-step per step (the presets accumulate several to make their rows per step; that adds only
# held gradients, a term the CPU tests check) and the H200's peak, so that the benchmark's MFU means
# something on any loop version.
H200 = ("rows_per_step=0", "grad_accum_steps=1", "peak_flops=989e12")
POINTS = {p.name: p for p in (
    Point(name="1.5b-full", preset="qwen2.5-1.5b-synthetic", overrides=("micro_batch=16", *H200)),
    Point(name="1.5b-full-ac", preset="qwen2.5-1.5b-synthetic", overrides=("micro_batch=16", AC, *H200)),
    Point(name="7b-lora", preset="qwen2.5-7b-lora-24gb", overrides=(SHAPE_7B, "micro_batch=8", NO_AC, *H200)),
    Point(name="7b-lora-ac", preset="qwen2.5-7b-lora-24gb", overrides=(SHAPE_7B, "micro_batch=8", AC, *H200)),
    Point(name="7b-full-ac", preset="qwen2.5-7b-24gb", overrides=(SHAPE_7B, "micro_batch=2", AC, *H200)),
)}
"""The points docs/PERFORMANCE.md records: the architectures with random weights (no hub here),
each at world size 1 with the preset's other settings."""


def prediction(point: Point, *, world_size: int = 1, liger_chunk_mem_const: int = LIGER_CHUNK_MEM_CONST,
               frozen_in_fsdp: bool = False) -> MemoryPrediction:
    """`liger_chunk_mem_const`: the loss's chunking the run had (a record made before it was set: 1);
    `frozen_in_fsdp`: the run's loop held a one-rank frozen base in FSDP2 (a record made before 2026-12-05)."""
    from workloads.model_io.architectures import named_architecture

    cfg = point.config()
    arch = Architecture.from_config(named_architecture(cfg.model.name_or_path))
    settings = dataclasses.replace(settings_for(cfg, shard_ranks=world_size),
                                   liger_chunk_mem_const=liger_chunk_mem_const, frozen_in_fsdp=frozen_in_fsdp)
    return predict(arch, settings)


def bench_command(point: Point, *, cap_gib: float, out: Path, steps: int) -> list[str]:
    cfg = point.config()
    sets = [arg for o in point.overrides if not o.startswith("micro_batch=") for arg in ("--set", o)]
    return [sys.executable, "-m", "workloads.bench", "--preset", point.preset, "--strategies", "tuned",
            "--data", "chats", "--micro-batches", str(cfg.micro_batch), "--steps", str(steps), "--warmup", "1",
            "--matmul-size", "0", "--memory-cap-gib", f"{cap_gib:.2f}", "--out", str(out), *sets]


def measured(out: Path) -> tuple[str, Optional[float], Optional[str], Optional[float]]:
    """(status, peak GiB, error, tokens/s) of the point's one benchmark run."""
    try:
        run = json.loads((out / "bench.json").read_text())["runs"][0]
    except (OSError, ValueError, IndexError, KeyError):
        return "failed", None, "no bench.json (see its log)", None
    figures = json.loads((out / "bench.json").read_text()).get("figures") or [{}]
    return run["status"], run.get("peak_mem_gib"), run.get("error"), figures[0].get("tokens_per_s_per_gpu")


def check(points: Sequence[Point], *, out: Path, margin: float, steps: int) -> list[dict]:
    rows = []
    for point in points:
        predicted = prediction(point)
        cap = predicted.peak_gib * (1 + margin)
        folder = out / point.name
        folder.mkdir(parents=True, exist_ok=True)
        command = bench_command(point, cap_gib=cap, out=folder, steps=steps)
        print(f"[memory] {point.name}: predicted {predicted.peak_gib:.2f} GiB, capped at {cap:.2f} GiB", flush=True)
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                         "expandable_segments:True")}
        with (folder / "log.txt").open("w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
        status, peak, error, rate = measured(folder)
        row = {"point": point.name, "preset": point.preset, "overrides": list(point.overrides),
               "predicted_gib": round(predicted.peak_gib, 2), "cap_gib": round(cap, 2),
               "terms_gib": {k: round(v / 2**30, 2) for k, v in predicted.terms.items()},
               "phase": predicted.phase, "liger_chunk_mem_const": LIGER_CHUNK_MEM_CONST,
               "status": status, "exit_code": code, "measured_gib": peak,
               "error": error, "tokens_per_s": rate,
               "relative_error": None if peak is None else round(predicted.peak_gib / peak - 1, 4)}
        rows.append(row)
        print(f"[memory] {point.name}: {status}, measured {peak} GiB, {rate} tokens/s"
              + ("" if peak is None else f", prediction {row['relative_error']:+.1%}"), flush=True)
        (out / "memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    return rows


def table(rows: Sequence[dict]) -> str:
    lines = [f"{'point':<14}{'predicted GiB':>15}{'cap GiB':>9}{'measured GiB':>14}{'error':>8}  status"]
    for r in rows:
        peak = "-" if r["measured_gib"] is None else f"{r['measured_gib']:.2f}"
        error = "-" if r["relative_error"] is None else f"{r['relative_error']:+.1%}"
        lines.append(f"{r['point']:<14}{r['predicted_gib']:>15.2f}{r['cap_gib']:>9.2f}{peak:>14}{error:>8}  "
                     f"{r['status']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.bench.memory_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, of {', '.join(POINTS)}")
    parser.add_argument("--margin", type=float, default=0.10, help="cap = prediction x (1 + margin)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.points.split(",") if n.strip()]
    unknown = [n for n in names if n not in POINTS]
    if unknown or not names:
        print(f"error: --points {','.join(unknown) or '(empty)'}: choose from {', '.join(POINTS)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows = check([POINTS[n] for n in names], out=args.out, margin=args.margin, steps=args.steps)
    text = table(rows)
    (args.out / "table.txt").write_text(text + "\n")
    print(text)
    within = all(r["relative_error"] is not None and abs(r["relative_error"]) <= args.margin for r in rows)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
