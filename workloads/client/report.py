"""Training progress read back from a job's logs, its summary, and the run report written to disk.

Rank 0 of the loop prints one `[train] {json}` line per logged step; Ray forwards worker output
to the job logs with a `(RayTrainWorker pid=..., ip=...)` prefix, so the record is found anywhere
in the line.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional

from workloads.context import SUMMARY_PREFIX, TRAIN_PREFIX

RATE_KEY = "tokens_per_s_per_device"


def parse_prefixed(line: str, prefix: str) -> Optional[dict]:
    """The JSON object after `prefix` anywhere in `line` (Ray prefixes worker lines), or None."""
    start = line.find(prefix + "{")
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(prefix) :])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def parse_train_line(line: str) -> Optional[dict]:
    """The step record of a `[train] {...}` line, or None for any other line."""
    record = parse_prefixed(line, TRAIN_PREFIX)
    if record is None or "step" not in record or "loss" not in record:
        return None
    return record


def train_records(lines: Iterable[str]) -> list[dict]:
    """Every step record in `lines`, one per step (a restarted attempt's repeats replace earlier ones)."""
    by_step: dict[int, dict] = {}
    for line in lines:
        record = parse_train_line(line)
        if record is not None:
            by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def loop_summary(lines: Iterable[str]) -> Optional[dict]:
    """The last `[train-summary] {...}` record in `lines`, or None."""
    found = None
    for line in lines:
        found = parse_prefixed(line, SUMMARY_PREFIX) or found
    return found


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    steps: int
    """The last step reported."""
    first_loss: float
    """Loss of the run's first step (the loop's summary), else of the first reported step."""
    last_loss: float
    """Loss at the last reported step."""
    tokens_per_s: Optional[float]
    """Training throughput per worker in tokens/s: the loop's mean over its logging windows after
    the first (start-up), else the median of the reported steps; None when nothing reported it."""
    eval_loss: Optional[float] = None
    """The last held-out loss reported, or None when the run did not evaluate."""


def summarize(records: list[dict], *, final: Optional[dict] = None) -> RunSummary:
    """Summarize the step records, preferring the loop's own `[train-summary]` figures (`final`)."""
    if not records:
        raise ValueError("the job logs hold no [train] step records, so there is nothing to summarize")
    final = final or {}
    rates = [float(r[RATE_KEY]) for r in records[1:] if r.get(RATE_KEY) is not None]
    rate = final.get(RATE_KEY)
    if rate is None and rates:
        rate = statistics.median(rates)
    first = final.get("first_loss")
    return RunSummary(
        steps=int(records[-1]["step"]),
        first_loss=float(records[0]["loss"] if first is None else first),
        last_loss=float(records[-1]["loss"]),
        tokens_per_s=None if rate is None else float(rate),
        eval_loss=next((float(r["eval_loss"]) for r in reversed(records) if r.get("eval_loss") is not None), None),
    )


def format_record(record: dict, *, total_steps: Optional[int] = None) -> str:
    """One progress line: `step 20/60  loss 2.3140  1,234 tokens/s`."""
    step = f"{record['step']}/{total_steps}" if total_steps else str(record["step"])
    text = f"step {step:>9}  loss {float(record['loss']):.4f}"
    if record.get("eval_loss") is not None:
        text += f"  eval {float(record['eval_loss']):.4f}"
    if record.get(RATE_KEY) is not None:
        text += f"  {float(record[RATE_KEY]):,.0f} tokens/s/worker"
    if record.get("mfu") is not None:
        text += f"  MFU {100 * float(record['mfu']):.1f}%"
    return text


def format_summary(summary: RunSummary) -> str:
    rate = "n/a" if summary.tokens_per_s is None else f"{summary.tokens_per_s:,.0f}"
    held_out = "" if summary.eval_loss is None else f" (eval {summary.eval_loss:.4f})"
    return (
        f"{summary.steps} steps: loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}{held_out}, "
        f"{rate} tokens/s per worker"
    )


def write_report(run_dir: Path, *, records: list[dict], summary: RunSummary, meta: dict) -> tuple[Path, Path]:
    """Write `report.json` (meta, summary, every step record) and `loss.png` into run_dir."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir.mkdir(parents=True, exist_ok=True)
    json_path = run_dir / "report.json"
    json_path.write_text(
        json.dumps({**meta, "summary": asdict(summary), "steps": records}, indent=2, sort_keys=True) + "\n"
    )
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker="o", markersize=3, label="train")
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    if evaluated:
        ax.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], marker="s", markersize=4,
                label="eval (held out)")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(meta.get("title", "training loss"))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    png_path = run_dir / "loss.png"
    fig.savefig(png_path)
    plt.close(fig)
    return json_path, png_path
