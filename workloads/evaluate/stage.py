"""The stage after training, on the cluster: the job's workers (the GPUs the run held, now free)
evaluate the tuned model and its base, one (model, task) unit per Ray task, as many at once as the
run had workers; the driver prints a progress line as each ends, compares, judges the gate, and
writes the result where the user looks (beside the final checkpoint, the model card, MLflow, and a
`[evaluate] {...}` line of the job's log that the client reads).

Whatever happens here, the trained checkpoint stays: an evaluation that fails says why in one line,
and only a gate makes the run's outcome depend on it.
"""

from __future__ import annotations

import importlib
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from workloads.evaluate.compare import Score, compare, judge
from workloads.evaluate.report import EVALUATE_PREFIX
from workloads.train.evaluation_config import HELDOUT_TASK, EvaluateConfig
from workloads.evaluate.units import Models, Unit, plan_units, run_unit


STAGE_MODULES = ("workloads.evaluate.cache", "workloads.evaluate.harness", "workloads.evaluate.report",
                 "workloads.evaluate.tasks", "workloads.model_io.cache", "workloads.model_io.sources",
                 "workloads.model_io.storage", "workloads.train.checkpoint", "workloads.train.config",
                 "workloads.train.data", "workloads.train.encode", "workloads.train.records",
                 "workloads.train.tracking", "workloads.files")
"""Every module of the project the stage imports as it runs."""


def preload() -> None:
    """Imports STAGE_MODULES now. The driver calls it before it connects to Ray: on a machine whose
    nodes share the job's working_dir, the workers' runtime env can remove it while the job runs, and
    a module first imported after that is not found. Not at this module's import, which the command
    line does to check a run's evaluation (the checkpoint module brings torch: 1.5 s)."""
    for name in STAGE_MODULES:
        importlib.import_module(name)


def base_of(train: dict) -> tuple[str, str]:
    """The model the run is compared with and its revision: evaluate.base, else model.name_or_path at
    its pinned revision; ("", "") for a model built from a named architecture (random weights)."""
    from workloads.train.config import TrainConfig

    cfg = TrainConfig.from_dict(train)
    if cfg.evaluate.base:
        return cfg.evaluate.base, ""
    if cfg.model.is_named_architecture:
        return "", ""
    return cfg.model.name_or_path, cfg.model.revision


def tasks_for(train: dict) -> tuple[tuple[str, ...], list[str]]:
    """The tasks the run is evaluated on, and notes on what is left out: the held-out task needs
    held-out records (a run on synthetic tokens, or with data.eval_fraction 0, has none; a gate on
    it is then a mistake)."""
    from workloads.train.config import TrainConfig

    cfg = TrainConfig.from_dict(train)
    tasks, notes = cfg.evaluate.task_list, []
    if HELDOUT_TASK in tasks and (cfg.data.kind == "synthetic" or cfg.data.eval_fraction == 0):
        why = ("trains on synthetic tokens" if cfg.data.kind == "synthetic"
               else "holds nothing out (data.eval_fraction 0)")
        if any(rule.task == HELDOUT_TASK for rule in cfg.evaluate.rules):
            raise ValueError(f"evaluate.gate names the heldout task, and the run {why}: set data.eval_fraction on "
                             "record data, or gate another task")
        tasks = tuple(t for t in tasks if t != HELDOUT_TASK)
        notes.append(f"no heldout task: the run {why}")
    return tasks, notes


