"""`python -m workloads evaluate`: a trained model beside its base, on this machine's GPU (or CPU).

    python -m workloads evaluate RUN|MODEL [--tasks heldout,gsm8k] [--base MODEL] [--set evaluate.KEY=VALUE]

RUN is a local run (its name under runs/, or its folder): its exported model/ is scored against the
model it started from, on the tasks its config names (`--tasks` instead), the held-out task made from
the records it held out. MODEL is a Hugging Face folder (or hub id) scored against `--base`; the
held-out task then needs the data named with `--set data.path=FILE` (and its eval_fraction, seed).
The base's scores are cached beside the runs (evaluate.cache), so a second evaluation against the
same base scores the tuned model alone.

Exit codes: 0 evaluated (and passed the gate, if any); 2 bad input; 5 the tuned model missed its gate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from workloads.client.usage import Parser, UsageError
from workloads.train.evaluation_config import EXIT_GATE_FAILED, HELDOUT_TASK, task_names

EXIT_OK, EXIT_USAGE = 0, 2


def _arg_parser() -> argparse.ArgumentParser:
    from workloads.client.runs import RUNS_DIR

    parser = Parser(prog="python -m workloads evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("target", metavar="RUN|MODEL", help="a local run (name or folder) or a model folder / hub id")
    parser.add_argument("--tasks", help="comma-separated tasks (default: the run's evaluate.tasks, heldout)")
    parser.add_argument("--base", help="the model to compare with (default: the one the run started from)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set evaluate.gate='heldout:exact_match>=base-0.01'")
    parser.add_argument("--runs-dir", type=Path, default=RUNS_DIR, help=f"where local runs are (default: {RUNS_DIR})")
    parser.add_argument("--out", type=Path, help="where evaluation.json/.txt/.png go (default: the run's folder, "
                        "or ./evaluation-<model> for a model)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def resolve_target(target: str, *, runs_dir: Path) -> tuple[Optional[Path], dict, str]:
    """(the run's folder or None, its train config or {}, the tuned model's folder or hub id)."""
    from workloads.client.runs import read_run

    for folder in (Path(target).expanduser(), runs_dir / target):
        record = read_run(folder)
        if record is not None:
            model = folder / "model"
            if not (model / "config.json").is_file():
                raise ValueError(f"run {folder.name} has no exported model ({model}): python -m workloads export "
                                 f"{folder} writes it")
            return folder.resolve(), record["train"], str(model.resolve())
    if Path(target).expanduser().is_dir():
        return None, {}, str(Path(target).expanduser().resolve())
    if "/" in target and not target.startswith((".", "/", "~")):
        return None, {}, target  # a hub id
    raise ValueError(f"{target!r} is neither a run in {runs_dir}, a run folder, a model folder nor a hub id")


def evaluation_config(train: dict, args: argparse.Namespace, *, tuned: str) -> dict:
    """The run's config (a model outside a run: the defaults, the model as model.name_or_path) with
    --tasks, --base and --set on top."""
    from workloads.client.overrides import user_overrides
    from workloads.train.config import TrainConfig, with_overrides

    cfg = TrainConfig.from_dict(train) if train else with_overrides(TrainConfig(), [f"model.name_or_path={tuned}"])
    sets = list(args.set)
    if args.tasks is not None:
        sets.append(f"evaluate.tasks={args.tasks}")
    if args.base is not None:
        sets.append(f"evaluate.base={args.base}")
    return with_overrides(cfg, user_overrides(cfg.to_dict(), sets)).to_dict()


def evaluate_here(train: dict, *, tuned: str, storage_path: str, device: Optional[str],
                  say: Callable[[str], None]) -> Optional[dict]:
    """Every unit of the evaluation, one after another on this machine; the record (None: nothing to do)."""
    import dataclasses

    from workloads.evaluate.harness import lm_eval_version
    from workloads.evaluate.stage import base_of, progress_line, summarize, tasks_for
    from workloads.evaluate.units import Models, plan_units, run_unit
    from workloads.train.config import TrainConfig

    cfg = TrainConfig.from_dict(train)
    tasks, notes = tasks_for(train)
    for note in notes:
        say(note)
    if not tasks:
        return None
    settings = dataclasses.replace(cfg.evaluate, tasks=",".join(tasks))
    base, revision = base_of(train)
    models = Models(tuned=tuned, base=base, base_revision=revision)
    lora = cfg.method == "lora" and (Path(tuned) / "adapter" / "adapter_config.json").is_file() and bool(base)
    units = plan_units(tasks, lora=lora, base=bool(base))
    started = time.monotonic()
    results = []
    for unit in units:
        results.append(run_unit(unit, train=train, models=models, storage_path=storage_path, device=device))
        say(progress_line(results[-1], done=len(results), total=len(units)))
    return summarize(results, settings=settings, seconds=time.monotonic() - started, models=models,
                     lm_eval_version=lm_eval_version())


def run(args: argparse.Namespace, *, say: Callable[[str], None]) -> int:
    from workloads.evaluate.report import format_evaluation, gate_summary, write_files
    from workloads.evaluate.stage import check_before_training
    from workloads.evaluate.tasks import hub_reachable

    run_dir, train, tuned = resolve_target(args.target, runs_dir=args.runs_dir)
    train = evaluation_config(train, args, tuned=tuned)
    if run_dir is None and not train["evaluate"]["base"]:
        raise ValueError("a model outside a run needs --base (the model to compare it with)")
    standard = any(task != HELDOUT_TASK for task in task_names(train["evaluate"]["tasks"]))
    for note in check_before_training(train, network=hub_reachable() if standard else True):
        say(note)
    record = evaluate_here(train, tuned=tuned, storage_path=str(args.runs_dir.resolve()), device=args.device, say=say)
    if record is None:
        say("nothing to evaluate")
        return EXIT_OK
    out = args.out or run_dir or Path.cwd() / f"evaluation-{Path(tuned).name}"
    files = write_files(out, record)
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
    else:
        print(format_evaluation(record))
        print(f"written: {', '.join(str(f) for f in files)}")
    if run_dir is not None and record.get("passed") and record.get("rows"):
        from workloads.evaluate.report import MODEL_CARD, model_card

        (Path(tuned) / MODEL_CARD).write_text(model_card(record, title=run_dir.name))
    print(gate_summary(record))
    return EXIT_OK if record.get("passed", True) else EXIT_GATE_FAILED


def main(command: str, argv: list[str]) -> int:
    try:
        args = _arg_parser().parse_args(argv)
        return run(args, say=lambda line: print(f"[evaluate] {line}", flush=True))
    except (UsageError, ValueError) as exc:
        print(f"{command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main("evaluate", sys.argv[1:]))
