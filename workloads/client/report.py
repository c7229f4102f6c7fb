"""Training progress read back from a job's logs, its summary, and the run report written to disk.

Rank 0 of the loop prints one `[train] {json}` line per logged step; Ray forwards worker output
to the job logs with a `(RayTrainWorker pid=..., ip=...)` prefix, so the record is found anywhere
in the line.
"""

from __future__ import annotations

import collections
import json
import re
import statistics
from dataclasses import asdict, dataclass, field
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


WORKER_PID = re.compile(r"\(RayTrainWorker pid=(\d+)")
"""The training process a forwarded worker line came from, in Ray's prefix of it."""


def attempts(lines: Iterable[str]) -> list[list[dict]]:
    """The step records of each attempt of a run, in order, one per step. Rank 0 prints them and
    every attempt has a new rank-0 process, which Ray names in the line's `(RayTrainWorker pid=N)`
    prefix. Ray forwards each worker line twice, not always in order, so records are keyed by process
    and step, not split where the step goes back."""
    by_process: dict[int, dict[int, dict]] = {}
    for line in lines:
        record = parse_train_line(line)
        if record is not None and (process := WORKER_PID.search(line)):
            by_process.setdefault(int(process.group(1)), {})[int(record["step"])] = record
    return [[steps[step] for step in sorted(steps)] for steps in by_process.values()]


def completed_losses(lines: Iterable[str]) -> dict[int, float]:
    """Each step's loss as the attempt that completed it logged it (a later attempt's redone step
    replaces the earlier one's): the run's loss curve across restarts and resizes."""
    losses: dict[int, float] = {}
    for attempt in attempts(lines):
        losses.update({int(r["step"]): float(r["loss"]) for r in attempt})
    return losses


def resize_events(lines: Iterable[str]) -> dict[str, list[dict]]:
    """What an elastic or preempted run went through, from its job log: each start of the worker
    group with its size and why (`[driver] {"event": "workers", ...}`), each checkpoint saved on a
    drain notice (`[preemption] {...}`), each start's world size and accumulation (`[elastic] {...}`)
    and each node's download of the checkpoint it resumed from (`[restore] {...}`). Ray may print a
    worker's line twice: a record seen already is one event."""
    from workloads.context import RESTORE_PREFIX
    from workloads.train.elastic import ELASTIC_PREFIX
    from workloads.train.preemption import PREEMPTION_PREFIX

    found: dict[str, list[dict]] = {"worker_group_starts": [], "checkpoints_on_notice": [], "world_sizes": [],
                                    "restores": []}

    def add(kind: str, record: dict) -> None:
        if record not in found[kind]:
            found[kind].append(record)

    for line in lines:
        if (record := parse_prefixed(line, "[driver] ")) and record.get("event") == "workers":
            add("worker_group_starts", record)
        elif record := parse_prefixed(line, PREEMPTION_PREFIX):
            add("checkpoints_on_notice", record)
        elif record := parse_prefixed(line, ELASTIC_PREFIX):
            add("world_sizes", record)
        elif record := parse_prefixed(line, RESTORE_PREFIX):
            add("restores", record)
    return found


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
    nodes: Optional[int] = None
    """The nodes (hosts) the ranks trained on, from the loop's summary."""
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
        nodes=final.get("nodes"),
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
    if record.get("rewards/margins") is not None:  # a preference objective's (TRL's names)
        text += (f"  margin {float(record['rewards/margins']):.4f}  accuracy "
                 f"{float(record['rewards/accuracies']):.2f}")
    if record.get("eval_rewards/accuracies") is not None:
        text += f"  eval accuracy {float(record['eval_rewards/accuracies']):.2f}"
    return text


SEQ_LEN_STEP = 64
"""A seq_len suggested to keep every conversation is rounded up to a multiple of this."""


