"""The tasks a run is scored on: its own held-out records made into an lm-eval task, and lm-eval's
standard tasks by name, checked before anything runs.

The held-out task is an ordinary lm-eval task folder (a YAML config, the records as JSONL, the
metric in a Python file beside them), so lm-eval's own CLI runs it too:

    lm_eval --model hf --model_args pretrained=MODEL --include_path FOLDER --tasks heldout

Each record is asked as training showed it: the tokenizer's chat template over the conversation up
to its last answer (system prompt and earlier turns included), the generation prompt appended; the
answer is that last assistant turn. Generation is greedy and stops at the template's end of turn.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from workloads.train.evaluation_config import HELDOUT_METRICS, HELDOUT_TASK, EvaluateConfig

TASK_FILE = f"{HELDOUT_TASK}.yaml"
RECORDS_FILE = f"{HELDOUT_TASK}.jsonl"
METRICS_MODULE = "heldout_metrics"

METRICS_SOURCE = '''"""The held-out task's scoring (written by workloads/evaluate/tasks.py)."""


def _answer(doc):
    return doc["answer"].strip()


def exact_match(doc, results):
    return {"exact_match": float(results[0].strip() == _answer(doc))}


def rougeL(doc, results):
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    return {"rougeL": scorer.score(_answer(doc), results[0].strip())["rougeL"].fmeasure}


def loglikelihood(doc, results):
    loglikelihood, _ = results[0]
    return {"loglikelihood": loglikelihood / max(1, doc["answer_tokens"])}
