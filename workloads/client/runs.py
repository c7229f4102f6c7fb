"""Local runs (`run --local`) as folders of runs/, and `python -m workloads runs`, which lists them.

Each run has a folder under the project's runs/ (or `run --local --out`), named after the run
(`--run-name NAME`, else `<preset>-<UTC time>`: the name the run's job, plot, tracker run and
every command use). `run.json` there says what the run is from its
start on: its name (Ray Train's and the tracker's), its preset and config, and its status (running,
succeeded, failed, interrupted). The report, the loss plot, the job's log, the checkpoints and the
exported model/ join it as the run goes. `run --local --run-name NAME` of a run that has a folder
resumes it from its latest checkpoint, with its config (and any `--set` on top, e.g. more steps).

    python -m workloads runs [--runs-dir DIR]

lists each run: name, status, steps done, loss (first -> last, and eval), and the model to chat with.
Folders of runs made before run.json existed are listed from their report.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from workloads.client.cluster import PROJECT_DIR
from workloads.client.report import method_label, trained_share
from workloads.client.usage import Parser, UsageError
from workloads.files import replace_whole

RUNS_DIR = PROJECT_DIR / "runs"
"""Where local runs go, wherever the command runs from (`run --local --out` names another)."""
RUN_FILE = "run.json"
REPORT_FILE = "report.json"
NOT_RUNS = ("mlflow", "evaluation-cache")
"""Folders of runs/ that are no run (the local tracking store, the base models' evaluation scores:
workloads/evaluate/cache.py)."""


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_file(run_dir: Path) -> Path:
    return run_dir / RUN_FILE


def read_run(run_dir: Path) -> Optional[dict]:
    """The run's record (run.json), or None for a folder without one."""
    try:
        record = json.loads(run_file(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_run(run_dir: Path, record: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_file(run_dir)
    replace_whole(path, json.dumps(record, indent=2, sort_keys=True) + "\n")


def update_run(run_dir: Path, **changes) -> None:
    """Change fields of the run's record (no-op for a folder without one)."""
    record = read_run(run_dir)
    if record is not None:
        write_run(run_dir, {**record, **changes})


def find_run(runs_dir: Path, name: str) -> Optional[Path]:
    """The folder of the run called `name` in `runs_dir`: the folder of that name, else one whose
    run.json names it (runs made before a run's folder took its name were folders named after their
    start's time only); None when there is none."""
    if (runs_dir / name).is_dir():
        return runs_dir / name
    if not runs_dir.is_dir() or "/" in name:
        return None
    return next((folder for folder in sorted(runs_dir.iterdir())
                 if folder.is_dir() and (read_run(folder) or {}).get("name") == name), None)


def latest_checkpoint_step(run_dir: Path) -> Optional[int]:
    """The step of the run's newest checkpoint (its progress.json), or None."""
    steps = []
    for progress in (run_dir / "checkpoints").glob("*/checkpoint*/progress.json"):
        try:
            steps.append(int(json.loads(progress.read_text())["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(steps, default=None)


@dataclass(frozen=True, kw_only=True)
class LocalRun:
    folder: Path
    name: str
    status: str
    steps: str
    """Steps done of the run's steps ("200/200"; "100/400" for one that stopped at a checkpoint)."""
    loss: str
    """"first -> last (eval E)" from the report; "-" without one."""
    model: Optional[Path]
    """The exported Hugging Face folder, or None."""
    score: str = ""
    """The evaluation's headline, tuned against base (workloads/evaluate/report.py); "" without one."""
    method: str = "full"
    """"full", or "lora r16 (0.22% trained)": the method, LoRA's rank, and the share of the model's
    parameters trained once the run has counted them."""


def describe(run_dir: Path) -> Optional[LocalRun]:
    """A folder of runs/ as a run, or None when it is none (no run.json and no report)."""
    record = read_run(run_dir)
    try:
        report = json.loads((run_dir / REPORT_FILE).read_text())
    except (OSError, ValueError):
        report = None
    if record is None and report is None:
        return None
    record = record or {}
    config = record.get("train") or (report or {}).get("config") or {}
    summary = (report or {}).get("summary") or {}
    done = summary.get("steps") if record.get("status") in (None, "succeeded", "failed") and summary else None
    done = done if done is not None else latest_checkpoint_step(run_dir)
    total = config.get("steps")
    steps = f"{done if done is not None else 0}/{total}" if total else str(done or "-")
    loss = "-"
    if summary.get("first_loss") is not None:
        loss = f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}"
        if summary.get("eval_loss") is not None:
            loss += f" (eval {summary['eval_loss']:.4f})"
    status = record.get("status") or str((report or {}).get("status", "?")).lower()
    model = run_dir / "model"
    evaluation = (report or {}).get("evaluation")
    if evaluation is None and (run_dir / "evaluation.json").is_file():  # `python -m workloads evaluate RUN`'s
        try:
            evaluation = json.loads((run_dir / "evaluation.json").read_text())
        except (OSError, ValueError):
            evaluation = None
    from workloads.evaluate.report import headline

    counted = (report or {}).get("loop_summary") or {}
    method = method_label(counted or config, short=True)
    if (share := trained_share(counted)) is not None and counted.get("method") == "lora":
        method += f" ({100 * share:.2f}% trained)"
    return LocalRun(folder=run_dir, name=run_dir.name, status=status, steps=steps, loss=loss,
                    model=model if (model / "config.json").is_file() else None, method=method,
                    score=headline(evaluation) if evaluation else "")


def local_runs(runs_dir: Path) -> list[LocalRun]:
    """The runs of `runs_dir`, oldest first (by the folder's time of change)."""
    if not runs_dir.is_dir():
        return []
    folders = sorted((p for p in runs_dir.iterdir() if p.is_dir() and p.name not in NOT_RUNS),
                     key=lambda p: (p.stat().st_mtime, p.name))
    return [run for run in map(describe, folders) if run is not None]


def format_runs(runs: list[LocalRun], *, cwd: Path) -> str:
    def shown(path: Optional[Path]) -> str:
        if path is None:
            return "-"
        try:
            return str(path.relative_to(cwd))
        except ValueError:
            return str(path)

    scored = any(r.score for r in runs)  # the SCORE column once a run has been evaluated
    rows = [("NAME", "STATUS", "STEPS", "LOSS", "METHOD", *(("SCORE",) if scored else ()), "MODEL")]
    rows += [(r.name, r.status, r.steps, r.loss, r.method, *((r.score or "-",) if scored else ()), shown(r.model))
             for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1]
                     for row in rows)


def main(command: str, argv: list[str]) -> int:
    parser = Parser(prog="python -m workloads runs", description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR, help=f"where the runs are (default: {RUNS_DIR})")
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return 2
    runs = local_runs(args.runs_dir)
    if not runs:
        print(f"no local runs in {args.runs_dir} (python -m workloads run makes one)")
        return 0
    print(format_runs(runs, cwd=Path.cwd()))
    print("\npython -m workloads chat NAME talks to a run's model; "
          "python -m workloads run --run-name NAME resumes a run")
    return 0