def format_data(record: dict) -> Optional[str]:
    """The loop's `[data]` record as one console line: records, held out, rows; and, when
    conversations were cut to seq_len or dropped, how many and the seq_len that keeps them. None for
    synthetic tokens."""
    if "records" not in record:
        return None
    held = f", {record['held_out']} held out for the eval loss" if record.get("held_out") else ""
    if record.get("objective") == "dpo":
        line = (f"{record['records']} preference records{held}: {record.get('pairs', '?')} pairs in "
                f"{record.get('rows', '?')} rows of {record.get('seq_len', '?')} tokens (a pair's two sequences share "
                f"a row), {record.get('label_tokens', '?')} answer tokens")
        return f"{line}; {record['pairs_note']}" if record.get("pairs_note") else line
    line = (f"{record['records']} records{held}: {record.get('examples', '?')} examples in {record.get('rows', '?')} "
            f"rows of {record.get('seq_len', '?')} tokens, {record.get('label_tokens', '?')} tokens to learn")
    truncated, dropped = int(record.get("truncated") or 0), int(record.get("dropped") or 0)
    if not truncated and not dropped:
        return line
    cut = [f"{truncated} conversation(s) longer than seq_len {record.get('seq_len', '?')} cut to their start"] * bool(
        truncated) + [f"{dropped} dropped with nothing left to learn"] * bool(dropped)
    longest = int(record.get("longest_cut") or 0)
    keep = (f": --set seq_len={-(-longest // SEQ_LEN_STEP) * SEQ_LEN_STEP} keeps every one whole" if longest
            else " (their assistant turns are empty)")
    return f"{line}; {' and '.join(cut)}{keep}"


def method_label(record: dict, *, short: bool = False) -> str:
    """The fine-tune method of a config or the loop's method record: "full fine-tune", "LoRA rank 16
    (alpha 32)"; short: "full", "lora r16"."""
    if record.get("method") != "lora":
        return "full" if short else "full fine-tune"
    lora = record.get("lora") or {}
    if short:
        return f"lora r{lora.get('rank', '?')}"
    alpha = lora.get("alpha")
    return f"LoRA rank {lora.get('rank', '?')}" + ("" if alpha is None else f" (alpha {float(alpha):g})")


def trained_share(record: dict) -> Optional[float]:
    """The share of the model's parameters the run trains (0..1), from the loop's records; None
    without its counts."""
    trained, total = record.get("trained_params"), record.get("params")
    return None if not trained or not total else float(trained) / float(total)


def format_method(record: dict) -> str:
    """The loop's method record (`[method] {...}`) as one console line, counted as peft's
    print_trainable_parameters counts: `LoRA rank 16 (alpha 32): trainable params: 1,089,536 || all
    params: 495,122,304 || trainable%: 0.2201`."""
    text = method_label(record)
    share = trained_share(record)
    if share is None:
        return text
    return (f"{text}: trainable params: {int(record['trained_params']):,} || all params: {int(record['params']):,} "
            f"|| trainable%: {100 * share:.4f}")


def format_summary(summary: RunSummary) -> str:
    rate = "n/a" if summary.tokens_per_s is None else f"{summary.tokens_per_s:,.0f}"
    where = "" if summary.nodes is None else f", on {summary.nodes} node(s)"
    held_out = "" if summary.eval_loss is None else f" (eval {summary.eval_loss:.4f})"
    return (
        f"{summary.steps} steps: loss {summary.first_loss:.4f} -> {summary.last_loss:.4f}{held_out}, "
        f"{rate} tokens/s per worker{where}"
    )


RISING_EVALS = 2
"""Evaluations in a row whose eval loss rose over the one before, from which a run is said to
overfit."""
FEW_HELD_OUT = 10
"""Held-out records below which an eval loss says little about the model."""