def check_before_training(train: dict, *, network: Optional[bool] = None, evaluated_here: bool = True,
                          base_made_later: bool = False) -> list[str]:
    """What can be known before any GPU time: the tasks exist, each gate names a metric its task
    has, a hub task has a network to read it from, the base can be found, lm-eval is installed.
    ValueError (one line) for a mistake; the notes to print otherwise. `evaluated_here`: this
    machine's Python runs the evaluation (the driver, a local run); `submit` passes False: the job
    installs lm-eval itself, and task names are checked here only when lm-eval is installed here.
    `base_made_later`: the base is the model the demo writes just before the job."""
    from workloads.evaluate.tasks import check_tasks, hub_offline

    tasks, notes = tasks_for(train)
    if not tasks:
        return notes
    from workloads.train.config import TrainConfig

    settings = TrainConfig.from_dict(train).evaluate
    base, _ = base_of(train)
    if base and not base_made_later:
        from workloads.model_io.sources import check_model_folder, source_kind

        if source_kind(base, what="evaluate.base") == "local":
            check_model_folder(Path(base).expanduser(), spec=base, what="evaluate.base")
    if not base and any(rule.relative for rule in settings.rules):
        raise ValueError("evaluate.gate compares with the base, and the run starts from random weights "
                         f"({TrainConfig.from_dict(train).model.name_or_path}): set evaluate.base to a model, or "
                         "give absolute bounds (TASK:METRIC>=0.5)")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        if not evaluated_here:
            return [*notes, "lm-eval is not installed here: the job checks the task names before it trains"]
        if settings.rules:
            raise ValueError("evaluate.gate needs lm-eval, which is not installed here: pip install -e "
                             "'.[evaluate]'") from None
        return [*notes, "lm-eval is not installed: the run will not be evaluated (pip install -e '.[evaluate]'; "
                        "--set evaluate.tasks= to turn evaluation off)"]
    import dataclasses

    check_tasks(dataclasses.replace(settings, tasks=",".join(tasks)),
                network=not hub_offline() if network is None else network)
    return notes


def scores_by(results: list[dict], role: str) -> tuple[dict[str, dict[str, Score]], dict[str, dict[str, bool]]]:
    scores: dict[str, dict[str, Score]] = {}
    better: dict[str, dict[str, bool]] = {}
    for result in results:
        if result["role"] == role:
            scores[result["task"]] = {m: Score(**s) for m, s in result["scores"].items()}
            better[result["task"]] = dict(result.get("higher_is_better") or {})
    return scores, better


def summarize(results: list[dict], *, settings: EvaluateConfig, seconds: float, models: Models,
              lm_eval_version: str) -> dict:
    """The comparison and the gate of the units' results, as evaluation.json holds it."""
    from workloads.evaluate.report import evaluation_record

    tuned, better = scores_by(results, "tuned")
    base, _ = scores_by(results, "base")
    rows = compare(tuned, base, higher_is_better=better)
    adapter_rows = None
    if any(r["role"] == "adapter" for r in results):
        adapter, _ = scores_by(results, "adapter")
        adapter_rows = compare(adapter, tuned, higher_is_better=better)
    return evaluation_record(rows=rows, gate=judge(settings.rules, rows), seconds=seconds, tuned=models.tuned,
                             base=models.base + (f"@{models.base_revision}" if models.base_revision else ""),
                             tasks=settings.task_list, lm_eval_version=lm_eval_version, units=[
                                 {k: r[k] for k in ("role", "task", "seconds", "cached", "node")} for r in results],
                             adapter_rows=adapter_rows)


def failed_record(reason: str, *, settings: EvaluateConfig, seconds: float) -> dict:
    """An evaluation that could not be done: with a gate, the gate fails (nothing shows the model
    passes it); without one, the run's outcome does not change."""
    return {"event": "evaluation", "error": reason, "tasks": list(settings.task_list), "seconds": round(seconds, 1),
            "rows": [], "gate": [{"rule": rule.text, "passed": False, "tuned": None, "bound": None,
                                  "message": f"{rule.text}: not evaluated ({reason})"} for rule in settings.rules],
            "passed": not settings.rules}


def run_units_on_ray(units: list[Unit], *, train: dict, models: Models, storage_path: str, use_gpu: bool,
                     cpus_per_unit: float, say: Callable[[str], None]) -> list[dict]:
    """Each unit as a Ray task on a worker (one GPU each on a GPU cluster), spread over the nodes;
    a progress line as each ends."""
    import ray

    remote = ray.remote(run_unit).options(num_gpus=1 if use_gpu else 0, num_cpus=cpus_per_unit,
                                          scheduling_strategy="SPREAD", max_retries=0)
    pending = {remote.remote(unit, train=train, models=models, storage_path=storage_path): unit for unit in units}
    results = []
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        unit = pending.pop(done[0])
        result = ray.get(done[0])
        results.append(result)
        assert (result["role"], result["task"]) == (unit.role, unit.task)
        say(progress_line(result, done=len(results), total=len(units)))
    return results