'''


@dataclass(frozen=True, kw_only=True)
class HeldOutExample:
    prompt: str
    """The conversation up to the answer, rendered with the chat template and its generation prompt."""
    answer: str
    answer_tokens: int
    where: str


def heldout_examples(records: list, held: set[int], *, tokenizer, limit: int = 0) -> list[HeldOutExample]:
    """The held-out chat records (in file order) as prompts and answers; text records have no answer
    to ask for and are left out."""
    examples = []
    for index in sorted(held):
        record = records[index]
        if not record.is_chat:
            continue
        last = max(i for i, m in enumerate(record.messages) if m["role"] == "assistant")
        context = record.messages[:last]
        if not context:
            continue
        if tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template(context, add_generation_prompt=True, tokenize=False)
        else:
            prompt = "\n".join(m["content"] for m in context) + "\n"
        answer = record.messages[last]["content"]
        examples.append(HeldOutExample(prompt=prompt, answer=answer, where=record.where,
                                       answer_tokens=len(tokenizer(answer, add_special_tokens=False)["input_ids"])))
        if limit and len(examples) >= limit:
            break
    return examples


def end_of_turn(tokenizer) -> Optional[str]:
    """The string the chat template ends a turn with (Qwen's <|im_end|>), where generation stops."""
    from workloads.train.encode import end_of_turn_id

    token_id = end_of_turn_id(tokenizer) if tokenizer.chat_template else None
    return None if token_id is None else tokenizer.convert_ids_to_tokens(token_id)


def write_heldout_task(folder: Path, examples: list[HeldOutExample], *, metric: str, max_new_tokens: int,
                       stop: Optional[str]) -> Path:
    """The lm-eval task folder of the held-out examples; returns it."""
    if metric not in HELDOUT_METRICS:
        raise ValueError(f"evaluate.metric is {metric!r}: use one of {', '.join(HELDOUT_METRICS)}")
    if not examples:
        raise ValueError("the run held out no chat record to ask: set data.eval_fraction (e.g. 0.05) on chat data, "
                         "or evaluate.tasks without heldout")
    folder.mkdir(parents=True, exist_ok=True)
    records = folder / RECORDS_FILE
    records.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer, "answer_tokens": e.answer_tokens,
                                           "where": e.where}) + "\n" for e in examples))
    (folder / f"{METRICS_MODULE}.py").write_text(METRICS_SOURCE)
    config: dict = {
        "task": HELDOUT_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(records.resolve())}},
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
        "process_results": f"!function {METRICS_MODULE}.{metric}",
        "metric_list": [{"metric": metric, "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    if metric == "loglikelihood":
        config.update(output_type="loglikelihood", doc_to_target="{{answer}}")
    else:
        config.update(output_type="generate_until", doc_to_target="{{answer}}", generation_kwargs={
            "until": [stop] if stop else [], "max_gen_toks": max_new_tokens, "do_sample": False})
    # YAML is a superset of JSON, but lm-eval's `!function` tag must stand bare.
    text = json.dumps(config, indent=2).replace(f'"!function {METRICS_MODULE}.{metric}"',
                                                 f"!function {METRICS_MODULE}.{metric}")
    (folder / TASK_FILE).write_text(text + "\n")
    return folder


def examples_digest(folder: Path) -> str:
    """What the held-out task asks and how it scores, as a hash (the base's cached scores are per
    question set): its records and its config but for where the folder is."""
    digest = hashlib.sha256((folder / RECORDS_FILE).read_bytes())
    digest.update((folder / TASK_FILE).read_text().replace(str((folder / RECORDS_FILE).resolve()), "").encode())
    return digest.hexdigest()[:16]


def build_heldout_task(train: dict, folder: Path, *, tokenizer_folder: Path, cache_dir: str = "") -> Path:
    """The run's held-out records (read as the loop read them, the same seeded choice) as a task in
    `folder`, rendered with the tokenizer of `tokenizer_folder` (the tuned model's, the base's own)."""
    from workloads.train.config import TrainConfig
    from workloads.train.data import data_files
    from workloads.train.encode import load_tokenizer
    from workloads.train.records import hold_out, read_records

    cfg = TrainConfig.from_dict(train)
    data, settings = cfg.data, cfg.evaluate
    if data.kind == "synthetic":
        raise ValueError("the heldout task needs records: this run trains on synthetic tokens (data.kind=synthetic); "
                         "set evaluate.tasks to lm-eval tasks, or to empty for no evaluation")
    records = read_records(data_files(data, cache_dir=cache_dir), text_field=data.text_field,
                           messages_field=data.messages_field, limit=data.max_examples, data_format=data.format)
    held = hold_out(len(records), fraction=data.eval_fraction, seed=cfg.seed)
    tokenizer = load_tokenizer(str(tokenizer_folder))
    examples = heldout_examples(records, held, tokenizer=tokenizer, limit=settings.limit)
    return write_heldout_task(folder, examples, metric=settings.metric, max_new_tokens=settings.max_new_tokens,
                              stop=end_of_turn(tokenizer))


# --- lm-eval's own tasks -----------------------------------------------------------------------


def task_manager(include_path: Optional[Path] = None):
    """lm-eval's TaskManager: of the held-out task folder alone when one is given (indexing lm-eval's
    fourteen thousand built-in task configs takes seconds to half a minute), else of the built-in tasks."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        return TaskManager(include_path=str(include_path), include_defaults=False)
    return TaskManager()


def hub_offline() -> bool:
    """Datasets cannot come from the hub here: offline by the environment (HF_HUB_OFFLINE,
    HF_DATASETS_OFFLINE)."""
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(*, timeout_s: float = 5.0) -> bool:
    """This machine can read datasets from the hub: not offline by the environment, and its endpoint
    (HF_ENDPOINT) answers."""
    import urllib.error
    import urllib.request

    if hub_offline():
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(f"{endpoint}/api/datasets?limit=1", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return True  # it answers
    except (OSError, ValueError):
        return False
    return True


def task_metrics(manager, name: str) -> tuple[str, ...]:
    """The metrics a standard task (or each subtask of a group) reports, from its config."""
    config = manager.task_index[name].cfg or {}  # the task's or group's YAML, as lm-eval 0.4.13 indexed it
    if "metric_list" in config:
        return tuple(m["metric"] for m in config["metric_list"] if isinstance(m.get("metric"), str))
    subtasks = config.get("task") or []
    names = [t if isinstance(t, str) else t.get("task") for t in subtasks] if isinstance(subtasks, list) else []
    found: dict[str, None] = {}
    for sub in names:
        if sub and sub in manager.all_tasks and sub != name:
            found.update(dict.fromkeys(task_metrics(manager, sub)))
    return tuple(found)


def check_tasks(settings: EvaluateConfig, *, network: bool, manager=None) -> None:
    """Every task name is lm-eval's or the held-out one, every gate names a metric its task has, and
    a task that reads the hub has a network to read it from; ValueError (one line) otherwise.
    `manager`: lm-eval's TaskManager (built here when there are standard tasks)."""
    standard = [t for t in settings.task_list if t != HELDOUT_TASK]
    if not standard:
        return
    manager = manager or task_manager()
    known = set(manager.all_tasks)
    for name in standard:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
            hint = f"; close: {', '.join(close)}" if close else "; `lm_eval ls tasks` lists them"
            raise ValueError(f"evaluate.tasks: unknown task {name!r}{hint}")
    for rule in settings.rules:
        if rule.task == HELDOUT_TASK:
            continue
        metrics = task_metrics(manager, rule.task)
        if metrics and rule.metric not in metrics:
            raise ValueError(f"evaluate.gate rule {rule.text!r}: task {rule.task} has no metric {rule.metric!r} "
                             f"(it has {', '.join(metrics)})")
    if not network:
        raise ValueError(f"evaluate.tasks {', '.join(standard)}: lm-eval reads these datasets from the Hugging Face "
                         "hub, which cannot be reached here (offline); evaluate them where the hub is reachable, "
                         f"or keep evaluate.tasks={HELDOUT_TASK}")