def eval_warnings(records: list[dict], *, data: Optional[dict] = None) -> list[str]:
    """What the eval loss says against the run looking like a success: it rose at each of the last
    RISING_EVALS evaluations or more (the model memorizes its training records), or it is computed
    over fewer than FEW_HELD_OUT held-out records (`data`: the loop's data record)."""
    warnings = []
    evals = [(int(r["step"]), float(r["eval_loss"])) for r in records if r.get("eval_loss") is not None]
    rises = 0
    while rises + 1 < len(evals) and evals[-1 - rises][1] > evals[-2 - rises][1]:
        rises += 1
    if rises >= RISING_EVALS:
        (low_step, low), (step, last) = evals[-1 - rises], evals[-1]
        warnings.append(
            f"the eval loss rose at each of the last {rises} evaluations, {low:.4f} at step {low_step} to "
            f"{last:.4f} at step {step}, while the training loss went to {float(records[-1]['loss']):.4f}: the model "
            "is memorizing its training records (overfitting). Train fewer steps or at a lower lr, add data, or keep "
            "the model of the lowest eval loss (--set checkpoint.keep_best=true)")
    held = (data or {}).get("held_out")
    if held is not None and 0 < int(held) < FEW_HELD_OUT:
        warnings.append(f"the eval loss is over {held} held-out record(s): too few to tell how the model does on "
                        "data it did not train on (more records, or a larger data.eval_fraction)")
    return warnings


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_WORKER_PREFIX = re.compile(r"^\(([^)]*pid=[^)]*)\) ")
REPEAT_WINDOW = 8
"""How many of a worker's latest lines a line is compared with. Ray's second copy of a printed line
comes within a few lines of the first, with the worker's logged lines (another stream) between."""


def clean_log(text: str) -> str:
    """The job log as a file for people: terminal colour codes removed, and a worker's line that
    repeats one of that worker's last REPEAT_WINDOW lines dropped (Ray 2.58 forwards each line a Ray
    Train worker prints twice). Lines of the driver are kept as they are."""
    recent: dict[str, collections.deque[str]] = collections.defaultdict(
        lambda: collections.deque(maxlen=REPEAT_WINDOW))
    kept = []
    for line in text.splitlines(keepends=True):
        line = _ANSI_ESCAPE.sub("", line)
        worker = _WORKER_PREFIX.match(line)
        if worker is not None:
            if line in recent[worker.group(1)]:
                continue
            recent[worker.group(1)].append(line)
        kept.append(line)
    return "".join(kept)


@dataclass(frozen=True, kw_only=True)
class Curves:
    """The series of the loss plot, as (step, value) points."""

    loss: list[tuple[int, float]]
    """Training loss from the run's first step: the loop's summary holds that step's loss, which
    the logged records (every `log_every` steps) do not."""
    eval_loss: list[tuple[int, float]]
    """Evaluation loss of the records that carry one (`eval_loss`); empty when none does."""
    lr: list[tuple[int, float]]
    """Learning rate of the logged steps."""
    warmup: Optional[tuple[int, int]] = None
    """The run's learning-rate warm-up steps (first, last) that the plot covers; None when none is."""
    preference: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """A preference objective's rewards/margins and rewards/accuracies (and their eval_ values) by
    name, for a second panel; empty for SFT."""


def curves(records: list[dict], *, final: Optional[dict] = None, warmup_steps: int = 0) -> Curves:
    loss = [(int(r["step"]), float(r["loss"])) for r in records]
    final = final or {}
    first_step = int(final.get("resumed_from_step") or 0) + 1
    if final.get("first_loss") is not None and (not loss or loss[0][0] > first_step):
        loss.insert(0, (first_step, float(final["first_loss"])))
    return Curves(
        loss=loss,
        eval_loss=[(int(r["step"]), float(r["eval_loss"])) for r in records if r.get("eval_loss") is not None],
        lr=[(int(r["step"]), float(r["lr"])) for r in records if r.get("lr") is not None],
        warmup=(first_step, warmup_steps) if warmup_steps >= first_step else None,
        preference={name: points for name in PREFERENCE_PANEL
                    if (points := [(int(r["step"]), float(r[name])) for r in records if r.get(name) is not None])},
    )