def one_line(exc: BaseException) -> str:
    """An error in one line: a Ray task's error ends with the task's own exception, as its last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def progress_line(result: dict, *, done: int, total: int) -> str:
    scores = ", ".join(f"{m} {s['value']:.4f}" + (f" ± {s['stderr']:.4f}" if s.get("stderr") is not None else "")
                       for m, s in result["scores"].items())
    how = "cached" if result.get("cached") else f"{result['seconds']:.1f} s"
    return f"{done}/{total} {result['role']} on {result['task']}: {scores} ({how}, {result.get('node', '?')})"


def evaluate_after_training(train: dict, *, checkpoint_uri: str, storage_path: str, use_gpu: bool,
                            cpus_per_unit: float, say: Callable[[str], None],
                            runner: Callable[..., list[dict]] = run_units_on_ray) -> Optional[dict]:
    """Evaluate the run whose final checkpoint is `checkpoint_uri` (its exported model in `model/`);
    None when the run asks for no evaluation. Never raises for an evaluation that fails: the record
    says why."""
    from workloads.evaluate.harness import lm_eval_version
    from workloads.train.config import TrainConfig

    import dataclasses

    cfg = TrainConfig.from_dict(train)
    tasks, notes = tasks_for(train)
    for note in notes:
        say(note)
    settings = dataclasses.replace(cfg.evaluate, tasks=",".join(tasks))
    if not tasks:
        return None
    started = time.monotonic()
    base, revision = base_of(train)
    models = Models(tuned=f"{checkpoint_uri.rstrip('/')}/model", base=base, base_revision=revision)
    units = plan_units(settings.task_list, lora=cfg.method == "lora" and bool(base), base=bool(base))
    say(f"evaluating the tuned model{' and its base ' + base if base else ''} on {', '.join(settings.task_list)}: "
        f"{len(units)} unit(s) on the run's {'GPU' if use_gpu else 'CPU'} workers")
    try:
        version = lm_eval_version()
        results = runner(units, train=train, models=models, storage_path=storage_path, use_gpu=use_gpu,
                         cpus_per_unit=cpus_per_unit, say=say)
        record = summarize(results, settings=settings, seconds=time.monotonic() - started, models=models,
                           lm_eval_version=version)
    except Exception as exc:  # the checkpoint is kept whatever went wrong here; the reason is the record's
        reason = one_line(exc)
        say(f"error: the evaluation failed: {reason}")
        record = failed_record(reason, settings=settings, seconds=time.monotonic() - started)
    store_results(record, checkpoint_uri=checkpoint_uri, train=train, say=say)
    print(EVALUATE_PREFIX + json.dumps(record, sort_keys=True), flush=True)
    return record


def store_results(record: dict, *, checkpoint_uri: str, train: dict, say: Callable[[str], None]) -> None:
    """evaluation.json/.txt/.png beside the checkpoint, the model card in its model/, the tracker's
    record. A storage or tracker that fails loses these copies, not the run (the log line has it all)."""
    from workloads.evaluate.report import MODEL_CARD, format_evaluation, log_to_tracker, model_card, write_files
    from workloads.model_io.storage import locate
    from workloads.train.checkpoint import PROGRESS_FILE
    from workloads.train.config import TrainConfig

    if not record.get("error"):
        for line in format_evaluation(record).splitlines():
            say(line)
    checkpoint = locate(checkpoint_uri)
    with tempfile.TemporaryDirectory(prefix="evaluation-") as tmp:
        files = write_files(Path(tmp), record)
        try:
            checkpoint.upload_from(Path(tmp))
            if record.get("rows"):
                card = Path(tmp) / "card"
                card.mkdir()
                (card / MODEL_CARD).write_text(model_card(record))
                checkpoint.join("model").upload_from(card)
        except ValueError as exc:
            say(f"warning: the evaluation could not be stored beside {checkpoint_uri}: {exc}")
        settings = TrainConfig.from_dict(train).tracking
        try:
            run_id = str(json.loads(checkpoint.join(PROGRESS_FILE).read_bytes()).get("tracking_run_id") or "")
        except ValueError:
            run_id = ""
        log_to_tracker(settings, run_id=run_id, record=record, files=files, say=say)

