"""Results of benchmark runs as plain data, the figures derived from them, a text table and JSON."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from workloads.files import replace_whole

OK = "ok"
OOM = "OOM"


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """What one strategy did at one micro-batch; figures are derived from it by `summarize`."""

    strategy: str
    micro_batch: int
    status: str
    """"ok", or "OOM" when the device ran out of memory on some rank."""
    tokens_per_step_per_gpu: int
    step_seconds: dict[int, float] = field(default_factory=dict)
    """Seconds of each timed step (every step after the first), keyed by step number (from 1)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Training loss at each step, averaged over ranks."""
    peak_mem_gib: Optional[float] = None
    """Largest peak of allocated device memory over ranks; None on the CPU."""
    steady_peak_mem_gib: Optional[float] = None
    """The same over the steps after the warm-up only: without what the first steps alone allocate
    (torch.compile's compilation and tuning among it)."""
    loop_metrics: list[dict] = field(default_factory=list)
    """The metrics the strategy reported itself, step by step, kept for cross-checking."""
    error: Optional[str] = None
    """The first line of the out-of-memory error, when status is OOM."""
    communication: Optional[dict] = None
    """From the profiled steps on CUDA: NCCL kernel time per step ("comm_s") and the part of it no
    other kernel overlapped ("exposed_s"); None when not profiled."""
    profile: Optional[dict] = None
    """From the profiled steps: device time per step by category and the top kernels
    (workloads/bench/profile_categories.py); None when not profiled."""


@dataclass(frozen=True, kw_only=True)
class RunFigures:
    strategy: str
    micro_batch: int
    status: str
    timed_steps: int = 0
    step_s_median: Optional[float] = None
    step_s_p90: Optional[float] = None
    tokens_per_s_per_gpu: Optional[float] = None
    mfu_vs_peak: Optional[float] = None
    """Model FLOPs utilization against the datasheet dense bf16 rate."""
    mfu_vs_matmul: Optional[float] = None
    """Model FLOPs utilization against the bf16 matmul rate measured in the same run."""
    peak_mem_gib: Optional[float] = None
    steady_peak_mem_gib: Optional[float] = None
    first_loss: Optional[float] = None
    final_loss: Optional[float] = None
    final_step: Optional[int] = None


def run_figures(
    run: RunResult,
    *,
    warmup: int,
    flops_per_token: float,
    peak_flops: Optional[float],
    matmul_flops: Optional[float],
) -> RunFigures:
    """Step-time statistics over the steps after `warmup`, and the rates and MFU they imply."""
    if run.status != OK:
        return RunFigures(strategy=run.strategy, micro_batch=run.micro_batch, status=run.status)
    timed = [seconds for step, seconds in sorted(run.step_seconds.items()) if step > warmup]
    final_step = max(run.losses) if run.losses else None
    figures = dict(
        strategy=run.strategy,
        micro_batch=run.micro_batch,
        status=run.status,
        timed_steps=len(timed),
        peak_mem_gib=run.peak_mem_gib,
        steady_peak_mem_gib=run.steady_peak_mem_gib,
        first_loss=run.losses[min(run.losses)] if run.losses else None,
        final_loss=run.losses[final_step] if final_step is not None else None,
        final_step=final_step,
    )
    if not timed:
        return RunFigures(**figures)
    step_median = median(timed)
    tokens_per_s = run.tokens_per_step_per_gpu / step_median
    achieved = tokens_per_s * flops_per_token
    return RunFigures(
        **figures,
        step_s_median=step_median,
        step_s_p90=percentile(timed, 90),
        tokens_per_s_per_gpu=tokens_per_s,
        mfu_vs_peak=achieved / peak_flops if peak_flops else None,
        mfu_vs_matmul=achieved / matmul_flops if matmul_flops else None,
    )


@dataclass(frozen=True, kw_only=True)
class Comparison:
    label: str
    """"same micro-batch N", "largest micro-batch that fits", "chat vs synthetic, ..." or
    "tuned vs <peer>, <method>, <model>, same micro-batch N"."""
    reference_micro_batch: int
    tuned_micro_batch: int
    ratio: float
    """tuned tokens/s per GPU divided by reference tokens/s per GPU."""


def comparisons(figures: Sequence[RunFigures], *, baseline: str, candidate: str) -> list[Comparison]:
    """Candidate/baseline throughput at each micro-batch both ran, then each at its largest fit."""
    rates = {
        (f.strategy, f.micro_batch): f.tokens_per_s_per_gpu
        for f in figures
        if f.tokens_per_s_per_gpu is not None
    }
    result = []
    for micro_batch in sorted({mb for _, mb in rates}, reverse=True):
        base, cand = rates.get((baseline, micro_batch)), rates.get((candidate, micro_batch))
        if base and cand:
            result.append(
                Comparison(
                    label=f"same micro-batch {micro_batch}",
                    reference_micro_batch=micro_batch,
                    tuned_micro_batch=micro_batch,
                    ratio=cand / base,
                )
            )
    best_base = max((mb for s, mb in rates if s == baseline), default=None)
    best_cand = max((mb for s, mb in rates if s == candidate), default=None)
    if best_base is not None and best_cand is not None:
        result.append(
            Comparison(
                label="largest micro-batch that fits",
                reference_micro_batch=best_base,
                tuned_micro_batch=best_cand,
                ratio=rates[(candidate, best_cand)] / rates[(baseline, best_base)],
            )
        )
    return result


def chat_comparisons(figures: Sequence[RunFigures], *, synthetic: str, chats: str) -> list[Comparison]:
    """The loop on chats over the loop on synthetic tokens, at each micro-batch both ran."""
    rates = {(f.strategy, f.micro_batch): f.tokens_per_s_per_gpu for f in figures if f.tokens_per_s_per_gpu}
    return [
        Comparison(label=f"chat vs synthetic, same micro-batch {mb}", reference_micro_batch=mb,
                   tuned_micro_batch=mb, ratio=rates[(chats, mb)] / rates[(synthetic, mb)])
        for mb in sorted({mb for _, mb in rates}, reverse=True)
        if (synthetic, mb) in rates and (chats, mb) in rates
    ]


def peer_comparisons(figures: Sequence[RunFigures], *, candidate: str, peers: Sequence[str],
                     describe: str) -> list[Comparison]:
    """The loop over the faster of its peer's runs (e.g. Trainer padding-free and padded) at each
    micro-batch they share, on non-padding tokens/s; labelled "tuned vs <describe>"."""
    rates = {(f.strategy, f.micro_batch): f.tokens_per_s_per_gpu for f in figures if f.tokens_per_s_per_gpu}
    result = []
    for mb in sorted({mb for _, mb in rates}, reverse=True):
        peer_rates = [rates[(peer, mb)] for peer in peers if (peer, mb) in rates]
        if (candidate, mb) in rates and peer_rates:
            result.append(Comparison(label=f"tuned vs {describe}, same micro-batch {mb}", reference_micro_batch=mb,
                                     tuned_micro_batch=mb, ratio=rates[(candidate, mb)] / max(peer_rates)))
    return result


def _cell(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec)


def format_table(figures: Sequence[RunFigures], comps: Sequence[Comparison]) -> str:
    header = (
        "strategy", "mb", "status", "tok/s/GPU", "MFU@peak", "MFU@matmul",
        "step med s", "step p90 s", "peak GiB", "after warmup", "loss first", "loss last",
    )
    rows = [header]
    for f in figures:
        rows.append((
            f.strategy,
            str(f.micro_batch),
            f.status,
            _cell(f.tokens_per_s_per_gpu, ",.0f"),
            _cell(f.mfu_vs_peak, ".1%"),
            _cell(f.mfu_vs_matmul, ".1%"),
            _cell(f.step_s_median, ".4f"),
            _cell(f.step_s_p90, ".4f"),
            _cell(f.peak_mem_gib, ".1f"),
            _cell(f.steady_peak_mem_gib, ".1f"),
            _cell(f.first_loss, ".4f"),
            _cell(f.final_loss, ".4f") + (f" @{f.final_step}" if f.final_step else ""),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for comp in comps:
        if comp.label.startswith("tuned vs "):
            lines.append(f"{comp.label}: {comp.ratio:.3f}x")
            continue
        if comp.label.startswith("chat vs synthetic"):
            lines.append(f"tuned on chats / on synthetic tokens, {comp.label.removeprefix('chat vs synthetic, ')}: "
                         f"{comp.ratio:.3f}x")
            continue
        lines.append(
            f"tuned/reference, {comp.label}: {comp.ratio:.3f}x "
            f"(reference mb {comp.reference_micro_batch}, tuned mb {comp.tuned_micro_batch})"
        )
    return "\n".join(lines)


def write_json(path: Path, document: dict) -> None:
    """Replace `path` atomically, so a run killed mid-write still leaves the last complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_whole(path, json.dumps(document, indent=2, sort_keys=False) + "\n")