PREFERENCE_PANEL = ("rewards/margins", "eval_rewards/margins", "rewards/accuracies", "eval_rewards/accuracies")
"""What the loss plot's second panel shows of a preference objective's metrics."""


def draw_curves(series: Curves, *, title: str):
    """The figure: loss (and eval loss) on a log axis, so that the late steps are not a flat line
    under the first ones, the warm-up steps shaded, the learning rate on the right axis, the legend
    below the plot (inside, it covered the curves' ends)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if series.preference:
        fig, (ax, rewards) = plt.subplots(2, 1, figsize=(7, 7.4), dpi=100, sharex=True,
                                          gridspec_kw={"height_ratios": (3, 2)})
        _draw_preference(rewards, series.preference)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.4), dpi=100)
    lines = ax.plot(*zip(*series.loss), marker="o", markersize=3, label="training loss")
    if series.eval_loss:
        lines += ax.plot(*zip(*series.eval_loss), marker="s", markersize=4, label="eval loss")
    if series.warmup is not None:
        first, last = series.warmup
        lines.append(ax.axvspan(first, last, color="orange", alpha=0.15, linewidth=0,
                                label=f"warm-up (steps {first}-{last})"))
    ax.set_yscale("log")
    _label_log_axis(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (log scale)")
    ax.grid(True, which="both", alpha=0.3)
    if series.lr:
        lr_axis = ax.twinx()
        lines += lr_axis.plot(*zip(*series.lr), color="grey", linestyle="--", label="learning rate")
        lr_axis.set_ylabel("learning rate")
        lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    fig.legend(lines, [line.get_label() for line in lines], loc="lower center", ncol=len(lines), frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07 if not series.preference else 0.04, 1, 1))
    return fig


def _draw_preference(ax, series: dict[str, list[tuple[int, float]]]) -> None:
    """Reward margins (left axis) and accuracies (right axis, 0 to 1), training and held-out."""
    for name in ("rewards/margins", "eval_rewards/margins"):
        if name in series:
            ax.plot(*zip(*series[name]), marker="o" if name.startswith("rewards") else "s", markersize=3, label=name)
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_ylabel("reward margin")
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    accuracy = ax.twinx()
    for name in ("rewards/accuracies", "eval_rewards/accuracies"):
        if name in series:
            accuracy.plot(*zip(*series[name]), linestyle="--", marker=".", label=name)
    accuracy.set_ylim(0, 1)
    accuracy.set_ylabel("reward accuracy")
    handles = ax.get_legend_handles_labels()[0] + accuracy.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="lower right", fontsize=8, frameon=False)


def _label_log_axis(ax) -> None:
    """Plain numbers on the log axis (0.3, not 3 x 10^-1): the decades only when the curves span one
    or more (a label on every minor tick of several decades overlaps its neighbours), every minor
    tick within a narrower span, where no decade may show."""
    import math

    import matplotlib.ticker

    low, high = ax.get_ylim()
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    if math.log10(high / low) >= 1:
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    else:
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))


def plot_curves(series: Curves, *, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = draw_curves(series, title=title)
    fig.savefig(path)
    plt.close(fig)


def write_report(run_dir: Path, *, records: list[dict], summary: RunSummary, meta: dict,
                 final: Optional[dict] = None) -> tuple[Path, Path]:
    """Write `report.json` (meta, summary, every step record) and `loss.png` (from the run's first
    step, with the loop's summary `final`) into run_dir."""
    run_dir.mkdir(parents=True, exist_ok=True)
    json_path = run_dir / "report.json"
    json_path.write_text(
        json.dumps({**meta, "summary": asdict(summary), "steps": records}, indent=2, sort_keys=True) + "\n"
    )
    png_path = run_dir / "loss.png"
    warmup = int((meta.get("config") or {}).get("warmup_steps") or 0)
    plot_curves(curves(records, final=final, warmup_steps=warmup), title=meta.get("title", "training loss"),
                path=png_path)
    return json_path, png_path
