"""The evaluation where the user looks: `evaluation.json` and `evaluation.png` beside the run's final
checkpoint (and in a local run's report), each metric of both models in MLflow with the table as an
artifact, the headline `runs` shows, and the model card (README.md) of the exported folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

from workloads.evaluate.compare import GateResult, Row, format_table
from workloads.model_io.evaluation_file import EVALUATION_FILE

EVALUATE_PREFIX = "[evaluate] "
"""Prefix of the stage's result line in the job's log: `[evaluate] {...}` (workloads/evaluate/stage.py)."""
EVALUATION_PLOT = "evaluation.png"
EVALUATION_TABLE = "evaluation.txt"
MODEL_CARD = "README.md"


def evaluation_record(*, rows: list[Row], gate: list[GateResult], seconds: float, tuned: str, base: str,
                      tasks: tuple[str, ...], lm_eval_version: str, units: list[dict],
                      adapter_rows: Optional[list[Row]] = None) -> dict:
    """What evaluation.json holds (and the job's `[evaluate] {...}` line)."""
    record: dict[str, Any] = {
        "event": "evaluation", "tuned": tuned, "base": base, "tasks": list(tasks), "seconds": round(seconds, 1),
        "lm_eval": lm_eval_version, "rows": [r.to_dict() for r in rows], "gate": [g.__dict__ for g in gate],
        "passed": all(g.passed for g in gate), "units": units,
    }
    if adapter_rows is not None:
        record["adapter_vs_merged"] = [r.to_dict() for r in adapter_rows]
        record["adapter_agrees"] = all(r.significant is False for r in adapter_rows)
    return record


def rows_of(record: dict) -> list[Row]:
    keep = {"task", "metric", "tuned", "tuned_stderr", "base", "base_stderr", "samples", "higher_is_better"}
    return [Row(**{k: v for k, v in row.items() if k in keep}) for row in record.get("rows", [])]


def headline(record: Optional[dict]) -> str:
    """The first task's first metric, tuned against base: what `runs` shows ("-" without one)."""
    rows = rows_of(record or {})
    if not rows:
        return "-"
    row = rows[0]
    text = f"{row.task}:{row.metric} {row.tuned:.3f}"
    if row.base is not None:
        text += f" (base {row.base:.3f}, {row.verdict})"
    if record and not record.get("passed", True):
        text += " GATE FAILED"
    return text


def format_evaluation(record: dict) -> str:
    """The table, the gate's verdicts and the time, as the console and evaluation.txt show them."""
    lines = [format_table(rows_of(record))]
    if "adapter_agrees" in record:
        lines.append("adapter (base + peft) and merged export " + (
            "agree within noise" if record["adapter_agrees"] else "DISAGREE beyond noise"))
    for result in record.get("gate", []):
        lines.append(("gate passed: " if result["passed"] else "gate FAILED: ") + result["message"])
    lines.append(f"evaluated in {record.get('seconds', 0):.1f} s with lm-eval {record.get('lm_eval', '?')} "
                 f"(tuned {record.get('tuned')}, base {record.get('base')})")
    return "\n".join(lines)


def plot_evaluation(record: dict, path: Path) -> Path:
    """Tuned against base per task and metric, each with two standard errors as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows_of(record)
    labels = [f"{r.task}\n{r.metric}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(rows) + 1.5), 3.6))
    xs = range(len(rows))
    width = 0.38
    for offset, name, values, errors in (
            (-width / 2, "base", [r.base or 0.0 for r in rows], [2 * (r.base_stderr or 0.0) for r in rows]),
            (width / 2, "tuned", [r.tuned for r in rows], [2 * (r.tuned_stderr or 0.0) for r in rows])):
        ax.bar([x + offset for x in xs], values, width, yerr=errors, capsize=4, label=name)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("score (error bars: 2 standard errors)")
    ax.set_title(("gate passed" if record.get("passed", True) else "gate FAILED") + f": {record.get('tuned', '')}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def model_card(record: dict, *, title: str = "Fine-tuned model") -> str:
    """README.md of an exported model folder: its scores beside its base's."""
    lines = [f"# {title}", "", f"Evaluated with EleutherAI's lm-evaluation-harness {record.get('lm_eval', '')} "
             f"against its base, `{record.get('base')}`, on the same tasks and settings.", "",
             "| task | metric | this model | base | difference | larger than noise (2 SE) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows_of(record):
        def pm(value, se):
            return "-" if value is None else f"{value:.4f}" + (f" ± {se:.4f}" if se is not None else "")

        diff = "-" if row.difference is None else f"{row.difference:+.4f}"
        lines.append(f"| {row.task} | {row.metric} | {pm(row.tuned, row.tuned_stderr)} | "
                     f"{pm(row.base, row.base_stderr)} | {diff} | {row.verdict} |")
    for result in record.get("gate", []):
        lines.append("")
        lines.append(f"Gate `{result['rule']}`: {'passed' if result['passed'] else 'FAILED'}.")
    return "\n".join(lines) + "\n"


def tracker_metrics(record: dict) -> dict[str, float]:
    """MLflow metric names and values: each task's metric for the tuned model and the base, and the
    difference."""
    metrics: dict[str, float] = {}
    for row in rows_of(record):
        name = f"eval/{row.task}/{row.metric.replace(',', '/')}".replace(" ", "_")
        metrics[f"{name}/tuned"] = row.tuned
        if row.base is not None:
            metrics[f"{name}/base"] = row.base
            metrics[f"{name}/difference"] = row.difference
        if row.tuned_stderr is not None:
            metrics[f"{name}/tuned_stderr"] = row.tuned_stderr
        if row.base_stderr is not None:
            metrics[f"{name}/base_stderr"] = row.base_stderr
    metrics["eval/gate_passed"] = 1.0 if record.get("passed", True) else 0.0
    metrics["eval/seconds"] = float(record.get("seconds") or 0.0)
    return metrics


def log_to_tracker(settings, *, run_id: str, record: dict, files: tuple[Path, ...],
                   say: Callable[[str], None] = print, timeout_s: float = 30.0) -> bool:
    """Each metric of both models, the gate's verdict and the table (files) in the run's MLflow run;
    bounded wait, never raises (a tracker that is down loses the evaluation's record there, not the run)."""
    import time

    from workloads.train import tracking

    uri = tracking.tracking_uri(settings)
    if not uri or not (run_id or settings.run_name):
        return False
    target = [run_id]

    def send() -> None:
        sink = tracking.MlflowSink(uri)
        if not target[0]:
            found = sink.find_run(settings.experiment_name, run_name=settings.run_name)
            if found is None:
                raise LookupError(f"no run named {settings.run_name} in experiment {settings.experiment_name}")
            target[0] = found.info.run_id
        now = int(time.time() * 1000)
        sink.log_batch(target[0], metrics=tuple((k, v, now, 0) for k, v in tracker_metrics(record).items()),
                       tags={"evaluation": "passed" if record.get("passed", True) else "gate failed"})
        sink.log_json(target[0], record, EVALUATION_FILE)
        for path in files:
            sink.log_file(target[0], path)

    _, why = tracking._within(timeout_s, send)
    if why is not None:
        say(f"[evaluate] warning: could not log the evaluation to run {target[0] or settings.run_name}: {why}")
        return False
    return True


def write_files(folder: Path, record: dict) -> tuple[Path, ...]:
    """evaluation.json, evaluation.txt and evaluation.png in a local folder (no plot where matplotlib
    is not installed: a bare GPU host)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EVALUATION_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    (folder / EVALUATION_TABLE).write_text(format_evaluation(record) + "\n")
    try:
        plot = (plot_evaluation(record, folder / EVALUATION_PLOT),)
    except ImportError:
        plot = ()
    return (folder / EVALUATION_FILE, folder / EVALUATION_TABLE, *plot)


def gate_summary(record: dict) -> str:
    """One line: the gate's verdict (the rules that failed, by how much), or the headline without a gate."""
    failed = [g for g in record.get("gate", []) if not g["passed"]]
    if failed:
        return ("evaluation gate failed: " + "; ".join(g["message"] for g in failed) +
                " (the checkpoint is kept; it is not made the run's model)")
    if record.get("error"):
        return f"evaluation failed: {record['error']} (the checkpoint is kept)"
    if record.get("gate"):
        return "evaluation gate passed: " + "; ".join(g["message"] for g in record["gate"])
    return f"evaluation: {headline(record)}"


def carry_model_card(*, checkpoint_uri: str, out_uri: str) -> bool:
    """Write the model card (README.md) into an exported folder from its checkpoint's evaluation,
    unless the folder has one already (a copied export carries the run's own); True when written."""
    import tempfile

    from workloads.model_io.storage import locate

    out = locate(out_uri)
    if out.join(MODEL_CARD).is_file():
        return False
    try:
        record = json.loads(locate(checkpoint_uri).join(EVALUATION_FILE).read_bytes())
    except ValueError:
        return False
    if not record.get("rows"):
        return False
    with tempfile.TemporaryDirectory(prefix="model-card-") as tmp:
        (Path(tmp) / MODEL_CARD).write_text(model_card(record))
        out.upload_from(Path(tmp))
    return True


def parse_evaluation_line(line: str) -> Optional[dict]:
    """The result of a `[evaluate] {"event": "evaluation", ...}` line, or None."""
    start = line.find(EVALUATE_PREFIX + "{")
    if start < 0:
        return None
    try:
        record = json.loads(line[start + len(EVALUATE_PREFIX):])
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and record.get("event") == "evaluation" else None


def evaluation_from_logs(logs: str) -> Optional[dict]:
    """The last evaluation result in a job's log (a resubmitted run's last), or None."""
    found = None
    for line in logs.splitlines():
        record = parse_evaluation_line(line)
        if record is not None:
            found = record
    return found
